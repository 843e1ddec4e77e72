"""Text in: calibration, search and evaluation windows from a user's texts, tokenized as the model is used.

A *text source* is a UTF-8 text file, JSON Lines with a text field (`.jsonl`, or `.json` holding one object a
line), or a folder of such files (read in sorted order, as if joined). Sources are never read whole: windows are
read in bounded pieces, so memory and time follow the windows asked for, not the size of the file. Only the
SHA-256 in the metadata reads every byte, in 1 MiB blocks.

Two layouts:
- **spread** (default): windows are drawn from across the whole source, seeded. Its bytes are cut into periods;
  in each period the first 60% belong to calibration, the next 20% to search, the last 20% to evaluation, so
  calibration, search and evaluation windows of one text never overlap, whichever commands draw them. A text
  that is not a calibration text (an evaluation text of its own, say) is read whole by its one role. Each window
  begins at a line start (a record start in JSON Lines).
- **from-start**: consecutive windows from the start of the text (search windows: the last ones), as layerdrop
  packed them before spreading existed; search from the end reads the whole text.

Windows follow the model's tokenizer: where `tokenizer(text)` would start with a BOS token (the tokenizer.json
post-processor, or `add_bos_token` in tokenizer_config.json), every window is BOS + seq_len text tokens. The BOS
is context only: never a predicted token, and left out of score and mean averages (`Windows.real`).
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import itertools
import json
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from layerdrop.errors import LayerdropError

ROLES = ("calib", "search", "eval")
# Spread layout: a period's share per role (calib, search, eval), and its size bounds in bytes.
ROLE_SHARES = (0.6, 0.2, 0.2)
PERIOD_MAX = 160 * 1024
PERIOD_MIN = 16 * 1024
BLOCK = 1 << 20  # bytes per read
CHUNK_CHARS = 1 << 16  # characters per tokenizer call when streaming
LINE_CAP = 1 << 16  # bytes a line may reach beyond its run before it is cut
READ_AHEAD = 1 << 14  # bytes first read of a JSON Lines record (most are short)
DOCUMENT_JOINER = "\n\n"  # between files of a folder and between JSON Lines records


BUNDLED = {"calib": "mixed kinds: narrative prose, a dialogue in verse, technical writing, code (the default "
                    "calibration and search text)",
           "prose": "Jane Austen, Persuasion (narrative prose; the calibration text before 2026-12-02)",
           "eval": "Jane Austen, Northanger Abbey (the default evaluation text)",
           "docs": "technical writing: docstrings of Python's standard library",
           "code": "code: Python standard-library source",
           "dictionary": "reference entries: Ambrose Bierce, The Devil's Dictionary (satirical definitions, some "
                         "verse; a kind the default calibration text does not hold)"}


def bundled_text(part: str) -> Path:
    """The bundled texts (`BUNDLED`; where they come from: layerdrop/data/SOURCE.md)."""
    return Path(str(resources.files("layerdrop") / "data" / f"{part}.txt"))


def resolve_text(text: Path | str | None, role: str = "calib") -> Path:
    """The file a text argument names: the role's bundled default for None, an existing path as it is, else a bundled
    text's name (`BUNDLED`: calib, prose, eval, docs, code, dictionary); anything else is returned for
    `TextSource.open` to refuse."""
    if text is None:
        return bundled_text("eval" if role == "eval" else "calib")
    path = Path(text)
    if not path.exists() and str(text) in BUNDLED:
        return bundled_text(str(text))
    return path


# -- the model's tokenizer ------------------------------------------------------------------------------------------

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


def stream_tokens(tokenizer: ModelTokenizer, pieces: Iterable[str], *, chunk_chars: int = CHUNK_CHARS,
                  margin_chars: int = 1024, context_chars: int = 256) -> Iterator[tuple[list[int], list[int]]]:
    """Tokenize the concatenation of `pieces` a chunk at a time, as one call on the whole text would.

    Yields (ids, starts) batches, starts being character offsets in the whole text. A chunk is cut only at a token
    boundary that two encodings with different left contexts agree on, from the cut to the chunk's end; the text
    before the cut stays as left context of the next chunk. So a tokenizer that merges across any character (no
    pre-tokenizer, as Gemma's) is cut where its merges stop, and never mid-merge.
    """
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


# -- text sources ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _File:
    path: Path
    jsonl: bool
    offset: int  # where the file begins in the source's joined byte space
    size: int


@dataclass(frozen=True)
class TextSource:
    """A text file, a folder of text files, or JSON Lines (records' `text_field`), as one joined byte space.

    Raises:
        LayerdropError: missing, empty, binary or unreadable files; a folder without text files.
    """

    path: Path
    text_field: str = "text"
    files: tuple[_File, ...] = field(default=(), compare=False)
    records: dict[Path, list[_Record]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def open(cls, path: Path, text_field: str = "text") -> TextSource:
        path = Path(path)
        if path.is_dir():
            members = sorted(p for p in path.rglob("*") if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(path).parts))
            if not members:
                raise LayerdropError(f"folder {path} holds no text files; pass a folder of UTF-8 or JSON Lines files")
        elif path.is_file():
            members = [path]
        else:
            raise LayerdropError(f"text file {path} does not exist; pass a UTF-8 text file, a .jsonl file, a folder, "
                                 f"or a bundled text's name ({', '.join(BUNDLED)})")
        files, offset = [], 0
        for member in members:
            size = member.stat().st_size
            files.append(_File(member, _is_jsonl(member), offset, size))
            _check_head(files[-1])
            offset += size
        if not any(f.size for f in files) or not any(_has_text(f) for f in files):
            raise LayerdropError(f"{path} is empty; pass a file with real text")
        return cls(path, text_field, tuple(files))

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def sha256(self) -> str:
        """SHA-256 of the file (of each file's relative path and digest, for a folder), read in 1 MiB blocks."""
        digests = []
        for item in self.files:
            digest = hashlib.sha256()
            with open(item.path, "rb") as handle:
                while block := handle.read(BLOCK):
                    digest.update(block)
            digests.append((item.path, digest.hexdigest()))
        if not self.path.is_dir():
            return digests[0][1]
        joined = "".join(f"{p.relative_to(self.path).as_posix()}\0{d}\n" for p, d in digests)
        return hashlib.sha256(joined.encode()).hexdigest()

    def describe(self) -> str:
        return self.path.name + ("/" if self.path.is_dir() else "")

    # -- reading ------------------------------------------------------------------------------------------------

    def documents(self) -> Iterator[str]:
        """The whole text from the start, in pieces of at most CHUNK_CHARS (the joiner between files and between
        records), so that streaming tokenization holds one chunk's tokens at a time."""
        for index, item in enumerate(self.files):
            if index:
                yield DOCUMENT_JOINER
            for piece in self._pieces(item):
                yield from (piece[i:i + CHUNK_CHARS] for i in range(0, len(piece), CHUNK_CHARS))

    def lines_from(self, start: int, end: int) -> tuple[str, list[int], list[int]]:
        """The text of the lines that begin in the joined byte range [start, end).

        Lines of JSON Lines are the lines of the records' text: each record's first line begins at its string's
        first character, the others after each `\\n` escape. Returns the text (DOCUMENT_JOINER between records and
        between the files of a folder), the character index where each line begins in it, and each one's byte
        offset. A line running far past `end` is cut after LINE_CAP more bytes.
        """
        parts: list[str] = []
        line_chars: list[int] = []
        line_bytes: list[int] = []
        length = 0
        for item in self.files:
            low, high = max(start, item.offset), min(end, item.offset + item.size)
            if low >= high:
                continue
            lines = self._record_lines if item.jsonl else self._lines
            for text, offset, begins in lines(item, low - item.offset, high - item.offset):
                if not text:
                    continue
                if parts and begins:  # a new record, or a new file of a folder
                    parts.append(DOCUMENT_JOINER)
                    length += len(DOCUMENT_JOINER)
                line_chars.append(length)
                line_bytes.append(item.offset + offset)
                parts.append(text)
                length += len(text)
        return "".join(parts), line_chars, line_bytes

    def byte_after(self, offset: int, fragment: str) -> int:
        """The joined byte offset where `fragment`, read from the line text at `offset`, ends in the file (in JSON
        Lines: each character as written in the record, an escape sequence or its UTF-8 bytes)."""
        if not fragment:
            return offset
        item = [f for f in self.files if f.offset <= offset][-1]
        if not item.jsonl:
            return offset + len(fragment.encode())
        with open(item.path, "rb") as handle:
            handle.seek(offset - item.offset)
            raw = handle.read(12 * len(fragment))
        position = 0
        for _ in fragment:
            position = _ONE_CHARACTER.match(raw, position).end()
        return offset + position

    def _lines(self, item: _File, low: int, high: int) -> Iterator[tuple[str, int, bool]]:
        """(text, byte offset, begins the file) of each line of a plain text file that begins in [low, high)."""
        with open(item.path, "rb") as handle:
            position = low
            if low > 0:  # begin at the first line that starts at or after `low`
                handle.seek(low - 1)
                if handle.read(1) != b"\n":
                    _skip_line(handle)
                position = handle.tell()
            while position < high:
                raw = handle.readline((high - position) + LINE_CAP)
                if not raw:
                    return
                cut = not raw.endswith(b"\n") and handle.read(1) not in (b"", b"\n")
                yield _decode_line(item, raw, position, cut), position, position == 0
                if cut:  # a line past LINE_CAP: its rest belongs to no window
                    _skip_line(handle)
                position = handle.tell()

    def _record_lines(self, item: _File, low: int, high: int) -> Iterator[tuple[str, int, bool]]:
        """(text, byte offset, begins a record) of each line of JSON Lines records' text that begins in
        [low, high), reading a record's string only around that range."""
        with open(item.path, "rb") as handle:
            start = self._record_start(item, handle, low)
            scanner = _RecordScanner(item, handle)
            while start < min(high, item.size):
                record = self._record(scanner, start)
                if record.text is not None and record.text[0] < high:
                    yield from _string_lines(item, handle, record, low, high)
                start = record.end

    def _record_start(self, item: _File, handle, low: int) -> int:
        """Where the record that holds byte `low` begins (a record ends at a raw line break)."""
        for record in self.records.get(item.path, ()):
            if record.start <= low < record.end:
                return record.start
        position = low
        while position > 0:
            take = min(BLOCK, position)
            handle.seek(position - take)
            found = handle.read(take).rfind(b"\n")
            if found >= 0:
                return position - take + found + 1
            position -= take
        return 0

    def _record(self, scanner: _RecordScanner, start: int) -> _Record:
        """The record that begins at byte `start`: where it ends and where its text field's string lies (remembered
        for records longer than a block, which runs inside them would otherwise scan again)."""
        for record in self.records.get(scanner.item.path, ()):
            if record.start == start:
                return record
        record = scanner.record(start, self.text_field)
        if record.end - record.start > BLOCK:
            self.records.setdefault(scanner.item.path, []).append(record)
        return record

    def _pieces(self, item: _File) -> Iterator[str]:
        """The text of a whole file from its start, in pieces of about a block (records joined for JSON Lines)."""
        if item.jsonl:
            yield from self._record_pieces(item)
            return
        decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        position = 0
        with open(item.path, "rb") as handle:
            while block := handle.read(BLOCK):
                if b"\x00" in block:
                    raise LayerdropError(f"{item.path} looks binary (it holds NUL bytes); pass a UTF-8 text file")
                try:
                    yield decoder.decode(block)
                except UnicodeDecodeError as exc:
                    raise LayerdropError(f"{item.path} is not UTF-8 (byte {position + exc.start}); convert it to "
                                         "UTF-8") from None
                position += len(block)
            try:
                yield decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise LayerdropError(f"{item.path} is not UTF-8 (it ends inside a character); convert it to "
                                     "UTF-8") from None

    def _record_pieces(self, item: _File) -> Iterator[str]:
        first = True
        with open(item.path, "rb") as handle:
            start = 0
            scanner = _RecordScanner(item, handle)
            while start < item.size:
                record = self._record(scanner, start)
                start = record.end
                if record.text is None or record.text[0] == record.text[1]:
                    continue
                if not first:
                    yield DOCUMENT_JOINER
                first = False
                position, stop = record.text
                while position < stop:
                    handle.seek(position)
                    raw = handle.read(min(BLOCK, stop - position))
                    text, used = _decode_string(item, record, raw, final=position + len(raw) == stop)
                    yield text
                    position += used


# -- JSON Lines records of any length -------------------------------------------------------------------------------
# A record is read as a JSON object only as far as finding where its text field's string lies; the string itself is
# decoded a piece at a time, cut only between escape sequences and between UTF-8 characters, so no record is ever
# held whole.

_STRING_BODY = re.compile(rb'[^"\\\x00-\x1f]*(?:\\[^\x00-\x1f][^"\\\x00-\x1f]*)*')
_ESCAPE = re.compile(rb"\\(?:u[0-9a-fA-F]{4}|[^u])")
_NEWLINE_ESCAPES = (b"\\n", b"\\u000a", b"\\u000A")
_ONE_CHARACTER = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\.|"
                            rb"[\x00-\x7f]|[\xc0-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf7][\x80-\xbf]{3}",
                            re.DOTALL)
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_NESTED_PLAIN = re.compile(rb'[^"{}\[\]\n]*')


@dataclass(frozen=True)
class _Record:
    start: int  # byte offset of the record's first byte in its file
    end: int  # just past its line break
    text: tuple[int, int] | None  # the text field's string between its quotes (None: a blank line)


def _malformed(item: _File, start: int) -> LayerdropError:
    return LayerdropError(f"{item.path}:{_line_number(item.path, start)}: not a JSON object; each line of a JSON Lines "
                          "file must be one")


class _RecordScanner:
    """Walks one record from its first byte in blocks: the object's keys, skipping values other than the text
    field, to the record's line break."""

    def __init__(self, item: _File, handle) -> None:
        self.item, self.handle = item, handle
        self.buffer, self.base, self.position = b"", 0, 0  # buffer holds the file from byte `base`
        self.start = 0  # where the record being read begins

    def _more(self) -> bool:
        self.handle.seek(self.base + len(self.buffer))  # the handle is shared with readers of strings
        block = self.handle.read(BLOCK if self.buffer else READ_AHEAD)
        if not block:
            return False
        self.buffer = self.buffer[self.position - self.base:] + block
        self.base = self.position
        return True

    def _peek(self) -> int | None:
        while self.position - self.base >= len(self.buffer):
            if not self._more():
                return None
        return self.buffer[self.position - self.base]

    def _space(self) -> int | None:
        while (byte := self._peek()) is not None and byte in b" \t\r":
            self.position += 1
        return byte

    def _expect(self, byte: bytes) -> None:
        if self._space() != byte[0]:
            raise _malformed(self.item, self.start)
        self.position += 1

    def _string(self) -> tuple[int, int]:
        """Skip a string (at its opening quote); returns where its body begins and ends."""
        self.position += 1
        begin = self.position
        while True:
            match = _STRING_BODY.match(self.buffer, self.position - self.base)
            self.position = self.base + match.end()
            offset = self.position - self.base
            if offset < len(self.buffer):
                if self.buffer[offset] == ord('"'):
                    self.position += 1
                    return begin, self.position - 1
                split = self.buffer[offset] == ord("\\") and offset == len(self.buffer) - 1
                if not (split and self._more()):  # only an escape cut by the block may read on
                    raise _malformed(self.item, self.start)
            elif not self._more():
                raise _malformed(self.item, self.start)

    def _value(self) -> None:
        byte = self._space()
        if byte == ord('"'):
            self._string()
        elif byte is not None and byte in b"{[":
            depth = 0
            while True:
                byte = self._peek()
                if byte is None or byte == ord("\n"):
                    raise _malformed(self.item, self.start)
                if byte == ord('"'):
                    self._string()
                    continue
                depth += 1 if byte in b"{[" else -1 if byte in b"}]" else 0
                self.position += 1
                if depth == 0:
                    return
                self.position = self.base + _NESTED_PLAIN.match(self.buffer, self.position - self.base).end()
        else:
            self._peek()
            if len(self.buffer) - (self.position - self.base) < 64:
                self._more()
            match = _SCALAR.match(self.buffer, self.position - self.base)
            if not match:
                raise _malformed(self.item, self.start)
            self.position = self.base + match.end()

    def _key(self) -> str | None:
        begin, end = self._string()
        if begin - 1 < self.base:  # a key longer than a block is no field name anyone passes
            return None
        try:
            return json.loads(self.buffer[begin - 1 - self.base:end + 1 - self.base])
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _malformed(self.item, self.start) from None

    def record(self, start: int, text_field: str) -> _Record:
        """The record from byte `start` to its line break; refuses a malformed one or one without the text field."""
        if not self.base <= start <= self.base + len(self.buffer):
            self.buffer, self.base = b"", start
        self.position = self.start = start
        byte = self._space()
        if byte is None or byte == ord("\n"):
            return _Record(self.start, self.position + (byte is not None), None)
        self._expect(b"{")
        text = None
        if self._space() == ord("}"):
            self.position += 1
        else:
            while True:
                if self._space() != ord('"'):
                    raise _malformed(self.item, self.start)
                key = self._key()
                self._expect(b":")
                if key == text_field:
                    text = self._string() if self._space() == ord('"') else None
                    if text is None:
                        self._value()
                else:
                    self._value()
                separator = self._space()
                self.position += 1
                if separator == ord("}"):
                    break
                if separator != ord(","):
                    raise _malformed(self.item, self.start)
        byte = self._space()
        if byte not in (None, ord("\n")):
            raise _malformed(self.item, self.start)
        if text is None:
            raise LayerdropError(f"{self.item.path}:{_line_number(self.item.path, self.start)}: no text field "
                                 f"{text_field!r}; name the field with --text-field")
        return _Record(self.start, self.position + (byte is not None), text)


def _string_lines(item: _File, handle, record: _Record, low: int, high: int) -> Iterator[tuple[str, int, bool]]:
    """(text, byte offset, begins the record) of each line of a record's string that begins in [low, high); the
    last one read at most LINE_CAP bytes past `high`."""
    begin, stop = record.text
    first = max(low, begin)
    if first >= stop:
        return
    aligned = _escape_start(handle, begin, first)
    end = min(stop, high + LINE_CAP)
    handle.seek(aligned)
    raw = handle.read(end - aligned)
    breaks = [aligned + m.end() for m in _ESCAPE.finditer(raw) if m.group() in _NEWLINE_ESCAPES]
    starts = ([begin] if begin >= low else []) + [b for b in breaks if low <= b < min(high, stop)]
    for start in starts:
        after = bisect.bisect_right(breaks, start)
        line_end = breaks[after] if after < len(breaks) else end
        whole = line_end != end or end == stop  # else the line was cut at LINE_CAP
        text, _ = _decode_string(item, record, raw[start - aligned:line_end - aligned], final=whole)
        yield text, start, start == begin


def _escape_start(handle, begin: int, position: int) -> int:
    """`position`, or where the escape sequence it falls inside begins (`begin`: where the string's body begins)."""
    look = max(begin, position - 6)
    handle.seek(look)
    before = handle.read(position - look)
    last = before.rfind(b"\\")
    if last < 0:
        return position
    run, at = 1, look + last  # backslashes ending at `at`; an odd run means `at` begins an escape
    while at - run >= begin:
        handle.seek(at - run)
        if handle.read(1) != b"\\":
            break
        run += 1
    if run % 2 == 0:
        return position
    handle.seek(at + 1)
    width = 6 if handle.read(1) == b"u" else 2
    return at if at + width > position else position


def _decode_string(item: _File, record: _Record, raw: bytes, *, final: bool) -> tuple[str, int]:
    """The text of a piece of a JSON string's body and how many of its bytes it used: all of them when `final`,
    else up to the last whole escape sequence (a surrogate pair kept together) and the last whole UTF-8 character."""
    cut = len(raw)
    if not final:
        last = raw.rfind(b"\\", max(0, cut - 12))
        if last >= 0:
            run = len(raw[:last + 1]) - len(raw[:last + 1].rstrip(b"\\"))
            if run % 2:  # `last` begins an escape sequence
                width = 6 if raw[last + 1:last + 2] == b"u" else 2
                high_surrogate = width == 6 and raw[last + 2:last + 4].lower() in (b"d8", b"d9", b"da", b"db")
                if last + (12 if high_surrogate else width) > cut:
                    cut = last
        lead = cut - 1
        while lead >= 0 and lead > cut - 4 and 0x80 <= raw[lead] < 0xC0:
            lead -= 1
        if lead >= 0 and raw[lead] >= 0xC0:
            size = 2 if raw[lead] < 0xE0 else 3 if raw[lead] < 0xF0 else 4
            if lead + size > cut:
                cut = lead
    try:
        return json.loads(b'"' + raw[:cut] + b'"'), cut
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _malformed(item, record.start) from None


def _skip_line(handle) -> None:
    """Read past the next line break, a block at a time."""
    while (chunk := handle.readline(BLOCK)) and not chunk.endswith(b"\n"):
        pass


def _decode_line(item: _File, raw: bytes, position: int, cut: bool) -> str:
    if b"\x00" in raw:
        raise LayerdropError(f"{item.path} looks binary (a NUL byte near byte {position}); pass UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (cut and exc.start >= len(raw) - 3 and exc.reason == "unexpected end of data"):
            raise LayerdropError(f"{item.path} is not UTF-8 (byte {position + exc.start}); convert it to "
                                 "UTF-8") from None
        return raw[:exc.start].decode("utf-8")  # the cap cut a character in two


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json", ".ndjson")


def _check_head(item: _File) -> None:
    """Refuse binary files and JSON that is not JSON Lines before reading anything else."""
    with open(item.path, "rb") as handle:
        head = handle.read(8192)
    if b"\x00" in head:
        raise LayerdropError(f"{item.path} looks binary (it holds NUL bytes); pass a UTF-8 text file")
    if item.jsonl and head.strip() and not head.lstrip().startswith(b"{"):
        raise LayerdropError(f"{item.path}:1: not JSON Lines (one JSON object a line); convert it, or rename it "
                             "to .txt to read it as plain text")


def _has_text(item: _File) -> bool:
    with open(item.path, "rb") as handle:
        while block := handle.read(BLOCK):
            if block.strip():
                return True
    return False


def _line_number(path: Path, position: int) -> int:
    """1-based line number of the byte `position` (counted only on the error path)."""
    count, done = 1, 0
    with open(path, "rb") as handle:
        while done < position:
            block = handle.read(min(BLOCK, position - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


# -- windows --------------------------------------------------------------------------------------------------------

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
