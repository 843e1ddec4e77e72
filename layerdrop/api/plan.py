"""`layerdrop plan`: for a budget, which attention layers or blocks go and how, compared with the papers' methods
on the same windows (see `search.planner`, `search.fit`, `search.blocks`)."""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop import model_folder
from layerdrop.api.common import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    int4_write_back,
    open_model,
    quantize_pass,
    rewrite_passes,
    save_model,
    windows_for,
)
from layerdrop.api.score import score
from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.formats import PLAN_KEY, TOKEN_LOGPROBS
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, suffix_to_logits, with_outputs
from layerdrop.passes.metadata import removed_modules, write_json
from layerdrop.passes.token_logprobs import TokenLogprobsPass, with_token_logprobs
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.generate import sample_windows
from layerdrop.runtime.session import make_session
from layerdrop.search.alpha_search import ALPHA_GRID
from layerdrop.search.blocks import BlockFit, replaceme_runs, with_replaced_run
from layerdrop.search.fit import fit_attention, solo_fits
from layerdrop.search.measure import attention_entries, branch_means
from layerdrop.search.planner import bypass_search, candidate_pool, plan_attention, plan_fits
from layerdrop.search.selection import (
    PrefillMeter,
    attention_count_for,
    count_for_speedup,
    drop_iteratively,
    lowest_layers,
    parse_budget,
    select_lowest,
)
from layerdrop.windows import Sampling, Windows, load_tokenizer

MOVES = ("drop", "bypass", "shift", "fit", "blocks")
ACCURACY_ITEMS = 200  # multiple-choice items of the accuracy column
ACCURACY_CONTEXT, ACCURACY_CONTINUATION = 32, 8  # tokens of an item's context and of each choice
SPEEDUP_TOKENS, SPEEDUP_RUNS = 1024, 5  # a speedup budget's prefill length (without one in it); timed runs a row
SIZING_RUNS = 3  # timed runs of each structure measured to size a speedup budget's rows
PREFIX_BYTES = 512 * 2**20  # the baseline's hidden states kept for the measured rows' suffixes, at most


@dataclass
class _HeldOut:
    """What every row is measured on besides the search windows: the held-out windows, those of the other
    held-out texts, and the multiple-choice items of the accuracy column (None: no column)."""

    main: Windows
    others: list[Windows]
    items: list[dict] | None

    def sets(self, search: Windows) -> dict[str, Windows]:
        """Every set of windows a row's perplexity is measured on, by key: search, eval, also0, also1, ..."""
        return {"search": search, "eval": self.main, **{f"also{i}": w for i, w in enumerate(self.others)}}


def _lowest_changed(candidate: Candidate) -> int | None:
    """The lowest layer a candidate changes (a fitted run: the block its transform is folded into), or None."""
    changed = [*candidate.alphas, *(candidate.fits or {}), *candidate.blocks]
    if candidate.run is not None:
        changed.append(candidate.run.start)
    return min(changed, default=None)


@dataclass
class _Prefix:
    """The baseline's hidden state entering some attention layers, for every measured window (search, held-out,
    other held-out texts), taken from the baseline row's own runs: a row whose lowest changed layer is at or above
    one of them runs from there (`passes.graph_cuts.suffix_to_logits`), since every layer below it computes what
    the baseline's does."""

    entries: dict[int, str]  # kept layer -> the name of the value entering its attention
    states: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # layer -> window set -> [n, seq, d]

    def start(self, rewritten: ir.Model, candidate: Candidate) -> int | None:
        """The highest kept layer at or below the candidate's lowest changed layer whose entry the `rewritten`
        graph still has, or None (run the whole model)."""
        lowest = _lowest_changed(candidate)
        if lowest is None or not self.states:
            return None
        names = {v.name for node in rewritten.graph for v in node.outputs}
        return max((k for k in self.states if k <= lowest and self.entries[k] in names), default=None)


