"""Windows: token windows drawn from a text source for one role, spread across it (seeded) or from its start."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdrop.errors import LayerdropError
from layerdrop.windows.sources import TextSource, resolve_text
from layerdrop.windows.tokenizer import ModelTokenizer, load_tokenizer, stream_tokens

ROLES = ("calib", "search", "eval")
# Spread layout: a period's share per role (calib, search, eval), and its size bounds in bytes.
ROLE_SHARES = (0.6, 0.2, 0.2)
PERIOD_MAX = 160 * 1024
PERIOD_MIN = 16 * 1024


@dataclass(frozen=True)
class Windows:
    """Token windows [samples, length] and where they came from.

    With `bos`, column 0 of every window is the BOS token and the rest are text tokens.
    """

    ids: np.ndarray
    source: dict
    bos: bool = False

    @property
    def real(self) -> np.ndarray:
        """Which positions are text tokens (False at the BOS column): the positions that scores and means use."""
        mask = np.ones(self.ids.shape, dtype=bool)
        if self.bos:
            mask[:, 0] = False
        return mask


@dataclass(frozen=True)
class Sampling:
    """How windows are taken from a text: spread across it (with `seed`) or `from_start`, and the JSON Lines field
    that holds the text."""

    seed: int = 0
    from_start: bool = False
    text_field: str = "text"


def draw_windows(
    folder: Path,
    text: Path | None,
    *,
    role: str,
    samples: int | None,
    seq_len: int,
    sampling: Sampling = Sampling(),
    max_positions: int | None = None,
    calibration_sha256: str | None = None,
) -> Windows:
    """Windows of `samples` x `seq_len` text tokens (plus the BOS where the tokenizer adds one) for one role.

    Args:
        folder: the model folder (its tokenizer).
        text: a text file, JSON Lines file or folder (None: the bundled calibration text, or the bundled
            evaluation text for role "eval").
        role: "calib" (scores, means, fits), "search" (choosing among candidates) or "eval" (held out).
        samples: how many windows (None, from the start only: every complete window).
        sampling: spread windows with a seed (same text and seed: same windows), or consecutive ones from the
            start (role "search": from the end); and the JSON Lines text field.
        calibration_sha256: the calibration text that search or evaluation windows must not overlap: when `text`
            is that text, they come from its own part of it; otherwise a spread role reads all of `text`.

    Raises:
        LayerdropError: a bad text, a bad size, or a text too short for the request (saying what it holds).
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    if seq_len < 2:
        raise LayerdropError(f"--seq-len must be at least 2 (got {seq_len})")
    if samples is not None and samples < 1:
        raise LayerdropError(f"--samples must be at least 1 (got {samples})")
    tokenizer = load_tokenizer(folder)
    length = seq_len + (tokenizer.bos_id is not None)
    if max_positions and length > max_positions:
        raise LayerdropError(f"--seq-len {seq_len} is beyond the model's context length {max_positions}"
                             + (" (with its BOS token)" if length > seq_len else ""))
    path = resolve_text(text, role)
    source = TextSource.open(path, sampling.text_field)
    digest = source.sha256()
    shared = role == "calib" or digest == calibration_sha256
    from_start, seed = sampling.from_start, sampling.seed
    if from_start and role == "eval" and shared:
        raise LayerdropError(f"{path} is the calibration text: with --from-start its evaluation windows would be "
                             "its calibration windows; give another evaluation text, or leave out --from-start")
    if from_start:
        rows, starts = _from_start(source, tokenizer, seq_len, samples, from_end=role == "search")
    else:
        if samples is None:
            raise LayerdropError("say how many windows (--samples) to spread across the text")
        rows, starts = _spread(source, tokenizer, seq_len, samples, role, seed, shared)
    ids = np.asarray(rows, dtype=np.int64).reshape(len(rows), seq_len)
    if tokenizer.bos_id is not None:
        ids = np.concatenate([np.full((len(ids), 1), tokenizer.bos_id, dtype=np.int64), ids], axis=1)
    info = {
        "file": source.describe(),
        "sha256": digest,
        "samples": len(ids),
        "seq_len": seq_len,
        "bos": tokenizer.bos_id is not None,
        "layout": "from-start" if from_start else "spread",
        "role": role,
        **({"from_end": True} if from_start and role == "search" else {}),
        **({} if from_start else {"seed": seed, "territory": "shared" if shared else "whole"}),
        **({"text_field": sampling.text_field} if any(f.jsonl for f in source.files) else {}),
        **({"starts": starts} if starts is not None else {}),
    }
    return Windows(ids, info, bos=tokenizer.bos_id is not None)


def _from_start(source: TextSource, tokenizer: ModelTokenizer, seq_len: int, samples: int | None,
                from_end: bool) -> tuple[list[list[int]], None]:
    """Consecutive windows from the start (or the last complete ones), reading only what they need (all of the
    text for the last ones, keeping only the tail)."""
    tokens: deque[int] = deque()
    seen = 0
    keep = None if samples is None else (samples + 1) * seq_len
    for ids, _ in stream_tokens(tokenizer, source.documents()):
        tokens.extend(ids)
        seen += len(ids)
        if not from_end and samples is not None and seen >= samples * seq_len:
            break
        while from_end and keep is not None and len(tokens) > keep:
            tokens.popleft()
    available = seen // seq_len
    wanted = available if samples is None else samples
    if available < 1 or wanted > available:
        raise LayerdropError(f"{source.path} holds {seen} tokens = {available} windows of {seq_len}; asked for "
                             f"{wanted}: use a longer text, fewer --samples or a shorter --seq-len")
    first = (available - wanted) if from_end else 0
    skipped = seen - len(tokens)  # tokens of the stream no longer held
    flat = list(tokens)[first * seq_len - skipped:(first + wanted) * seq_len - skipped]
    return [flat[i * seq_len:(i + 1) * seq_len] for i in range(wanted)], None


