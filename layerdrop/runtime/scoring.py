"""Calibration scoring (SPEC §2): run text through ONNX Runtime and measure S = 1 - cos(X, Y) per region.

The calibration copy of the graph computes, inside ONNX Runtime and in float64, the per-token norms of X and Y
and their dot product for every region, and outputs only those; everything after the last region (final norm,
LM head) is dead code and never runs; a KV graph runs with past length 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from tqdm import tqdm

from layerdrop.model_folder import copy_model
from layerdrop.passes.find_residuals import ResidualRegion, find_residual_regions
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session
from layerdrop.windows import Windows


@dataclass(frozen=True)
class ModuleScore:
    """The score of one module: kind "attn", "mlp" or "block"."""

    layer: int
    kind: str
    score: float
    norm_ratio: float


def _block_spans(regions: list[ResidualRegion]) -> dict[int, tuple[ir.Value, ir.Value]]:
    spans: dict[int, tuple[ir.Value, ir.Value]] = {}
    for region in regions:
        start = spans[region.layer][0] if region.layer in spans else region.skip
        spans[region.layer] = (start, region.output)
    return spans


def calibration_model(model: ir.Model) -> tuple[ir.Model, list[tuple[str, int, str, str, str]]]:
    """A copy of `model` that outputs, per token and in float64, |X|^2 and |Y|^2 of every region and block and
    X·Y of each; nothing after the last region (final norm, LM head) is computed.

    Returns the copy and one (kind, layer, x_norm2, y_norm2, dot) row of output names per module, regions first.
    """
    copy = copy_model(model)
    regions = find_residual_regions(copy.graph)
    spans = [(r.kind, r.layer, r.skip, r.output) for r in regions]
    spans += [("block", layer, x, y) for layer, (x, y) in _block_spans(regions).items()]
    graph = copy.graph
    axes = ir.Value(name="layerdrop.calib.axes", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]),
                    const_value=ir.tensor(np.array([-1], dtype=np.int64), name="layerdrop.calib.axes"))
    graph.register_initializer(axes)
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


class _CosineAccumulator:
    """Sums of (1 - cos) and |Y|/|X| over real tokens, in float64."""

    def __init__(self) -> None:
        self.distance = 0.0
        self.ratio = 0.0
        self.tokens = 0

    def add(self, x_norm2: np.ndarray, y_norm2: np.ndarray, dot: np.ndarray, mask: np.ndarray) -> None:
        tiny = np.finfo(np.float64).tiny
        x_norm, y_norm = np.sqrt(x_norm2[mask]), np.sqrt(y_norm2[mask])
        cos = dot[mask] / np.maximum(x_norm * y_norm, tiny)
        self.distance += float(np.sum(1.0 - cos))
        self.ratio += float(np.sum(y_norm / np.maximum(x_norm, tiny)))
        self.tokens += int(mask.sum())


def compute_scores(
    model: ir.Model,
    folder: Path,
    windows: Windows,
    *,
    batch_size: int = 1,
    provider: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> list[ModuleScore]:
    """Score every attention, MLP and block module of `model` on `windows` through ONNX Runtime.

    Args:
        model: the graph (not modified); its external weights are read from `folder` by ONNX Runtime.
        windows: calibration windows; a BOS column (context only) is left out of the averages.

    Returns:
        One ModuleScore per module, sorted by layer, then attn, mlp, block.
    """
    calib, rows = calibration_model(model)
    session = make_session(calib, folder=folder, provider=provider, threads=threads)
    names = [o.name for o in session.get_outputs()]
    accumulators = [_CosineAccumulator() for _ in rows]
    batches = range(0, len(windows.ids), batch_size)
    real = windows.real
    for start in tqdm(batches, desc="scoring", unit="batch", disable=not progress, leave=False):
        ids, mask = windows.ids[start : start + batch_size], real[start : start + batch_size]
        outputs = dict(zip(names, session.run(names, prefill_feed(session, ids))))
        for accumulator, (_, _, x_norm2, y_norm2, dot) in zip(accumulators, rows):
            accumulator.add(outputs[x_norm2], outputs[y_norm2], outputs[dot], mask)
    kind_order = {"attn": 0, "mlp": 1, "block": 2}
    scores = [
        ModuleScore(layer, kind, acc.distance / acc.tokens, acc.ratio / acc.tokens)
        for (kind, layer, *_), acc in zip(rows, accumulators)
    ]
    return sorted(scores, key=lambda s: (s.layer, kind_order[s.kind]))
