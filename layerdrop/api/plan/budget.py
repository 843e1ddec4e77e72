"""What a budget asks of the plan: the moves it may use, and how many attention layers and blocks its rows move
(for a speedup, sized by measured prefill: `search.selection.count_for_speedup`)."""

from __future__ import annotations

from dataclasses import dataclass

from layerdrop.errors import LayerdropError
from layerdrop.search.alpha_search import ALPHA_GRID
from layerdrop.search.selection import (
    Budget,
    PrefillMeter,
    attention_count_for,
    count_for_speedup,
    lowest_layers,
)

MOVES = ("drop", "bypass", "shift", "fit", "blocks")


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


def allowed_moves(text: str | None, budget: Budget, *, shift: bool = True, per_layer_moves: bool = False,
                  self_samples: int = 0, fit_previous: bool = False) -> frozenset:
    """The move words the plan may use (`parse_moves`, less the shift without `shift`), checked against the options
    that shape them.

    Raises:
        LayerdropError: a bad move word, or an option the allowed moves cannot use.
    """
    allowed = parse_moves(text, budget.kind) - (frozenset() if shift else {"shift"})
    if per_layer_moves and not ("fit" in allowed and allowed & {"drop", "bypass"}):
        raise LayerdropError("--per-layer-moves chooses among fit, drop and bypass for each layer: allow fit and drop "
                             "or bypass in --moves (the default for attn and kv budgets)")
    if self_samples < 0:
        raise LayerdropError(f"--self-samples {self_samples}: give a number of windows, 0 or more")
    if self_samples and not allowed & {"fit", "blocks"}:
        raise LayerdropError("--self-samples adds windows to the fits' calibration: allow fit or blocks in --moves")
    if fit_previous and "fit" not in allowed:
        raise LayerdropError("--fit-previous shapes the fitted attention maps: allow fit in --moves")
    return allowed


def grid_of(allowed: frozenset) -> tuple[float, ...]:
    """The alphas the planner may try: 0 with the drop move, the positive ones with the bypass."""
    return tuple(a for a in ALPHA_GRID if (a == 0 and "drop" in allowed) or (a > 0 and "bypass" in allowed))


@dataclass
class RowCounts:
    """What the budget asks of the rows: attention layers of the attention rows and blocks of the block rows (None:
    no such rows), and where the block rows are faster, the attention layers whose fitted maps reach their speed
    (`matched`, None otherwise)."""

    attention: int | None
    blocks: int | None
    matched: int | None = None


def row_counts(budget: Budget, meter: PrefillMeter | None, scores: dict[int, float], block_scores: dict[int, float],
               allowed: frozenset, extra: int, skipped: list[str]) -> RowCounts:
    """The counts of the rows (`RowCounts`). A speedup that one kind of move cannot reach leaves its rows out, with
    the reason in `skipped`, unless neither can.

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
                found[what] = attention_count_for(budget, meter, scores)
            else:
                found[what] = int(budget.value) if budget.kind == "blocks" else count_for_speedup(
                    budget.value, meter, block_scores, ("attn", "mlp"))
        except LayerdropError as exc:
            errors.append(exc)
    if not any(found.values()):
        raise errors[0]
    skipped += [f"rows left out: {exc}" for exc in errors]
    counts = RowCounts(found["attention"], found["block"])
    if meter is not None and counts.attention and counts.blocks and "fit" in allowed:
        counts.matched = _matched_count(meter, scores, block_scores, counts, extra, skipped)
    return counts


def _matched_count(meter: PrefillMeter, scores: dict[int, float], block_scores: dict[int, float], counts: RowCounts,
                   extra: int, skipped: list[str]) -> int | None:
    """Under a speedup budget, a block is a coarser step than an attention layer, so the block rows the sizing
    takes can overshoot the budget by more than the attention rows do. For a comparison at equal speed, the number
    of attention layers whose fitted maps reach the block rows' measured speedup (from the sizing's confirmed runs,
    which the table's block rows reuse), if that is more than the attention rows' count and within the planner's
    pool (`extra`); else None."""
    runs = max(meter.runs, meter.confirm_runs)
    blocks = meter.speedup(lowest_layers(block_scores, counts.blocks), (), runs)
    if blocks <= meter.speedup((), lowest_layers(scores, counts.attention), runs):
        return None
    none = f"no row of fitted attention at the block rows' {blocks:.3f}x"
    try:
        found = count_for_speedup(blocks, meter, scores, ("attn",))
    except LayerdropError:  # not even every attention layer but one, each keeping a cache to read the past from
        skipped.append(f"{none}: attention alone does not reach it")
        return None
    if found > counts.attention + extra:
        skipped.append(f"{none}: it takes more layers than the planner's pool of {counts.attention} + {extra} "
                       "(--extra)")
        return None
    return found if found > counts.attention else None
