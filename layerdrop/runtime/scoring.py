"""Calibration scoring (SPEC §2): run text through ONNX Runtime and measure S = 1 - cos(X, Y) per region.

The calibration copy of the graph outputs X and Y of every region and nothing else, so everything after the
last region (final norm, LM head) is dead code and never runs; a KV graph runs with past length 0.
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
from layerdrop.runtime.text import Windows


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


def calibration_model(model: ir.Model) -> tuple[ir.Model, list[tuple[str, int, str, str]]]:
    """A copy of `model` whose outputs are the X and Y of every region (and of every block).

    Returns the copy and one (kind, layer, x_name, y_name) row per module, regions first, then blocks.
    """
    copy = copy_model(model)
    regions = find_residual_regions(copy.graph)
    rows = [(r.kind, r.layer, r.skip, r.output) for r in regions]
    rows += [("block", layer, x, y) for layer, (x, y) in _block_spans(regions).items()]
    copy.graph.outputs.clear()
    for _, _, x, y in rows:
        for value in (x, y):
            if value not in copy.graph.outputs:
                copy.graph.outputs.append(value)
    RemoveUnusedNodesPass()(copy)
    return copy, [(kind, layer, x.name, y.name) for kind, layer, x, y in rows]


class _CosineAccumulator:
    """Sums of (1 - cos) and |Y|/|X| over real tokens, in float64."""

    def __init__(self) -> None:
        self.distance = 0.0
        self.ratio = 0.0
        self.tokens = 0

    def add(self, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> None:
        x = x.astype(np.float64)[mask]
        y = y.astype(np.float64)[mask]
        x_norm = np.linalg.norm(x, axis=-1)
        y_norm = np.linalg.norm(y, axis=-1)
        tiny = np.finfo(np.float64).tiny
        cos = np.einsum("td,td->t", x, y) / np.maximum(x_norm * y_norm, tiny)
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
        windows: packed calibration windows; every token is real (no padding).

    Returns:
        One ModuleScore per module, sorted by layer, then attn, mlp, block.
    """
    calib, rows = calibration_model(model)
    session = make_session(calib, folder=folder, provider=provider, threads=threads)
    names = [o.name for o in session.get_outputs()]
    accumulators = [_CosineAccumulator() for _ in rows]
    batches = range(0, len(windows.ids), batch_size)
    for start in tqdm(batches, desc="scoring", unit="batch", disable=not progress, leave=False):
        ids = windows.ids[start : start + batch_size]
        mask = np.ones(ids.shape, dtype=bool)
        outputs = dict(zip(names, session.run(names, prefill_feed(session, ids))))
        for accumulator, (_, _, x_name, y_name) in zip(accumulators, rows):
            accumulator.add(outputs[x_name], outputs[y_name], mask)
    kind_order = {"attn": 0, "mlp": 1, "block": 2}
    scores = [
        ModuleScore(layer, kind, acc.distance / acc.tokens, acc.ratio / acc.tokens)
        for (kind, layer, _, _), acc in zip(rows, accumulators)
    ]
    return sorted(scores, key=lambda s: (s.layer, kind_order[s.kind]))
