"""Rewrite pass: remove the KV-cache inputs and outputs of removed or bypassed attention layers.

The remaining `past_key_values.{i}.*` inputs and `present.{i}.*` outputs are renumbered contiguously (optimum
and onnxruntime-genai pair them by index); model metadata `layerdrop.kv_layers` maps each new index to the
original layer.
"""

from __future__ import annotations

import json
import re

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes.drop_branches import DROPPED_KEY, removed_modules

KV_LAYERS_KEY = "layerdrop.kv_layers"
_KV_NAME = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


def kv_layer_map(model: ir.Model) -> list[int]:
    """Original layer index of each KV index of `model` (identity for an unpruned model)."""
    if KV_LAYERS_KEY in model.metadata_props:
        return json.loads(model.metadata_props[KV_LAYERS_KEY])
    indices = {int(m.group(2)) for v in model.graph.inputs if (m := _KV_NAME.match(v.name or ""))}
    return sorted(indices)


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is None or b.shape is None or list(a.shape) == list(b.shape)


class PruneKvCachePass(ir.passes.InPlacePass):
    """Remove the KV inputs/outputs listed for removed attention layers in `layerdrop.dropped`, then renumber.

    A removed past input may still feed Shape arithmetic of the whole graph (the exporter binds the symbolic past
    length to one cache input); such uses are re-sourced to a surviving past input of the same shape first.

    Raises:
        LayerdropError: every attention layer of a KV graph would lose its cache (nothing left to read the past
            length from).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        history = removed_modules(model)
        pending = [entry for entry in history if not entry.get("kv_pruned")]
        doomed_inputs = {n for entry in pending for n in entry.get("kv_inputs", [])}
        doomed_outputs = {n for entry in pending for n in entry.get("kv_outputs", [])}
        old_map = kv_layer_map(model)
        inputs = [v for v in graph.inputs if v.name in doomed_inputs]
        outputs = [v for v in graph.outputs if v.name in doomed_outputs]
        if not inputs and not outputs:
            return ir.passes.PassResult(model, modified=False)
        for value in outputs:
            graph.outputs.remove(value)
        survivors = [v for v in graph.inputs if _KV_NAME.match(v.name or "") and v.name not in doomed_inputs]
        for value in inputs:
            if value.uses():
                source = next((s for s in survivors if _same_shape(s, value)), None)
                if source is None:
                    raise LayerdropError(
                        "cannot remove the KV cache of every attention layer; keep one, or export with --no-kv-cache"
                    )
                value.replace_all_uses_with(source)
            graph.inputs.remove(value)
        self._renumber(model, old_map)
        for entry in pending:
            entry["kv_pruned"] = True
        model.metadata_props[DROPPED_KEY] = json.dumps(history, sort_keys=True)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _renumber(model: ir.Model, old_map: list[int]) -> None:
        values = [v for v in [*model.graph.inputs, *model.graph.outputs] if _KV_NAME.match(v.name or "")]
        kept = sorted({int(_KV_NAME.match(v.name).group(2)) for v in values})
        new_index = {old: new for new, old in enumerate(kept)}
        for value in values:  # two phases so a new name never collides with an old one
            value.name = f"__layerdrop_tmp__{value.name}"
        for value in values:
            prefix, index, part = _KV_NAME.match(value.name.removeprefix("__layerdrop_tmp__")).groups()
            value.name = f"{prefix}.{new_index[int(index)]}.{part}"
        model.metadata_props[KV_LAYERS_KEY] = json.dumps([old_map[old] for old in kept])
