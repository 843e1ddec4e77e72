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

A map with `mean` set as well (`plan --fit-mean`; three times the hidden size in rows) also reads the causal running
mean of the layer's normalized input, M_t = the mean of Norm(X)_s over the real positions s <= t: [Norm(X)_t,
Norm(X)_{t-1}, M_t] W + b. In a graph with a KV cache the running mean and the count of real positions so far ride in
the layer's `recurrent_state`, [batch, 1, 1, d + 1] (the mean, then the count), summed in float32 whatever the
graph's type, and read by one node before anything writes the present state.
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
    `weight` is [2d, d] and its rows d..2d read the previous token's normalized input; with `mean` too, [3d, d] and its
    last d rows read the running mean (module docstring)."""

    weight: np.ndarray
    bias: np.ndarray
    previous: bool = False
    mean: bool = False

    @property
    def inputs(self) -> int:
        """How many d-wide inputs the map reads: 1, 2 (the previous token) or 3 (and the running mean)."""
        return 1 + self.previous + self.mean


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
    if fitted.mean and not fitted.previous:
        raise LayerdropError(f"layer {region.layer}: a map that reads the running mean reads the previous token too")
    if len(weight) != fitted.inputs * width:
        raise LayerdropError(f"layer {region.layer}: a map of {len(weight)} rows for hidden size {width}"
                             + (" and the previous token" if fitted.previous else "")
                             + (" and the running mean" if fitted.mean else ""))
    project = ir.node("MatMul", [region.norm_output, initializer(graph, f"{prefix}.weight", weight[:width])])
    nodes, total = [project], project.outputs[0]
    if fitted.previous:
        context, inputs = context_states(graph, region.norm_output, region.layer, width, dtype, fitted.mean)
        nodes += context
        for index, (value, name) in enumerate(zip(inputs, ("previous_weight", "mean_weight")), start=1):
            rows = weight[index * width:(index + 1) * width]
            nodes.append(ir.node("MatMul", [value, initializer(graph, f"{prefix}.{name}", rows)]))
            nodes.append(ir.node("Add", [total, nodes[-1].outputs[0]]))
            total = nodes[-1].outputs[0]
    shift = ir.node("Add", [total, initializer(graph, f"{prefix}.bias", np.asarray(fitted.bias).astype(dtype))])
    nodes.append(shift)
    skip_index = 0 if region.add.inputs[0] is region.skip else 1
    if keep is not None:
        nodes.append(ir.node("Where", [keep, region.add.inputs[1 - skip_index], shift.outputs[0]]))
    graph.insert_before(region.add, nodes)
    region.add.replace_input_with(1 - skip_index, nodes[-1].outputs[0])


def context_states(graph: ir.Graph, normalized: ir.Value, layer: int, width: int, dtype, mean: bool = False
                   ) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes that give each position its previous normalized input and, with `mean`, its running mean (each
    [batch, seq, d]; module docstring): returns the nodes and those values. The states are taken times the mask over
    the new tokens; in a graph with a KV cache the layer's state inputs and outputs are added."""
    prefix = f"layerdrop.fit.{layer}"
    element = ir.DataType.from_numpy(np.dtype(dtype))
    nodes: list[ir.Node] = []
    axis = initializer(graph, f"{prefix}.axis", np.array([1], np.int64))
    end = initializer(graph, f"{prefix}.end", np.array([2 ** 62], np.int64))
    masked, weights = normalized, None
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    carried = any(is_past(v.name) for v in graph.inputs)
    if mask is not None:  # the mask's last seq columns are the new tokens'
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
    past = state_inputs(graph, layer, width, element, mean) if carried else None
    if past is not None:  # [state, X] and the last real position as the next step's state
        state_nodes, joined = carried_previous(graph, past[0], masked, weights, layer, width, element, axis,
                                               minus_one, end)
        nodes += state_nodes
    else:  # [0, X]
        nodes.append(ir.node("Pad", [masked, initializer(graph, f"{prefix}.pads",
                                                         np.array([0, 1, 0, 0, 0, 0], np.int64))]))
        joined = nodes[-1].outputs[0]
    nodes.append(ir.node("Slice", [joined, initializer(graph, f"{prefix}.start", np.array([0], np.int64)),
                                   minus_one, axis]))
    found = [nodes[-1].outputs[0]]
    if mean:
        mean_nodes, means, present = running_means(graph, masked, weights, past[1] if past else None, layer, width,
                                                   element, axis, minus_one, end)
        nodes += mean_nodes
        found.append(means)
    elif past is not None:  # the unused recurrent state: zeros
        nodes.append(ir.node("Shape", [past[1]]))
        nodes.append(ir.node("ConstantOfShape", [nodes[-1].outputs[0]],
                             attributes={"value": ir.tensor(np.zeros(1, element.numpy()))}))
        present = nodes[-1].outputs[0]
    if past is not None:
        present.name = state_name("present", layer, "recurrent_state")
        graph.outputs.append(present)
    return nodes, found


