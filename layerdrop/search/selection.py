"""Which modules: the n lowest scores (one tie-break everywhere), paper 1's iterative selection, and budgets
turned into a count of attention layers."""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import AttachScoresPass
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.moves import move_passes, tidy_passes
from layerdrop.runtime.session import RunOptions
from layerdrop.search.measure import compute_scores
from layerdrop.windows import Windows

BUDGET_KINDS = ("attn", "kv", "speedup", "blocks")


def _order(row: dict) -> tuple:
    return (row["score"], row["layer"], row["kind"])  # the tie-break: lower layer, then kind


def select_lowest(rows: list[dict], kinds: tuple[str, ...], count: int) -> list[tuple[str, int]]:
    """The `count` lowest-scored modules among `kinds`, as (kind, layer); ties go to the lower layer.

    Raises:
        LayerdropError: count is not positive or larger than the modules there are.
    """
    pool = [r for r in rows if r["kind"] in kinds]
    label = "+".join(kinds)
    if count < 1:
        raise LayerdropError(f"the {label} count must be at least 1 (got {count})")
    if count > len(pool):
        raise LayerdropError(f"asked to drop {count} {label} modules but the model has {len(pool)}")
    return [(r["kind"], r["layer"]) for r in sorted(pool, key=_order)[:count]]


def lowest_layers(scores: dict[int, float], count: int) -> list[int]:
    """The `count` layers with the lowest scores (layer -> score), with the same tie-break."""
    rows = [{"layer": layer, "kind": "attn", "score": score} for layer, score in scores.items()]
    return [layer for _, layer in select_lowest(rows, ("attn",), count)] if count else []


def rank_overlap(first: list[dict], second: list[dict], n: int, kinds: Iterable[str] = ("attn", "mlp")) -> dict:
    """How many of the n lowest-scored modules two rankings share (over the given kinds)."""
    kinds = tuple(kinds)
    a = select_lowest(first, kinds, min(n, sum(r["kind"] in kinds for r in first)))
    b = select_lowest(second, kinds, min(n, sum(r["kind"] in kinds for r in second)))
    return {"n": n, "shared": len(set(a) & set(b)), "first": a, "second": b}


def selection_kinds(counts: dict[str, int]) -> list[tuple[tuple[str, ...], int]]:
    """Score-based counts ({"attn": n, "mlp": n, "block": n, "joint": n}) as (kinds, n) selections."""
    kinds = {"attn": ("attn",), "mlp": ("mlp",), "block": ("block",), "joint": ("attn", "mlp")}
    return [(kinds[key], counts[key]) for key in kinds if counts.get(key) is not None]


def drop_iteratively(model: ir.Model, folder: Path, windows: Windows, kinds: tuple[str, ...], count: int,
                     options: RunOptions = RunOptions(), progress: bool = True) -> None:
    """Drop the lowest-scored module, re-score the pruned graph, repeat `count` times (SPEC §3, iterative)."""
    label = "joint" if len(kinds) > 1 else kinds[0]
    for step in range(count):
        scores = compute_scores(model, folder, windows, options=options, progress=progress)
        target = select_lowest([asdict(s) for s in scores], kinds, count - step)[:1]
        run_passes(model, [AttachScoresPass(scores, windows.source),
                           *move_passes(target, reason=f"{label}-{count} iterative step {step + 1}")])


@dataclass(frozen=True)
class Budget:
    """A budget as the user wrote it (`text`), its kind (attn, kv, blocks or speedup), its value, and for a speedup
    the prefill length it names (`tokens`, None where it names none)."""

    text: str
    kind: str
    value: float
    tokens: int | None = None


