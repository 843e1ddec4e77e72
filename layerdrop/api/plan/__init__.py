"""`layerdrop plan`: for a budget, which attention layers or blocks go and how, compared with the papers' methods
on the same windows.

`budget` says what a budget asks of the rows, `texts` which windows they are chosen and measured on,
`candidates` makes the moves (the papers' methods and the planner's searches: `search.planner`, `search.fit`,
`search.blocks`), `measure` measures each as a row, `report` holds the rows and the pick, `resume` checkpoints every
finished measurement so `--resume` goes on where a killed plan stopped."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from layerdrop import model_folder
from layerdrop.api.common import (
    guard_memory,
    int4_write_back,
    one_at_a_time,
    open_model,
    quantize_pass,
    save_model,
    vocabulary,
)
from layerdrop.api.plan.budget import MOVES, RowCounts, allowed_moves, grid_of, parse_moves, row_counts
from layerdrop.api.plan.candidates import (
    Candidate,
    Inputs,
    block_candidates,
    bypass_candidates,
    fit_candidates,
    fitted_runs,
    mixed_candidates,
    mixed_sizes,
    paper_candidates,
)
from layerdrop.api.plan.measure import FIDELITY_BYTES, PREFIX_BYTES, Measure, choose_prefix, fidelity_windows
from layerdrop.api.plan.report import CRITERIA, DEFAULT_CRITERION, PlanResult, PlanRow, check_criterion, choose_pick
from layerdrop.api.plan.resume import Checkpoints, folder_fingerprint, keeps_work, plan_work_area, window_ids
from layerdrop.api.plan.texts import PlanWindows, Texts, fit_windows, plan_windows
from layerdrop.api.reports import plan_summary, reproduce_command, run_snippet
from layerdrop.api.score import score
from layerdrop.checkpoints import CheckpointStore
from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.formats import PLAN_KEY
from layerdrop.model_folder import write_atomically
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import removed_modules, write_json
from layerdrop.runtime.session import RunOptions
from layerdrop.search.planner import candidate_pool
from layerdrop.search.selection import Budget, PrefillMeter, parse_budget

__all__ = ["CRITERIA", "DEFAULT_CRITERION", "MOVES", "Candidate", "PlanResult", "PlanRow", "Texts", "choose_pick",
           "parse_moves", "plan"]

REPORT_NAME = "plan-report.md"  # the plan's report, in the written model's folder
SPEEDUP_TOKENS, SPEEDUP_RUNS = 1024, 5  # a speedup budget's prefill length (without one in it); timed runs a row
SIZING_RUNS = 3  # timed runs of each structure measured to size a speedup budget's rows


@keeps_work
def plan(
    model_path: Path,
    out_dir: Path,
    *,
    budget: str,
    texts: Texts = Texts(),
    extra: int = 4,
    moves: str | None = None,
    shift: bool = True,
    per_layer_moves: bool = False,
    fit_previous: bool | None = None,
    pick: str = DEFAULT_CRITERION,
    options: RunOptions = RunOptions(),
    force: bool = False,
    progress: bool = True,
    quantize: str | None = None,
    keep_float: bool = False,
    speedup_tokens: int | None = None,
    speedup_runs: int = SPEEDUP_RUNS,
    resume: bool = False,
    memory_limit: int | None = None,
) -> PlanResult:
    """Plan the best set of moves for a budget, compare it with the papers' methods, and write the pick.

    An attention or KV budget (`attn=N`, `kv=F`) takes the attention moves (drop, V·O bypass with a searched alpha,
    the mean shift on those, a fitted linear map per layer), a `blocks=N` budget the block moves (ShortGPT's drop,
    ReplaceMe's fitted run), a `speedup=X@T` budget any of them, its rows sized by measured prefill at T tokens;
    `moves` narrows them (`budget.parse_moves`). With the fit move, the planner searches fits (with
    `per_layer_moves`, each chosen layer's fit, drop or bypass; maps that also read the previous token unless
    `fit_previous` is False); without it, drops and bypasses. `texts` (`texts.Texts`) says which texts are read
    and how many windows and items of each: every choice is made on the search windows (of `texts.search_text`, or
    the search part of `texts.calib`); every row is also measured on `texts.validation_samples` windows of each
    validation kind (the calibration text's held-out part, the bundled mix) and the first
    `texts.validation_items` items of each validation task (`runtime.standard_tasks.VALIDATION_TASKS`: the
    validation splits of ARC and OpenBookQA, the last items of HellaSwag, PIQA and LAMBADA), which no fit, mean or
    search sees; on `texts.eval_text` and each `texts.also_eval` text, which nothing is chosen on; on
    `texts.accuracy_items` multiple-choice items of the held-out text (lm-eval, 0: no column); on the first
    `texts.task_items` items of each of the papers' standard tasks (`runtime.standard_tasks.PAPERS`, lm-eval's
    definitions, offline; 0: no column), which nothing is chosen on either; and with `speedup_runs` > 0 timed at
    `speedup_tokens` tokens. `texts.self_samples` windows the model writes itself join every fit's calibration
    windows.
    The pick is the row `pick` (`report.CRITERIA`; default: the best validation choice the best paper row does not beat)
    chooses among those the allowed moves make (under a speedup budget, among those that reach it in the table's
    timing). The written model is float unless `quantize` (or an int4 source without `keep_float`) says
    otherwise.

    Every finished measurement is checkpointed in the work folder `.NAME.plan-work` beside `out_dir`
    (`resume.plan_work_area`), removed once the output is written; with `resume`, a rerun loads the checkpoints of
    the same inputs and computes only the rest. A KeyboardInterrupt part way says how to resume. Before anything
    starts, the estimated peak memory (the base's session and a row's at once, the cached hidden-state prefixes) is
    checked against `memory_limit` (`one_at_a_time`): over it, the timings build one session at a time
    (`PrefillMeter.alone`, with a note), and a plan whose one session does not fit either is refused.

    Returns:
        The `PlanResult` (its `to_dict()` is plan.json; its `notes` are for the user).

    Raises:
        LayerdropError: a bad budget, move word, pick criterion, model or text, or a work folder of an interrupted
            plan without `resume` or `force`.
    """
    check_criterion(pick)
    calib, samples, seq_len, sampling = texts.calib, texts.samples, texts.seq_len, texts.sampling
    if min(texts.validation_samples, texts.validation_items, texts.task_items) < 0:
        raise LayerdropError("--validation-samples, --validation-items and --task-items count windows and items: "
                             "give 0 or more")
    if texts.task_items:
        from layerdrop.runtime.standard_tasks import check_validation_overlap

        check_validation_overlap(texts.validation_items, texts.task_items)
    sizes = {"extra": PREFIX_BYTES + FIDELITY_BYTES, "tokens": max(
        options.batch_size * seq_len, speedup_tokens or (SPEEDUP_TOKENS if budget.startswith("speedup") else seq_len))}
    alone = one_at_a_time("plan", [model_path, model_path], memory_limit, **sizes)  # the base's session and a row's
    if quantize is not None:
        guard_memory("plan", [model_path], memory_limit, quantizes=True, **sizes)
    folder, model = open_model(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    store = CheckpointStore.open(plan_work_area(out_dir), resume=resume, force=force)
    saved = Checkpoints(store, folder_fingerprint(folder.path, folder.onnx_path))
    attention = sorted(r.layer for r in annotated_regions(model) if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions; nothing to plan")
    parsed = parse_budget(budget, len(attention))
    allowed = allowed_moves(moves, parsed, shift=shift, per_layer_moves=per_layer_moves,
                            self_samples=texts.self_samples, fit_previous=bool(fit_previous))
    fit_previous = "fit" in allowed if fit_previous is None else fit_previous
    started = time.perf_counter()
    notes: list[str] = []  # for the user; those of rows left out also go into the report's `skipped`
    if alone:
        notes.append(f"timing one graph at a time (the base's session, then each row's): {alone}")
    windows = plan_windows(folder.path, texts, notes)
    rows = read_scores(model) or saved.cached(
        "scores", (windows.calib.source["sha256"], samples, seq_len, sampling, options.provider),
        lambda: score(folder.path, None, calib=calib, samples=samples, seq_len=seq_len, sampling=sampling,
                      options=RunOptions(options.provider, options.threads), progress=progress,
                      memory_limit=memory_limit)["regions"])
    inputs = Inputs(model, folder.path, {r["layer"]: r["score"] for r in rows if r["kind"] == "attn"},
                    {r["layer"]: r["score"] for r in rows if r["kind"] == "block"}, windows.calib, windows.search,
                    None, options, progress, [], fit_previous)
    phase = _Phases(progress)
    meter = None
    if parsed.kind == "speedup":
        meter = _sizing_meter(inputs, parsed, allowed, speedup_runs, phase, bool(alone))
    counts = saved.cached("sizing", (parsed, inputs.scores, inputs.block_scores, allowed, extra, options,
                                     speedup_runs, fit_previous),
                          lambda: row_counts(parsed, meter, inputs.scores, inputs.block_scores, allowed, extra,
                                             inputs.skipped), skipped=inputs.skipped, meter=meter)
    if "fit" in allowed or counts.blocks:
        inputs.fit = saved.cached("fit-windows", (window_ids(windows.calib), texts.samples, texts.fit_samples,
                                                  texts.self_samples, sampling, options),
                                  lambda: fit_windows(model, folder.path, texts, options, progress))
    candidates, log, allowed = _candidates(inputs, attention, counts, allowed, extra, meter, parsed, phase,
                                           per_layer_moves, moves is not None, saved)
    if meter is not None:
        meter.bar.close()
    tokens = speedup_tokens or parsed.tokens or (SPEEDUP_TOKENS if parsed.kind == "speedup" else seq_len)
    phase(f"measuring {len(candidates)} rows on the search and held-out windows"
          + (f", and their prefill time at {tokens} tokens" if speedup_runs else ""))
    if speedup_runs and (meter is None or meter.seq != tokens):  # else the sizing's runs are the rows' too
        meter = (PrefillMeter.alone(model, folder.path, tokens, speedup_runs, options=options) if alone else
                 PrefillMeter(model, folder.path, tokens, options.session(model, folder=folder.path), speedup_runs,
                              options=options))
    result = _measured(inputs, windows, candidates, allowed, len(attention), meter,
                       (tokens, speedup_runs), parsed, counts, saved, pick)
    result.search_seconds = time.perf_counter() - started
    result.planner_log = log
    result.notes = [*notes, *result.skipped, *filter(None, [saved.summary()])]
    write_json(model.metadata_props, PLAN_KEY, result.record())
    chosen = next(c for c, row in zip(candidates, result.rows) if row is result.pick).applied_to(model)
    # the comparison is measured in float; the written model is quantized
    writes = [quantize_pass(quantize)] if quantize is not None else int4_write_back(model, keep_float)
    chosen = run_passes(chosen, writes) if writes else chosen
    result.removed = removed_modules(chosen)
    save_model(chosen, out_dir, folder, force=force)
    runtime, python = run_snippet(Path(out_dir))
    result.run = {"runtime": runtime, "python": python}
    result.reproduce = reproduce_command("plan", [model_path], {
        "-o": out_dir, "--budget": budget, "--calib": calib, "--eval": texts.eval_text,
        "--search-text": texts.search_text, "--also-eval": list(texts.also_eval), "--moves": moves,
        "--no-shift": not shift, "--per-layer-moves": per_layer_moves,
        "--fit-per-token": not fit_previous and "fit" in allowed, "--pick": _unless(pick, DEFAULT_CRITERION),
        **{option: _unless(getattr(texts, name), getattr(DEFAULT_TEXTS, name)) for option, name in TEXT_OPTIONS},
        "--extra": _unless(extra, 4), "--speedup-tokens": speedup_tokens,
        "--speedup-runs": _unless(speedup_runs, SPEEDUP_RUNS), "--seed": _unless(sampling.seed, 0),
        "--from-start": sampling.from_start, "--text-field": _unless(sampling.text_field, "text"),
        "--provider": _unless(options.provider, "cpu"), "--threads": options.threads,
        "--batch-size": _unless(options.batch_size, 1), "--quantize": quantize, "--keep-float": keep_float})
    write_atomically(Path(out_dir) / REPORT_NAME, plan_summary(result.to_dict()) + "\n")
    result.checkpoints = {"loaded": list(store.loaded), "computed": list(store.computed)}
    store.remove()
    return result


DEFAULT_TEXTS = Texts()
TEXT_OPTIONS = (("--samples", "samples"), ("--search-samples", "search_samples"), ("--eval-samples", "eval_samples"),
                ("--fit-samples", "fit_samples"), ("--seq-len", "seq_len"), ("--self-samples", "self_samples"),
                ("--validation-samples", "validation_samples"), ("--validation-items", "validation_items"),
                ("--task-items", "task_items"), ("--accuracy-items", "accuracy_items"))


def _unless(value, default):
    """`value`, or None (left out of the reproduce command) where it is the default."""
    return None if value == default else value


def _sizing_meter(inputs: Inputs, budget: Budget, allowed: frozenset, speedup_runs: int, phase: _Phases,
                  alone: bool) -> PrefillMeter:
    """The meter a speedup budget's sizing measures prefill with (its runs confirmed with the table's); with
    `alone`, one that times one graph at a time (`PrefillMeter.alone`)."""
    tokens = budget.tokens or SPEEDUP_TOKENS
    phase.total = 2 + 2 * bool(allowed - {"blocks", "shift"}) + ("blocks" in allowed)  # until the sizing says
    phase(f"sizing the rows: the fewest layers and blocks whose measured prefill at {tokens} tokens reaches "
          f"{budget.value:g}x")
    maps = (1 + inputs.previous) * bool(allowed & {"fit", "bypass"})
    runs = min(speedup_runs or SIZING_RUNS, SIZING_RUNS)
    settings = {"confirm_runs": speedup_runs, "maps": maps, "options": inputs.options,
                "bar": tqdm(desc="sizing rows by measured prefill", unit="graph", disable=not inputs.progress,
                            leave=False)}
    if alone:
        return PrefillMeter.alone(inputs.model, inputs.folder, tokens, runs, **settings)
    base = inputs.options.session(inputs.model, folder=inputs.folder)
    return PrefillMeter(inputs.model, inputs.folder, tokens, base, runs, **settings)


def _candidates(inputs: Inputs, attention: list[int], counts: RowCounts, allowed: frozenset, extra: int,
                meter: PrefillMeter | None, budget: Budget, phase: _Phases, per_layer_moves: bool, named: bool,
                saved: Checkpoints) -> tuple[list[Candidate], list[dict], frozenset]:
    """Every candidate the budget's counts and the allowed moves make, the planner search's log, and the allowed
    moves (less the fit where the windows cannot support one and the moves were not `named` by the user); each
    phase's candidates are checkpointed in `saved`.

    Raises:
        TooFewTokens: the windows cannot support a fit the user asked for by name.
    """
    count, block_count = counts.attention, counts.blocks
    grid = grid_of(allowed) if count else ()
    fits_searched = bool(count) and "fit" in allowed
    phase.total = phase.done + 1 + bool(count) + (fits_searched or bool(grid)) + bool(block_count)
    candidates: list[Candidate] = []
    planned = None
    pool = len(candidate_pool(inputs.scores, count, extra)) if count else 0
    # what each phase's candidates are made from: the scores, the windows it reads, how ONNX Runtime runs
    scores, calib, search, fit = (inputs.scores, window_ids(inputs.calib), window_ids(inputs.search),
                                  window_ids(inputs.fit))
    shifted = "shift" in allowed
    if count:
        phase("the papers' methods: one-shot and iterative drop, HARP, score-selected bypass")
        candidates += saved.cached("papers", (scores, calib, search, inputs.options, attention, count),
                                   lambda: paper_candidates(inputs, attention, count))
    if fits_searched:
        phase(f"the planner's search over fits of the {pool} lowest-scored layers"
              + (", then each chosen layer's fit, drop or bypass" if per_layer_moves else "")
              + (f" (and on to {counts.matched}, the block rows' speed)" if counts.matched else "")
              + ", then the chosen and the lowest-scored layers fitted bottom-up")
        try:
            fits_grid = grid if per_layer_moves else ()
            planned, found = saved.cached(
                "fits", (scores, fit, search, calib if fits_grid and shifted else None, inputs.options,
                         inputs.previous, count, extra, fits_grid, shifted, counts.matched),
                lambda: fit_candidates(inputs, count, extra, fits_grid, shifted, counts.matched))
            candidates += found
        except TooFewTokens as exc:
            if named:  # asked for by name: the user must hear why it cannot be done
                raise
            inputs.skipped.append(f"fit rows left out: {exc}")
            allowed -= {"fit"}
            phase.total += bool(grid)  # the search over bypasses and drops instead
    if grid and "fit" not in allowed:
        phase(f"the planner's search over the {pool} lowest-scored layers")
        planned, found = saved.cached("bypasses", (scores, search, calib if shifted else None, inputs.options,
                                                   count, extra, grid, shifted),
                                      lambda: bypass_candidates(inputs, count, extra, grid, shifted))
        candidates += found
    if block_count:
        phase(f"block moves: ShortGPT's drop and ReplaceMe's fitted run of {block_count} blocks"
              + (", and runs of fewer blocks with attention moves" if meter and allowed - {"blocks"} else ""))
        sizes = mixed_sizes(block_count, allowed) if meter is not None else []
        runs = saved.cached("block-runs", (fit, search, inputs.options, block_count, sizes),
                            lambda: fitted_runs(inputs, [block_count, *sizes]), skipped=inputs.skipped)
        candidates += block_candidates(inputs.block_scores, block_count, runs)
        if runs:
            candidates += saved.cached(
                "mixed", (scores, fit, search, inputs.options, inputs.previous, budget.value, sizes, runs, allowed),
                lambda: mixed_candidates(inputs, meter, budget.value, sizes, runs, allowed),
                skipped=inputs.skipped, meter=meter)
    return candidates, planned.log if planned is not None else [], allowed


def _measured(inputs: Inputs, windows: PlanWindows, candidates: list[Candidate], allowed: frozenset, layers: int,
              meter: PrefillMeter | None, speed: tuple[int, int], budget: Budget, counts: RowCounts,
              saved: Checkpoints, criterion: str) -> PlanResult:
    """Measure the baseline and every candidate (a progress bar with the baseline's and the best held-out
    perplexity so far; `speed`: the rows' prefill tokens and timed runs, through `meter`) and pick the allowed one
    `criterion` chooses on the validation evidence; the plan's result, without its timing, log and notes. Each row
    is checkpointed in `saved` (the baseline's with the hidden states it keeps for the other rows)."""
    tokens, runs = speed
    model, held_out, search = inputs.model, windows.held_out, windows.search
    measure = Measure(model, inputs.folder, search, held_out, layers, inputs.options, meter, runs,
                      validation=windows.validation,
                      fidelity=fidelity_windows(held_out.main, vocabulary(model, inputs.folder)))
    sets = measure.sets()
    measure.prefix = choose_prefix(model, candidates, sum(len(w.ids) for w in sets.values()), search.ids.shape[1])
    prefix = measure.prefix
    bar = tqdm(total=1 + len(candidates), desc="measuring rows", unit="row", disable=not inputs.progress,
               leave=False)
    timed = meter if meter is not None and runs > 0 else None
    validation_items = windows.validation.items if windows.validation is not None else 0
    measured_on = ({key: window_ids(w) for key, w in sets.items()}, held_out.items, validation_items, layers,
                   inputs.options, runs, tokens, prefix.entries, held_out.tasks)

    def baseline() -> tuple[PlanRow, dict, np.ndarray]:
        row = measure.row(Candidate("baseline"), timed=False)
        return row, prefix.states, measure.reference

    base, prefix.states, measure.reference = saved.cached("baseline", (*measured_on, "fidelity"), baseline)
    bar.set_postfix(baseline=f"{base.eval_ppl:.2f}")
    bar.update()
    table: list[PlanRow] = []
    for candidate in candidates:
        table.append(saved.cached("row", (measured_on, candidate, "fidelity"), lambda c=candidate: measure.row(c),
                                  meter=timed))
        best = min(table, key=lambda row: row.eval_ppl)
        bar.set_postfix(baseline=f"{base.eval_ppl:.2f}", best_held_out=f"{best.eval_ppl:.2f}")
        bar.update()
    bar.close()
    if held_out.items is not None:
        for row in table:
            row.compare_accuracy(base)
    skipped = inputs.skipped
    pick, short, picks = choose_pick([row for row, c in zip(table, candidates) if c.moves <= allowed], base,
                                     criterion, budget.value if budget.kind == "speedup" and runs else None)
    if short:
        skipped.append(short)
    fitted = any(c.fits is not None or c.run is not None for c in candidates)
    count, block_count = counts.attention, counts.blocks
    return PlanResult(
        budget=budget.text, attention_layers=count if count is not None else block_count, block_count=block_count,
        kv_fraction_kept=(layers - count) / layers if count is not None else pick.kv_kept, moves=sorted(allowed),
        baseline=base, speedup_tokens=tokens if runs else None, rows=table, pick=pick,
        search_seconds=0.0, search_text=search.source, eval_text=held_out.main.source,
        also_eval_texts=[w.source for w in held_out.others],
        accuracy_items=len(held_out.items) if held_out.items is not None else 0,
        accuracy_task=held_out.items or [],
        fit_text=inputs.fit.source if inputs.fit is not None and fitted else None,
        fit_previous=any(m.previous for c in candidates for m in (c.fits or {}).values()),
        skipped=skipped, criterion=criterion, picks=picks,
        validation_texts={kind: w.source for kind, w in windows.validation.kinds.items()}
        if windows.validation is not None else {}, validation_items=validation_items, task_items=held_out.tasks,
        fidelity_text={**measure.fidelity.source, "tokens": int(measure.fidelity.ids.size)},
        **(meter.record() if meter is not None else {}))


class _Phases:
    """'layerdrop plan: [2/4] ... (95 s in)' on stderr as each phase starts (with progress on): the plan's progress
    line."""

    def __init__(self, progress: bool, total: int = 0) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        self.done += 1
        if self.progress:
            elapsed = time.perf_counter() - self.started
            print(f"layerdrop plan: [{self.done}/{self.total}] {text} ({elapsed:.0f} s in)", file=sys.stderr,
                  flush=True)
