"""Text sources: a UTF-8 text file, JSON Lines with a text field, or a folder of such files, as one joined byte
space read in bounded pieces (see the package docstring)."""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from layerdrop.errors import LayerdropError
from layerdrop.windows.records import BLOCK, LINE_CAP, ONE_CHARACTER, Record, RecordScanner, decode_string, string_lines
from layerdrop.windows.tokenizer import CHUNK_CHARS

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
    """The file a text argument names: the role's bundled default for None; a bundled text's name (`BUNDLED`: calib,
    prose, eval, docs, code, dictionary) given as a string is that text even where a file of that name exists here;
    a `Path` that exists is itself; anything else is returned for `TextSource.open` to refuse."""
    if text is None:
        return bundled_text("eval" if role == "eval" else "calib")
    path = Path(text)
    if str(text) in BUNDLED and (isinstance(text, str) or not path.exists()):
        return bundled_text(str(text))
    return path


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
    records: dict[Path, list[Record]] = field(default_factory=dict, compare=False, repr=False)

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
            position = ONE_CHARACTER.match(raw, position).end()
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
            scanner = RecordScanner(item.path, handle)
            while start < min(high, item.size):
                record = self._record(scanner, start)
                if record.text is not None and record.text[0] < high:
                    yield from string_lines(item.path, handle, record, low, high)
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

    def _record(self, scanner: RecordScanner, start: int) -> Record:
        """The record that begins at byte `start`: where it ends and where its text field's string lies (remembered
        for records longer than a block, which runs inside them would otherwise scan again)."""
        for record in self.records.get(scanner.path, ()):
            if record.start == start:
                return record
        record = scanner.record(start, self.text_field)
        if record.end - record.start > BLOCK:
            self.records.setdefault(scanner.path, []).append(record)
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
            scanner = RecordScanner(item.path, handle)
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
                    text, used = decode_string(item.path, record, raw, final=position + len(raw) == stop)
                    yield text
                    position += used


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
