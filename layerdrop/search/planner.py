"""The planner: for an attention budget, choose which attention layers go and how (drop, a rescaled V·O bypass
with which alpha, or a fitted map), by perplexity on search windows measured in ONNX Runtime.

With `means` (the default in `layerdrop plan`), every bypass or drop also carries the mean shift of
`HarpBypassPass`: the bypassed branch keeps the original branch's calibration mean, and alpha 0 leaves that
constant instead of nothing.

Search over bypasses and drops (`plan_attention`), starting from the cosine ranking instead of every combination:
  1. pool: the `budget + extra` lowest-scored attention layers;
  2. solo: for each pool layer alone, the best alpha in {0, 0.1, ..., 1} (alpha 0 is a drop);
  3. greedy: add, one at a time, the pool layer (with its solo alpha) whose addition gives the lowest perplexity;
  4. refine: re-search the chosen layers' alphas greedily top-down, as HARP does.
Search over fits (`plan_fits`): the same pool, each layer with its map fitted alone (`search.fit.solo_fits`); solo,
then greedy as above; then, given a grid of alphas (`plan --per-layer-moves`), each chosen layer's move is chosen
again, top-down with the others' kept, among its map and the alphas of its (mean-shifted) bypass, and changed only
if that lowers the search perplexity: so each layer ends up with the fit, a drop or a bypass. That sweep takes the
perplexity as unimodal in alpha (it stops after two alphas in a row that do no better) and runs the layers below the
swept one once, from the state their moves leave (`GatedSuffix.entering`).

The greedy stage is lazy: the increase in perplexity a layer's move caused when last measured (alone, or with
fewer layers moved) is a lower bound on the increase it causes with the current set if increases compound (a
move hurts no less when more layers are moved), so only the layer with the lowest bound is measured again, and
taken once its increase stays at or below every other bound. Under that assumption it takes the layer that
measuring every candidate would take, with a few measurements a step instead of one per candidate.

Every evaluation starts from the hidden state entering the lowest changed layer, computed once from the
unmodified model, so a candidate costs only the layers above it; and every move set over the pool runs in the
same graph (keep, alpha or the fitted map are chosen by inputs), so no candidate builds a session of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop.passes.gated_search import FIT
from layerdrop.runtime.session import RunOptions
from layerdrop.search.alpha_search import ALPHA_GRID, GatedSuffix, best_alpha, greedy_alpha_search
from layerdrop.search.fit import Fit
from layerdrop.search.selection import lowest_layers


@dataclass
class Plan:
    """Chosen moves (layer -> alpha; 0 means drop, or the constant mean with the shift; and the fitted layers), the
    search perplexity, and a log of every evaluation."""

    alphas: dict[int, float]
    perplexity: float
    log: list[dict] = field(default_factory=list)
    fits: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # plan_fits: the greedy order, `more` layers past the budget too


class _Evaluator:
    """Perplexities of move sets (one gated graph per start layer, see `GatedSuffix`), with a progress bar
    showing the best so far."""

    def __init__(self, model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int], progress: bool,
                 means: dict | None, grid: tuple[float, ...], options: RunOptions, fits: dict | None = None,
                 mixed: bool = False) -> None:
        self.suffix = GatedSuffix(model, folder, windows, layers, means, fits=fits, mixed=mixed, options=options)
        self.grid = grid
        self.start: int | None = None  # None: from the lowest moved layer
        self.bar = tqdm(desc="plan", unit="eval", disable=not progress, leave=False)
        self.best = float("inf")

    def __call__(self, alphas: dict[int, float | str], below: dict[int, float | str] | None = None) -> float:
        value = self.suffix.perplexity(alphas, self.start if below is None else min(alphas), below)
        self.best = min(self.best, value)
        self.bar.update()
        self.bar.set_postfix(best=f"{self.best:.2f}")
        return value

    def alpha_sweep(self, fixed: dict[int, float], layer: int) -> dict[float, float]:
        """Perplexity for each alpha of `layer`, with the `fixed` moves kept."""
        return {alpha: self({**fixed, layer: alpha}) for alpha in self.grid}

    def unimodal_sweep(self, fixed: dict[int, float | str], layer: int, patience: int = 2) -> dict[float, float]:
        """Perplexity for the alphas of `layer` in grid order, with the `fixed` moves kept (those below `layer` run
        once), until `patience` alphas in a row do no better than the best so far: the perplexity is taken as
        unimodal in alpha."""
        below = {k: v for k, v in fixed.items() if k < layer}
        above = {k: v for k, v in fixed.items() if k > layer}
        sweep: dict[float, float] = {}
        best, worse = float("inf"), 0
        for alpha in self.grid:
            sweep[alpha] = self({**above, layer: alpha}, below)
            best, worse = (sweep[alpha], 0) if sweep[alpha] < best else (best, worse + 1)
            if worse >= patience:
                break
        return sweep


def candidate_pool(scores: dict[int, float], budget: int, extra: int) -> list[int]:
    """The `budget + extra` lowest-scored attention layers: the planner's candidates."""
    return lowest_layers(scores, min(len(scores), budget + extra))


