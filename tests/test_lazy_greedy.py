"""The planner's lazy greedy stage takes the layers that measuring every candidate at every step would take, when
the increases in perplexity compound (a move hurts no less when more layers are moved), with fewer
measurements."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from layerdrop.search.planner import _lazy_greedy


class _Counting:
    """A stand-in for the planner's evaluator: a perplexity for every move set, and a count of measurements."""

    def __init__(self, table: dict[frozenset, float]) -> None:
        self.table, self.calls, self.start = table, 0, None
        self.suffix = self

    def __call__(self, moves: dict[int, float]) -> float:
        self.calls += 1
        return self.table[frozenset(moves)]

    def perplexity(self, moves: dict[int, float], start: int) -> float:
        return self(moves)


def _monotone_table(layers: list[int], rng) -> dict[frozenset, float]:
    """Perplexities whose increases compound: a base cost per layer plus smaller random pairwise interactions (as
    on a real model, where layers differ more than they interact)."""
    cost = {k: rng.uniform(0.5, 3.0) for k in layers}
    pair = {p: rng.uniform(0.0, 0.2) for p in itertools.combinations(layers, 2)}
    return {frozenset(s): 10.0 + sum(cost[k] for k in s) + sum(pair[p] for p in itertools.combinations(sorted(s), 2))
            for r in range(len(layers) + 1) for s in itertools.combinations(layers, r)}


def _plain_greedy(table: dict[frozenset, float], layers: list[int], budget: int) -> list[int]:
    chosen: list[int] = []
    while len(chosen) < budget:
        trials = {k: table[frozenset([*chosen, k])] for k in layers if k not in chosen}
        chosen.append(min(trials, key=lambda k: (trials[k], k)))
    return chosen


@pytest.mark.parametrize("seed", range(5))
def test_lazy_greedy_takes_what_measuring_every_candidate_takes_with_fewer_measurements(seed):
    rng = np.random.RandomState(seed)
    layers, budget = [3, 5, 7, 9, 11, 13, 17], 4
    table = _monotone_table(layers, rng)
    evaluate = _Counting(table)
    alone = {k: table[frozenset([k])] for k in layers}
    log: list[dict] = []
    chosen, perplexity = _lazy_greedy(evaluate, dict.fromkeys(layers, 0.0), alone, budget, log)
    expected = _plain_greedy(table, layers, budget)
    assert [entry["layer"] for entry in log] == expected and sorted(chosen) == sorted(expected)
    assert perplexity == table[frozenset(expected)]
    plain_measurements = sum(len(layers) - step for step in range(1, budget))  # after the solo stage
    assert evaluate.calls - 1 < plain_measurements  # the one more: nothing moved


@pytest.mark.parametrize("best", [0.0, 0.3, 0.7, 1.0])
def test_the_refine_sweep_finds_a_unimodal_minimum_and_stops_two_alphas_past_it(best):
    """The refine stage's sweep over one layer's alphas: on a perplexity with one minimum in alpha it returns that
    minimum, having measured only up to two alphas past it; the layers below run from the state they leave."""
    from layerdrop.search.alpha_search import ALPHA_GRID
    from layerdrop.search.planner import _Evaluator

    calls = []

    class Suffix:
        def perplexity(self, moves, start, below):
            calls.append((dict(moves), start, dict(below)))
            return 10.0 + (moves[5] - best) ** 2

    evaluate = _Evaluator.__new__(_Evaluator)
    evaluate.suffix, evaluate.grid, evaluate.best = Suffix(), ALPHA_GRID, float("inf")
    evaluate.bar = type("Bar", (), {"update": lambda self: None, "set_postfix": lambda self, **_: None})()
    sweep = evaluate.unimodal_sweep({3: "fit", 7: 0.2}, 5)
    assert min(sweep, key=sweep.get) == best
    assert list(sweep) == [a for a in ALPHA_GRID if a <= round(best + 0.2, 1)]
    assert all(start == 5 and below == {3: "fit"} and moves[7] == 0.2 for moves, start, below in calls)
