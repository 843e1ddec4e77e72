"""Rewrite pass: replace attention branches by fitted linear maps, Norm(X) W + b (the planner's `fit` move).

The whole branch goes, with the family's post-attention norm if it has one (Gemma): the residual Add then reads
one MatMul + Add from the branch's normalized input. W and b come from a least-squares fit on calibration hidden
states (`search.fit`); this pass only writes them. The layer's KV cache goes with `PruneKvCachePass`.

A map with `previous` set (`plan --fit-previous`; twice the hidden size in rows) also reads the previous token's
normalized input:
[Norm(X)_t, Norm(X)_{t-1}] W + b, with Norm(X)_{-1} = 0 and a padded position's state taken as 0 (the mask). In a
graph with a KV cache the previous token's state is carried from step to step as one input and one output per layer,
`past_fit.{layer}` / `present_fit.{layer}` [batch, 1, d] (zeros before the first token), in place of the layer's
cache; without a cache it is the sequence shifted by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import REGION_KEY, is_past, state_name
from layerdrop.passes._ir_utils import add_initializer as initializer
from layerdrop.passes.find_residuals import ResidualRegion, attention_regions
from layerdrop.passes.metadata import record_removals, removal_record


@dataclass(frozen=True)
class FittedMap:
    """A linear map in place of an attention branch, Norm(X) W + b: `weight` [d, d] and `bias` [d]; with `previous`,
    `weight` is [2d, d] and its last d rows read the previous token's normalized input (module docstring)."""

    weight: np.ndarray
    bias: np.ndarray
    previous: bool = False


class FitAttentionPass(ir.passes.InPlacePass):
    """Replace the attention branch of each layer in `maps` (layer -> FittedMap) by its map.

    Reads the regions `FindResidualsPass` annotated; records each layer (how = "fit") under `layerdrop.dropped`.

    Raises:
        LayerdropError: a layer has no attention region, or a map does not fit the hidden size.
    """

    def __init__(self, maps: dict[int, FittedMap], reason: str = "fit") -> None:
        super().__init__()
        self.maps = dict(maps)
        self.reason = reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = attention_regions(model, self.maps, "replace")
        entries = []
        for layer in sorted(self.maps):
            region = regions[layer]
            fit_branch(graph, region, self.maps[layer])
            entries.append(removal_record(region, "fit", self.reason))
            # structure alone would call this branch an MLP now; the annotation keeps what it was
            region.add.metadata_props[REGION_KEY] = json.dumps({**region.annotation(), "kind": "fit"}, sort_keys=True)
        record_removals(model, entries)
        return ir.passes.PassResult(model, modified=bool(self.maps))


def fit_branch(graph: ir.Graph, region: ResidualRegion, fitted: FittedMap, keep: ir.Value | None = None) -> None:
    """Make the residual Add of `region` read the `fitted` map's Norm(X) W + b instead of the branch; with `keep`
    (a boolean scalar input), Where(keep, branch, Norm(X) W + b), so one graph computes both. The one place that
    writes the map; `FitAttentionPass` and the gated search graph both call it.

    Raises:
        LayerdropError: the branch has no normalized input to fit from, or the map's rows do not fit the hidden size.
    """
    if region.norm_output is None:
        raise LayerdropError(f"layer {region.layer}: the attention branch has no normalized input to fit")
    dtype = region.skip.dtype.numpy() if region.skip.dtype is not None else np.float32
    prefix = f"layerdrop.fit.{region.layer}"
    weight = np.asarray(fitted.weight).astype(dtype)
    width = weight.shape[1]
    if len(weight) != (1 + fitted.previous) * width:
        raise LayerdropError(f"layer {region.layer}: a map of {len(weight)} rows for hidden size {width}"
                             + (" and the previous token" if fitted.previous else ""))
    project = ir.node("MatMul", [region.norm_output, initializer(graph, f"{prefix}.weight", weight[:width])])
    nodes = [project]
    if fitted.previous:
        nodes += previous_states(graph, region.norm_output, region.layer, width, dtype)
        nodes.append(ir.node("MatMul", [nodes[-1].outputs[0],
                                        initializer(graph, f"{prefix}.previous_weight", weight[width:])]))
        nodes.append(ir.node("Add", [project.outputs[0], nodes[-1].outputs[0]]))
    shift = ir.node("Add", [nodes[-1].outputs[0], initializer(graph, f"{prefix}.bias",
                                                              np.asarray(fitted.bias).astype(dtype))])
    nodes.append(shift)
    skip_index = 0 if region.add.inputs[0] is region.skip else 1
    if keep is not None:
        nodes.append(ir.node("Where", [keep, region.add.inputs[1 - skip_index], shift.outputs[0]]))
    graph.insert_before(region.add, nodes)
    region.add.replace_input_with(1 - skip_index, nodes[-1].outputs[0])


def previous_states(graph: ir.Graph, normalized: ir.Value, layer: int, width: int, dtype) -> list[ir.Node]:
    """Nodes whose last output is each position's previous normalized input [batch, seq, d] (module docstring): the
    states times the mask over the new tokens, shifted by one behind the carried state (a `past_fit.{layer}` input
    and a `present_fit.{layer}` output, in a graph with a KV cache) or behind zeros."""
    prefix = f"layerdrop.fit.{layer}"
    element = ir.DataType.from_numpy(np.dtype(dtype))
    nodes: list[ir.Node] = []
    axis = initializer(graph, f"{prefix}.axis", np.array([1], np.int64))
    masked = normalized
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    carried = any(is_past(v.name) for v in graph.inputs)
    end = initializer(graph, f"{prefix}.end", np.array([2 ** 62], np.int64)) if mask is not None or carried else None
    if mask is not None:  # the mask's last seq columns are the new tokens'
        nodes.append(ir.node("Shape", [normalized], attributes={"start": 1, "end": 2}))
        nodes.append(ir.node("Neg", [nodes[-1].outputs[0]]))
        nodes.append(ir.node("Slice", [mask, nodes[-1].outputs[0], end, axis]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": element}))
        nodes.append(ir.node("Unsqueeze", [nodes[-1].outputs[0],
                                           initializer(graph, f"{prefix}.feature_axis", np.array([2], np.int64))]))
        nodes.append(ir.node("Mul", [normalized, nodes[-1].outputs[0]]))
        masked = nodes[-1].outputs[0]
    minus_one = initializer(graph, f"{prefix}.minus_one", np.array([-1], np.int64))
    if carried:  # [state, X] and the last position as the next step's state
        batch = next((v.shape[0] for v in graph.inputs if v.name == "input_ids" and v.shape is not None), "batch")
        state = ir.Value(name=state_name("past", layer), shape=ir.Shape([batch, 1, width]),
                         type=ir.TensorType(element))
        graph.inputs.append(state)
        joined = ir.node("Concat", [state, masked], attributes={"axis": 1})
        present = ir.node("Slice", [masked, minus_one, end, axis])
        present.outputs[0].name = state_name("present", layer)
        graph.outputs.append(present.outputs[0])
        nodes += [joined, present]
    else:  # [0, X]
        joined = ir.node("Pad", [masked, initializer(graph, f"{prefix}.pads", np.array([0, 1, 0, 0, 0, 0], np.int64))])
        nodes.append(joined)
    nodes.append(ir.node("Slice", [joined.outputs[0], initializer(graph, f"{prefix}.start", np.array([0], np.int64)),
                                   minus_one, axis]))
    return nodes