def plan_attention(
    model: ir.Model,
    folder: Path,
    windows: np.ndarray,
    scores: dict[int, float],
    budget: int,
    *,
    extra: int = 4,
    means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    grid: tuple[float, ...] = ALPHA_GRID,
    progress: bool = True,
    options: RunOptions = RunOptions(),
) -> Plan:
    """Choose `budget` attention layers and their alphas (see module docstring).

    Args:
        scores: attention layer -> cosine score S (low: candidate).
        windows: token windows [n, seq] of the search text.
        means: `branch_means` of the pool layers, for mean-shifted moves; None searches the papers' moves only.
        grid: the alphas a layer may take (0 = drop; the moves `--moves` allows).
    """
    pool = candidate_pool(scores, budget, extra)
    evaluate = _Evaluator(model, folder, windows, pool, progress, means, grid, options)
    log: list[dict] = []

    solo: dict[int, float] = {}
    for layer in pool:
        sweep = evaluate.alpha_sweep({}, layer)
        solo[layer] = best_alpha(sweep)
        log.append({"stage": "solo", "layer": layer, "alpha": solo[layer], "perplexity": sweep[solo[layer]]})

    alone = {entry["layer"]: entry["perplexity"] for entry in log}
    chosen, current = _lazy_greedy(evaluate, solo, alone, budget, log)
    refined = dict(chosen)
    for layer in sorted(chosen, reverse=True):
        others = {k: v for k, v in refined.items() if k != layer}
        sweep = evaluate.alpha_sweep(others, layer)
        best = best_alpha(sweep)
        if sweep[best] < current:
            refined[layer], current = best, sweep[best]
        log.append({"stage": "refine", "layer": layer, "alpha": refined[layer], "perplexity": current})
    evaluate.bar.close()
    return Plan(refined, current, log)


def plan_fits(model: ir.Model, folder: Path, windows: np.ndarray, scores: dict[int, float], budget: int, *,
              solo: Fit, extra: int = 4, progress: bool = True, grid: tuple[float, ...] = (),
              means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None, more: int = 0,
              options: RunOptions = RunOptions()) -> Plan:
    """Choose `budget` attention layers to replace by fitted maps (see module docstring): each pool layer's map
    (`solo`: fitted alone, for every pool layer, see `search.fit.solo_fits`) measured alone, then added greedily;
    with a `grid` of alphas (the bypass and drop moves allowed; `means` of the pool layers for the shift), each
    chosen layer's move chosen again among its map and those alphas, top-down. With `more`, the greedy stage goes on
    for that many layers past the budget (at most the pool's `extra`), which changes nothing of the first `budget`.

    Returns:
        A Plan with the layers that keep their map in `fits`, the others' alphas, the perplexity of them all, and
        the greedy order (`order`: `budget` + `more` layers).
    """
    pool = candidate_pool(scores, budget, extra)
    evaluate = _Evaluator(model, folder, windows, pool, progress, None, (), options, fits=solo.maps)
    log: list[dict] = []
    alone = {}
    for layer in pool:
        alone[layer] = evaluate({layer: 0.0})
        log.append({"stage": "solo", "layer": layer, "move": "fit", "ridge": solo.ridges[layer],
                    "perplexity": alone[layer]})
    taken, _ = _lazy_greedy(evaluate, dict.fromkeys(pool, 0.0), alone, min(budget + max(more, 0), len(pool)), log)
    evaluate.bar.close()
    order = list(taken)
    chosen = {layer: taken[layer] for layer in order[:budget]}
    steps = [entry for entry in log if entry["stage"] == "greedy"]
    current = steps[budget - 1]["perplexity"]
    for entry in steps[budget:]:
        entry["stage"] = "greedy, past the budget"
    moves: dict[int, float | str] = dict.fromkeys(chosen, FIT)
    if grid:
        layers = sorted(chosen)
        mixed = _Evaluator(model, folder, windows, layers, progress, means, grid, options,
                           fits={k: solo.maps[k] for k in layers}, mixed=True)
        for layer in reversed(layers):
            sweep = mixed.unimodal_sweep({k: v for k, v in moves.items() if k != layer}, layer)
            best = best_alpha(sweep)
            if sweep[best] < current:
                moves[layer], current = best, sweep[best]
            log.append({"stage": "refine", "layer": layer, "move": _move_word(moves[layer]),
                        "alpha": None if moves[layer] == FIT else moves[layer], "perplexity": current})
        mixed.bar.close()
    return Plan({k: v for k, v in moves.items() if v != FIT}, current, log,
                fits=sorted(k for k, v in moves.items() if v == FIT), order=order)


def _move_word(move: float | str) -> str:
    return "fit" if move == FIT else "drop" if move == 0 else "bypass"


def _lazy_greedy(evaluate: _Evaluator, moves: dict[int, float], alone: dict[int, float], budget: int,
                 log: list[dict]) -> tuple[dict[int, float], float]:
    """The greedy stage (module docstring): `moves` has each pool layer's move, `alone` its perplexity measured
    alone. Returns the chosen moves (in the order taken) and the perplexity with all of them."""
    # Move sets from here on start at different layers; one graph from the lowest pool layer serves them all.
    evaluate.start = min(moves)
    current = evaluate.suffix.perplexity({}, evaluate.start)  # nothing moved: what each increase is measured from
    increase = {layer: value - current for layer, value in alone.items()}
    chosen: dict[int, float] = {}
    while len(chosen) < budget:
        fresh: set[int] = set(increase) if not chosen else set()  # measured with the current set
        while True:
            layer = min((k for k in moves if k not in chosen), key=lambda k: (increase[k], k))
            if layer in fresh:
                break
            increase[layer] = evaluate({**chosen, layer: moves[layer]}) - current
            fresh.add(layer)
        chosen[layer], current = moves[layer], current + increase[layer]
        log.append({"stage": "greedy", "layer": layer, "alpha": moves[layer], "perplexity": current,
                    "measured": len(fresh) if len(chosen) > 1 else 0})
    return chosen, current


def bypass_search(model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int], *, progress: bool = True,
                  cache: dict | None = None, options: RunOptions = RunOptions()) -> dict[int, float]:
    """Greedy top-down alphas for a fixed set of layers (HARP's search on any layers); `cache` as in
    `greedy_alpha_search`."""
    return greedy_alpha_search(model, folder, windows, sorted(layers, reverse=True), progress=progress,
                               cache=cache, options=options).alphas