def parse_budget(text: str, attention_layers: int) -> Budget:
    """'attn=8' | 'kv=0.75' | 'blocks=4' | 'speedup=1.2' or 'speedup=1.2@1024' -> the Budget.

    Raises:
        LayerdropError: an unknown or out-of-range budget.
    """
    kind, sep, value = text.partition("=")
    if not sep or kind not in BUDGET_KINDS:
        raise LayerdropError(f"bad --budget {text!r}: use attn=N, kv=FRACTION, blocks=N or speedup=X[@TOKENS]")
    value, _, seq = value.partition("@")
    try:
        number = float(value)
        seq_len = int(seq) if seq else None
    except ValueError:
        raise LayerdropError(f"bad --budget {text!r}: {value!r} is not a number") from None
    if kind == "attn" and not (number.is_integer() and 1 <= number <= attention_layers):
        raise LayerdropError(f"--budget attn={value} must be a whole number from 1 to {attention_layers}")
    if kind == "blocks" and not (number.is_integer() and 1 <= number < attention_layers):
        raise LayerdropError(f"--budget blocks={value} must be a whole number from 1 to {attention_layers - 1} (a "
                             "block must stay to carry a fitted run)")
    if kind == "kv" and not 0 <= number < 1:
        raise LayerdropError(f"--budget kv={value} must be a fraction in [0, 1) of the KV cache to keep")
    if kind == "speedup" and not number > 1:
        raise LayerdropError(f"--budget speedup={value} must be above 1")
    return Budget(text, kind, number, seq_len)


def attention_count_for(budget: Budget, meter: PrefillMeter | None, scores: dict[int, float]) -> int:
    """How many attention layers a budget asks to remove or bypass (for a speedup: the fewest lowest-scored whose
    measured prefill reaches it)."""
    if budget.kind in ("attn", "blocks"):
        return int(budget.value)
    if budget.kind == "kv":
        return max(1, math.ceil(len(scores) * (1 - budget.value) - 1e-9))
    return count_for_speedup(budget.value, meter, scores, ("attn",))


def structure_key(model: ir.Model) -> str:
    """What a graph's prefill costs depends on: its nodes' op types and the shapes and types of their constant
    inputs (the weights), as a multiset. Two graphs with the same key do the same work, whatever the values of the
    weights and whichever layers were moved (a fitted map in layer 5 or in layer 25; a fitted run folded into a
    down-projection or the same blocks dropped), so they share one timing."""
    counts: dict[tuple, int] = {}
    for node in model.graph.all_nodes():
        inputs = tuple("" if v is None else "-" if v.const_value is None and not v.is_initializer()
                       else f"{v.dtype}{v.shape}" for v in node.inputs)
        key = (node.domain, node.op_type, inputs)
        counts[key] = counts.get(key, 0) + 1
    return hashlib.sha256(repr(sorted(counts.items())).encode()).hexdigest()[:16]