def territory(size: int, role: str, shared: bool) -> list[tuple[int, int]]:
    """The byte ranges of the joined source that a spread role draws from (see the module docstring)."""
    period = max(PERIOD_MIN, min(PERIOD_MAX, size // 8))
    index = ROLES.index(role)
    low = sum(ROLE_SHARES[:index]) if shared else 0.0
    high = low + ROLE_SHARES[index] if shared else 1.0
    runs = []
    for begin in range(0, size, period):
        start, end = begin + round(low * period), min(size, begin + round(high * period))
        if start < end:
            runs.append((start, end))
    return runs


def _spread(source: TextSource, tokenizer: ModelTokenizer, seq_len: int, samples: int, role: str, seed: int,
            shared: bool) -> tuple[list[list[int]], list[int]]:
    """Windows at seeded, stratified positions of the role's territory, each at a line start, none overlapping.

    Returns the windows' tokens and the byte offset of each window's first token in the joined source.
    """
    runs = territory(source.size, role, shared)
    edges = np.cumsum([0] + [end - start for start, end in runs])
    rng = np.random.default_rng([seed, ROLES.index(role)])
    wanted: dict[int, list[int]] = {}  # run -> byte offsets asked for in it
    for i in range(samples):
        target = (i + rng.random()) * edges[-1] / samples
        run = min(int(np.searchsorted(edges, target, side="right")) - 1, len(runs) - 1)
        wanted.setdefault(run, []).append(runs[run][0] + int(target - edges[run]))
    rows: list[list[int]] = []
    starts: list[int] = []
    placed: dict[int, list[int]] = {}  # run -> the first token of each of its windows
    carried = 0  # windows that did not fit in their run go to the next one
    for index, (start, end) in enumerate(runs):
        requests = [start] * carried + sorted(wanted.get(index, []))
        if not requests:
            continue
        run = _Run(source, tokenizer, start, end)
        taken = 0  # tokens of this run already in a window
        carried = 0
        for position, byte in enumerate(requests):
            token = run.place(byte, taken, seq_len)
            if token is None:
                carried = len(requests) - position
                break
            placed.setdefault(index, []).append(token)
            rows.append(run.ids[token:token + seq_len])
            starts.append(run.byte_of(token))
            taken = token + seq_len
    for index in reversed(range(len(runs))):  # the last run's leftovers go to gaps in it and the runs before it
        if not carried:
            break
        carried = _fill_gaps(_Run(source, tokenizer, *runs[index]), placed.get(index, []), carried, seq_len, rows,
                             starts)
    if carried:
        raise LayerdropError(
            f"{source.path} holds too little text for {samples} windows of {seq_len} tokens spread across its "
            f"{role} part ({len(rows)} fit); use fewer --samples, a shorter --seq-len, a longer text, or "
            "--from-start")
    return rows, starts


def _fill_gaps(run: _Run, taken: list[int], count: int, seq_len: int, rows: list[list[int]], starts: list[int]
               ) -> int:
    """Put up to `count` more windows in `run`, at the first line starts where a window overlaps none of the
    windows starting at the tokens of `taken`; returns how many found no room."""
    taken = sorted(taken)
    for token in run.line_tokens:
        if not count or token + seq_len > len(run.ids):
            break
        after = bisect.bisect_left(taken, token - seq_len + 1)  # the first window that could overlap this one
        if after < len(taken) and taken[after] < token + seq_len:
            continue
        bisect.insort(taken, token)
        rows.append(run.ids[token:token + seq_len])
        starts.append(run.byte_of(token))
        count -= 1
    return count


class _Run:
    """The tokenized lines (records) that begin in one byte range of a source, and where windows may start."""

    def __init__(self, source: TextSource, tokenizer: ModelTokenizer, start: int, end: int) -> None:
        self.source = source
        self.text, self.line_chars, self.line_bytes = source.lines_from(start, end)
        self.ids, self.char_starts = _tokens_of(tokenizer, self.text)
        # a window starts at the first token of a line (or record)
        self.line_tokens = sorted({bisect.bisect_left(self.char_starts, c) for c in self.line_chars} - {len(self.ids)})

    def place(self, byte: int, taken: int, seq_len: int) -> int | None:
        """The first line-start token at or after `byte` (and after token `taken`) that leaves room for a window;
        else the last one that does; None when no window fits in this run any more."""
        fits = [t for t in self.line_tokens if t >= taken and t + seq_len <= len(self.ids)]
        if not fits:
            return None
        line = bisect.bisect_left(self.line_bytes, byte)
        wanted = bisect.bisect_left(self.char_starts, self.line_chars[line]) if line < len(self.line_chars) else None
        later = [t for t in fits if wanted is not None and t >= wanted]
        return later[0] if later else fits[-1]

    def byte_of(self, token: int) -> int:
        """Byte offset of a token's first character in the joined source."""
        char = self.char_starts[token]
        line = bisect.bisect_right(self.line_chars, char) - 1
        return self.source.byte_after(self.line_bytes[line], self.text[self.line_chars[line]:char])


def _tokens_of(tokenizer: ModelTokenizer, text: str) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    starts: list[int] = []
    for part, offsets in stream_tokens(tokenizer, [text]):
        ids += part
        starts += offsets
    return ids, starts
