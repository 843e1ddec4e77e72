"""The calibration graph of scoring (SPEC §2): per token and in float64, |X|^2, |Y|^2 and X·Y of every annotated
region and block, and nothing else; everything after the last region (final norm, LM head) is dead code then."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from layerdrop.model_folder import copy_model
from layerdrop.passes._ir_utils import add_initializer
from layerdrop.passes.find_residuals import ResidualRegion, annotated_regions


def _block_spans(regions: list[ResidualRegion]) -> dict[int, tuple[ir.Value, ir.Value]]:
    spans: dict[int, tuple[ir.Value, ir.Value]] = {}
    for region in regions:
        start = spans[region.layer][0] if region.layer in spans else region.skip
        spans[region.layer] = (start, region.output)
    return spans


def calibration_model(model: ir.Model) -> tuple[ir.Model, list[tuple[str, int, str, str, str]]]:
    """A copy of `model` whose outputs are the per-token float64 |X|^2, |Y|^2 and X·Y of every region and block.

    Returns the copy and one (kind, layer, x_norm2, y_norm2, dot) row of output names per module, regions first.

    Raises:
        LayerdropError: the model has no region annotations.
    """
    copy = copy_model(model)
    regions = annotated_regions(copy)
    spans = [(r.kind, r.layer, r.skip, r.output) for r in regions]
    spans += [("block", layer, x, y) for layer, (x, y) in _block_spans(regions).items()]
    graph = copy.graph
    axes = add_initializer(graph, "layerdrop.calib.axes", np.array([-1], dtype=np.int64))
    doubles: dict[ir.Value, ir.Value] = {}
    outputs: list[ir.Value] = []

    def add(op: str, inputs: list[ir.Value], **attributes) -> ir.Value:
        node = ir.node(op, inputs, attributes=attributes)
        graph.append(node)
        return node.outputs[0]

    def as_double(value: ir.Value) -> ir.Value:
        if value not in doubles:
            doubles[value] = add("Cast", [value], to=ir.DataType.DOUBLE)
        return doubles[value]

    def reduced(a: ir.Value, b: ir.Value, name: str) -> str:
        total = add("ReduceSum", [add("Mul", [as_double(a), as_double(b)]), axes], keepdims=0)
        total.name = name
        outputs.append(total)
        return name

    norms: dict[ir.Value, str] = {}
    rows = []
    for index, (kind, layer, x, y) in enumerate(spans):
        for value in (x, y):
            if value not in norms:
                norms[value] = reduced(value, value, f"layerdrop.calib.norm2.{len(norms)}")
        rows.append((kind, layer, norms[x], norms[y], reduced(x, y, f"layerdrop.calib.dot.{index}")))
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    RemoveUnusedNodesPass()(copy)
    return copy, rows
