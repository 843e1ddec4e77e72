"""Trace a Hugging Face decoder LLM with torch.export into an ONNX model folder, with or without a KV cache."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import DynamicCache

from layerdrop.errors import LayerdropError
from layerdrop.export.loading import TOKENIZER_FILES, gguf_tokenizer, load_model
from layerdrop.model_folder import MODEL_NAME, publish_folder, reserve_output

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _WithCache(torch.nn.Module):
    """Flat-tensor wrapper: (input_ids, attention_mask, position_ids, *past) -> (logits, *present)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        cache = DynamicCache(ddp_cache_data=pairs)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


class _WithoutCache(torch.nn.Module):
    """(input_ids, attention_mask) -> logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def kv_layout(config: transformers.PretrainedConfig) -> tuple[int, int, int]:
    """Return (layers, kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def export_model(
    model: torch.nn.Module,
    out_path: Path,
    *,
    kv_cache: bool = True,
    dtype: str = "float32",
) -> None:
    """Export `model` to `out_path` (model.onnx plus model.onnx.data in the same folder).

    Inputs with cache: input_ids [batch, seq], attention_mask [batch, total], position_ids [batch, seq],
    past_key_values.{i}.key/.value [batch, kv_heads, past, head_dim]; outputs logits and present.{i}.key/.value.
    Without cache: input_ids and attention_mask in, logits out.
    """
    if dtype not in DTYPES:
        raise LayerdropError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    model = model.to(DTYPES[dtype]).eval()
    layers, kv_heads, head_dim = kv_layout(model.config)
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    total = torch.export.Dim("total")
    ids = torch.ones(2, 5, dtype=torch.long)
    if kv_cache:
        past_len = 3
        wrapper = _WithCache(model)
        past_tensors = [
            torch.zeros(2, kv_heads, past_len, head_dim, dtype=DTYPES[dtype]) for _ in range(2 * layers)
        ]
        args = (ids, torch.ones(2, 5 + past_len, dtype=torch.long), torch.arange(3, 8).repeat(2, 1), *past_tensors)
        input_names = ["input_ids", "attention_mask", "position_ids"]
        output_names = ["logits"]
        for i in range(layers):
            input_names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            output_names += [f"present.{i}.key", f"present.{i}.value"]
        dynamic_shapes = (
            {0: batch, 1: seq},
            {0: batch, 1: total},
            {0: batch, 1: seq},
            tuple({0: batch, 2: past} for _ in past_tensors),
        )
    else:
        wrapper = _WithoutCache(model)
        args = (ids, torch.ones(2, 5, dtype=torch.long))
        input_names, output_names = ["input_ids", "attention_mask"], ["logits"]
        dynamic_shapes = ({0: batch, 1: seq}, {0: batch, 1: seq})

    # torch.onnx logs one warning per missing torchvision op; they are irrelevant to language models.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=input_names,
            output_names=output_names,
            optimize=True,
            verbose=False,
        )
    family = model.config.get_text_config(decoder=True).model_type
    program.model.metadata_props["layerdrop.family"] = family
    program.model.metadata_props["layerdrop.num_layers"] = str(layers)
    program.model.metadata_props["layerdrop.kv_cache"] = "1" if kv_cache else "0"
    text_config = model.config.get_text_config(decoder=True)
    program.model.metadata_props["layerdrop.num_attention_heads"] = str(text_config.num_attention_heads)
    program.model.metadata_props["layerdrop.num_kv_heads"] = str(kv_heads)
    program.model.metadata_props["layerdrop.head_dim"] = str(head_dim)
    program.model.producer_version = torch.__version__
    program.save(str(out_path), external_data=True)


def export_folder(
    source: Path | None,
    out_dir: Path,
    *,
    kv_cache: bool = True,
    dtype: str = "float32",
    force: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """Export a model folder or GGUF file (None: the default model) into the ONNX model folder `out_dir`.

    The folder receives model.onnx, model.onnx.data, and the tokenizer files. It is written under a
    temporary name and renamed into place, so a failure leaves nothing behind.

    Raises:
        LayerdropError: bad source, refused output folder, or a model the exporter cannot trace.
    """
    from layerdrop.export.default_model import resolve_source

    reserve_output(out_dir, inputs=[source] if source else [], force=force)
    source = resolve_source(source)
    model, tokenizer_dir = load_model(source, trust_remote_code=trust_remote_code)
    print(f"layerdrop: tracing {source.name} with torch.export ({'with' if kv_cache else 'without'} KV cache); "
          "a real model takes a minute or two", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        staged = Path(tmp) / "model"
        staged.mkdir()
        try:
            export_model(model, staged / MODEL_NAME, kv_cache=kv_cache, dtype=dtype)
        except LayerdropError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch.export fails in many ways for unsupported models
            family = model.config.get_text_config(decoder=True).model_type
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise LayerdropError(f"torch.export could not trace this {family} model "
                                 f"({type(model).__name__}): {reason}") from None
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copy2(tokenizer_dir / name, staged / name)
        else:
            _save_gguf_tokenizer(source, staged)
        model.config.save_pretrained(staged)
        if kv_cache:
            (staged / "genai_config.json").write_text(json.dumps(genai_config(model.config), indent=4) + "\n")
        publish_folder(staged, out_dir, force=force)
    return out_dir


def genai_config(config: transformers.PretrainedConfig) -> dict:
    """onnxruntime-genai's genai_config.json for a KV-cache export, so onnxruntime-genai can serve it (and every
    rewrite of it: layerdrop keeps this file true for the layers it removes).

    The graph takes position_ids and returns past and present as separate tensors (it concatenates, it does not
    write into a shared buffer), and masks a sliding window itself from the full cache.
    """
    text = config.get_text_config(decoder=True)
    layers, kv_heads, head_dim = kv_layout(config)
    context = int(getattr(text, "max_position_embeddings", 0) or 4096)

    def token(name: str) -> int | None:
        value = getattr(text, name, None)
        value = value[0] if isinstance(value, list) and value else value
        return value if isinstance(value, int) else None

    eos = token("eos_token_id")
    pad = token("pad_token_id") if token("pad_token_id") is not None else eos
    ids = {k: v for k, v in (("bos_token_id", token("bos_token_id")), ("eos_token_id", eos), ("pad_token_id", pad))
           if v is not None}  # onnxruntime-genai reads numbers only: a token the model has not is left out
    return {
        "model": {
            **ids, "context_length": context, "vocab_size": text.vocab_size, "type": text.model_type,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_NAME, "head_size": head_dim, "hidden_size": text.hidden_size,
                "num_attention_heads": text.num_attention_heads, "num_key_value_heads": kv_heads,
                "num_hidden_layers": layers,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "max_length": context, "min_length": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def _save_gguf_tokenizer(gguf_path: Path, folder: Path) -> None:
    gguf_tokenizer(gguf_path).save_pretrained(folder)
