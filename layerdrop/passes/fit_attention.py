"""Rewrite pass: replace attention branches by fitted linear maps, Norm(X) W + b (the planner's `fit` move).

The whole branch goes, with the family's post-attention norm if it has one (Gemma): the residual Add then reads
one MatMul + Add from the branch's normalized input. W and b come from a least-squares fit on calibration hidden
states (`search.fit`); this pass only writes them. The layer's KV cache goes with `PruneKvCachePass`.

A map with `previous` set (`plan --fit-previous`; twice the hidden size in rows) also reads the previous token's
normalized input: [Norm(X)_t, Norm(X)_{t-1}] W + b, with Norm(X)_{-1} = 0 and a padded position's state taken as 0
(the mask). In a graph with a KV cache the previous token's state is carried from step to step in the form
onnxruntime-genai's RecurrentState carries (layerdrop.formats): `past_key_values.{layer}.conv_state` [batch, d, 1]
in and `present.{layer}.conv_state` out, with the `recurrent_state` [batch, 1, 1, 1] it requires beside it, in place
of the layer's cache. The next state is the last real (unmasked) position's, or the carried one where a step has
none, so a batch padded on either side carries each row's own last token; it is computed from the concatenation that
reads the past state, because onnxruntime-genai may hand past and present the same buffer. Without a cache the
previous state is the sequence shifted by one.
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
    states times the mask over the new tokens, shifted by one behind the carried state (in a graph with a KV cache)
    or behind zeros."""
    prefix = f"layerdrop.fit.{layer}"
    element = ir.DataType.from_numpy(np.dtype(dtype))
    nodes: list[ir.Node] = []
    axis = initializer(graph, f"{prefix}.axis", np.array([1], np.int64))
    masked, weights = normalized, None
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    carried = any(is_past(v.name) for v in graph.inputs)
    if mask is not None:  # the mask's last seq columns are the new tokens'
        end = initializer(graph, f"{prefix}.end", np.array([2 ** 62], np.int64))
        nodes.append(ir.node("Shape", [normalized], attributes={"start": 1, "end": 2}))
        nodes.append(ir.node("Neg", [nodes[-1].outputs[0]]))
        nodes.append(ir.node("Slice", [mask, nodes[-1].outputs[0], end, axis]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": element}))
        weights = nodes[-1].outputs[0]
        nodes.append(ir.node("Unsqueeze", [weights, initializer(graph, f"{prefix}.feature_axis",
                                                                np.array([2], np.int64))]))
        nodes.append(ir.node("Mul", [normalized, nodes[-1].outputs[0]]))
        masked = nodes[-1].outputs[0]
    minus_one = initializer(graph, f"{prefix}.minus_one", np.array([-1], np.int64))
    if carried:  # [state, X] and the last real position as the next step's state
        state_nodes, joined = carried_state(graph, masked, weights, layer, width, element, axis, minus_one)
        nodes += state_nodes
    else:  # [0, X]
        nodes.append(ir.node("Pad", [masked, initializer(graph, f"{prefix}.pads",
                                                         np.array([0, 1, 0, 0, 0, 0], np.int64))]))
        joined = nodes[-1].outputs[0]
    nodes.append(ir.node("Slice", [joined, initializer(graph, f"{prefix}.start", np.array([0], np.int64)),
                                   minus_one, axis]))
    return nodes


def carried_state(graph: ir.Graph, masked: ir.Value, weights: ir.Value | None, layer: int, width: int,
                  element: ir.DataType, axis: ir.Value, minus_one: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    """The state inputs and outputs of `layer` (module docstring) and the nodes between: returns the nodes and
    [state, masked] [batch, 1 + seq, d]. `weights` [batch, seq] is the new tokens' mask (None: all real); `axis`
    and `minus_one` are the constants [1] and [-1]."""
    prefix = f"layerdrop.fit.{layer}"
    batch = next((v.shape[0] for v in graph.inputs if v.name == "input_ids" and v.shape is not None), "batch")
    past, present = [], []
    for part, shape in (("conv_state", [batch, width, 1]), ("recurrent_state", [batch, 1, 1, 1])):
        past.append(ir.Value(name=state_name("past_key_values", layer, part), shape=ir.Shape(shape),
                             type=ir.TensorType(element)))
        graph.inputs.append(past[-1])
    rows = initializer(graph, f"{prefix}.state_rows", np.array([0, 1, width], np.int64))
    columns = initializer(graph, f"{prefix}.state_columns", np.array([0, width, 1], np.int64))
    nodes = [ir.node("Reshape", [past[0], rows])]
    nodes.append(ir.node("Concat", [nodes[-1].outputs[0], masked], attributes={"axis": 1}))
    joined = nodes[-1].outputs[0]
    if weights is None:  # every position real: the last one
        nodes.append(ir.node("Slice", [joined, minus_one, initializer(graph, f"{prefix}.end",
                                                                      np.array([2 ** 62], np.int64)), axis]))
    else:  # weight 1 on the last position of [state, X] that is real, the state counting as real
        nodes.append(ir.node("Shape", [weights], attributes={"start": 0, "end": 1}))
        nodes.append(ir.node("Concat", [nodes[-1].outputs[0], axis], attributes={"axis": 0}))
        nodes.append(ir.node("ConstantOfShape", [nodes[-1].outputs[0]],
                             attributes={"value": ir.tensor(np.ones(1, element.numpy()))}))
        nodes.append(ir.node("Concat", [nodes[-1].outputs[0], weights], attributes={"axis": 1}))
        real = nodes[-1].outputs[0]
        nodes.append(ir.node("CumSum", [real, initializer(graph, f"{prefix}.axis_scalar", np.array(1, np.int64))],
                             attributes={"exclusive": 1, "reverse": 1}))
        nodes.append(ir.node("Equal", [nodes[-1].outputs[0], initializer(graph, f"{prefix}.zero",
                                                                          np.array(0, element.numpy()))]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": element}))
        nodes.append(ir.node("Mul", [real, nodes[-1].outputs[0]]))
        nodes.append(ir.node("Unsqueeze", [nodes[-1].outputs[0], axis]))
        nodes.append(ir.node("MatMul", [nodes[-1].outputs[0], joined]))
    nodes.append(ir.node("Reshape", [nodes[-1].outputs[0], columns]))
    present.append(nodes[-1].outputs[0])
    nodes.append(ir.node("Shape", [past[1]]))
    nodes.append(ir.node("ConstantOfShape", [nodes[-1].outputs[0]],
                         attributes={"value": ir.tensor(np.zeros(1, element.numpy()))}))
    present.append(nodes[-1].outputs[0])
    for value, part in zip(present, ("conv_state", "recurrent_state")):
        value.name = state_name("present", layer, part)
        graph.outputs.append(value)
    return nodes, joined