def state_inputs(graph: ir.Graph, layer: int, width: int, element: ir.DataType, mean: bool) -> list[ir.Value]:
    """The layer's two state inputs, added to the graph: `conv_state` [batch, d, 1] and `recurrent_state` [batch, 1,
    1, d + 1] with `mean`, else [batch, 1, 1, 1]."""
    batch = next((v.shape[0] for v in graph.inputs if v.name == "input_ids" and v.shape is not None), "batch")
    past = []
    sizes = (("conv_state", [batch, width, 1]), ("recurrent_state", [batch, 1, 1, width + 1 if mean else 1]))
    for part, shape in sizes:
        past.append(ir.Value(name=state_name("past_key_values", layer, part), shape=ir.Shape(shape),
                             type=ir.TensorType(element)))
        graph.inputs.append(past[-1])
    return past


def carried_previous(graph: ir.Graph, past: ir.Value, masked: ir.Value, weights: ir.Value | None, layer: int,
                     width: int, element: ir.DataType, axis: ir.Value, minus_one: ir.Value, end: ir.Value
                     ) -> tuple[list[ir.Node], ir.Value]:
    """The nodes from the `conv_state` input `past` to its present output (module docstring): returns them and
    [state, masked] [batch, 1 + seq, d]. `weights` [batch, seq] is the new tokens' mask (None: all real); `axis`,
    `minus_one` and `end` are the constants [1], [-1] and [2^62]."""
    prefix = f"layerdrop.fit.{layer}"
    rows = initializer(graph, f"{prefix}.state_rows", np.array([0, 1, width], np.int64))
    columns = initializer(graph, f"{prefix}.state_columns", np.array([0, width, 1], np.int64))
    nodes = [ir.node("Reshape", [past, rows])]
    nodes.append(ir.node("Concat", [nodes[-1].outputs[0], masked], attributes={"axis": 1}))
    joined = nodes[-1].outputs[0]
    if weights is None:  # every position real: the last one
        nodes.append(ir.node("Slice", [joined, minus_one, end, axis]))
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
    nodes[-1].outputs[0].name = state_name("present", layer, "conv_state")
    graph.outputs.append(nodes[-1].outputs[0])
    return nodes, joined


