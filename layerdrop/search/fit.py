"""Fitted replacements for attention layers: each chosen layer's branch becomes Norm(X) W + b, the least-squares map
from its normalized input to its output, fitted in closed form on calibration hidden states from ONNX Runtime.

Layers are fitted bottom-up: a layer's states come from the model whose lower chosen layers are already replaced,
and its target is what the original branch computes from them. The normal equations are accumulated in float64
over every text token of the calibration windows (a BOS is left out), so memory stays (d + 1)^2 whatever the
number of tokens, and solved with a ridge term lambda = ridge * mean(diag(G)) (relative to the states' scale; the
bias is augmented and penalized alike). Each layer's ridge is chosen among `RIDGES` by perplexity on validation
windows the fit never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.model_folder import copy_model
from layerdrop.passes.cleanup import cleanup_passes, run_passes
from layerdrop.passes.find_residuals import FindResidualsPass, annotated_regions
from layerdrop.passes.fit_attention import FitAttentionPass
from layerdrop.passes.graph_cuts import with_outputs
from layerdrop.passes.prune_kv_cache import PruneKvCachePass
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session
from layerdrop.windows import Windows

RIDGES = (1e-3, 1e-2, 1e-1)


def normal_equations(states: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(G, C) of the augmented least-squares problem [X 1] theta = Y: G = A^T A, C = A^T Y, in float64."""
    augmented = np.concatenate([states.astype(np.float64), np.ones((len(states), 1))], axis=1)
    return augmented.T @ augmented, augmented.T @ targets.astype(np.float64)


def solve_ridge(gram: np.ndarray, cross: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """(W [d, d], b [d]) minimizing |[X 1] theta - Y|^2 + lambda |theta|^2, lambda = ridge * mean(diag(G))."""
    penalty = ridge * float(np.mean(np.diag(gram))) * np.eye(len(gram))
    solution = np.linalg.solve(gram + penalty, cross)
    return solution[:-1], solution[-1]


def layer_statistics(model: ir.Model, folder: Path, windows: Windows, layer: int, **session_args
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """(G, C, tokens) of one attention layer of `model`: its normalized input and its branch output, every text
    token of the windows."""
    region = next((r for r in annotated_regions(model) if r.kind == "attn" and r.layer == layer), None)
    if region is None or region.norm_output is None:
        raise LayerdropError(f"layer {layer} has no attention branch with a normalized input to fit")
    names = [region.norm_output.name, region.branch_output.name]
    session = make_session(with_outputs(model, names), folder=folder, **session_args)
    gram, cross, tokens = 0.0, 0.0, 0
    for row, real in zip(windows.ids, windows.real):
        states, targets = session.run(names, prefill_feed(session, row[None]))
        g, c = normal_equations(states[0, real], targets[0, real])
        gram, cross, tokens = gram + g, cross + c, tokens + int(real.sum())
    return gram, cross, tokens


def _with_maps(model: ir.Model, maps: dict[int, tuple[np.ndarray, np.ndarray]]) -> ir.Model:
    """A copy of `model` with `maps` in place of those layers' attention (their caches gone), annotated again."""
    copy = copy_model(model)
    run_passes(copy, [FitAttentionPass(maps), PruneKvCachePass(), *cleanup_passes(), FindResidualsPass()])
    return copy


@dataclass
class Fit:
    """Fitted maps (layer -> (W, b)), each layer's chosen ridge, and every validation perplexity tried."""

    maps: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    ridges: dict[int, float] = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)


def fit_attention(model: ir.Model, folder: Path, windows: Windows, layers: list[int], *,
                  validation: np.ndarray | None = None, ridges: tuple[float, ...] = RIDGES, batch_size: int = 1,
                  progress: bool = False, **session_args) -> Fit:
    """Fit a linear map in place of the attention of each of `layers`, bottom-up (module docstring).

    With `validation` windows, each layer's ridge is the one of `ridges` whose model (this layer's map, the lower
    layers' chosen ones) has the lowest perplexity there; without, the middle one is used.

    Raises:
        LayerdropError: the windows hold fewer text tokens than the hidden size + 1 (the fit is not well posed).
    """
    result = Fit()
    bar = tqdm(total=len(layers), desc="fit", unit="layer", disable=not progress, leave=False)
    for layer in sorted(layers):
        bar.set_postfix(layer=layer)
        current = _with_maps(model, result.maps)
        gram, cross, tokens = layer_statistics(current, folder, windows, layer, **session_args)
        if tokens < len(gram):
            raise TooFewTokens(f"a fit needs at least {len(gram)} calibration tokens (hidden size + 1) and the "
                                 f"windows hold {tokens}; use more --samples or a longer --seq-len")
        candidates = {ridge: solve_ridge(gram, cross, ridge) for ridge in ridges}
        if validation is None:
            chosen = ridges[len(ridges) // 2]
        else:
            scores = {}
            for ridge, found in candidates.items():
                trial = _with_maps(model, {**result.maps, layer: found})
                session = make_session(trial, folder=folder, **session_args)
                scores[ridge] = perplexity(session, validation, batch_size=batch_size).perplexity
                result.trials.append({"layer": layer, "ridge": ridge, "perplexity": scores[ridge]})
            chosen = min(scores, key=lambda r: (scores[r], -r))  # on a tie, the stronger ridge
        result.maps[layer], result.ridges[layer] = candidates[chosen], chosen
        bar.update()
        if validation is not None:
            bar.set_postfix(layer=layer, ridge=chosen, ppl=f"{scores[chosen]:.2f}")
    bar.close()
    return result
