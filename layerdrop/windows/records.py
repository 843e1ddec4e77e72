"""JSON Lines records of any length, read in bounded memory.

A record is read as a JSON object only as far as finding where its text field's string lies (`RecordScanner`);
the string itself is decoded a piece at a time, cut only between escape sequences and between UTF-8 characters,
so no record is ever held whole. The lines of a record's text begin at its string's first character and after
each `\\n` escape; a line's byte offset is that of its first character as written in the file.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from layerdrop.errors import LayerdropError

BLOCK = 1 << 20  # bytes per read
LINE_CAP = 1 << 16  # bytes a line may reach beyond its run before it is cut
READ_AHEAD = 1 << 14  # bytes a record scanner reads first, doubling up to BLOCK

_STRING_BODY = re.compile(rb'[^"\\\x00-\x1f]*(?:\\[^\x00-\x1f][^"\\\x00-\x1f]*)*')
_ESCAPE = re.compile(rb"\\(?:u[0-9a-fA-F]{4}|[^u])")
_NEWLINE_ESCAPES = (b"\\n", b"\\u000a", b"\\u000A")
ONE_CHARACTER = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\.|"
                            rb"[\x00-\x7f]|[\xc0-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf7][\x80-\xbf]{3}",
                            re.DOTALL)
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_NESTED_PLAIN = re.compile(rb'[^"{}\[\]\n]*')


@dataclass(frozen=True)
class Record:
    """Where one record of a JSON Lines file lies, and where its text field's string lies inside it."""

    start: int  # byte offset of the record's first byte in its file
    end: int  # just past its line break
    text: tuple[int, int] | None  # the text field's string between its quotes (None: a blank line)


def _malformed(path: Path, start: int) -> LayerdropError:
    return LayerdropError(f"{path}:{_line_number(path, start)}: not a JSON object; each line of a JSON Lines "
                          "file must be one")


class RecordScanner:
    """Walks one record from its first byte in blocks: the object's keys, skipping values other than the text
    field, to the record's line break."""

    def __init__(self, path: Path, handle) -> None:
        self.path, self.handle = path, handle
        self.buffer, self.base, self.position = b"", 0, 0  # buffer holds the file from byte `base`
        self.start = 0  # where the record being read begins

    def _more(self) -> bool:
        self.handle.seek(self.base + len(self.buffer))  # the handle is shared with readers of strings
        block = self.handle.read(min(BLOCK, max(READ_AHEAD, 2 * len(self.buffer))))  # most records are short
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
            raise _malformed(self.path, self.start)
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
                    raise _malformed(self.path, self.start)
            elif not self._more():
                raise _malformed(self.path, self.start)

    def _value(self) -> None:
        byte = self._space()
        if byte == ord('"'):
            self._string()
        elif byte is not None and byte in b"{[":
            depth = 0
            while True:
                byte = self._peek()
                if byte is None or byte == ord("\n"):
                    raise _malformed(self.path, self.start)
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
                raise _malformed(self.path, self.start)
            self.position = self.base + match.end()

    def _key(self) -> str | None:
        begin, end = self._string()
        if begin - 1 < self.base:  # a key longer than a block is no field name anyone passes
            return None
        try:
            return json.loads(self.buffer[begin - 1 - self.base:end + 1 - self.base])
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _malformed(self.path, self.start) from None

    def record(self, start: int, text_field: str) -> Record:
        """The record from byte `start` to its line break; refuses a malformed one or one without the text field."""
        if not self.base <= start <= self.base + len(self.buffer):
            self.buffer, self.base = b"", start
        self.position = self.start = start
        byte = self._space()
        if byte is None or byte == ord("\n"):
            return Record(self.start, self.position + (byte is not None), None)
        self._expect(b"{")
        text = None
        if self._space() == ord("}"):
            self.position += 1
        else:
            while True:
                if self._space() != ord('"'):
                    raise _malformed(self.path, self.start)
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
                    raise _malformed(self.path, self.start)
        byte = self._space()
        if byte not in (None, ord("\n")):
            raise _malformed(self.path, self.start)
        if text is None:
            raise LayerdropError(f"{self.path}:{_line_number(self.path, self.start)}: no text field "
                                 f"{text_field!r}; name the field with --text-field")
        return Record(self.start, self.position + (byte is not None), text)


def string_lines(path: Path, handle, record: Record, low: int, high: int) -> Iterator[tuple[str, int, bool]]:
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
        text, _ = decode_string(path, record, raw[start - aligned:line_end - aligned], final=whole)
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


def decode_string(path: Path, record: Record, raw: bytes, *, final: bool) -> tuple[str, int]:
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
        raise _malformed(path, record.start) from None


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
