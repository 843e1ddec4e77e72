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
  begins at a line start; in JSON Lines, at the start of a record's text or of a line inside it, so windows are
  drawn inside a long record as inside any text.
- **from-start**: consecutive windows from the start of the text (search windows: the last ones), as layerdrop
  packed them before spreading existed; search from the end reads the whole text.

A window's recorded start (`starts` in its metadata) is the byte offset, in the joined source, of its first
token's first character. Inside a JSON string that is the offset of the character as written in the file: the
first byte of its escape sequence (`\\n`, `\\"`, `\\u00e9`, a surrogate pair) or of its UTF-8 bytes; so the
file's bytes from there, read as the rest of that JSON string, begin with the window's text.

Windows follow the model's tokenizer: where `tokenizer(text)` would start with a BOS token (the tokenizer.json
post-processor, or `add_bos_token` in tokenizer_config.json), every window is BOS + seq_len text tokens. The BOS
is context only: never a predicted token, and left out of score and mean averages (`Windows.real`).
"""

from layerdrop.windows.records import BLOCK, LINE_CAP
from layerdrop.windows.sampling import (
    PERIOD_MAX,
    PERIOD_MIN,
    ROLE_SHARES,
    ROLES,
    Sampling,
    Windows,
    draw_windows,
    territory,
)
from layerdrop.windows.sources import BUNDLED, DOCUMENT_JOINER, TextSource, bundled_text, resolve_text
from layerdrop.windows.tokenizer import CHUNK_CHARS, ModelTokenizer, load_tokenizer, stream_tokens

__all__ = [
    "BLOCK", "BUNDLED", "CHUNK_CHARS", "DOCUMENT_JOINER", "LINE_CAP", "PERIOD_MAX", "PERIOD_MIN", "ROLES",
    "ROLE_SHARES",
    "ModelTokenizer", "Sampling", "TextSource", "Windows", "bundled_text", "draw_windows", "load_tokenizer",
    "resolve_text", "stream_tokens", "territory",
]
