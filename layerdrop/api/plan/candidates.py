"""The planner's candidates: each a set of moves (attention drops, bypasses, fitted maps, whole blocks, a fitted
run of blocks) made by a paper's method or by the planner's own search, at the budget's counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from layerdrop import model_folder
from layerdrop.api.common import rewrite_passes
from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.metadata import removed_modules
from layerdrop.runtime.session import RunOptions
from layerdrop.search.blocks import BlockFit, replaceme_runs, with_replaced_run
from layerdrop.search.fit import fit_attention, solo_fits
from layerdrop.search.measure import branch_means
from layerdrop.search.planner import Plan, bypass_search, candidate_pool, plan_attention, plan_fits
from layerdrop.search.selection import (
    PrefillMeter,
    count_for_speedup,
    drop_iteratively,
    lowest_layers,
    select_lowest,
)
from layerdrop.windows import Windows


@dataclass
class Candidate:
    """A set of moves the plan compares: its name in the table, its attention moves, its blocks, and the move words
    they use (the pick is made among the candidates whose words `--moves` allows)."""

    name: str
    alphas: dict[int, float] = field(default_factory=dict)  # V·O bypasses, alpha 0 = drop
    means: dict | None = None  # the mean shift of those layers
    fits: dict | None = None  # layer -> FittedMap
    blocks: list[int] = field(default_factory=list)  # whole blocks dropped
    run: BlockFit | None = None  # a ReplaceMe run
    ridges: dict | None = None  # layer -> the ridge each fit chose by its error on the search windows
    moves: frozenset = frozenset()
    paper: bool = False  # a paper's method (the pick's guard compares the planner's rows with these)

    def lowest_changed(self) -> int | None:
        """The lowest layer the moves change (a fitted run: the block its transform is folded into), or None."""
        changed = [*self.alphas, *(self.fits or {}), *self.blocks]
        if self.run is not None:
            changed.append(self.run.start)
        return min(changed, default=None)

    def applied_to(self, model: ir.Model) -> ir.Model:
        """A copy of `model` with the moves applied: a fitted run of blocks first, then the rest."""
        run = self.run
        rewritten = (with_replaced_run(model, run.start, run.count, run.transform) if run is not None
                     else model_folder.copy_model(model))
        drops = [("block", k) for k in self.blocks]
        if drops or self.alphas or self.fits:
            run_passes(rewritten, rewrite_passes(drops, self.alphas, "plan", means=self.means, fits=self.fits))
        return rewritten


@dataclass
class Inputs:
    """What the candidates are made from: the annotated model and its folder, the module scores, the windows (the
    calibration windows of the means and the iterative drop, the search windows every choice is made on, the fits'
    calibration windows), how ONNX Runtime runs, and why default rows were left out."""

    model: ir.Model
    folder: Path
    scores: dict[int, float]  # attention layer -> score
    block_scores: dict[int, float]
    calib: Windows
    search: Windows
    fit: Windows | None
    options: RunOptions
    progress: bool
    skipped: list[str]  # the default rows left out, and why
    previous: bool = False  # fitted maps also read the previous token


def moves_of(alphas: dict[int, float]) -> frozenset:
    """The move words of a set of alphas: drop for alpha 0, bypass for a positive one."""
    return frozenset(({"drop"} if 0.0 in alphas.values() else set())
                     | ({"bypass"} if any(a > 0 for a in alphas.values()) else set()))


def paper_candidates(inputs: Inputs, attention: list[int], count: int) -> list[Candidate]:
    """The papers' methods at `count` attention layers: paper 1's one-shot and iterative drop, HARP's bypass of the
    top layers and a bypass of the lowest-scored ones, both with alphas searched top-down."""
    model, folder, options = inputs.model, inputs.folder, inputs.options
    lowest = lowest_layers(inputs.scores, count)
    scratch = model_folder.copy_model(model)
    # scores are computed a window at a time, as `layerdrop drop` does
    drop_iteratively(scratch, folder, inputs.calib, ("attn",), count, progress=inputs.progress,
                     options=RunOptions(options.provider, options.threads))
    drop = frozenset({"drop"})
    tried: dict = {}  # both searches start at the top layers: their first sweeps are measured once
    search = inputs.search.ids
    harp = bypass_search(model, folder, search, attention[::-1][:count], progress=inputs.progress, cache=tried,
                         options=options)
    bypass = bypass_search(model, folder, search, lowest, progress=inputs.progress, cache=tried, options=options)
    return [Candidate("paper 1: one-shot drop of the lowest scores", dict.fromkeys(lowest, 0.0), moves=drop,
                      paper=True),
            Candidate("paper 1: iterative drop", {e["layer"]: 0.0 for e in removed_modules(scratch)}, moves=drop,
                      paper=True),
            Candidate("HARP: top layers, searched alphas", harp, moves=moves_of(harp), paper=True),
            Candidate("score-selected bypass, searched alphas", bypass, moves=moves_of(bypass), paper=True)]


def bypass_candidates(inputs: Inputs, count: int, extra: int, grid: tuple[float, ...], shift: bool
                      ) -> tuple[Plan, list[Candidate]]:
    """The planner's search over drops and bypasses (`search.planner.plan_attention`) of `count` layers among the
    `count + extra` lowest-scored; with `shift`, with the mean shift, and the same moves without it as a second
    row. Returns (the search's Plan, the candidates)."""
    model, folder = inputs.model, inputs.folder
    pool = candidate_pool(inputs.scores, count, extra)
    means = branch_means(model, folder, inputs.calib, pool, inputs.options) if shift else None
    planned = plan_attention(model, folder, inputs.search.ids, inputs.scores, count, extra=extra, means=means,
                             grid=grid, progress=inputs.progress, options=inputs.options)
    searched = moves_of(planned.alphas)
    if means is None:
        return planned, [Candidate("planner", planned.alphas, moves=searched)]
    return planned, [Candidate("planner (moves with the mean shift)", planned.alphas,
                               {k: means[k] for k in planned.alphas}, moves=searched | {"shift"}),
                     Candidate("planner's layers and alphas without the shift", planned.alphas, moves=searched)]


def fit_candidates(inputs: Inputs, count: int, extra: int, grid: tuple[float, ...] = (), shift: bool = False,
                   matched: int | None = None) -> tuple[Plan, list[Candidate]]:
    """The planner's search over fits (each pool layer's map fitted alone on the unmodified model, layers added
    greedily by search perplexity; with a `grid` of alphas, each chosen layer's move then chosen again among its
    map, drop and bypass, mean-shifted with `shift`), and the candidates of the layers it chose and of the
    lowest-scored layers, the maps of each set fitted bottom-up (on the model with the plan's drops and bypasses in
    place); with `matched`, also the candidate of the first `matched` layers the greedy search takes (it goes on
    past `count`), fitted the same way: the planner at the block rows' speed. Returns (the search's Plan, the
    candidates).

    Raises:
        TooFewTokens: the calibration windows cannot support a fit.
    """
    model, folder, options, search = inputs.model, inputs.folder, inputs.options, inputs.search
    pool = candidate_pool(inputs.scores, count, extra)
    solo = solo_fits(model, folder, inputs.fit, pool, validation=search, previous=inputs.previous, options=options)
    means = branch_means(model, folder, inputs.calib, pool, options) if grid and shift else None
    planned = plan_fits(model, folder, search.ids, inputs.scores, count, solo=solo, extra=extra,
                        progress=inputs.progress, grid=grid, means=means, more=(matched or count) - count,
                        options=options)
    lowest = lowest_layers(inputs.scores, count)

    def fitted(name: str, base: ir.Model, layers: list[int], alphas: dict | None = None,
               shifted: dict | None = None) -> Candidate:
        """A candidate with `layers` replaced by maps fitted bottom-up on `base` (the model with `alphas` applied)."""
        fit = fit_attention(base, folder, inputs.fit, layers, validation=search, progress=inputs.progress,
                            previous=inputs.previous, options=options)
        moves = ({"fit"} if layers else set()) | moves_of(alphas or {}) | ({"shift"} if shifted else set())
        return Candidate(name, dict(alphas or {}), means=shifted, fits=fit.maps or None, ridges=fit.ridges,
                         moves=frozenset(moves))

    found = []
    if matched:
        found.append(fitted(f"planner: fitted maps on the {matched} layers it chose first, at the block rows' speed",
                            model, sorted(planned.order[:matched])))
    if planned.fits == lowest and not planned.alphas:
        return planned, [fitted("planner: fitted maps on the layers it chose (the lowest-scored)", model, lowest),
                         *found]
    found.insert(0, fitted("attention fit on the lowest-scored layers", model, lowest))
    if not planned.alphas:
        return planned, found + [fitted("planner: fitted maps on the layers it chose", model, planned.fits)]
    shifted = {k: means[k] for k in planned.alphas} if means is not None else None
    bypassed = model_folder.copy_model(model)
    run_passes(bypassed, rewrite_passes([], planned.alphas, "plan", means=shifted))
    return planned, found + [fitted("planner: the fit, drop or bypass it chose for each layer", bypassed,
                                    planned.fits, planned.alphas, shifted)]


def fitted_runs(inputs: Inputs, counts: list[int]) -> dict[int, BlockFit]:
    """ReplaceMe's fitted runs (its selection, its fit) of each of `counts` blocks, the calibration windows run once
    for all of them (`search.blocks.replaceme_runs`); none, with a note, where the windows cannot support a fit."""
    try:
        return replaceme_runs(inputs.model, inputs.folder, inputs.fit, counts, validation=inputs.search.ids,
                              options=inputs.options)
    except TooFewTokens as exc:
        inputs.skipped.append(f"ReplaceMe row left out: {exc}")
        return {}


def block_candidates(block_scores: dict[int, float], count: int, runs: dict[int, BlockFit]) -> list[Candidate]:
    """Block budgets: ShortGPT's drop of the lowest-scored blocks, and ReplaceMe's fitted run (its selection) where
    `runs` has one of `count` blocks."""
    moves = frozenset({"blocks"})
    scores = [{"layer": layer, "kind": "block", "score": s} for layer, s in block_scores.items()]
    lowest = sorted(layer for _, layer in select_lowest(scores, ("block",), count))
    candidates = [Candidate("ShortGPT-style block drop of the lowest block scores", blocks=lowest, moves=moves,
                            paper=True)]
    if count not in runs:
        return candidates
    run = runs[count]
    return candidates + [Candidate("ReplaceMe: its selection and fitted transform", run=run,
                                   ridges={run.start: run.ridge}, moves=moves, paper=True)]


def mixed_sizes(block_count: int, allowed: frozenset) -> list[int]:
    """The runs of fewer blocks a speedup budget mixes with attention moves: a third and two thirds of the blocks
    the budget takes alone (none without an attention move to mix)."""
    if not allowed & {"fit", "drop"}:
        return []
    return sorted({block_count // 3, 2 * block_count // 3} - {0, block_count})


def mixed_candidates(inputs: Inputs, meter: PrefillMeter, value: float, sizes: list[int],
                     runs: dict[int, BlockFit], allowed: frozenset) -> list[Candidate]:
    """Speedup budgets with block and attention moves allowed: ReplaceMe's run (its selection and fit) of each of
    `sizes` blocks (`mixed_sizes`), then the lowest-scored attention layers outside the run, as few as reach the
    speedup `value` with it by measured prefill, fitted on the model with the run in place (or dropped, without the
    fit move)."""
    word = "fit" if "fit" in allowed else "drop" if "drop" in allowed else None
    if word is None:
        return []
    candidates = []
    for size in sizes:
        run = runs[size]
        gone = range(run.start + 1, run.start + 1 + size)
        rest = {layer: s for layer, s in inputs.scores.items() if layer not in gone}
        try:
            layers = lowest_layers(rest, count_for_speedup(value, meter, rest, ("attn",), removed=gone))
        except LayerdropError as exc:
            inputs.skipped.append(f"the run of {size} blocks with attention moves left out: {exc}")
            continue
        name = f"ReplaceMe's run of {size} blocks, attention {word} on {len(layers)} lowest-scored"
        if word == "drop":
            candidates.append(Candidate(name, dict.fromkeys(layers, 0.0), run=run, moves=frozenset({"blocks", word})))
            continue
        try:
            fit = fit_attention(with_replaced_run(inputs.model, run.start, run.count, run.transform), inputs.folder,
                                inputs.fit, layers, validation=inputs.search, progress=inputs.progress,
                                previous=inputs.previous, options=inputs.options)
        except TooFewTokens as exc:
            inputs.skipped.append(f"the runs with fitted attention left out: {exc}")
            break
        candidates.append(Candidate(name, fits=fit.maps, ridges=fit.ridges, run=run, moves=frozenset({"blocks", word})))
    return candidates
