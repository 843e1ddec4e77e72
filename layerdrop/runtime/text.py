"""Text in: read a user's text file safely, tokenize it with the model folder's tokenizer, pack fixed windows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from layerdrop.errors import LayerdropError


def bundled_text(part: str) -> Path:
    """The bundled public-domain corpus: part "calib" (Persuasion) or "eval" (Northanger Abbey)."""
    return Path(str(resources.files("layerdrop") / "data" / f"{part}.txt"))


def read_text(path: Path) -> str:
    """Read a UTF-8 text file.

    Raises:
        LayerdropError: missing, empty, binary, or not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise LayerdropError(f"text file {path} does not exist; pass a UTF-8 text file")
    raw = path.read_bytes()
    if not raw.strip():
        raise LayerdropError(f"text file {path} is empty; pass a file with real text")
    if b"\x00" in raw:
        raise LayerdropError(f"{path} looks binary (it holds NUL bytes); pass a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LayerdropError(f"{path} is not UTF-8 (byte {exc.start}); convert it to UTF-8") from None


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a model folder (its tokenizer.json).

    Raises:
        LayerdropError: the folder has no usable tokenizer.json.
    """
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise LayerdropError(f"{folder} has no tokenizer.json; export the model with `layerdrop export`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the Rust tokenizer raises a generic Exception
        raise LayerdropError(f"{path} is not a valid tokenizer file: {str(exc)[:200]}") from None


@dataclass(frozen=True)
class Windows:
    """Packed token windows [samples, seq_len] and where they came from."""

    ids: np.ndarray
    source: dict

    @property
    def tokens(self) -> int:
        return int(self.ids.size)


def pack_windows(
    folder: Path,
    text_path: Path,
    *,
    seq_len: int,
    samples: int | None,
    max_positions: int | None = None,
    from_end: bool = False,
) -> Windows:
    """Tokenize a text without special tokens, concatenate, and cut consecutive windows of `seq_len` tokens.

    Args:
        samples: how many windows to use (None: all complete windows).
        max_positions: the model's context length, if known.
        from_end: take the last windows instead of the first (a search set disjoint from the scoring set).

    Raises:
        LayerdropError: a bad text file, a bad size, or a text too short for the request (the message says how
            many windows it holds).
    """
    if seq_len < 2:
        raise LayerdropError(f"--seq-len must be at least 2 (got {seq_len})")
    if samples is not None and samples < 1:
        raise LayerdropError(f"--samples must be at least 1 (got {samples})")
    if max_positions and seq_len > max_positions:
        raise LayerdropError(f"--seq-len {seq_len} is beyond the model's context length {max_positions}")
    text = read_text(text_path)
    tokens = load_tokenizer(folder).encode(text, add_special_tokens=False).ids
    available = len(tokens) // seq_len
    wanted = available if samples is None else samples
    if available < 1 or wanted > available:
        raise LayerdropError(
            f"{text_path} holds {len(tokens)} tokens = {available} windows of {seq_len}; "
            f"asked for {wanted}: use a longer text, fewer --samples or a shorter --seq-len"
        )
    first = available - wanted if from_end else 0
    ids = np.asarray(tokens[first * seq_len : (first + wanted) * seq_len], dtype=np.int64).reshape(wanted, seq_len)
    source = {
        "file": Path(text_path).name,
        "sha256": hashlib.sha256(Path(text_path).read_bytes()).hexdigest(),
        "samples": wanted,
        "seq_len": seq_len,
        **({"from_end": True} if from_end else {}),
    }
    return Windows(ids, source)