def running_means(graph: ir.Graph, masked: ir.Value, weights: ir.Value | None, past: ir.Value | None, layer: int,
                  width: int, element: ir.DataType, axis: ir.Value, minus_one: ir.Value, end: ir.Value
                  ) -> tuple[list[ir.Node], ir.Value, ir.Value | None]:
    """The nodes that give each position the mean of the real positions up to it (the carried ones included, from
    the `recurrent_state` input `past`), summed in float32: returns them, the means [batch, seq, d] in the graph's
    type, and the present `recurrent_state` (None without `past`). `weights` [batch, seq] is the new tokens' mask
    (None: all real)."""
    prefix = f"layerdrop.fit.{layer}"
    f32 = ir.DataType.FLOAT
    feature = initializer(graph, f"{prefix}.mean_feature_axis", np.array([2], np.int64))
    nodes: list[ir.Node] = []
    if weights is None:  # ones [batch, seq, 1]
        nodes.append(ir.node("Shape", [masked], attributes={"start": 0, "end": 2}))
        nodes.append(ir.node("ConstantOfShape", [nodes[-1].outputs[0]],
                             attributes={"value": ir.tensor(np.ones(1, element.numpy()))}))
        weights = nodes[-1].outputs[0]
    nodes.append(ir.node("Unsqueeze", [weights, feature]))
    nodes.append(ir.node("Concat", [masked, nodes[-1].outputs[0]], attributes={"axis": 2}))  # [X, 1]: sums, count
    nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": f32}))
    summed = nodes[-1].outputs[0]
    zero, one = (initializer(graph, f"{prefix}.mean_{n}", np.array([v], np.int64)) for n, v in (("zero", 0),
                                                                                                  ("one", 1)))
    d, d1 = (initializer(graph, f"{prefix}.mean_{n}", np.array([v], np.int64)) for n, v in (("width", width),
                                                                                              ("width1", width + 1)))
    carried_count = None
    if past is not None:  # [mean0 * count0, count0] before the new tokens; the one node that reads the past
        nodes.append(ir.node("Reshape", [past, initializer(graph, f"{prefix}.mean_rows",
                                                           np.array([0, 1, width + 1], np.int64))]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": f32}))
        state = nodes[-1].outputs[0]
        nodes.append(ir.node("Slice", [state, zero, d, feature]))
        carried_mean = nodes[-1].outputs[0]
        nodes.append(ir.node("Slice", [state, d, d1, feature]))
        carried_count = nodes[-1].outputs[0]
        nodes.append(ir.node("Mul", [carried_mean, carried_count]))
        nodes.append(ir.node("Concat", [nodes[-1].outputs[0], carried_count], attributes={"axis": 2}))
        nodes.append(ir.node("Concat", [nodes[-1].outputs[0], summed], attributes={"axis": 1}))
        summed = nodes[-1].outputs[0]
    nodes.append(ir.node("CumSum", [summed, initializer(graph, f"{prefix}.mean_axis", np.array(1, np.int64))]))
    running = nodes[-1].outputs[0]
    floor = initializer(graph, f"{prefix}.mean_floor", np.array(1, np.float32))

    def mean_of(totals: ir.Value) -> list[ir.Node]:  # [sums / max(count, 1), count]
        found = [ir.node("Slice", [totals, zero, d, feature]), ir.node("Slice", [totals, d, d1, feature])]
        found.append(ir.node("Max", [found[1].outputs[0], floor]))
        found.append(ir.node("Div", [found[0].outputs[0], found[2].outputs[0]]))
        return found

    present = None
    if past is not None:
        nodes.append(ir.node("Slice", [running, minus_one, end, axis]))  # the totals after the last position
        last = mean_of(nodes[-1].outputs[0])
        nodes += last
        nodes.append(ir.node("Concat", [last[3].outputs[0], last[1].outputs[0]], attributes={"axis": 2}))
        nodes.append(ir.node("Reshape", [nodes[-1].outputs[0], initializer(
            graph, f"{prefix}.mean_columns", np.array([0, 1, 1, width + 1], np.int64))]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": element}))
        present = nodes[-1].outputs[0]
        nodes.append(ir.node("Slice", [running, one, end, axis]))  # the new positions' totals
        running = nodes[-1].outputs[0]
    means = mean_of(running)
    nodes += means
    nodes.append(ir.node("Cast", [means[3].outputs[0]], attributes={"to": element}))
    return nodes, nodes[-1].outputs[0], present
