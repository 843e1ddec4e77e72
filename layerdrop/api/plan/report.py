"""The plan's result: one measured row per candidate, the pick among them, and everything a report of the plan
needs, as dataclasses that serialise to plan.json's fields."""

from __future__ import annotations

from dataclasses import dataclass, field

_MEASURED = ("method", "alphas", "fits", "shift", "ridges", "blocks", "replaced_into", "run_ridge", "moves",
             "kv_kept", "search_ppl", "eval_ppl")
_ACCURACY = ("accuracy", "accuracy_correct")
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
    also_eval_ppl: dict[str, float] | None = None  # held-out text's file name -> perplexity
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
    timings: dict = field(default_factory=dict)  # structure -> {"base_ms", "ms"}: every timed run, in order
    sizing: list[dict] = field(default_factory=list)  # the structures a speedup budget's sizing measured
    planner_log: list[dict] = field(default_factory=list)
    checkpoints: dict = field(default_factory=dict)  # "loaded", "computed": the work folder's entries, by this run
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """The plan as the written model's metadata holds it (plan.json without the search's log)."""
        baseline = self.baseline.to_dict()
        return {"budget": self.budget, "attention_layers": self.attention_layers, "block_count": self.block_count,
                "kv_fraction_kept": self.kv_fraction_kept, "moves": self.moves,
                "baseline": {key: baseline[key] for key in ("search_ppl", "eval_ppl", "also_eval_ppl", "accuracy",
                                                            "accuracy_correct") if key in baseline},
                "speedup_tokens": self.speedup_tokens, "methods": [row.to_dict() for row in self.rows],
                "pick": self.pick.to_dict(), "search_seconds": self.search_seconds, "search_text": self.search_text,
                "eval_text": self.eval_text, "also_eval_texts": self.also_eval_texts,
                "accuracy_items": self.accuracy_items, "accuracy_task": self.accuracy_task,
                "fit_text": self.fit_text, "fit_previous": self.fit_previous, "skipped": self.skipped,
                "timings": self.timings, "sizing": self.sizing}

    def to_dict(self) -> dict:
        """plan.json: `record()` and the search's log."""
        return {**self.record(), "planner_log": self.planner_log}


def choose_pick(rows: list[PlanRow], speedup: float | None = None) -> tuple[PlanRow, str | None]:
    """The pick among the rows the allowed moves make: the lowest search perplexity; under a speedup budget
    (`speedup`, with the table's timed column), among the rows whose speedup measured in the table reaches it,
    since the sizing's shorter measurement can land a row just under it. Returns the row, and where no row reaches
    the budget (the pick is then made among all), why."""
    reaching = [row for row in rows if speedup is None or row.speedup >= speedup]
    if reaching:
        return min(reaching, key=lambda row: row.search_ppl), None
    best = max(row.speedup for row in rows)
    return (min(rows, key=lambda row: row.search_ppl),
            f"no row reached {speedup:g}x in the table's own timing (the fastest: {best:.2f}x); the pick is the "
            "lowest search perplexity of all: raise the budget a little, or time more runs (--speedup-runs)")
