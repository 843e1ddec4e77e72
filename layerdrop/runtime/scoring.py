"""Calibration scoring (SPEC §2) in ONNX Runtime: run the calibration graph (`passes.calibration_taps`) over the
windows and average S = 1 - cos(X, Y) and |Y|/|X| over their text tokens; a KV graph runs with past length 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from layerdrop.runtime.feeds import prefill_feed
from layerdrop.windows import Windows


@dataclass(frozen=True)
class ModuleScore:
    """The score of one module: kind "attn", "mlp" or "block"."""

    layer: int
    kind: str
    score: float
    norm_ratio: float


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


def run_scores(session: ort.InferenceSession, rows: list[tuple[str, int, str, str, str]], windows: Windows, *,
               batch_size: int = 1, progress: bool = True) -> list[ModuleScore]:
    """Scores from a calibration-graph session; `rows` name each module's |X|^2, |Y|^2 and X·Y outputs.

    A BOS column of the windows (context only) is left out of the averages.

    Returns:
        One ModuleScore per module, sorted by layer, then attn, mlp, block.
    """
    names = [o.name for o in session.get_outputs()]
    accumulators = [_CosineAccumulator() for _ in rows]
    real = windows.real
    for start in tqdm(range(0, len(windows.ids), batch_size), desc="scoring", unit="batch", disable=not progress,
                      leave=False):
        ids, mask = windows.ids[start : start + batch_size], real[start : start + batch_size]
        outputs = dict(zip(names, session.run(names, prefill_feed(session, ids))))
        for accumulator, (_, _, x_norm2, y_norm2, dot) in zip(accumulators, rows):
            accumulator.add(outputs[x_norm2], outputs[y_norm2], outputs[dot], mask)
    kind_order = {"attn": 0, "mlp": 1, "block": 2}
    scores = [ModuleScore(layer, kind, acc.distance / acc.tokens, acc.ratio / acc.tokens)
              for (kind, layer, *_), acc in zip(rows, accumulators)]
    return sorted(scores, key=lambda s: (s.layer, kind_order[s.kind]))