def _prefix(model: ir.Model, candidates: list[Candidate], windows: int, seq: int) -> _Prefix:
    """Which layers' entering states to keep for the rows: chosen greedily by the layer runs they save (a row runs
    from the highest kept layer at or below its lowest changed one), as many as `PREFIX_BYTES` holds for
    `windows` windows of `seq` tokens."""
    entries = attention_entries(model)
    values = {v.name: v for node in model.graph for v in node.outputs}
    shapes = [values[name].shape for name in entries.values() if name in values and values[name].shape]
    width = shapes[0][-1] if shapes and isinstance(shapes[0][-1], int) else None
    lowest = [k for k in map(_lowest_changed, candidates) if k]
    if width is None or not lowest:
        return _Prefix({})
    def saved(layers: list[int]) -> int:
        return sum(max((k for k in layers if k <= low), default=0) for low in lowest)

    kept: list[int] = []
    for _ in range(PREFIX_BYTES // (windows * seq * width * 4)):
        best = max(sorted(set(lowest) - set(kept)), key=lambda k: saved([*kept, k]), default=None)
        if best is None or saved([*kept, best]) == saved(kept):
            break
        kept.append(best)
    return _Prefix({k: entries[k] for k in kept if k in entries})


@dataclass
class Candidate:
    """One row of the planner's comparison: its attention moves and the move words they use."""

    name: str
    alphas: dict[int, float] = field(default_factory=dict)  # V·O bypasses, alpha 0 = drop
    means: dict | None = None  # the mean shift of those layers
    fits: dict | None = None  # layer -> (W, b)
    blocks: list[int] = field(default_factory=list)  # whole blocks dropped
    run: BlockFit | None = None  # a ReplaceMe run
    ridges: dict | None = None  # layer -> the ridge each fit chose by its error on the search windows
    moves: frozenset = frozenset()


def parse_moves(text: str | None, budget_kind: str = "attn") -> frozenset:
    """'drop,bypass' -> the move words allowed. By default every attention move for an attention or KV budget,
    `blocks` for a blocks budget, and all of them for a speedup budget, which any mix of moves can meet.

    Raises:
        LayerdropError: an unknown word, or moves that cannot meet the kind of budget.
    """
    words = {w.strip() for w in (text or "").split(",") if w.strip()}
    attention = set(MOVES) - {"blocks"}
    if text is None:
        return frozenset({"blocks"} if budget_kind == "blocks" else
                         MOVES if budget_kind == "speedup" else attention)
    unknown = sorted(words - set(MOVES))
    if unknown or not words:
        raise LayerdropError(f"bad --moves {text!r}: use words of {', '.join(MOVES)} (e.g. --moves drop,bypass)")
    if "shift" in words and not words & {"drop", "bypass"}:
        raise LayerdropError("--moves shift shifts drop or bypass moves; add drop or bypass")
    fits = {"blocks": words == {"blocks"}, "speedup": True}.get(budget_kind, "blocks" not in words)
    if not fits:
        raise LayerdropError(f"--moves {text} cannot meet this budget: blocks=N takes the blocks move alone, attn "
                             "and kv budgets drop, bypass, shift or fit, speedup any of them")
    return frozenset(words)


def plan(
    model_path: Path,
    out_dir: Path,
    *,
    budget: str,
    calib: Path | None = None,
    eval_text: Path | None = None,
    search_text: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    search_samples: int = 16,
    eval_samples: int = 32,
    fit_samples: int = 64,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    batch_size: int = 1,
    extra: int = 4,
    moves: str | None = None,
    shift: bool = True,
    per_layer_moves: bool = False,
    self_samples: int = 0,
    fit_previous: bool = False,
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
    quantize: str | None = None,
    keep_float: bool = False,
    also_eval: list[Path] | None = None,
    accuracy_items: int = ACCURACY_ITEMS,
    speedup_tokens: int | None = None,
    speedup_runs: int = SPEEDUP_RUNS,
) -> dict:
    """Plan the best set of moves for a budget and write the chosen model.

    Moves (`moves`): drop, V·O bypass with a searched alpha (HARP's map), the mean shift on those, and a fitted
    linear map (`search.fit`) per attention layer; whole blocks: ShortGPT's drop by block score and ReplaceMe's
    fitted run (`search.blocks`). With the fit move allowed, the planner searches fits (`search.planner.plan_fits`:
    each pool layer's map fitted alone, layers added greedily by search perplexity; with `per_layer_moves` (and drop
    or bypass allowed too), each chosen layer's move then chosen again among its fit, drop and bypass alphas; the
    maps fitted bottom-up on the model with those drops and bypasses in place); without it, drops and bypasses
    (`plan_attention`), with and without the mean shift; drop and bypass rows are measured either way (the papers'
    methods). An attention or KV budget takes the attention moves, a `blocks=N` budget the block moves, a
    `speedup=X@T` budget any of them (all by default): the rows are sized by measured prefill at T tokens
    (`search.selection.count_for_speedup`): the attention rows take the fewest lowest-scored layers which, replaced
    by a map (or dropped, with neither fit nor bypass allowed), reach X, the block rows the fewest lowest-scored
    blocks, and with both kinds allowed, ReplaceMe's run of a third and of two thirds of those blocks comes with as
    many fitted (or dropped) attention layers outside the run as the rest of the budget takes; where the block
    rows' measured speedup is above the attention rows' (a block is the coarser step), the fit search goes on to
    the fewest layers whose maps reach it, for a row of the planner's fits at the block rows' speed. The search windows
    come from the search part of `calib` (disjoint from its calibration windows, on which means and fits are
    estimated), or from `search_text` (all of it, unless it is `calib`): every choice (alphas, layers, ridges, the
    pick) is made on them, so a search text of several kinds guards the choices against the calibration text's kind;
    the pick is the row with the lowest search perplexity among those the allowed moves make (under a speedup budget,
    among those whose prefill speedup measured in the table reaches it, where any does: `choose_pick`), and every
    row is also measured on `eval_text`, which no estimate or choice ever sees (its evaluation part, if it is
    `calib` itself), and on each `also_eval` text (other kinds, say). With `accuracy_items` > 0 (and lm-eval
    installed), every row also gets its accuracy on a multiple-choice task of that many items built from the held-out
    text (`runtime.tasks`: a window's next tokens against three other windows' ones), run through lm-eval and the
    `layerdrop` lm-eval model, that accuracy as a percentage of the baseline's, and its difference from the
    baseline's in points with the standard error of that difference over the same items (item by item,
    `runtime.tasks.paired_difference`: how far the choice of items alone could move it). With `speedup_runs` > 0,
    every row's prefill at `speedup_tokens` (default: a speedup budget's T, 1024 if it names none, else `seq_len`)
    is timed against the baseline's, runs alternating, and the ratio of the medians is its measured speedup; rows
    whose graphs have the same structure (the same ops on the same weight shapes: `search.selection.structure_key`)
    share one timing, which also holds the sizing's runs of that structure (the count the sizing settles on is
    confirmed with `speedup_runs` runs), so every row of a structure has one figure, from `speedup_runs` runs or more.
    With `self_samples` > 0, that many windows the model writes itself (`runtime.generate.sample_windows`: from a
    random first token, temperature 1, seeded by `sampling.seed`) join the calibration windows of every fit (the
    attention maps and ReplaceMe's transforms; not the means, the scores or the search): a prior toward the model's
    own distribution where the calibration text is of one kind (the README's cross-kind run). With `fit_previous`,
    every fitted attention map also reads the previous token's normalized input (`search.fit`): the layer's KV cache
    gives way to a one-token state that layerdrop's runtime carries and onnxruntime-genai cannot.

    Returns:
        {"budget", "attention_layers" (of the attention rows; blocks, without them), "block_count" (of the block
         rows, or None), "kv_fraction_kept", "moves", "speedup_tokens", "pick": {...}, "methods": [{"method",
         "alphas", "fits", "ridges", "shift", "blocks", "replaced_into", "run_ridge", "moves", "kv_kept",
         "speedup", "speedup_runs", "structure" (the key its timing is pooled under), "search_ppl", "eval_ppl",
         "also_eval_ppl": {text: ppl}, "accuracy", "accuracy_retained",
         "accuracy_difference", "accuracy_difference_se" (points), "accuracy_correct" (each item: 1 right, 0 wrong)}],
         "baseline": {...}, "search_seconds", "also_eval_texts",
         "accuracy_items", "accuracy_task": [{"context", "choices", "answer"}],
         "search_text", "eval_text", "fit_text" (with "self_samples" where some were added), "fit_previous"
         (whether the maps read the previous token), "skipped": [why a
         default move made no row, e.g. too few tokens for a fit], "timings": {structure: {"base_ms", "ms"}: every
         timed run, the baseline's and the structure's, in order}, "sizing": [{"blocks", "attention", "structure",
         "speedup"}: the structures a speedup budget's sizing measured]}

    Raises:
        LayerdropError: a bad budget, move word, model or text.
    """
    folder, model = open_model(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    attention = sorted(r.layer for r in annotated_regions(model) if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions; nothing to plan")
    kind, value, seq = parse_budget(budget, len(attention))
    allowed = parse_moves(moves, kind) - (frozenset() if shift else {"shift"})
    if per_layer_moves and not ("fit" in allowed and allowed & {"drop", "bypass"}):
        raise LayerdropError("--per-layer-moves chooses among fit, drop and bypass for each layer: allow fit and drop "
                             "or bypass in --moves (the default for attn and kv budgets)")
    if self_samples < 0:
        raise LayerdropError(f"--self-samples {self_samples}: give a number of windows, 0 or more")
    if self_samples and not allowed & {"fit", "blocks"}:
        raise LayerdropError("--self-samples adds windows to the fits' calibration: allow fit or blocks in --moves")
    if fit_previous and "fit" not in allowed:
        raise LayerdropError("--fit-previous shapes the fitted attention maps: allow fit in --moves")
    started = time.perf_counter()
    calib_windows, search, held_out = _plan_windows(folder.path, calib, eval_text, search_text, samples,
                                                    search_samples, eval_samples, seq_len, sampling)
    held_out = _HeldOut(held_out, [windows_for(folder.path, text, role="eval", samples=eval_samples,
                                               seq_len=seq_len, sampling=sampling,
                                               calibration_sha256=calib_windows.source["sha256"])
                                   for text in also_eval or []],
                        _accuracy_rows(folder.path, eval_text, accuracy_items, calib_windows.source["sha256"],
                                       sampling))
    if search.source["sha256"] != calib_windows.source["sha256"] and any(
            w.source["sha256"] == search.source["sha256"] for w in (held_out.main, *held_out.others)):
        raise LayerdropError(f"--search-text {search.source['file']} is also a held-out text (--eval or --also-eval):"
                             " every choice would see it; give another --search-text, or hold out another text")
    rows = read_scores(model) or score(folder.path, None, calib=calib, samples=samples, seq_len=seq_len,
                                        sampling=sampling, provider=provider, threads=threads,
                                        progress=progress)["regions"]
    scores = {r["layer"]: r["score"] for r in rows if r["kind"] == "attn"}
    block_scores = {r["layer"]: r["score"] for r in rows if r["kind"] == "block"}
    speed_seq = speedup_tokens or seq or (SPEEDUP_TOKENS if kind == "speedup" else seq_len)  # timed column
    session_args = {"provider": provider, "threads": threads}
    base_session = None  # built once, here for a speedup budget's sizing, else for measuring the rows
    meter = None
    phase = _Phases(progress, 0)
    if kind == "speedup":
        tokens = seq or SPEEDUP_TOKENS
        phase.total = 2 + 2 * bool(allowed - {"blocks", "shift"}) + ("blocks" in allowed)  # until the sizing says
        phase(f"sizing the rows: the fewest layers and blocks whose measured prefill at {tokens} tokens reaches "
              f"{value:g}x")
        base_session = make_session(model, folder=folder.path, **session_args)
        meter = PrefillMeter(model, folder.path, tokens, base_session, min(speedup_runs or SIZING_RUNS, SIZING_RUNS),
                             confirm_runs=speedup_runs,
                             maps=(1 + fit_previous) * bool(allowed & {"fit", "bypass"}), **session_args,
                             bar=tqdm(desc="sizing rows by measured prefill", unit="graph", disable=not progress,
                                      leave=False))
    skipped: list[str] = []  # default moves that these windows cannot support, with the reason
    count, block_count = _counts(kind, value, meter, scores, block_scores, allowed, skipped)
    matched = None  # the planner's fits sized to the block rows' measured speedup, where those are faster
    if meter is not None and count and block_count and "fit" in allowed:
        matched = _matched_count(meter, scores, block_scores, count, block_count, extra, skipped)
    search_args = {**session_args, "batch_size": batch_size}  # sessions, and windows per run in every search
    fit_windows = None
    if "fit" in allowed or block_count:
        fit_windows = windows_for(folder.path, calib, role="calib", samples=min(samples, fit_samples),
                                  seq_len=seq_len, sampling=sampling)
        if self_samples:
            fit_windows = with_self_samples(model, folder.path, fit_windows, self_samples, sampling.seed, progress,
                                            session_args)
    grid = grid_of(allowed) if count else ()
    fits_searched = bool(count) and "fit" in allowed  # with fits allowed, the planner searches fits
    phase.total = phase.done + 1 + bool(count) + (fits_searched or bool(grid)) + bool(block_count)
    candidates: list[Candidate] = []
    planned = None
    if count:
        phase("the papers' methods: one-shot and iterative drop, HARP, score-selected bypass")
        candidates += _paper_methods(model, folder.path, scores, attention, count, calib_windows, search.ids,
                                     progress, search_args)
    if fits_searched:
        phase(f"the planner's search over fits of the {len(candidate_pool(scores, count, extra))} lowest-scored "
              "layers" + (", then each chosen layer's fit, drop or bypass" if per_layer_moves else "")
              + (f" (and on to {matched}, the block rows' speed)" if matched else "")
              + ", then the chosen and the lowest-scored layers fitted bottom-up")
        try:
            planned, rows = _fit_rows(model, folder.path, scores, count, extra, fit_windows, search, progress,
                                      search_args, grid if per_layer_moves else (),
                                      calib_windows if "shift" in allowed else None, matched, fit_previous)
            candidates += rows
        except TooFewTokens as exc:
            if moves is not None:  # asked for by name: the user must hear why it cannot be done
                raise
            skipped.append(_skip(f"fit rows left out: {exc}"))
            allowed -= {"fit"}
            phase.total += bool(grid)  # the search over bypasses and drops instead
    if grid and "fit" not in allowed:
        phase(f"the planner's search over the {len(candidate_pool(scores, count, extra))} lowest-scored layers")
        means = None
        if "shift" in allowed:
            means = branch_means(model, folder.path, calib_windows, candidate_pool(scores, count, extra),
                                 **session_args)
        planned = plan_attention(model, folder.path, search.ids, scores, count, extra=extra, means=means,
                                 grid=grid, progress=progress, **search_args)
        searched = _moves_of(planned.alphas)
        if means is not None:
            candidates += [Candidate("planner (moves with the mean shift)", planned.alphas,
                                     {k: means[k] for k in planned.alphas}, moves=searched | {"shift"}),
                           Candidate("planner's layers and alphas without the shift", planned.alphas, moves=searched)]
        else:
            candidates.append(Candidate("planner", planned.alphas, moves=searched))
    if block_count:
        phase(f"block moves: ShortGPT's drop and ReplaceMe's fitted run of {block_count} blocks"
              + (", and runs of fewer blocks with attention moves" if meter and allowed - {"blocks"} else ""))
        sizes = _mixed_sizes(block_count, allowed) if meter is not None else []
        runs = _replaceme_runs(model, folder.path, fit_windows, [block_count, *sizes], search.ids, search_args,
                               skipped)
        candidates += _block_methods(block_scores, block_count, runs)
        if runs:
            candidates += _mixed_methods(model, folder.path, meter, value, scores, sizes, runs, fit_windows,
                                         search, allowed, progress, search_args, skipped, fit_previous)
    if meter is not None:
        meter.bar.close()
    phase(f"measuring {len(candidates)} rows on the search and held-out windows"
          + (f", and their prefill time at {speed_seq} tokens" if speedup_runs else ""))
    return _finish(model, folder, out_dir, force, budget, (count, block_count), len(attention), candidates, allowed,
                   search, held_out, started, base_session, search_args,
                   fit_windows if "fit" in allowed or block_count else None,
                   planned.log if planned is not None else [], (quantize, keep_float), skipped,
                   (speed_seq, speedup_runs, meter), progress)


def _counts(kind: str, value: float, meter: PrefillMeter | None, scores: dict[int, float],
            block_scores: dict[int, float], allowed: frozenset, skipped: list[str]) -> tuple[int | None, int | None]:
    """(attention layers, blocks) the budget asks of the attention rows and of the block rows (None: no such
    rows). A speedup that one kind of move cannot reach leaves its rows out with a note, unless neither can.

    Raises:
        LayerdropError: no allowed kind of move meets the budget.
    """
    wanted = {"attention": bool(allowed - {"blocks", "shift"}), "block": "blocks" in allowed}
    found: dict[str, int | None] = {}
    errors = []
    for what, on in wanted.items():
        found[what] = None
        if not on:
            continue
        try:
            if what == "attention":
                found[what] = attention_count_for(kind, value, meter, scores)
            else:
                found[what] = int(value) if kind == "blocks" else count_for_speedup(value, meter, block_scores,
                                                                                     ("attn", "mlp"))
        except LayerdropError as exc:
            errors.append(exc)
    if not any(found.values()):
        raise errors[0]
    for exc in errors:
        skipped.append(_skip(f"rows left out: {exc}"))
    return found["attention"], found["block"]


def _matched_count(meter: PrefillMeter, scores: dict[int, float], block_scores: dict[int, float], count: int,
                   block_count: int, extra: int, skipped: list[str]) -> int | None:
    """Under a speedup budget, a block is a coarser step than an attention layer, so the block rows the sizing
    takes can overshoot the budget by more than the attention rows do (SmolLM2 at 1024 tokens: 10 blocks 1.426x
    against 13 fitted layers' 1.391x, 30 runs each, `benchmarks/timing_noise.py`). For a comparison at equal speed,
    the number of attention layers whose fitted maps reach the block rows' measured speedup (from the sizing's
    confirmed runs, which the table's block rows reuse), if that is more than `count` and within the planner's pool
    (`extra`); else None."""
    runs = max(meter.runs, meter.confirm_runs)
    blocks = meter.speedup(lowest_layers(block_scores, block_count), (), runs)
    if blocks <= meter.speedup((), lowest_layers(scores, count), runs):
        return None
    try:
        found = count_for_speedup(blocks, meter, scores, ("attn",))
    except LayerdropError:
        found = len(scores)
    if found > count + extra:
        skipped.append(_skip(f"no row of fitted attention at the block rows' {blocks:.3f}x: it takes more layers "
                             f"than the planner's pool of {count} + {extra} (--extra)"))
        return None
    return found if found > count else None


def _finish(model: ir.Model, folder, out_dir: Path, force: bool, budget: str, counts: tuple, layers: int,
            candidates: list[Candidate], allowed: frozenset, search: Windows, held_out: _HeldOut, started: float,
            base_session, search_args: dict, fit_windows: Windows | None, log: list[dict], output: tuple,
            skipped: list[str], speed: tuple, progress: bool) -> dict:
    """Measure every candidate (a progress bar with the baseline's and the best held-out perplexity so far), pick
    the best allowed one on the search windows, write it; the plan's report. `speed`: (tokens, runs, the sizing's
    meter or None): rows are timed at `tokens` through the sizing's meter where it timed the same length, so the
    structures it measured keep their runs."""
    if base_session is None:
        base_session = make_session(model, folder=folder.path, provider=search_args["provider"],
                                    threads=search_args["threads"])
    tokens, runs, meter = speed
    if runs and (meter is None or meter.seq != tokens):
        meter = PrefillMeter(model, folder.path, tokens, base_session, runs, provider=search_args["provider"],
                             threads=search_args["threads"])
    bar = tqdm(total=1 + len(candidates), desc="measuring rows", unit="row", disable=not progress, leave=False)
    sets = held_out.sets(search)
    prefix = _prefix(model, candidates, sum(len(w.ids) for w in sets.values()), search.ids.shape[1])
    base = _measured(model, folder.path, Candidate("baseline"), search, held_out, search_args, layers,
                     session=base_session, prefix=prefix)
    bar.set_postfix(baseline=f"{base['eval_ppl']:.2f}")
    bar.update()
    table = []
    for candidate in candidates:
        table.append(_measured(model, folder.path, candidate, search, held_out, search_args, layers,
                               speed=(meter, runs) if runs else None, prefix=prefix))
        best = min(table, key=lambda row: row["eval_ppl"])
        bar.set_postfix(baseline=f"{base['eval_ppl']:.2f}", best_held_out=f"{best['eval_ppl']:.2f}")
        bar.update()
    bar.close()
    if held_out.items is not None:
        from layerdrop.runtime.tasks import paired_difference

        for row in table:
            row["accuracy_retained"] = 100.0 * row["accuracy"] / base["accuracy"] if base["accuracy"] else None
            difference, error = paired_difference(row["accuracy_correct"], base["accuracy_correct"])
            row["accuracy_difference"], row["accuracy_difference_se"] = 100.0 * difference, 100.0 * error
    kind, value, _ = parse_budget(budget, layers)
    pick_row, short = choose_pick([row for row, c in zip(table, candidates) if c.moves <= allowed],
                                  value if kind == "speedup" and runs else None)
    if short:
        skipped.append(_skip(short))
    pick = candidates[table.index(pick_row)]
    seconds = time.perf_counter() - started
    baseline = {key: base[key] for key in ("search_ppl", "eval_ppl", "also_eval_ppl", "accuracy", "accuracy_correct")
                if key in base}
    count, block_count = counts
    fitted = any(c.fits is not None or c.run is not None for c in candidates)
    result = {"budget": budget, "attention_layers": count if count is not None else block_count,
              "block_count": block_count,
              "kv_fraction_kept": (layers - count) / layers if count is not None else pick_row["kv_kept"],
              "moves": sorted(allowed), "baseline": baseline,
              "speedup_tokens": tokens if runs else None,
              "methods": table, "pick": pick_row, "search_seconds": seconds, "search_text": search.source,
              "eval_text": held_out.main.source, "also_eval_texts": [w.source for w in held_out.others],
              "accuracy_items": len(held_out.items) if held_out.items is not None else 0,
              "accuracy_task": held_out.items or [],  # the items, to rerun them through lm-eval elsewhere
              "fit_text": fit_windows.source if fit_windows is not None and fitted else None,
              "fit_previous": any(len(w) == 2 * w.shape[1] for c in candidates for w, _ in (c.fits or {}).values()),
              "skipped": skipped,
              **(meter.record() if meter is not None else {"timings": {}, "sizing": []})}
    write_json(model.metadata_props, PLAN_KEY, result)
    result["planner_log"] = log
    chosen = _rewritten(model, pick)
    quantize, keep_float = output  # the comparison is measured in float; the written model is quantized
    writes = [quantize_pass(quantize)] if quantize is not None else int4_write_back(model, keep_float)
    chosen = run_passes(chosen, writes) if writes else chosen
    save_model(chosen, out_dir, folder, force=force)
    return result


def choose_pick(rows: list[dict], speedup: float | None = None) -> tuple[dict, str | None]:
    """The pick among the rows the allowed moves make: the lowest search perplexity; under a speedup budget
    (`speedup`, with the table's timed column), among the rows whose speedup measured in the table reaches it,
    since the sizing's shorter measurement can land a row just under it. Returns the row, and where no row reaches
    the budget (the pick is then made among all), why."""
    reaching = [row for row in rows if speedup is None or row["speedup"] >= speedup]
    if reaching:
        return min(reaching, key=lambda row: row["search_ppl"]), None
    best = max(row["speedup"] for row in rows)
    return (min(rows, key=lambda row: row["search_ppl"]),
            f"no row reached {speedup:g}x in the table's own timing (the fastest: {best:.2f}x); the pick is the "
            "lowest search perplexity of all: raise the budget a little, or time more runs (--speedup-runs)")


def _plan_windows(folder: Path, calib: Path | None, eval_text: Path | None, search_text: Path | None,
                  samples: int, search_samples: int, eval_samples: int, seq_len: int, sampling: Sampling
                  ) -> tuple[Windows, Windows, Windows]:
    """Calibration windows (means, the iterative drop), search windows (of `search_text`, default the search part
    of the calibration text), held-out windows.

    Raises:
        LayerdropError: a text too short for its windows.
    """
    calib_windows = windows_for(folder, calib, role="calib", samples=min(samples, 16), seq_len=seq_len,
                                sampling=sampling)
    digest = calib_windows.source["sha256"]
    search = windows_for(folder, search_text if search_text is not None else calib, role="search",
                         samples=search_samples, seq_len=seq_len, sampling=sampling, calibration_sha256=digest)
    if sampling.from_start and search.source["sha256"] == digest:  # the search windows are the text's last ones
        try:
            windows_for(folder, calib, role="calib", samples=samples + search_samples, seq_len=seq_len,
                        sampling=sampling)
        except LayerdropError:
            raise LayerdropError(f"with --from-start the calibration text must hold {samples} calibration and "
                                 f"{search_samples} search windows of {seq_len} tokens apart; use a longer text, "
                                 "fewer --samples, or leave out --from-start") from None
    held_out = windows_for(folder, eval_text, role="eval", samples=eval_samples, seq_len=seq_len, sampling=sampling,
                           calibration_sha256=digest)
    return calib_windows, search, held_out


def _paper_methods(model: ir.Model, folder: Path, scores: dict[int, float], attention: list[int], count: int,
                   calib_windows: Windows, search_ids, progress: bool, search_args: dict) -> list[Candidate]:
    """The papers' methods at the same budget, each with the moves it makes."""
    lowest = lowest_layers(scores, count)
    scratch = model_folder.copy_model(model)
    drop_iteratively(scratch, folder, calib_windows, ("attn",), count, progress=progress,
                     provider=search_args["provider"], threads=search_args["threads"])
    drop = frozenset({"drop"})
    tried: dict = {}  # both searches start at the top layers: their first sweeps are measured once
    harp = bypass_search(model, folder, search_ids, attention[::-1][:count], progress=progress, cache=tried,
                         **search_args)
    bypass = bypass_search(model, folder, search_ids, lowest, progress=progress, cache=tried, **search_args)
    return [Candidate("paper 1: one-shot drop of the lowest scores", dict.fromkeys(lowest, 0.0), moves=drop),
            Candidate("paper 1: iterative drop", {e["layer"]: 0.0 for e in removed_modules(scratch)}, moves=drop),
            Candidate("HARP: top layers, searched alphas", harp, moves=_moves_of(harp)),
            Candidate("score-selected bypass, searched alphas", bypass, moves=_moves_of(bypass))]


def _fit_rows(model: ir.Model, folder: Path, scores: dict[int, float], count: int, extra: int, fit_windows: Windows,
              search: Windows, progress: bool, search_args: dict, grid: tuple[float, ...] = (),
              means_windows: Windows | None = None, matched: int | None = None, previous: bool = False) -> tuple:
    """The planner's search over fits (each pool layer's map fitted alone on the unmodified model, layers added
    greedily by search perplexity; with a `grid` of alphas, each chosen layer's move then chosen again among its
    map, drop and bypass, mean-shifted with `means_windows`), and the rows of the layers it chose and of the
    lowest-scored layers, the maps of each set fitted bottom-up (on the model with the plan's drops and bypasses in
    place); with `matched`, also the row of the first `matched` layers the greedy search takes (it goes on past
    `count`), fitted the same way: the planner at the block rows' speed (`_matched_count`). With `previous`, every
    map also reads the previous token (`search.fit`). Returns (the search's Plan, the rows).

    Raises:
        TooFewTokens: the calibration windows cannot support a fit.
    """
    pool = candidate_pool(scores, count, extra)
    solo = solo_fits(model, folder, fit_windows, pool, validation=search, previous=previous, **search_args)
    means = None
    if grid and means_windows is not None:
        means = branch_means(model, folder, means_windows, pool, provider=search_args["provider"],
                             threads=search_args["threads"])
    planned = plan_fits(model, folder, search.ids, scores, count, solo=solo, extra=extra, progress=progress,
                        grid=grid, means=means, more=(matched or count) - count, **search_args)
    lowest = lowest_layers(scores, count)

    def row(name: str, base: ir.Model, layers: list[int], alphas: dict | None = None, shifted: dict | None = None):
        """A row with `layers` replaced by maps fitted bottom-up on `base` (the model with `alphas` applied)."""
        fit = fit_attention(base, folder, fit_windows, layers, validation=search, progress=progress,
                            previous=previous, **search_args)
        moves = ({"fit"} if layers else set()) | _moves_of(alphas or {}) | ({"shift"} if shifted else set())
        return Candidate(name, dict(alphas or {}), means=shifted, fits=fit.maps or None, ridges=fit.ridges,
                         moves=frozenset(moves))

    rows = []
    if matched:
        rows.append(row(f"planner: fitted maps on the {matched} layers it chose first, at the block rows' speed",
                        model, sorted(planned.order[:matched])))
    if planned.fits == lowest and not planned.alphas:
        return planned, [row("planner: fitted maps on the layers it chose (the lowest-scored)", model, lowest), *rows]
    rows.insert(0, row("attention fit on the lowest-scored layers", model, lowest))
    if not planned.alphas:
        return planned, rows + [row("planner: fitted maps on the layers it chose", model, planned.fits)]
    shifted = {k: means[k] for k in planned.alphas} if means is not None else None
    bypassed = model_folder.copy_model(model)
    run_passes(bypassed, rewrite_passes([], planned.alphas, "plan", means=shifted))
    return planned, rows + [row("planner: the fit, drop or bypass it chose for each layer", bypassed, planned.fits,
                                planned.alphas, shifted)]


def _moves_of(alphas: dict[int, float]) -> frozenset:
    return frozenset(({"drop"} if 0.0 in alphas.values() else set())
                     | ({"bypass"} if any(a > 0 for a in alphas.values()) else set()))


def _rewritten(model: ir.Model, candidate: Candidate) -> ir.Model:
    """A copy of `model` with the candidate's moves applied: a fitted run of blocks first, then the rest."""
    run = candidate.run
    rewritten = (with_replaced_run(model, run.start, run.count, run.transform) if run is not None
                 else model_folder.copy_model(model))
    drops = [("block", k) for k in candidate.blocks]
    if drops or candidate.alphas or candidate.fits:
        run_passes(rewritten, rewrite_passes(drops, candidate.alphas, "plan", means=candidate.means,
                                             fits=candidate.fits))
    return rewritten


def _measured(model: ir.Model, folder: Path, candidate: Candidate, search: Windows, held_out: _HeldOut,
              search_args: dict, layers: int, speed: tuple | None = None, session=None,
              prefix: _Prefix | None = None) -> dict:
    """One row of the comparison: the rewritten model's perplexity on the search and the held-out windows, its
    accuracy on the held-out items, the share of attention layers that keep a KV cache, and (with `speed` = (a
    `PrefillMeter`, runs)) its prefill speedup measured against the baseline's, runs alternating, pooled with the
    runs of any graph of the same structure timed before (`search.selection.structure_key`): `speedup_runs` runs
    behind it, `structure` the key.

    Perplexities come from a session whose graph takes the log-softmax itself (`with_token_logprobs`); accuracy and
    timings from one of the rewritten graph as it is written (`session`, or one built after the first is freed).
    With a `prefix`, the baseline (a candidate without moves) keeps the hidden states it names from its own runs,
    and a row whose lowest changed layer is at or above a kept one runs from there on those states."""
    rewritten = _rewritten(model, candidate)
    session_args = {"provider": search_args["provider"], "threads": search_args["threads"]}
    batch = search_args["batch_size"]
    run = candidate.run
    row = {"method": candidate.name, "alphas": {int(k): v for k, v in sorted(candidate.alphas.items())},
           "fits": sorted(candidate.fits or {}), "shift": candidate.means is not None,
           "ridges": {int(k): v for k, v in (candidate.ridges or {}).items()},
           "blocks": candidate.blocks or (list(range(run.start + 1, run.start + 1 + run.count)) if run else []),
           "replaced_into": run.start if run else None, "run_ridge": run.ridge if run else None,
           "moves": sorted(candidate.moves),
           "kv_kept": sum(r.kind == "attn" for r in annotated_regions(rewritten)) / layers}
    sets = held_out.sets(search)
    ppl = _perplexities(rewritten, folder, candidate, sets, prefix, session_args, batch)
    row["search_ppl"], row["eval_ppl"] = ppl["search"], ppl["eval"]
    if held_out.others:
        row["also_eval_ppl"] = {w.source["file"]: ppl[key] for key, w in sets.items() if key.startswith("also")}
    timed = speed is not None
    if held_out.items is None and not timed:
        return row
    if held_out.items is not None:
        if session is None:
            session = make_session(rewritten, folder=folder, **session_args)
        scores = _accuracy(rewritten, session, folder, held_out.items, search_args)
        row["accuracy"], row["accuracy_correct"] = scores.accuracy, [int(c) for c in scores.correct]
    if timed:
        meter, runs = speed
        row["speedup"], row["speedup_runs"], row["structure"] = meter.timed(rewritten, runs, session)
    return row


def _perplexities(rewritten: ir.Model, folder: Path, candidate: Candidate, sets: dict[str, Windows],
                  prefix: _Prefix | None, session_args: dict, batch: int) -> dict[str, float]:
    """The rewritten model's perplexity on each window set, from its lowest changed layer where `prefix` keeps the
    baseline's state there (the baseline fills the prefix from these runs); the session is freed on return."""
    start = prefix.start(rewritten, candidate) if prefix is not None else None
    if start is not None:
        graph = suffix_to_logits(rewritten, prefix.entries[start])
        TokenLogprobsPass()(graph)
        scoring = make_session(graph, folder=folder, **session_args)
        return {key: perplexity(scoring, w.ids, batch_size=batch,
                                feed_extra=lambda rows, key=key: {HIDDEN_INPUT: prefix.states[start][key][rows]}
                                ).perplexity for key, w in sets.items()}
    keep = prefix is not None and _lowest_changed(candidate) is None and bool(prefix.entries)
    graph = with_token_logprobs(rewritten)
    if keep:  # the baseline: its runs also return the states the rows will start from
        graph = with_outputs(graph, [TOKEN_LOGPROBS, *prefix.entries.values()])
    scoring = make_session(graph, folder=folder, **session_args)
    found = {}
    for key, w in sets.items():
        capture = {name: [] for name in prefix.entries.values()} if keep else None
        found[key] = perplexity(scoring, w.ids, batch_size=batch, capture=capture).perplexity
        for layer, name in (prefix.entries.items() if keep else ()):
            prefix.states.setdefault(layer, {})[key] = np.concatenate(capture[name])
    return found


def _accuracy_rows(folder: Path, eval_text: Path | None, items: int, calibration_sha256: str,
                   sampling: Sampling) -> list[dict] | None:
    """The accuracy column's multiple-choice items from the held-out text, or None (no column: with 0 items, or
    without lm-eval, which is said on stderr)."""
    if items <= 0:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        _skip("no accuracy column: lm-eval is not installed (pip install -e '.[eval]'); --accuracy-items 0 "
              "leaves it out without this note")
        return None
    from layerdrop.runtime.tasks import next_tokens_rows
    from layerdrop.windows import load_tokenizer

    windows = windows_for(folder, eval_text, role="eval", samples=items, sampling=sampling,
                          seq_len=ACCURACY_CONTEXT + ACCURACY_CONTINUATION, calibration_sha256=calibration_sha256)
    tokenizer = load_tokenizer(folder)
    bos = 1 if windows.source.get("bos") else 0  # the BOS is lm-eval's to add, as for any task
    return next_tokens_rows(windows.ids[:, bos:], tokenizer.decode, ACCURACY_CONTINUATION)


def _accuracy(model: ir.Model, session, folder: Path, items: list[dict], search_args: dict):
    """lm-eval's accuracy on the items and each item's outcome (`runtime.tasks.ChoiceScores`), through the
    `layerdrop` lm-eval model on the row's own session."""
    from layerdrop.runtime.harness import LayerdropLM
    from layerdrop.runtime.tasks import choice_scores

    lm = LayerdropLM(path=str(folder), model=model, session=session, batch_size=max(8, search_args["batch_size"]),
                     progress=False)
    return choice_scores(lm, items)


def _replaceme_runs(model: ir.Model, folder: Path, fit_windows: Windows, counts: list[int], search_ids,
                    search_args: dict, skipped: list[str]) -> dict[int, BlockFit]:
    """ReplaceMe's fitted runs (its selection, its fit) of each of `counts` blocks, the calibration windows run once
    for all of them (`search.blocks.replaceme_runs`); none, with a note, where the windows cannot support a fit."""
    try:
        return replaceme_runs(model, folder, fit_windows, counts, validation=search_ids, **search_args)
    except TooFewTokens as exc:
        skipped.append(_skip(f"ReplaceMe row left out: {exc}"))
        return {}


def _block_methods(block_scores: dict[int, float], count: int, runs: dict[int, BlockFit]) -> list[Candidate]:
    """Block budgets: ShortGPT's drop of the lowest-scored blocks, and ReplaceMe's fitted run (its selection) where
    `runs` has one of `count` blocks."""
    moves = frozenset({"blocks"})
    scores = [{"layer": layer, "kind": "block", "score": s} for layer, s in block_scores.items()]
    lowest = sorted(layer for _, layer in select_lowest(scores, ("block",), count))
    candidates = [Candidate("ShortGPT-style block drop of the lowest block scores", blocks=lowest, moves=moves)]
    if count not in runs:
        return candidates
    run = runs[count]
    return candidates + [Candidate("ReplaceMe: its selection and fitted transform", run=run,
                                   ridges={run.start: run.ridge}, moves=moves)]


def _mixed_sizes(block_count: int, allowed: frozenset) -> list[int]:
    """The runs of fewer blocks a speedup budget mixes with attention moves: a third and two thirds of the blocks
    the budget takes alone (none without an attention move to mix)."""
    if not allowed & {"fit", "drop"}:
        return []
    return sorted({block_count // 3, 2 * block_count // 3} - {0, block_count})


def _mixed_methods(model: ir.Model, folder: Path, meter: PrefillMeter, value: float, scores: dict[int, float],
                   sizes: list[int], runs: dict[int, BlockFit], fit_windows: Windows, search: Windows,
                   allowed: frozenset, progress: bool, search_args: dict, skipped: list[str], previous: bool = False
                   ) -> list[Candidate]:
    """Speedup budgets with block and attention moves allowed: ReplaceMe's run (its selection and fit) of each of
    `sizes` blocks (`_mixed_sizes`), then the lowest-scored attention layers outside the run, as few as reach the
    budget with it by measured prefill, fitted on the model with the run in place (or dropped, without the fit
    move; with `previous`, maps that also read the previous token)."""
    word = "fit" if "fit" in allowed else "drop" if "drop" in allowed else None
    if word is None:
        return []
    candidates = []
    for size in sizes:
        run = runs[size]
        gone = range(run.start + 1, run.start + 1 + size)
        rest = {layer: s for layer, s in scores.items() if layer not in gone}
        try:
            layers = lowest_layers(rest, count_for_speedup(value, meter, rest, ("attn",), removed=gone))
        except LayerdropError as exc:
            skipped.append(_skip(f"the run of {size} blocks with attention moves left out: {exc}"))
            continue
        name = f"ReplaceMe's run of {size} blocks, attention {word} on {len(layers)} lowest-scored"
        if word == "drop":
            candidates.append(Candidate(name, dict.fromkeys(layers, 0.0), run=run, moves=frozenset({"blocks", word})))
            continue
        try:
            fit = fit_attention(with_replaced_run(model, run.start, run.count, run.transform), folder, fit_windows,
                                layers, validation=search, progress=progress, previous=previous, **search_args)
        except TooFewTokens as exc:
            skipped.append(_skip(f"the runs with fitted attention left out: {exc}"))
            break
        candidates.append(Candidate(name, fits=fit.maps, ridges=fit.ridges, run=run, moves=frozenset({"blocks", word})))
    return candidates


def grid_of(allowed: frozenset) -> tuple[float, ...]:
    """The alphas the planner may try: 0 with the drop move, the positive ones with the bypass."""
    return tuple(a for a in ALPHA_GRID if (a == 0 and "drop" in allowed) or (a > 0 and "bypass" in allowed))


class _Phases:
    """'layerdrop plan: [2/4] ... (95 s in)' on stderr as each phase starts (with progress on)."""

    def __init__(self, progress: bool, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        self.done += 1
        if self.progress:
            elapsed = time.perf_counter() - self.started
            print(f"layerdrop plan: [{self.done}/{self.total}] {text} ({elapsed:.0f} s in)", file=sys.stderr,
                  flush=True)


def ordinary_tokens(tokenizer, folder: Path) -> np.ndarray:
    """The ordinary token ids of `tokenizer` (the folder's; special ones left out) below the model's vocabulary
    size."""
    special = {i for i, token in tokenizer.tokenizer.get_added_tokens_decoder().items() if token.special}
    size = min(tokenizer.tokenizer.get_vocab_size(), model_folder.config(folder).get("vocab_size") or sys.maxsize)
    return np.array([i for i in range(size) if i not in special], dtype=np.int64)


def with_self_samples(model: ir.Model, folder: Path, windows: Windows, count: int, seed: int, progress: bool,
                      session_args: dict) -> Windows:
    """`windows` and `count` more that the model writes itself, as wide, from a first token drawn among the
    tokenizer's ordinary tokens (special ones left out) below the model's vocabulary size, after the BOS where the
    windows have one (`runtime.generate.sample_windows`)."""
    tokenizer = load_tokenizer(folder)
    first = ordinary_tokens(tokenizer, folder)
    bar = tqdm(total=count, desc="sampling calibration windows from the model", unit="window", disable=not progress,
               leave=False)
    sampled = sample_windows(make_session(model, folder=folder, **session_args), count, windows.ids.shape[1], first,
                             bos_id=tokenizer.bos_id if windows.bos else None, seed=seed, bar=bar)
    bar.close()
    return Windows(np.concatenate([windows.ids, sampled]), {**windows.source, "self_samples": count}, windows.bos)


def _skip(reason: str) -> str:
    """Say on stderr that a default row was left out, and why; the reason, for the report."""
    print(f"layerdrop: note: {reason}", file=sys.stderr)
    return reason
