"""Rewrite pass: remove the KV-cache inputs and outputs of removed or bypassed attention layers.

The remaining `past_key_values.{i}.*` inputs and `present.{i}.*` outputs are renumbered contiguously (optimum
and onnxruntime-genai pair them by index); model metadata `layerdrop.kv_layers` maps each new index to the
original layer.
"""

from __future__ import annotations

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import DROPPED_KEY, KV_LAYERS_KEY, KV_NAME, is_past, kv_index, kv_name
from layerdrop.passes.metadata import kv_layer_map, removed_modules, write_json


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
        survivors = [v for v in graph.inputs if is_past(v.name) and v.name not in doomed_inputs]
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
        write_json(model.metadata_props, DROPPED_KEY, history)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _renumber(model: ir.Model, old_map: list[int]) -> None:
        values = [v for v in [*model.graph.inputs, *model.graph.outputs] if KV_NAME.match(v.name or "")]
        kept = sorted({kv_index(v.name) for v in values})
        new_index = {old: new for new, old in enumerate(kept)}
        for value in values:  # two phases so a new name never collides with an old one
            value.name = f"__layerdrop_tmp__{value.name}"
        for value in values:
            prefix, index, part = KV_NAME.match(value.name.removeprefix("__layerdrop_tmp__")).groups()
            value.name = kv_name(prefix, new_index[int(index)], part)
        write_json(model.metadata_props, KV_LAYERS_KEY, [old_map[old] for old in kept])