@dataclass
class PrefillMeter:
    """Measured prefill speedups at `seq` tokens against the unpruned model's session `base`, runs alternating
    (`runtime.bench.paired_speedup`; the ratio of the medians): what removing whole blocks and replacing attention
    layers saves on this machine. Runs are pooled by graph structure (`structure_key`): each structure is timed
    once, and asking for it again with more runs only adds the missing ones, so the plan's table reuses, and tops
    up, what the sizing measured, and rows of the same structure get one figure.

    For sizing (`speedup`), an attention layer becomes what the allowed moves leave of it: a `maps` d x d map (1: a
    fitted map's MatMul and Add, the cost of a folded V·O bypass too; 2: a map that also reads the previous token;
    its values do not matter, so zeros) or nothing (0: a drop). ReplaceMe's transform is folded into a kept
    block's MLP, so a fitted run costs what dropping its blocks does. `runs` runs a structure the sizing
    measures, `confirm_runs` (if more) the count it settles on; `bar` (a tqdm bar) counts the measurements; `options`
    how the sessions run.

    Made by `alone` instead (where the base and a rewritten graph do not fit in memory together), the meter times
    one graph at a time: the base first in a session of its own, released before any other is built, then each
    structure alone against those base runs (the runs no longer alternate, so they spread more with the machine's
    load)."""

    model: ir.Model
    folder: Path
    seq: int
    base: Any  # onnxruntime.InferenceSession of `model`, or None: one graph at a time
    runs: int = 5
    maps: int = 1
    options: RunOptions = RunOptions()
    bar: Any = None
    confirm_runs: int = 0
    measured: dict = field(default_factory=dict)  # (blocks, attention) -> speedup, of the sizing's structures
    keys: dict = field(default_factory=dict)  # (blocks, attention) -> structure key
    timings: dict = field(default_factory=dict)  # structure key -> (the baseline's run times, the structure's), ms
    base_alone_ms: list = field(default_factory=list)  # without a base session: the base's own run times

    @classmethod
    def alone(cls, model: ir.Model, folder: Path, seq: int, runs: int, **kwargs) -> PrefillMeter:
        """A meter that times one graph at a time: the base's `max(runs, confirm_runs)` runs now, in a session of
        its own released before any other is built (so call it before building a rewritten graph's session)."""
        from layerdrop.runtime.bench import lone_prefill_ms

        meter = cls(model, folder, seq, None, runs, **kwargs)
        meter.base_alone_ms = lone_prefill_ms(meter._session(model), seq, max(runs, meter.confirm_runs))
        return meter

    def speedup(self, blocks: Iterable[int] = (), attention: Iterable[int] = (), runs: int | None = None) -> float:
        """The measured prefill speedup with these blocks removed and these attention layers replaced, from at least
        `runs` (default `self.runs`) timed runs."""
        key = (frozenset(blocks), frozenset(attention))
        graph = None
        if key not in self.keys:
            graph = self.structure(*key)
            self.keys[key] = structure_key(graph)
        timed = []  # a session was built: new runs were timed

        def session():
            timed.append(True)
            return self._session(graph if graph is not None else self.structure(*key))

        self.measured[key] = self._timed(self.keys[key], runs or self.runs, session)
        if self.bar is not None and timed:
            self.bar.set_postfix(blocks=len(key[0]), attention=len(key[1]), speedup=f"{self.measured[key]:.3f}x")
            self.bar.update()
        return self.measured[key]

    def timed(self, graph: ir.Model, runs: int, session=None) -> tuple[float, int, str]:
        """`graph`'s measured prefill speedup from at least `runs` timed runs of its structure (`session`: one of
        `graph`, if there is one). Returns (the speedup, the runs behind it, the structure key)."""
        key = structure_key(graph)
        speedup = self._timed(key, runs, lambda: session if session is not None else self._session(graph))
        return speedup, len(self.timings[key][1]), key

    def pooled(self, key: str) -> tuple[float, int]:
        """The speedup of a measured structure from all its runs so far, and their number."""
        base_ms, ms = self.timings[key]
        return statistics.median(base_ms) / statistics.median(ms), len(ms)

    def record(self) -> dict:
        """For a report: every timed run by structure, in order, and the structures the sizing measured."""
        return {"timings": {key: {"base_ms": base, "ms": ms} for key, (base, ms) in self.timings.items()},
                "sizing": [{"blocks": sorted(blocks), "attention": sorted(attention), "speedup": speedup,
                            "structure": self.keys[blocks, attention]}
                           for (blocks, attention), speedup in self.measured.items()
                           if (blocks, attention) in self.keys]}

    def _timed(self, key: str, runs: int, session) -> float:
        from layerdrop.runtime.bench import lone_prefill_ms, paired_speedup

        base_ms, ms = self.timings.setdefault(key, ([], []))
        if len(ms) < runs and self.base is None:  # against the base's runs timed alone first (`alone`)
            ms += lone_prefill_ms(session(), self.seq, runs - len(ms))
            base_ms[:] = self.base_alone_ms
        elif len(ms) < runs:
            # a new session is warmed twice; the base twice on its first use, then once
            found = paired_speedup(self.base, session(), self.seq, runs=runs - len(ms),
                                   base_warmup=1 if any(base for base, _ in self.timings.values()) else 2)
            base_ms += found["base_runs_ms"]
            ms += found["runs_ms"]
        return self.pooled(key)[0]

    def _session(self, graph: ir.Model):
        return self.options.session(graph, folder=self.folder)

    def savings(self) -> tuple[float, float]:
        """The share of prefill time one block's removal and one attention layer's replacement save, by least
        squares over the structures measured so far (0 for a kind none of them changed)."""
        if not self.measured:
            return 0.0, 0.0
        counts = np.array([[len(blocks), len(attention - blocks)] for blocks, attention in self.measured], float)
        saved = np.array([1 - 1 / speedup for speedup in self.measured.values()])
        per_block, per_layer = np.linalg.lstsq(counts, saved, rcond=None)[0]
        return float(per_block), float(per_layer)

    def structure(self, blocks: Iterable[int], attention: Iterable[int]) -> ir.Model:
        """A copy of the model with `blocks` dropped and `attention` replaced by zero maps (or dropped)."""
        from layerdrop.model_folder import copy_model
        from layerdrop.passes.fit_attention import FitAttentionPass, FittedMap

        copy = copy_model(self.model)
        attention = sorted(set(attention) - set(blocks))
        drops = [("block", k) for k in sorted(blocks)] + ([] if self.maps else [("attn", k) for k in attention])
        passes: list[ir.passes.PassBase] = [DropBranchesPass(drops, reason="sizing")] if drops else []
        if self.maps and attention:
            regions = {r.layer: r for r in annotated_regions(copy) if r.kind == "attn"}
            width = {k: regions[k].skip.shape[-1] if regions[k].skip.shape is not None else None for k in attention}
            if not all(isinstance(d, int) for d in width.values()):
                raise LayerdropError("a speedup budget needs the hidden size in the graph's shapes to time fitted "
                                     "maps; run the graph through onnx shape inference, or use --moves drop,blocks")
            passes.append(FitAttentionPass({k: FittedMap(np.zeros((self.maps * d, d), np.float32),
                                                         np.zeros(d, np.float32), previous=self.maps == 2)
                                            for k, d in width.items()}, reason="sizing"))
        run_passes(copy, [*passes, *tidy_passes()])
        return copy


