"""The model's tokenizer (tokenizer.json with the BOS convention of transformers' `tokenizer(text)`), and
tokenization of a long text a chunk at a time that gives what one call on the whole text would."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer

from layerdrop.errors import LayerdropError

CHUNK_CHARS = 1 << 16  # characters per tokenizer call when streaming


class ModelTokenizer:
    """A model folder's tokenizer.json, with the BOS convention of transformers' `tokenizer(text)`.

    Attributes:
        bos_id: the token `tokenizer(text)` puts first, or None when it adds none.
        declared_bos_id: the tokenizer's BOS token whether or not it is added (lm-eval's prefix token), or None.

    Raises:
        LayerdropError: no usable tokenizer.json, or a tokenizer that declares a BOS it does not have.
    """

    def __init__(self, folder: Path) -> None:
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise LayerdropError(f"{folder} has no tokenizer.json; export the model with `layerdrop export`")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust tokenizer raises a generic Exception
            raise LayerdropError(f"{path} is not a valid tokenizer file: {str(exc)[:200]}") from None
        config = _json_file(Path(folder) / "tokenizer_config.json")
        declared = _token_text(config.get("bos_token"))
        self.declared_bos_id = self.tokenizer.token_to_id(declared) if declared else None
        wanted = config.get("add_bos_token")
        if wanted is True:
            if self.declared_bos_id is None:
                raise LayerdropError(f"{folder}/tokenizer_config.json sets add_bos_token but its bos_token "
                                     f"{declared!r} is not in the vocabulary; fix the tokenizer files")
            self.bos_id = self.declared_bos_id
        elif wanted is False:
            self.bos_id = None
        else:
            self.bos_id = self._post_processor_bos()
        if self.declared_bos_id is None:
            self.declared_bos_id = self.bos_id

    def _post_processor_bos(self) -> int | None:
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        special = self.tokenizer.encode("a", add_special_tokens=True).ids
        prefix = special[: len(special) - len(plain)] if special[len(special) - len(plain):] == plain else []
        if len(prefix) > 1:
            raise LayerdropError(f"the tokenizer puts {len(prefix)} special tokens before every text; layerdrop "
                                 "handles one BOS token at most")
        return prefix[0] if prefix else None

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of `text`; with `special`, as `tokenizer(text)` gives them (BOS first where it adds one)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if special and self.bos_id is not None else ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_spans(self, text: str) -> tuple[list[int], list[int]]:
        """(ids, start character of each token) of `text`, without special tokens."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]


def load_tokenizer(folder: Path) -> ModelTokenizer:
    """The tokenizer of a model folder (see ModelTokenizer)."""
    return ModelTokenizer(folder)


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LayerdropError(f"{path} is not valid JSON; fix or remove it") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def stream_tokens(tokenizer: ModelTokenizer, pieces: Iterable[str], *, chunk_chars: int | None = None,
                  margin_chars: int = 1024, context_chars: int = 256) -> Iterator[tuple[list[int], list[int]]]:
    """Tokenize the concatenation of `pieces` a chunk at a time, as one call on the whole text would.

    Yields (ids, starts) batches, starts being character offsets in the whole text. A chunk is cut only at a token
    boundary that two encodings with different left contexts agree on, from the cut to the chunk's end; the text
    before the cut stays as left context of the next chunk. So a tokenizer that merges across any character (no
    pre-tokenizer, as Gemma's) is cut where its merges stop, and never mid-merge.
    """
    chunk_chars = chunk_chars or CHUNK_CHARS
    # `buffer` holds the text from absolute offset `base`; its tokens before `emit_from` were yielded already
    buffer, base, emit_from = "", 0, 0
    end = object()
    for piece in itertools.chain(pieces, [end]):
        last = piece is end
        if not last:
            buffer += piece
            if len(buffer) - emit_from < chunk_chars + margin_chars:
                continue
        ids, starts = tokenizer.token_spans(buffer)
        first = bisect.bisect_left(starts, emit_from)
        if last:
            yield ids[first:], [base + s for s in starts[first:]]
            return
        cut = _stable_cut(tokenizer, buffer, ids, starts, first, margin_chars, context_chars)
        if cut is None:
            continue  # no boundary both contexts agree on yet: read more
        k, keep_from = cut
        yield ids[first:k], [base + s for s in starts[first:k]]
        base += keep_from
        emit_from = starts[k] - keep_from
        buffer = buffer[keep_from:]


def _stable_cut(tokenizer: ModelTokenizer, buffer: str, ids: list[int], starts: list[int], first: int,
                margin_chars: int, context_chars: int, tries: int = 32) -> tuple[int, int] | None:
    """(token index k, buffer index where the next buffer begins) of a boundary both encodings agree on."""
    limit = len(buffer) - margin_chars
    k = bisect.bisect_right(starts, limit) - 1
    for _ in range(tries):
        if k <= first:
            return None
        if starts[k - 1] < starts[k]:  # a real boundary, not inside one character's bytes
            keep_from = starts[bisect.bisect_left(starts, max(starts[first], starts[k] - context_chars))]
            keep_from = min(keep_from, starts[k])
            if keep_from > 0:
                again, again_starts = tokenizer.token_spans(buffer[keep_from:])
                j = bisect.bisect_left(again_starts, starts[k] - keep_from)
                if again[j:] == ids[k:] and [s + keep_from for s in again_starts[j:]] == starts[k:]:
                    return k, keep_from
        k -= 1
    return None
