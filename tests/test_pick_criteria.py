"""How the plan's pick is chosen among its measured rows: each criterion against a numpy computation of the same
rule over the rows' validation figures, the guard that falls back to the best paper row, and bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from layerdrop.api.plan import CRITERIA, PlanRow, choose_pick
from layerdrop.cli import main
from layerdrop.errors import LayerdropError

KINDS = ("calibration kind", "bundled mix", "another kind")
BASE = {"calibration kind": 20.0, "bundled mix": 30.0, "another kind": 5.0}


def row(method: str, ppl: tuple[float, float, float], accuracy: float | None = None, search: float = 25.0,
        paper: bool = False) -> PlanRow:
    found = PlanRow(method, {}, [], False, {}, [], None, None, [], 0.75, search, search, paper=paper)
    found.validation_ppl = dict(zip(KINDS, ppl))
    found.validation_accuracy = accuracy
    return found


BASELINE = row("baseline", tuple(BASE.values()), 0.40, search=20.0)


def trails(mine: np.ndarray, theirs: np.ndarray) -> bool:
    """Whether outcomes `mine` trail `theirs` on the same items by more than two paired standard errors, by numpy."""
    differences = mine - theirs
    return differences.mean() < -2 * differences.std(ddof=1) / np.sqrt(len(differences))


def log_ratios(rows: list[PlanRow]) -> np.ndarray:
    """[rows, kinds] log(perplexity / the baseline's), by numpy."""
    table = np.array([[r.validation_ppl[k] for k in KINDS] for r in rows])
    return np.log(table / np.array([BASE[k] for k in KINDS]))


@pytest.fixture
def rows() -> list[PlanRow]:
    # the fitted row wins on its calibration kind and on the search, and loses on another kind
    return [row("paper 1: one-shot drop", (26.0, 39.0, 6.5), 0.37, search=26.0, paper=True),
            row("HARP", (25.0, 40.0, 6.4), 0.38, search=25.5, paper=True),
            row("planner: fitted maps", (21.0, 36.0, 8.5), 0.36, search=21.5),
            row("planner: bypasses", (24.0, 38.5, 6.3), 0.385, search=24.0)]


def test_each_criterion_picks_the_row_its_rule_gives_by_numpy(rows):
    ratios = log_ratios(rows)
    expected = {"validation": int(np.argmin(ratios.mean(axis=1))), "worst-kind": int(np.argmin(ratios.max(axis=1))),
                "tasks": int(np.argmax([r.validation_accuracy for r in rows])),
                "search": int(np.argmin([r.search_ppl for r in rows]))}
    assert expected["search"] == 2 and expected["validation"] == 3  # the rows separate the criteria
    for criterion, index in expected.items():
        pick, short, picks = choose_pick(rows, BASELINE, criterion)
        assert pick is rows[index] and short is None, criterion
        assert picks[criterion] == rows[index].method
    assert set(picks) == set(CRITERIA)


def test_the_guard_keeps_a_planner_row_only_if_no_paper_row_is_as_good_on_every_kind_and_task(rows):
    ratios = log_ratios(rows)
    papers = [i for i, r in enumerate(rows) if r.paper]
    best_paper = papers[int(np.argmin(ratios[papers].mean(axis=1)))]
    chosen = int(np.argmin(ratios.mean(axis=1)))
    beats = bool(np.all(ratios[chosen] <= ratios[best_paper])) and (
        rows[chosen].validation_accuracy >= rows[best_paper].validation_accuracy)
    assert beats  # the bypass row is better than the best paper row everywhere: kept
    assert choose_pick(rows, BASELINE, "guarded")[0] is rows[chosen]
    rows[chosen].validation_accuracy = rows[best_paper].validation_accuracy - 0.01  # now worse on the tasks
    assert choose_pick(rows, BASELINE, "guarded")[0] is rows[best_paper]
    rows[chosen].validation_accuracy = 0.5
    rows[chosen].validation_ppl["another kind"] = rows[best_paper].validation_ppl["another kind"] * 1.01
    if np.argmin(log_ratios(rows).mean(axis=1)) == chosen:  # still the validation choice, now worse on one kind
        assert choose_pick(rows, BASELINE, "guarded")[0] is rows[best_paper]


def test_without_validation_windows_the_validation_criteria_fall_back_to_the_search_perplexity(rows):
    baseline = copy.deepcopy(BASELINE)
    for r in [*rows, baseline]:
        r.validation_ppl = None
    lowest = min(rows, key=lambda r: r.search_ppl)
    assert choose_pick(rows, baseline, "validation")[0] is lowest
    assert choose_pick(rows, baseline, "worst-kind")[0] is lowest


def test_the_tasks_criterion_needs_task_items(rows):
    for r in rows:
        r.validation_accuracy = None
    with pytest.raises(LayerdropError, match="--pick tasks needs the validation task items"):
        choose_pick(rows, BASELINE, "tasks")
    assert "tasks" not in choose_pick(rows, BASELINE, "guarded")[2]


@pytest.mark.parametrize("args", [["--pick", "lowest-loss"], ["--validation-items", "-1"],
                                  ["--budget", "attn=99"], ["--task-items", "1800", "--validation-items", "50"]])
def test_a_bad_pick_criterion_count_or_unmeetable_budget_is_one_line_and_writes_nothing(exported, tmp_path, capsys,
                                                                                        args):
    budget = [] if "--budget" in args else ["--budget", "attn=2"]
    folder = exported("llama", True)
    capsys.readouterr()
    code = main(["plan", str(folder), "-o", str(tmp_path / "m"), *budget, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("layerdrop: ")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_the_guard_lets_a_row_trail_a_paper_row_on_the_task_items_by_noise_only(rows):
    """With each item's outcome, a planner row that is better on every kind keeps the pick unless its task accuracy
    is below the paper row's by more than two standard errors of the paired difference (numpy over the items)."""
    rng = np.random.default_rng(0)
    paper_correct = (rng.random(150) < 0.4).astype(int)
    chosen = min(rows, key=lambda r: log_ratios([r]).mean())
    best_paper = min((r for r in rows if r.paper), key=lambda r: log_ratios([r]).mean())
    for other in rows:
        if other.paper and other is not best_paper:
            other.validation_accuracy = 0.30  # the best paper row by the measure is the best on the tasks too
    for flips in (2, 30):  # items the row gets wrong that the paper row gets right
        mine = paper_correct.copy()
        mine[np.flatnonzero(paper_correct == 1)[:flips]] = 0
        best_paper.validation_correct, chosen.validation_correct = paper_correct.tolist(), mine.tolist()
        best_paper.validation_accuracy, chosen.validation_accuracy = paper_correct.mean(), mine.mean()
        kept = not trails(mine, paper_correct)
        assert kept == (flips == 2)
        assert choose_pick(rows, BASELINE, "guarded")[0] is (chosen if kept else best_paper)


def test_the_guard_judges_each_validation_task_apart_and_takes_the_best_row_that_passes():
    """A row that loses one validation task by more than two paired standard errors fails the guard even when it
    wins another task by as much (pooled, the items would tie); the guard then takes the next row by the validation
    measure that passes, before the best paper row (numpy over the items)."""
    rng = np.random.default_rng(1)
    paper_items = {task: (rng.random(150) < 0.5).astype(int) for task in ("arc_easy", "lambada_openai")}
    paper = row("paper 1: one-shot drop", (26.0, 39.0, 6.5), paper=True)
    first = row("planner: fitted maps", (21.0, 36.0, 6.0))
    second = row("planner: bypasses", (24.0, 38.0, 6.4))
    lose, win = paper_items["lambada_openai"].copy(), paper_items["arc_easy"].copy()
    lose[np.flatnonzero(lose == 1)[:30]] = 0
    win[np.flatnonzero(win == 0)[:30]] = 1
    for found, items in ((paper, paper_items), (second, paper_items),
                         (first, {"arc_easy": win, "lambada_openai": lose})):
        found.validation_correct = {task: outcomes.tolist() for task, outcomes in items.items()}
        found.validation_accuracy = float(np.mean(np.concatenate(list(items.values()))))
    assert first.validation_accuracy == pytest.approx(paper.validation_accuracy)  # pooled: a tie
    assert trails(lose, paper_items["lambada_openai"])
    rows = [paper, second, first]
    ranked = sorted(rows, key=lambda r: log_ratios([r]).mean())
    assert ranked == [first, second, paper]
    assert choose_pick(rows, BASELINE, "guarded")[0] is second
    second.validation_ppl["another kind"] = 7.0  # now worse than the paper row on one kind: the paper row
    assert choose_pick(rows, BASELINE, "guarded")[0] is paper
    first.validation_correct["lambada_openai"] = paper_items["lambada_openai"].tolist()  # no longer loses
    assert choose_pick(rows, BASELINE, "guarded")[0] is first


def test_the_guard_holds_the_tasks_to_the_paper_row_best_on_them_and_falls_back_to_it():
    """The paper row best by the validation measure is not the one best on the task items: a planner row better
    than both on every kind, and on each task within noise of the first, still fails the guard when, over all the
    items, it trails the paper row best on the tasks by more than two paired standard errors; the pick is then that
    paper row (numpy over the items)."""
    rng = np.random.default_rng(2)
    tasks = ("arc_easy", "hellaswag", "lambada_openai")
    strong = {task: (rng.random(150) < 0.5).astype(int) for task in tasks}
    by_measure = row("score-selected bypass", (24.0, 37.0, 6.0), paper=True)
    by_tasks = row("paper 1: one-shot drop", (26.0, 39.0, 6.5), paper=True)
    planner = row("planner: fitted maps", (21.0, 36.0, 5.5))
    weaker = {task: outcomes.copy() for task, outcomes in strong.items()}
    for outcomes in weaker.values():
        lost, won = np.flatnonzero(outcomes == 1)[:9], np.flatnonzero(outcomes == 0)[:4]
        outcomes[lost], outcomes[won] = 0, 1  # on each task nine items lost, four won
    for found, items in ((by_tasks, strong), (by_measure, weaker), (planner, weaker)):
        found.validation_correct = {task: outcomes.tolist() for task, outcomes in items.items()}
        found.validation_accuracy = float(np.mean(np.concatenate(list(items.values()))))

    assert not any(trails(weaker[task], strong[task]) for task in tasks)  # each task apart: noise
    assert trails(np.concatenate([weaker[t] for t in tasks]), np.concatenate([strong[t] for t in tasks]))
    rows = [by_tasks, by_measure, planner]
    assert choose_pick(rows, BASELINE, "validation")[0] is planner
    assert choose_pick(rows, BASELINE, "guarded")[0] is by_tasks
    planner.validation_correct = by_tasks.validation_correct  # as good on the tasks: the planner row passes
    planner.validation_accuracy = by_tasks.validation_accuracy
    assert choose_pick(rows, BASELINE, "guarded")[0] is planner
