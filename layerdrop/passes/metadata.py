"""The records passes keep inside a model: what was removed, the KV-layer map, and what both mean for a
deployment (KV bytes per token, onnxruntime-genai's genai_config.json). Keys and names are in layerdrop.formats."""

from __future__ import annotations

import json
import math

import onnx_ir as ir

from layerdrop.formats import (
    CALIBRATION_KEY,
    DROPPED_KEY,
    HEAD_DIM_KEY,
    HEADS_KEY,
    KV_HEADS_KEY,
    KV_LAYERS_KEY,
    SCORE_KEY,
    is_past,
    is_state_past,
    kv_index,
)


def read_json(props: dict, key: str, default):
    """A JSON value stored under `key` of a metadata dict (model or node), or `default` when absent or broken."""
    try:
        return json.loads(props[key]) if key in props else default
    except json.JSONDecodeError:
        return default


def write_json(props: dict, key: str, value) -> None:
    props[key] = json.dumps(value, sort_keys=True)


def removed_modules(model: ir.Model) -> list[dict]:
    """The modules earlier rewrites removed or bypassed, oldest first."""
    return read_json(model.metadata_props, DROPPED_KEY, [])


def record_removals(model: ir.Model, entries: list[dict]) -> None:
    """Append removal records (see `removal_record`) to the model's history."""
    write_json(model.metadata_props, DROPPED_KEY, removed_modules(model) + entries)


def removal_record(region, how: str, reason: str, **extra) -> dict:
    """The history entry of a region a rewrite removes or bypasses: what it was, its score, and its KV-cache names
    (which `PruneKvCachePass` removes later)."""
    return {"kind": region.kind, "layer": region.layer, "how": how, "reason": reason,
            "score": read_json(region.add.metadata_props, SCORE_KEY, None),
            "kv_inputs": region.kv_inputs, "kv_outputs": region.kv_outputs, **extra}


def calibration_record(model: ir.Model) -> dict | None:
    """Where the model's scores came from (text, SHA-256, windows), or None for an unscored model."""
    return read_json(model.metadata_props, CALIBRATION_KEY, None)


def kv_layer_map(model: ir.Model) -> list[int]:
    """Original layer index of each KV index of `model` (identity for an unpruned model)."""
    if KV_LAYERS_KEY in model.metadata_props:
        return read_json(model.metadata_props, KV_LAYERS_KEY, [])
    return sorted({kv_index(v.name) for v in model.graph.inputs if is_past(v.name)})


def head_layout_metadata(model: ir.Model) -> tuple[int, int, int] | None:
    """(query heads, kv heads, head_dim) as the exporter recorded them, or None."""
    meta = model.metadata_props
    try:
        return int(meta[HEADS_KEY]), int(meta[KV_HEADS_KEY]), int(meta[HEAD_DIM_KEY])
    except (KeyError, ValueError):
        return None


def kv_bytes_per_token(model: ir.Model) -> int | None:
    """KV-cache bytes one token costs (keys and values of every cached layer, batch 1); None without a cache."""
    total = 0
    for value in model.graph.inputs:
        if is_past(value.name) and value.shape is not None:
            heads, head_dim = value.shape[1], value.shape[3]
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                return None
            total += heads * head_dim * int(value.dtype.itemsize)
    return total or None


def state_bytes_per_sequence(model: ir.Model) -> int | None:
    """Bytes of the fitted maps' states one sequence carries (batch 1), whatever its length; 0 without states, None
    where a state's shape is not fixed."""
    total = 0
    for value in model.graph.inputs:
        if is_state_past(value.name):
            dims = list(value.shape[1:]) if value.shape is not None else [None]
            if not all(isinstance(d, int) for d in dims):
                return None
            total += math.prod(dims) * int(value.dtype.itemsize)
    return total


def updated_genai_config(config: dict, source_map: list[int], model: ir.Model) -> dict:
    """onnxruntime-genai's genai_config.json of a source folder, for the rewritten `model`.

    `num_hidden_layers` becomes the number of cache layers the graph keeps (their past/present names are already
    contiguous, so the `%d` templates hold), and a `sliding_window.layers` list (indices into the source's cache
    layers, whose original layers `source_map` gives) is renumbered the same way. Everything else is kept.
    """
    config = json.loads(json.dumps(config))
    decoder = config.get("model", {}).get("decoder")
    kept = sum(1 for v in model.graph.inputs if is_past(v.name) and v.name.endswith(".key"))
    if not isinstance(decoder, dict) or not kept:
        return config
    decoder["num_hidden_layers"] = kept
    window = decoder.get("sliding_window")
    if isinstance(window, dict) and isinstance(window.get("layers"), list):
        local = {source_map[i] for i in window["layers"] if 0 <= i < len(source_map)}
        window["layers"] = [new for new, original in enumerate(kv_layer_map(model)) if original in local]
    return config
