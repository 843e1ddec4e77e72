"""The plan's result: one measured row per candidate, the pick among them, and everything a report of the plan
needs, as dataclasses that serialise to plan.json's fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from layerdrop.errors import LayerdropError

_MEASURED = ("method", "paper", "alphas", "fits", "shift", "ridges", "blocks", "replaced_into", "run_ridge",
             "moves", "kv_kept", "search_ppl", "eval_ppl")
_VALIDATION = ("validation_ppl", "validation_accuracy", "validation_correct")
_ACCURACY = ("accuracy", "accuracy_correct")
_TASKS = ("tasks_correct", "tasks_chance")
_FIDELITY = ("kl", "top1_agreement")
_AGAINST_BASELINE = ("accuracy_retained", "accuracy_difference", "accuracy_difference_se")
_TIMED = ("speedup", "speedup_runs", "structure")


@dataclass
class PlanRow:
    """One candidate as measured: its moves (attention layer -> alpha, fitted layers with each fit's ridge, blocks
    removed, the block a fitted run went into and its ridge), the share of attention layers that keep a KV cache,
    its perplexities, and where measured its accuracy on the items (each item: 1 right, 0 wrong; against the
    baseline: the retained percentage, the difference in points and that difference's paired standard error) and
    its prefill speedup (from `speedup_runs` runs, pooled under the graph's `structure` key)."""

    method: str
    alphas: dict[int, float]
    fits: list[int]
    shift: bool
    ridges: dict[int, float]
    blocks: list[int]
    replaced_into: int | None
    run_ridge: float | None
    moves: list[str]
    kv_kept: float
    search_ppl: float
    eval_ppl: float
    paper: bool = False  # a paper's method
    also_eval_ppl: dict[str, float] | None = None  # held-out text's label (`reports.text_labels`) -> perplexity
    validation_ppl: dict[str, float] | None = None  # validation kind -> perplexity
    validation_accuracy: float | None = None  # on the validation task items
    validation_correct: dict[str, list[int]] | list[int] | None = None  # by task (plans before: one list)
    tasks_correct: dict[str, list[float]] | None = None  # papers' task -> each item's value of its metric
    tasks_chance: dict[str, float] | None = None  # papers' task -> its items' mean chance level
    kl: float | None = None  # KL(baseline || row) of the next-token distribution, nats per token, held-out
    top1_agreement: float | None = None  # share of held-out positions whose most likely next token is the baseline's
    accuracy: float | None = None
    accuracy_correct: list[int] | None = None
    accuracy_retained: float | None = None
    accuracy_difference: float | None = None
    accuracy_difference_se: float | None = None
    compared: bool = False  # the three fields above are set
    speedup: float | None = None
    speedup_runs: int | None = None
    structure: str | None = None

    def to_dict(self) -> dict:
        """The row as plan.json holds it: the fields of what was measured only."""
        row = {name: getattr(self, name) for name in _MEASURED}
        if self.also_eval_ppl is not None:
            row["also_eval_ppl"] = self.also_eval_ppl
        row |= {name: getattr(self, name) for name in (*_VALIDATION, *_TASKS, *_FIDELITY)
                if getattr(self, name) is not None}
        if self.accuracy is not None:
            row |= {name: getattr(self, name) for name in _ACCURACY}
        if self.compared:
            row |= {name: getattr(self, name) for name in _AGAINST_BASELINE}
        if self.speedup is not None:
            row |= {name: getattr(self, name) for name in _TIMED}
        return row

    def compare_accuracy(self, baseline: PlanRow) -> None:
        """Set the accuracy against the baseline's: the retained percentage (None for a baseline at 0), and the
        difference in points with its standard error over the same items (`runtime.tasks.paired_difference`)."""
        from layerdrop.runtime.tasks import paired_difference

        self.accuracy_retained = 100.0 * self.accuracy / baseline.accuracy if baseline.accuracy else None
        difference, error = paired_difference(self.accuracy_correct, baseline.accuracy_correct)
        self.accuracy_difference, self.accuracy_difference_se = 100.0 * difference, 100.0 * error
        self.compared = True


@dataclass
class PlanResult:
    """What `plan` found: the budget and the counts it asked of the attention rows (of the block rows, without
    them) and of the block rows, the moves allowed, the baseline's figures, every row and the pick, the texts (and
    the accuracy items) the rows were measured on, the calibration text of the fits, whether the maps read the
    previous token, why default rows were left out (`skipped`), the timed runs and the speedup sizing, the search's
    log, and `notes` for the user (the reasons in `skipped` among them)."""

    budget: str
    attention_layers: int | None
    block_count: int | None
    kv_fraction_kept: float
    moves: list[str]
    baseline: PlanRow
    speedup_tokens: int | None
    rows: list[PlanRow]
    pick: PlanRow
    search_seconds: float
    search_text: dict
    eval_text: dict
    also_eval_texts: list[dict]
    accuracy_items: int
    accuracy_task: list[dict]  # the items, to rerun them through lm-eval elsewhere
    fit_text: dict | None
    fit_previous: bool
    skipped: list[str]
    criterion: str = "guarded"
    picks: dict = field(default_factory=dict)  # criterion -> the method it picks among the same rows
    validation_texts: dict = field(default_factory=dict)  # validation kind -> its windows' source
    validation_items: int = 0  # items of each validation task
    task_items: int = 0  # held-out items of each of the papers' tasks
    fidelity_text: dict | None = None  # the held-out windows the fidelity is measured on
    timings: dict = field(default_factory=dict)  # structure -> {"base_ms", "ms"}: every timed run, in order
    sizing: list[dict] = field(default_factory=list)  # the structures a speedup budget's sizing measured
    planner_log: list[dict] = field(default_factory=list)
    checkpoints: dict = field(default_factory=dict)  # "loaded", "computed": the work folder's entries, by this run
    notes: list[str] = field(default_factory=list)
    removed: list[dict] = field(default_factory=list)  # the written model's removal records (its metadata)
    run: dict = field(default_factory=dict)  # "runtime", "python": how to run the written model
    reproduce: str = ""  # the command that makes this plan again

    def record(self) -> dict:
        """The plan as the written model's metadata holds it (plan.json without the search's log)."""
        baseline = self.baseline.to_dict()
        return {"budget": self.budget, "attention_layers": self.attention_layers, "block_count": self.block_count,
                "kv_fraction_kept": self.kv_fraction_kept, "moves": self.moves,
                "baseline": {key: baseline[key] for key in ("search_ppl", "eval_ppl", "also_eval_ppl", "accuracy",
                                                            "accuracy_correct", *_VALIDATION, *_TASKS)
                             if key in baseline},
                "speedup_tokens": self.speedup_tokens, "methods": [row.to_dict() for row in self.rows],
                "pick": self.pick.to_dict(), "search_seconds": self.search_seconds, "search_text": self.search_text,
                "eval_text": self.eval_text, "also_eval_texts": self.also_eval_texts,
                "accuracy_items": self.accuracy_items, "accuracy_task": self.accuracy_task,
                "fit_text": self.fit_text, "fit_previous": self.fit_previous, "skipped": self.skipped,
                "criterion": self.criterion, "picks": self.picks, "validation_texts": self.validation_texts,
                "validation_items": self.validation_items, "task_items": self.task_items,
                "fidelity_text": self.fidelity_text, "timings": self.timings, "sizing": self.sizing}

    def to_dict(self) -> dict:
        """plan.json: `record()`, what was removed, how to run and reproduce it, and the search's log."""
        return {**self.record(), "removed": self.removed, "run": self.run, "reproduce": self.reproduce,
                "planner_log": self.planner_log}


CRITERIA = {
    "guarded": "the row with the lowest validation measure that is no worse than the best paper row by that measure "
               "on any validation kind, and trails the paper row best on the validation tasks by no more than two "
               "paired standard errors on any task or on all their items; else that paper row (best on the tasks)",
    "validation": "the lowest geometric mean, over the validation kinds, of perplexity relative to the baseline",
    "worst-kind": "the lowest worst-kind perplexity relative to the baseline over the validation kinds",
    "tasks": "the highest accuracy on the validation task items (ties: the validation measure)",
    "search": "the lowest perplexity on the search windows (the calibration kind, which the search chose on)",
}
DEFAULT_CRITERION = "guarded"


def check_criterion(name: str) -> str:
    """`name` if it is a pick criterion.

    Raises:
        LayerdropError: it is not one of CRITERIA.
    """
    if name not in CRITERIA:
        raise LayerdropError(f"--pick {name!r} is not a pick criterion; use one of {', '.join(CRITERIA)}")
    return name


def _ratios(row: PlanRow, baseline: PlanRow) -> dict[str, float]:
    """log(perplexity / the baseline's) on each validation kind (on the search windows where there are none)."""
    if row.validation_ppl and baseline.validation_ppl:
        return {kind: math.log(ppl / baseline.validation_ppl[kind]) for kind, ppl in row.validation_ppl.items()}
    return {"search": math.log(row.search_ppl / baseline.search_ppl)}


def _validation(row: PlanRow, baseline: PlanRow) -> float:
    ratios = _ratios(row, baseline)
    return sum(ratios.values()) / len(ratios)


def _key(criterion: str, baseline: PlanRow):
    if criterion == "search":
        return lambda row: row.search_ppl
    if criterion == "worst-kind":
        return lambda row: (max(_ratios(row, baseline).values()), _validation(row, baseline))
    if criterion == "tasks":
        return lambda row: (-(row.validation_accuracy or 0.0), _validation(row, baseline))
    return lambda row: _validation(row, baseline)


TASK_TOLERANCE = 2.0  # paired standard errors by which the guard lets a row trail a paper row on the task items


def _by_task(correct: dict[str, list[int]] | list[int]) -> dict[str, list[int]]:
    return correct if isinstance(correct, dict) else {"validation tasks": correct}


def _trails(mine: list[int], theirs: list[int]) -> bool:
    """Whether outcomes `mine` trail `theirs` (the same items) by more than TASK_TOLERANCE paired standard errors
    (with fewer than two items, or no spread, by any margin)."""
    from layerdrop.runtime.tasks import paired_difference

    if len(mine) < 2:
        return sum(mine) < sum(theirs)
    difference, error = paired_difference(mine, theirs)
    return difference < -TASK_TOLERANCE * error or (error == 0 and difference < 0)


def _not_worse(row: PlanRow, by_measure: PlanRow, by_tasks: PlanRow, baseline: PlanRow) -> bool:
    """Whether `row` is at least as good as the paper row `by_measure` (the best by the validation measure) on
    every validation kind, and trails the paper row `by_tasks` (the best on the validation task items) by no more
    than TASK_TOLERANCE paired standard errors on any validation task nor on all their items together (a few items'
    difference is noise; a plan made before the tasks were told apart compares all its items as one; where the
    outcomes are missing, the accuracies are compared as they are)."""
    mine, theirs = _ratios(row, baseline), _ratios(by_measure, baseline)
    if any(mine[kind] > theirs[kind] for kind in mine):
        return False
    if row.validation_accuracy is None or by_tasks.validation_accuracy is None:
        return True
    if not (row.validation_correct and by_tasks.validation_correct):
        return row.validation_accuracy >= by_tasks.validation_accuracy
    ours, others = _by_task(row.validation_correct), _by_task(by_tasks.validation_correct)
    pooled = [outcome for task in sorted(ours) for outcome in ours[task]]
    pooled_others = [outcome for task in sorted(ours) for outcome in others[task]]
    return not (_trails(pooled, pooled_others) or any(_trails(ours[task], others[task]) for task in ours))


def pick_by(rows: list[PlanRow], baseline: PlanRow, criterion: str) -> PlanRow:
    """The row `criterion` (one of CRITERIA) picks among `rows`."""
    if criterion == "guarded":
        ranked = sorted(rows, key=_key("validation", baseline))
        papers = [row for row in ranked if row.paper]
        if not papers:
            return ranked[0]
        by_measure = papers[0]
        by_tasks = min(papers, key=_key("tasks", baseline))  # without task items: by_measure, on the ties
        return next((row for row in ranked if _not_worse(row, by_measure, by_tasks, baseline)), by_tasks)
    return min(rows, key=_key(criterion, baseline))


def choose_pick(rows: list[PlanRow], baseline: PlanRow, criterion: str = DEFAULT_CRITERION,
                speedup: float | None = None) -> tuple[PlanRow, str | None, dict[str, str]]:
    """The pick among the rows the allowed moves make, by `criterion` (CRITERIA; the validation measures fall back
    to the search perplexity where the plan has no validation windows, the task measure needs task items); under a
    speedup budget (`speedup`, with the table's timed column), among the rows whose speedup measured in the table
    reaches it, since the sizing's shorter measurement can land a row just under it. Returns the row, where no row
    reaches the budget (the pick is then made among all) why, and the method every criterion picks among the same
    rows.

    Raises:
        LayerdropError: `criterion` is "tasks" and the rows have no validation task items.
    """
    check_criterion(criterion)
    has_items = all(row.validation_accuracy is not None for row in rows)
    if criterion == "tasks" and not has_items:
        raise LayerdropError("--pick tasks needs the validation task items: install the eval extra (pip install -e "
                             "'.[eval]') and give --validation-items above 0, or pick by another criterion")
    reaching = [row for row in rows if speedup is None or row.speedup >= speedup]
    short = None
    if not reaching:
        best = max(row.speedup for row in rows)
        reaching = rows
        short = (f"no row reached {speedup:g}x in the table's own timing (the fastest: {best:.2f}x); the pick is made "
                 "among all rows: raise the budget a little, or time more runs (--speedup-runs)")
    picks = {name: pick_by(reaching, baseline, name).method for name in CRITERIA if name != "tasks" or has_items}
    return pick_by(reaching, baseline, criterion), short, picks
