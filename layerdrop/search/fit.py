"""Fitted replacements for attention layers: each chosen layer's branch becomes Norm(X) W + b, the least-squares map
from its normalized input to its output, fitted in closed form on calibration hidden states from ONNX Runtime.

Layers are fitted bottom-up: a layer's states come from the model whose lower chosen layers are already replaced,
and its target is what the original branch computes from them. The model is run once, in pieces: the hidden
state entering the lowest chosen layer is taken from the unmodified model, and from there each layer's piece (its
statistics, then, with its map in place, the way up to the next chosen layer) starts at the state the piece below
left, so the layers below are never run again. The normal equations are accumulated in float64 over every text
token of the windows (a BOS is left out), so memory stays (d + 1)^2 whatever the number of tokens, and solved with
a ridge term lambda = ridge * mean(diag(G)) (relative to the states' scale; the bias is augmented and penalized
alike). Each layer's ridge is the one of `RIDGES` whose map predicts the branch best on validation windows the
fit never saw (squared error, in closed form from the validation windows' own normal equations).
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
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, segment
from layerdrop.passes.prune_kv_cache import PruneKvCachePass
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session
from layerdrop.search.measure import attention_entries, hidden_states_at
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


def validation_error(gram: np.ndarray, cross: np.ndarray, square: float, weight: np.ndarray, bias: np.ndarray
                     ) -> float:
    """|[X 1] theta - Y|^2 of theta = [W; b] from the normal equations (G, C) of [X 1] and Y and square = |Y|^2."""
    theta = np.concatenate([weight, bias[None]])
    return float(np.sum(theta * (gram @ theta)) - 2.0 * np.sum(theta * cross) + square)


@dataclass
class _Stream:
    """Windows on their way up the model: ids, which positions are text tokens, and the hidden state entering the
    next layer to fit."""

    ids: np.ndarray
    real: np.ndarray
    hidden: np.ndarray | None = None


def _run(session, stream: _Stream, names: list[str], batch_size: int):
    """Each output of `names` for every window of `stream`, run from its hidden state; yields (rows, outputs)."""
    for start in range(0, len(stream.ids), batch_size):
        rows = slice(start, start + batch_size)
        feed = prefill_feed(session, stream.ids[rows], extra={HIDDEN_INPUT: stream.hidden[rows]})
        yield rows, session.run(names, feed)


def _statistics(model: ir.Model, folder: Path, streams: list[_Stream], entry: str, layer: int, batch_size: int,
                **session_args) -> list[tuple[np.ndarray, np.ndarray, float, int]]:
    """Per stream, (G, C, |Y|^2, tokens) of one attention layer: its normalized input X and its branch output Y at
    every text token, run from the state entering it."""
    region = next(r for r in annotated_regions(model) if r.kind == "attn" and r.layer == layer)
    names = [region.norm_output.name, region.branch_output.name]
    session = make_session(segment(model, entry, names), folder=folder, **session_args)
    found = []
    for stream in streams:
        gram, cross, square, tokens = 0.0, 0.0, 0.0, 0
        for rows, (states, targets) in _run(session, stream, names, batch_size):
            real = stream.real[rows]
            g, c = normal_equations(states[real], targets[real])
            gram, cross, tokens = gram + g, cross + c, tokens + int(real.sum())
            square += float(np.sum(targets[real].astype(np.float64) ** 2))
        found.append((gram, cross, square, tokens))
    return found


def _climb(model: ir.Model, folder: Path, streams: list[_Stream], entry: str, target: str, batch_size: int,
           **session_args) -> None:
    """Move every stream's hidden state from the value `entry` up to the value `target` of `model`."""
    session = make_session(segment(model, entry, [target]), folder=folder, **session_args)
    for stream in streams:
        stream.hidden = np.concatenate([outputs[0] for _, outputs in _run(session, stream, [target], batch_size)])


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
                  validation: Windows | np.ndarray | None = None, ridges: tuple[float, ...] = RIDGES,
                  batch_size: int = 1, progress: bool = False, **session_args) -> Fit:
    """Fit a linear map in place of the attention of each of `layers`, bottom-up (module docstring).

    With `validation` windows, each layer's ridge is the one of `ridges` whose map has the lowest squared error on
    them (every trial is in `Fit.trials`: layer, ridge, error per token); without, the middle one is used.

    Raises:
        LayerdropError: the windows hold fewer text tokens than the hidden size + 1 (the fit is not well posed), or a
            layer has no attention branch to fit.
    """
    result = Fit()
    layers = sorted(layers)
    if not layers:
        return result
    if isinstance(validation, np.ndarray):
        validation = Windows(validation, {})
    streams = [_Stream(windows.ids, windows.real)]
    if validation is not None:
        streams.append(_Stream(validation.ids, validation.real))
    fittable = {r.layer for r in annotated_regions(model) if r.kind == "attn" and r.norm_output is not None}
    missing = sorted(set(layers) - fittable)
    if missing:
        raise LayerdropError(f"layers {missing} have no attention branch with a normalized input to fit")
    for stream in streams:  # the state entering the lowest layer: the unmodified model's
        stream.hidden = hidden_states_at(model, folder, stream.ids, [layers[0]], **session_args)[layers[0]]
    bar = tqdm(total=len(layers), desc="fit", unit="layer", disable=not progress, leave=False)
    current = model  # the model with the maps fitted so far
    for index, layer in enumerate(layers):
        bar.set_postfix(layer=layer)
        entry = attention_entries(current)[layer]
        (gram, cross, _, tokens), *held = _statistics(current, folder, streams, entry, layer, batch_size,
                                                       **session_args)
        if tokens < len(gram):
            raise TooFewTokens(f"a fit needs at least {len(gram)} calibration tokens (hidden size + 1) and the "
                               f"windows hold {tokens}; use more --samples or a longer --seq-len")
        candidates = {ridge: solve_ridge(gram, cross, ridge) for ridge in ridges}
        chosen = ridges[len(ridges) // 2]
        if held:
            v_gram, v_cross, v_square, v_tokens = held[0]
            errors = {ridge: validation_error(v_gram, v_cross, v_square, *found) / max(v_tokens, 1)
                      for ridge, found in candidates.items()}
            result.trials += [{"layer": layer, "ridge": ridge, "error": error} for ridge, error in errors.items()]
            chosen = min(errors, key=lambda r: (errors[r], -r))  # on a tie, the stronger ridge
            bar.set_postfix(layer=layer, ridge=chosen, error=f"{errors[chosen]:.3g}")
        result.maps[layer], result.ridges[layer] = candidates[chosen], chosen
        if index + 1 < len(layers):  # up to the next layer, through this layer's map
            current = _with_maps(model, result.maps)
            _climb(current, folder, streams, entry, attention_entries(current)[layers[index + 1]], batch_size,
                   **session_args)
        bar.update()
    bar.close()
    return result
