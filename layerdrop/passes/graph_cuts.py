"""Graph cuts for measurements: a copy that returns chosen inner values, and a suffix that starts at a hidden
state and returns logits (onnx-ir's `convenience.extract`). Neither changes the model it is given."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from layerdrop.errors import LayerdropError
from layerdrop.model_folder import copy_model
from layerdrop.passes.find_residuals import annotated_regions

HIDDEN_INPUT = "layerdrop_hidden"


def with_outputs(model: ir.Model, names: list[str]) -> ir.Model:
    """A copy of `model` whose outputs are the values called `names` (in that order); what they do not need goes.

    Raises:
        LayerdropError: a name is not a value of the graph.
    """
    copy = copy_model(model)
    values = {v.name: v for node in copy.graph for v in node.outputs}
    values.update({v.name: v for v in copy.graph.inputs})
    missing = [name for name in names if name not in values]
    if missing:
        raise LayerdropError(f"the graph has no values {missing[:3]}")
    copy.graph.outputs.clear()
    for name in dict.fromkeys(names):
        copy.graph.outputs.append(values[name])
    RemoveUnusedNodesPass()(copy)
    return copy


def suffix_to_logits(model: ir.Model, entry: str) -> ir.Model:
    """The part of `model` after the value called `entry`: that value becomes the input `layerdrop_hidden`, the
    output is the logits, and graph inputs the suffix does not read are left out.

    Raises:
        LayerdropError: `entry` is not a value of the graph, or the graph has no logits output.
    """
    if not any(v.name == "logits" for v in model.graph.outputs):
        raise LayerdropError(f"cannot cut the graph at {entry!r}: no logits output")
    return segment(model, entry, ["logits"])


def segment(model: ir.Model, entry: str, outputs: list[str]) -> ir.Model:
    """The part of `model` from the value called `entry` to the values called `outputs` (in that order): `entry`
    becomes the input `layerdrop_hidden`, and graph inputs the segment does not read are left out. The graph
    inputs it does read (ids, mask, positions, a layer's past) stay inputs, so rotary tables and masks are computed
    as in the whole model.

    Raises:
        LayerdropError: `entry` or one of `outputs` is not a value of the graph.
    """
    graph = model.graph
    values = {v.name: v for node in graph for v in node.outputs}
    values.update({v.name: v for v in graph.outputs})
    missing = [name for name in [entry, *outputs] if name not in values]
    if missing:
        raise LayerdropError(f"cannot cut the graph at {entry!r}: it has no values {missing[:3]}")
    last = values[outputs[-1]]
    part = ir.convenience.extract(graph, inputs=[values[entry], *graph.inputs],
                                  outputs=[values[name] for name in dict.fromkeys(outputs)])
    hidden = part.inputs[0]
    hidden.name = HIDDEN_INPUT
    hidden.type = hidden.type or last.type  # a graph without inner value types: the stream's type is the output's
    for unused in [v for v in part.inputs[1:] if not v.uses()]:
        part.inputs.remove(unused)
    return ir.Model(part, ir_version=model.ir_version, producer_name="layerdrop")


def bypass_taps(model: ir.Model, layers: list[int]) -> tuple[ir.Model, dict[int, tuple[str, str]]]:
    """A copy in which each of `layers` is HARP's unscaled bypass (alpha 1) fed from an input of its own: the
    branch reads `layerdrop_hidden_<l>` instead of the rewritten stream, and returns what it adds to the stream.

    So P(X) (the V·O map after a post-attention norm, if any) can be computed on hidden states X taken from the
    unmodified model. Returns the copy and, per layer, (input name, output name).
    """
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.passes.harp_bypass import HarpBypassPass

    copy = copy_model(model)
    regions = {r.layer: r for r in annotated_regions(copy) if r.kind == "attn"}
    readers = {layer: [(node, index) for node in regions[layer].branch for index, inp in enumerate(node.inputs)
                       if inp is regions[layer].skip] for layer in layers}
    run_passes(copy, [HarpBypassPass(dict.fromkeys(layers, 1.0))])
    copy.graph.outputs.clear()
    names = {}
    for layer in layers:
        region = regions[layer]
        state = ir.Value(name=f"{HIDDEN_INPUT}_{layer}", shape=region.skip.shape,
                         type=region.skip.type or region.output.type or ir.TensorType(ir.DataType.FLOAT))
        copy.graph.inputs.append(state)
        for node, index in readers[layer]:
            node.replace_input_with(index, state)
        add = region.add
        projected = add.inputs[1] if add.inputs[0] is region.skip else add.inputs[0]
        projected.name = f"layerdrop_bypass_{layer}"
        copy.graph.outputs.append(projected)
        names[layer] = (state.name, projected.name)
    RemoveUnusedNodesPass()(copy)
    return copy, names
