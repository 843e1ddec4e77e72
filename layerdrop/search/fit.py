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

With `previous`, each map also reads the previous token's normalized input: the states are [X_t, X_{t-1}] (X_{-1} =
0, within each window; a BOS column is a previous token like any other), W is [2d, d], and the layer's KV cache gives
way to a one-token state (`passes.fit_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.model_folder import copy_model
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.fit_attention import FittedMap
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, segment, with_outputs
from layerdrop.passes.moves import move_passes
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import RunOptions
from layerdrop.search.measure import attention_entries
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
    """Each output of `names` for every window of `stream` (run from its hidden state, if it has one); yields
    (rows, outputs)."""
    for start in range(0, len(stream.ids), batch_size):
        rows = slice(start, start + batch_size)
        extra = {HIDDEN_INPUT: stream.hidden[rows]} if stream.hidden is not None else None
        yield rows, session.run(names, prefill_feed(session, stream.ids[rows], extra=extra))


def with_previous(states: np.ndarray) -> np.ndarray:
    """[X_t, X_{t-1}] for states [batch, seq, d] (X_{-1} = 0): the inputs of a map that reads the previous token."""
    before = np.concatenate([np.zeros_like(states[:, :1]), states[:, :-1]], axis=1)
    return np.concatenate([states, before], axis=-1)


def _statistics(session, streams: list[_Stream], pairs: list[tuple[str, str]], batch_size: int,
                previous: bool = False) -> list[list[tuple[np.ndarray, np.ndarray, float, int]]]:
    """Per pair of values (a layer's normalized input X, its branch output Y) and per stream, (G, C, |Y|^2, tokens)
    over every text token: one run of the session for all pairs. With `previous`, X is `with_previous(X)`."""
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    found = []
    for stream in streams:
        sums = [[0.0, 0.0, 0.0, 0] for _ in pairs]
        for rows, arrays in _run(session, stream, names, batch_size):
            real = stream.real[rows]
            outputs = dict(zip(names, arrays))
            for total, (state, target) in zip(sums, pairs):
                states = with_previous(outputs[state]) if previous else outputs[state]
                g, c = normal_equations(states[real], outputs[target][real])
                total[0], total[1] = total[0] + g, total[1] + c
                total[2] += float(np.sum(outputs[target][real].astype(np.float64) ** 2))
                total[3] += int(real.sum())
        found.append([tuple(total) for total in sums])
    return [list(per_pair) for per_pair in zip(*found)]


def _choose(result: Fit, layer: int, stats: list[tuple], ridges: tuple[float, ...], previous: bool = False) -> None:
    """Solve one layer's map from its statistics (calibration first, then validation, if any) for every ridge and
    keep the one with the least validation error (the middle ridge without validation) in `result` (a map that
    reads the previous token with `previous`: the statistics are of `with_previous` states).

    Raises:
        TooFewTokens: fewer calibration tokens than the hidden size + 1.
    """
    (gram, cross, _, tokens), *held = stats
    if tokens < len(gram):
        raise TooFewTokens(f"a fit needs at least {len(gram)} calibration tokens (its inputs + 1) and the "
                           f"windows hold {tokens}; use more --samples or a longer --seq-len")
    candidates = {ridge: solve_ridge(gram, cross, ridge) for ridge in ridges}
    chosen = ridges[len(ridges) // 2]
    if held:
        v_gram, v_cross, v_square, v_tokens = held[0]
        errors = {ridge: validation_error(v_gram, v_cross, v_square, *found) / max(v_tokens, 1)
                  for ridge, found in candidates.items()}
        result.trials += [{"layer": layer, "ridge": ridge, "error": error} for ridge, error in errors.items()]
        chosen = min(errors, key=lambda r: (errors[r], -r))  # on a tie, the stronger ridge
    result.maps[layer], result.ridges[layer] = FittedMap(*candidates[chosen], previous=previous), chosen


def _climb(session, streams: list[_Stream], target: str, batch_size: int) -> None:
    """Move every stream's hidden state to the value `target` that `session` returns (from the stream's state, or
    from the ids when it has none yet)."""
    for stream in streams:
        stream.hidden = np.concatenate([outputs[0] for _, outputs in _run(session, stream, [target], batch_size)])


def _with_maps(model: ir.Model, maps: dict[int, FittedMap]) -> ir.Model:
    """A copy of `model` with `maps` in place of those layers' attention (their caches gone), annotated again."""
    copy = copy_model(model)
    run_passes(copy, move_passes(fits=maps, reason="fit"))
    return copy


@dataclass
class Fit:
    """Fitted maps (layer -> FittedMap), each layer's chosen ridge, and every validation perplexity tried."""

    maps: dict[int, FittedMap] = field(default_factory=dict)
    ridges: dict[int, float] = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)


def fit_attention(model: ir.Model, folder: Path, windows: Windows, layers: list[int], *,
                  validation: Windows | np.ndarray | None = None, ridges: tuple[float, ...] = RIDGES,
                  options: RunOptions = RunOptions(), progress: bool = False, previous: bool = False) -> Fit:
    """Fit a linear map in place of the attention of each of `layers`, bottom-up (module docstring).

    With `validation` windows, each layer's ridge is the one of `ridges` whose map has the lowest squared error on
    them (every trial is in `Fit.trials`: layer, ridge, error per token); without, the middle one is used. With
    `previous`, the maps also read the previous token's normalized input (module docstring).

    Raises:
        LayerdropError: the windows hold fewer text tokens than the map's inputs + 1 (the fit is not well posed), or a
            layer has no attention branch to fit.
    """
    result = Fit()
    layers = sorted(layers)
    if not layers:
        return result
    streams = _streams(model, windows, layers, validation)
    entering = attention_entries(model)[layers[0]]  # the state entering the lowest layer: the unmodified model's
    batch_size = options.batch_size
    _climb(options.session(with_outputs(model, [entering]), folder=folder), streams, entering, batch_size)
    bar = tqdm(total=len(layers), desc="fit", unit="layer", disable=not progress, leave=False)
    current = model  # the model with the maps fitted so far
    for index, layer in enumerate(layers):
        bar.set_postfix(layer=layer)
        entry = attention_entries(current)[layer]
        pair = _pair(current, layer)
        session = options.session(segment(current, entry, list(pair)), folder=folder)
        _choose(result, layer, _statistics(session, streams, [pair], batch_size, previous)[0], ridges, previous)
        if index + 1 < len(layers):  # up to the next layer, through this layer's map
            current = _with_maps(model, result.maps)
            target = attention_entries(current)[layers[index + 1]]
            _climb(options.session(segment(current, entry, [target]), folder=folder), streams, target, batch_size)
        bar.update()
    bar.close()
    return result


def solo_fits(model: ir.Model, folder: Path, windows: Windows, layers: list[int], *,
              validation: Windows | np.ndarray | None = None, ridges: tuple[float, ...] = RIDGES,
              options: RunOptions = RunOptions(), previous: bool = False) -> Fit:
    """A map for each of `layers` fitted alone, on the unmodified model's states (one run for all of them): the
    maps a search tries one layer at a time. Ridges and `previous` as in `fit_attention`.

    Raises:
        LayerdropError: as `fit_attention`.
    """
    result = Fit()
    streams = _streams(model, windows, layers, validation)
    pairs = [_pair(model, layer) for layer in sorted(layers)]
    session = options.session(with_outputs(model, [name for pair in pairs for name in pair]), folder=folder)
    for layer, stats in zip(sorted(layers), _statistics(session, streams, pairs, options.batch_size, previous)):
        _choose(result, layer, stats, ridges, previous)
    return result


def _streams(model: ir.Model, windows: Windows, layers: list[int], validation: Windows | np.ndarray | None
             ) -> list[_Stream]:
    """The calibration stream and, if given, the validation one, after checking every layer can be fitted.

    Raises:
        LayerdropError: a layer has no attention branch with a normalized input.
    """
    fittable = {r.layer for r in annotated_regions(model) if r.kind == "attn" and r.norm_output is not None}
    missing = sorted(set(layers) - fittable)
    if missing:
        raise LayerdropError(f"layers {missing} have no attention branch with a normalized input to fit")
    if isinstance(validation, np.ndarray):
        validation = Windows(validation, {})
    return [_Stream(w.ids, w.real) for w in (windows, validation) if w is not None]


def _pair(model: ir.Model, layer: int) -> tuple[str, str]:
    """The names of one attention layer's normalized input and branch output."""
    region = next(r for r in annotated_regions(model) if r.kind == "attn" and r.layer == layer)
    return region.norm_output.name, region.branch_output.name
