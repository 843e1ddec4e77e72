"""What layerdrop's files say and how they name things: metadata keys and KV-cache names.

Shared by every stage (the exporter writes some keys, passes read and write the rest, the runtime pairs cache
inputs with outputs), so it sits below all of them and imports nothing of layerdrop.
"""

from __future__ import annotations

import re

# -- model metadata (ModelProto.metadata_props) ---------------------------------------------------------------------
FAMILY_KEY = "layerdrop.family"              # the exporter: Hugging Face model_type
NUM_LAYERS_KEY = "layerdrop.num_layers"      # the exporter, then the region analysis
KV_CACHE_KEY = "layerdrop.kv_cache"          # the exporter: "1" with a KV cache
HEADS_KEY = "layerdrop.num_attention_heads"  # the exporter: the head layout HARP needs
KV_HEADS_KEY = "layerdrop.num_kv_heads"
HEAD_DIM_KEY = "layerdrop.head_dim"
CALIBRATION_KEY = "layerdrop.calibration"    # scores: where the calibration windows came from
DROPPED_KEY = "layerdrop.dropped"            # every module a rewrite removed or bypassed, oldest first
KV_LAYERS_KEY = "layerdrop.kv_layers"        # original layer of each kept KV-cache index
FUSIONS_KEY = "layerdrop.ort_fusions"        # counts of ONNX Runtime fusions applied
FUSION_NOTE_KEY = "layerdrop.ort_fusions.note"  # why GroupQueryAttention was kept from forming
HARP_SEARCH_KEY = "layerdrop.harp_search"    # alpha search: text, every trial, seconds
PLAN_KEY = "layerdrop.plan"                  # the planner's table and pick
QUANTIZATION_KEY = "layerdrop.quantization"  # int4: bits, block size, accuracy level

# -- node metadata (on a region's residual Add) ---------------------------------------------------------------------
REGION_KEY = "layerdrop.region"              # the analysis: kind, layer, skip input, norm output, KV names
SCORE_KEY = "layerdrop.score"                # {"score", "norm_ratio"} of the region
BLOCK_SCORE_KEY = "layerdrop.block_score"    # the block's score, on the Add that ends the block
SCOPES_KEY = "pkg.torch.onnx.name_scopes"    # torch.onnx's provenance (a cross-check for layer numbers)

# -- graph outputs layerdrop adds -----------------------------------------------------------------------------------
TOKEN_LOGPROBS = "layerdrop_token_logprobs"  # log p(next token) per position, for perplexity (TokenLogprobsPass)

# -- graph inputs layerdrop adds --------------------------------------------------------------------------------------
LOGITS_FROM = "layerdrop_logits_from"        # the first position the LM head runs on, default 0 (LogitsFromPass)

# -- KV-cache names (optimum's and onnxruntime-genai's convention) -------------------------------------------------
KV_NAME = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


def is_past(name: str | None) -> bool:
    """A cache input: past_key_values.{i}.key / .value."""
    match = KV_NAME.match(name or "")
    return bool(match) and match.group(1) == "past_key_values"


def is_present(name: str | None) -> bool:
    """A cache output: present.{i}.key / .value."""
    match = KV_NAME.match(name or "")
    return bool(match) and match.group(1) == "present"


def kv_index(name: str | None) -> int | None:
    """The layer index in a cache name, or None for any other name."""
    match = KV_NAME.match(name or "")
    return int(match.group(2)) if match else None


def kv_name(prefix: str, index: int, part: str) -> str:
    """past_key_values.{index}.{part} or present.{index}.{part}."""
    return f"{prefix}.{index}.{part}"


# -- the one-token state of a map that reads the previous token (`plan --fit-previous`) ------------------------------
# onnxruntime-genai's RecurrentState carries it: per layer a rank-3 `conv_state` (here [batch, d, 1], the previous
# token's normalized input) and a rank-4 `recurrent_state` it requires beside it (here [batch, 1, 1, 1], unused),
# named after the cache templates, zeroed before the first token and fed back each step.
STATE_NAME = re.compile(r"^(past_key_values|present)\.(\d+)\.(conv_state|recurrent_state)$")
STATE_PARTS = ("conv_state", "recurrent_state")


def state_name(prefix: str, layer: int, part: str = "conv_state") -> str:
    """past_key_values.{layer}.{part} or present.{layer}.{part}: a previous-token state input or output."""
    return f"{prefix}.{layer}.{part}"


def state_layer(name: str | None) -> int | None:
    """The layer of a state input or output (past_key_values.{layer}.conv_state / .recurrent_state, present.{...}),
    or None for any other name."""
    match = STATE_NAME.match(name or "")
    return int(match.group(2)) if match else None


def is_state_past(name: str | None) -> bool:
    """A previous-token state input: past_key_values.{layer}.conv_state or .recurrent_state."""
    return state_layer(name) is not None and name.startswith("past_key_values.")


def is_carried(name: str | None) -> bool:
    """An output the next step takes back as an input: a cache output, or a previous-token state."""
    return is_present(name) or (state_layer(name) is not None and name.startswith("present."))


def past_for(present: str) -> str:
    """The input a carried output (cache or state) feeds at the next step."""
    return "past_key_values." + present.removeprefix("present.")
