"""Which modules: the n lowest scores (one tie-break everywhere), paper 1's iterative selection, and budgets
turned into a count of attention layers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import AttachScoresPass
from layerdrop.passes.cleanup import cleanup_passes, run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import FindResidualsPass, annotated_regions
from layerdrop.passes.prune_kv_cache import PruneKvCachePass
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
                     provider: str = "cpu", threads: int | None = None, progress: bool = True) -> None:
    """Drop the lowest-scored module, re-score the pruned graph, repeat `count` times (SPEC §3, iterative)."""
    label = "joint" if len(kinds) > 1 else kinds[0]
    for step in range(count):
        scores = compute_scores(model, folder, windows, provider=provider, threads=threads, progress=progress)
        target = select_lowest([asdict(s) for s in scores], kinds, count - step)[:1]
        run_passes(model, [AttachScoresPass(scores, windows.source),
                           DropBranchesPass(target, reason=f"{label}-{count} iterative step {step + 1}"),
                           PruneKvCachePass(), *cleanup_passes(), FindResidualsPass()])


def parse_budget(text: str, attention_layers: int) -> tuple[str, float, int | None]:
    """'attn=8' | 'kv=0.75' | 'blocks=4' | 'speedup=1.2' or 'speedup=1.2@1024' -> (kind, value, seq for speedup).

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
    return kind, number, seq_len


def attention_count_for(kind: str, value: float, profile: SpeedupProfile | None, scores: dict[int, float]) -> int:
    """How many attention layers a budget asks to remove or bypass (for a speedup: the lowest-scored first, until
    the profile says it is reached)."""
    if kind in ("attn", "blocks"):
        return int(value)
    if kind == "kv":
        return max(1, math.ceil(len(scores) * (1 - value) - 1e-9))
    return count_for_speedup(value, profile, scores, ("attn",))


@dataclass
class SpeedupProfile:
    """Per-node ONNX Runtime profile times of one prefill at `seq` tokens, summed per module branch: what a set of
    removed modules would save, ideally (ReplaceMe's folded map and a fitted map's MatMul count as free)."""

    seq: int
    total: float
    modules: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, layer) -> branch time

    @classmethod
    def of(cls, model: ir.Model, folder: Path, seq: int, threads: int | None) -> SpeedupProfile:
        from layerdrop.runtime.bench import node_times

        times = node_times(folder, seq, runs=2, threads=threads)
        modules: dict[tuple[str, int], float] = {}
        for region in annotated_regions(model):
            if region.kind in ("attn", "mlp"):
                key = (region.kind, region.layer)
                modules[key] = modules.get(key, 0.0) + sum(times.get(n.name, 0.0) for n in region.branch)
        return cls(seq, sum(times.values()), modules)

    def speedup(self, removed: Iterable[tuple[str, int]]) -> float:
        """The ideal prefill speedup with these (kind, layer) modules gone."""
        saved = sum(self.modules.get(module, 0.0) for module in set(removed))
        return self.total / max(self.total - saved, 1e-9)


def block_modules(layers: Iterable[int]) -> list[tuple[str, int]]:
    """The modules whole blocks remove: their attention and their MLP."""
    return [(kind, layer) for layer in layers for kind in ("attn", "mlp")]


def count_for_speedup(value: float, profile: SpeedupProfile, scores: dict[int, float], kinds: tuple[str, ...],
                      removed: Iterable[tuple[str, int]] = ()) -> int:
    """The fewest lowest-scored modules whose removal, with the `removed` ones, reaches a prefill speedup of `value`
    by the profile: attention branches (`kinds` ("attn",)), or whole blocks (("attn", "mlp"); `scores` are then
    block scores, and a block must stay).

    Raises:
        LayerdropError: even every module does not reach it.
    """
    blocks = len(kinds) > 1
    gone = list(removed)
    allowed = lowest_layers(scores, len(scores) - blocks)
    chosen: list[tuple[str, int]] = []
    for count, layer in enumerate(allowed, start=1):
        chosen += block_modules([layer]) if blocks else [("attn", layer)]
        if profile.speedup(gone + chosen) >= value:
            return count
    what = "whole blocks (one must stay)" if blocks else "attention alone"
    raise LayerdropError(f"--budget speedup={value:g} is out of reach by removing {what}: all {len(allowed)} give "
                         f"{profile.speedup(gone + chosen):.2f}x; ask for less")