def count_for_speedup(value: float, meter: PrefillMeter, scores: dict[int, float], kinds: tuple[str, ...],
                      removed: Iterable[int] = ()) -> int:
    """The fewest lowest-scored modules whose removal, with the `removed` blocks, reaches a measured prefill
    speedup of `value` (`meter`): attention layers (`kinds` ("attn",)), or whole blocks (("attn", "mlp"); `scores`
    are then block scores). One must stay (a block, or an attention layer with its cache).

    The saved share of prefill time, 1 - 1/speedup, grows about linearly with the count, so the count is searched
    on that line: a first guess from the per-module savings measured so far (`meter.savings`; half the modules
    when there are none), then guesses interpolated inside the bracket of a count that falls short and one that
    reaches, until they are neighbours. A few measurements, each a rewrite and `meter.runs` prefills of it and of
    the original, alternating. The count that reaches is then confirmed with more runs (`meter.confirm_runs` in
    all, the plan's table's; pooled with the first ones): a count that falls short on them is not taken, the search
    goes on above it. So a row sized in reaches the budget in the table's own timing, which reuses these runs.

    Raises:
        LayerdropError: even every module but one does not reach it.
    """
    blocks = len(kinds) > 1
    gone = list(removed)
    allowed = lowest_layers(scores, len(scores) - 1)
    target = 1 - 1 / value
    per_block, per_layer = meter.savings()
    rate = per_block if blocks else per_layer
    saved = {0: per_block * len(gone)}  # count -> measured saved share (estimated at 0)

    def measure(count: int, runs: int | None = None) -> float:
        chosen = allowed[:count]
        speedup = meter.speedup(gone + chosen, [], runs) if blocks else meter.speedup(gone, chosen, runs)
        return 1 - 1 / speedup

    low, high = 0, None  # saved[low] < target <= saved[high]
    guess = math.ceil((target - saved[0]) / rate) if rate > 0 else len(allowed) // 2
    while True:
        probe = min(max(guess, low + 1), len(allowed) if high is None else high - 1)
        saved[probe] = measure(probe)
        low, high = (low, probe) if saved[probe] >= target else (probe, high)
        if high is not None and high - low == 1:  # settled: confirmed by more runs, or on to larger counts
            saved[high] = measure(high, max(meter.runs, meter.confirm_runs))
            if saved[high] >= target:
                return high
            low, high = high, None
        if high is None and low == len(allowed):
            what = "whole blocks (one must stay)" if blocks else "attention alone (one layer must keep its cache)"
            raise LayerdropError(f"--budget speedup={value:g} is out of reach by removing {what}: all "
                                 f"{len(allowed)} give {1 / (1 - saved[low]):.2f}x measured at {meter.seq} "
                                 "tokens; ask for less")
        top = high if high is not None else low  # the line through the bracket (or from the start to `low`)
        bottom = low if high is not None else 0
        slope = (saved[top] - saved[bottom]) / (top - bottom) if top > bottom else 0.0
        guess = (bottom + math.ceil((target - saved[bottom]) / slope) if slope > 0
                 else len(allowed) if high is None else (low + high) // 2)
