"""Texts of any size and format become windows that follow the model's tokenizer.

References are independent of the code under test: one tokenizer call on the whole text, the text decoded from the
byte offsets the windows record, transformers' own tokenizer for the BOS convention.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, trainers

from layerdrop import api, windows
from layerdrop.cli import main
from layerdrop.errors import LayerdropError
from layerdrop.windows import Sampling, TextSource, bundled_text, draw_windows, load_tokenizer, stream_tokens
from tests.torch_reference import VOCAB, hook_scores, tiny_model

TEXT = bundled_text("calib").read_text(encoding="utf-8")


def _folder_with(tmp_path: Path, tokenizer_file: Path, config: dict | None = None) -> Path:
    folder = tmp_path / "tokenizer-folder"
    folder.mkdir(exist_ok=True)
    shutil.copy(tokenizer_file, folder / "tokenizer.json")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def merging_tokenizer_file(tmp_path_factory) -> Path:
    """A BPE with no pre-tokenizer (like Gemma's): its merges span spaces and line breaks."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=False, unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False,
                                  max_token_length=12)
    tokenizer.train_from_iterator([TEXT[i:i + 5000] for i in range(0, 60000, 5000)], trainer)
    merged = [t for t in tokenizer.get_vocab() if (" " in t or "\n" in t) and len(t.strip()) > 0]
    assert merged, "the test tokenizer must merge across spaces or line breaks"
    path = tmp_path_factory.mktemp("merging") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


# -- streaming ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [7, 64, 1000])
@pytest.mark.parametrize("kind", ["byte-level", "merging"])
def test_streamed_tokens_equal_one_call_on_the_whole_text(kind, chunk, tiny_tokenizer_file, merging_tokenizer_file,
                                                          tmp_path):
    path = tiny_tokenizer_file if kind == "byte-level" else merging_tokenizer_file
    tokenizer = load_tokenizer(_folder_with(tmp_path, path))
    text = TEXT[:30000]
    whole = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False)
    pieces = [text[i:i + 333] for i in range(0, len(text), 333)]  # pieces that cut words and lines anywhere
    ids, starts = [], []
    for part, offsets in stream_tokens(tokenizer, pieces, chunk_chars=chunk, margin_chars=40, context_chars=24):
        ids += part
        starts += offsets
    assert ids == whole.ids
    assert starts == [start for start, _ in whole.offsets]


def test_from_start_windows_are_the_first_windows_of_the_whole_text(monkeypatch, tiny_tokenizer_file, tmp_path):
    monkeypatch.setattr(windows.tokenizer, "CHUNK_CHARS", 500)  # many chunk boundaries inside the windows
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    got = draw_windows(folder, None, role="calib", samples=6, seq_len=100, sampling=Sampling(from_start=True))
    ids = Tokenizer.from_file(str(tiny_tokenizer_file)).encode(TEXT, add_special_tokens=False).ids
    np.testing.assert_array_equal(got.ids, np.array(ids[:600]).reshape(6, 100))
    last = draw_windows(folder, None, role="search", samples=2, seq_len=100, sampling=Sampling(from_start=True))
    count = len(ids) // 100
    np.testing.assert_array_equal(last.ids, np.array(ids[(count - 2) * 100:count * 100]).reshape(2, 100))
    assert got.source["layout"] == "from-start" and last.source["from_end"] is True


# -- spread windows -------------------------------------------------------------------------------------------------

def _spans(result, path: Path, tokenizer_file: Path) -> list[tuple[int, int]]:
    """Byte range of each window, from its recorded start and its decoded text; and each window equals one
    tokenizer call on the text from that start."""
    raw = path.read_bytes()
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    spans = []
    for row, start in zip(result.ids, result.source["starts"]):
        text = tokenizer.decode(row.tolist())
        assert raw[start:].decode("utf-8").startswith(text)
        reference = tokenizer.encode(raw[start:start + 4 * len(text.encode()) + 64].decode("utf-8", "ignore"),
                                     add_special_tokens=False).ids
        assert reference[:len(row)] == row.tolist()
        spans.append((start, start + len(text.encode())))
    return spans


def test_spread_windows_are_seeded_spread_and_each_is_its_text(tiny_tokenizer_file, tmp_path):
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    path = bundled_text("calib")
    first = draw_windows(folder, None, role="calib", samples=16, seq_len=64)
    again = draw_windows(folder, None, role="calib", samples=16, seq_len=64)
    other = draw_windows(folder, None, role="calib", samples=16, seq_len=64, sampling=Sampling(seed=1))
    np.testing.assert_array_equal(first.ids, again.ids)
    assert first.source["starts"] != other.source["starts"]
    spans = _spans(first, path, tiny_tokenizer_file)
    size = path.stat().st_size
    assert spans[0][0] < size * 0.2 and spans[-1][0] > size * 0.7, "windows come from across the whole text"
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "windows do not overlap"
    assert first.source["layout"] == "spread" and first.source["seed"] == 0


def test_windows_that_find_no_room_where_asked_go_to_gaps_earlier_in_the_text(tiny_tokenizer_file, tmp_path):
    """Near the text's capacity the last part's leftovers go back into gaps between earlier windows (the windows
    are then not in text order): every window is still its own text and none overlaps another or leaves the
    calibration part; past the capacity the refusal says how many fit."""
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    path = bundled_text("calib")
    got = draw_windows(folder, None, role="calib", samples=300, seq_len=256)
    assert len(got.ids) == 300 and got.source["starts"] != sorted(got.source["starts"])
    spans = sorted(_spans(got, path, tiny_tokenizer_file))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "windows do not overlap"
    part = windows.territory(path.stat().st_size, "calib", shared=True)
    assert all(any(lo <= start < hi for lo, hi in part) for start, _ in spans)
    with pytest.raises(LayerdropError, match=r"too little text for 400 windows .*\(\d+ fit\)"):
        draw_windows(folder, None, role="calib", samples=400, seq_len=256)


def test_calibration_search_and_evaluation_windows_of_one_text_never_overlap(tiny_tokenizer_file, tmp_path):
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    path = bundled_text("calib")
    calib = draw_windows(folder, path, role="calib", samples=40, seq_len=64)
    digest = calib.source["sha256"]
    drawn = [calib] + [draw_windows(folder, path, role=role, samples=12, seq_len=64, calibration_sha256=digest)
                       for role in ("search", "eval")]
    spans = sorted(span for result in drawn for span in _spans(result, path, tiny_tokenizer_file))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # a text that is no calibration text is read whole by its one role
    whole = draw_windows(folder, path, role="eval", samples=12, seq_len=64)
    assert whole.source["territory"] == "whole" and drawn[2].source["territory"] == "shared"


def test_jsonl_records_and_folders_are_read_like_the_text_they_hold(tiny_tokenizer_file, tmp_path):
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    paragraphs = [p for p in TEXT.split("\n\n") if len(p) > 200][:120]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"body": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    got = draw_windows(folder, jsonl, role="calib", samples=6, seq_len=32, sampling=Sampling(text_field="body"))
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_file))
    joined = "\n\n".join(paragraphs)
    for row in got.ids:
        assert tokenizer.decode(row.tolist()) in joined
    assert got.source["text_field"] == "body"
    start = draw_windows(folder, jsonl, role="calib", samples=3, seq_len=32,
                         sampling=Sampling(from_start=True, text_field="body"))
    np.testing.assert_array_equal(start.ids.reshape(-1), tokenizer.encode(joined).ids[:96])
    books = tmp_path / "books"
    (books / "b").mkdir(parents=True)
    (books / "a.txt").write_text(TEXT[:40000])
    (books / "b" / "c.txt").write_text(TEXT[40000:90000])
    whole = draw_windows(folder, books, role="calib", samples=4, seq_len=32, sampling=Sampling(from_start=True))
    np.testing.assert_array_equal(whole.ids.reshape(-1), tokenizer.encode(TEXT[:40000]).ids[:128])
    spread = draw_windows(folder, books, role="calib", samples=12, seq_len=32)
    texts = [tokenizer.decode(row.tolist()) for row in spread.ids]
    assert any(t in TEXT[40000:90000] for t in texts) and all(t in TEXT[:40000] + "\n\n" + TEXT[40000:90000]
                                                              for t in texts)


def _long_record_text(characters: int) -> str:
    """Prose with quotes, backslashes, tabs, accents and characters beyond the BMP, so every kind of escape occurs."""
    extra = ' "quoted" back\\slash\ttab café 𝄞 naïve ☃\n'
    text = "".join(TEXT[i:i + 3000] + extra for i in range(0, len(TEXT) - 3000, 3000))
    return (text * (characters // len(text) + 1))[:characters]


@pytest.mark.parametrize("ascii_only", [True, False])
def test_a_record_of_several_megabytes_gives_the_windows_of_its_text(tiny_tokenizer_file, tmp_path, ascii_only):
    """Windows are drawn inside a long record as inside a plain text: each one is the tokenizer on the record's
    decoded text from the offset it records (that character as written in the file), and they come from across it."""
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    long = _long_record_text(3_000_000)
    records = [{"id": 0, "meta": {"tags": ["a", "b}"], "n": -1.5e3}, "text": long}, {"text": "a short record\n"}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=ascii_only) + "\n" for r in records), encoding="utf-8")
    raw = path.read_bytes()
    assert len(raw) > 3 * windows.LINE_CAP * 10
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_file))
    start = draw_windows(folder, path, role="calib", samples=5, seq_len=64, sampling=Sampling(from_start=True))
    np.testing.assert_array_equal(start.ids.reshape(-1), tokenizer.encode(long[:20000]).ids[:5 * 64])
    spread = draw_windows(folder, path, role="calib", samples=24, seq_len=64)
    body_end = raw.index(b"\n") - 2  # the long record's text is its last field: its string ends before `"}`
    for row, offset in zip(spread.ids, spread.source["starts"]):
        rest = json.loads(b'"' + raw[offset:body_end] + b'"')  # the record's text from the recorded offset
        assert tokenizer.encode(rest[:1000], add_special_tokens=False).ids[:64] == row.tolist()
    assert spread.source["starts"][-1] > 0.7 * len(raw) and spread.source["starts"][0] < 0.2 * len(raw)


_PEAK_MEMORY = """
import resource, sys
from pathlib import Path
from layerdrop.windows import Sampling, draw_windows
folder, path = Path(sys.argv[1]), Path(sys.argv[2])
draw_windows(folder, path, role="calib", samples=16, seq_len=64)
draw_windows(folder, path, role="calib", samples=4, seq_len=64, sampling=Sampling(from_start=True))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_memory(folder: Path, path: Path) -> int:
    """Peak resident bytes of a fresh process that draws spread and from-start windows from `path`."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PEAK_MEMORY, str(folder), str(path)], capture_output=True,
                          text=True, timeout=1800, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_a_gigabyte_of_a_few_huge_records_costs_no_more_memory_than_a_small_file(tiny_tokenizer_file, tmp_path):
    """Four records of 256 MB each: at most 200 MB more peak memory than a file of a few short records."""
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": TEXT[i:i + 50000]}) + "\n" for i in range(0, 200000, 50000)))
    piece = json.dumps(TEXT)[1:-1].encode()
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as handle:
        for record in range(4):
            handle.write(b'{"id": %d, "text": "' % record)
            for _ in range(256 * 2**20 // len(piece)):
                handle.write(piece)
            handle.write(b'"}\n')
    assert big.stat().st_size > 2**30 * 0.95
    assert _peak_memory(folder, big) - _peak_memory(folder, small) < 200 * 2**20


@pytest.mark.parametrize("content, expected", [
    ('{"text": "a fine line"}\n{"text": 3}\n', r"corpus\.jsonl:2: no text field 'text'"),
    ('{"text": "a fine line"}\n{"text": "ok"}\n{broken\n', r"corpus\.jsonl:3: not a JSON object"),
    ('[{"text": "an array"}]\n', r"corpus\.jsonl:1: not JSON Lines"),
    ('{"text": "ok"}\n{"text": "' + "long " * 100_000 + '\n{"text": "ok"}\n', r"corpus\.jsonl:2: not a JSON object"),
    ('{"text": "ok"}\n\n{"text": "' + "long " * 100_000 + '\\x"}\n', r"corpus\.jsonl:3: not a JSON object"),
    ('{"text": "ok"}\n{"id": [1, {"text": 2}], "text": 7, "n": "' + "x" * 300_000 + '"}\n',
     r"corpus\.jsonl:2: no text field 'text'"),
])
def test_bad_json_lines_name_the_file_and_line(tiny_tokenizer_file, tmp_path, content, expected):
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    path = tmp_path / "corpus.jsonl"
    path.write_text(content)
    with pytest.raises(LayerdropError, match=expected):
        draw_windows(folder, path, role="calib", samples=1, seq_len=4, sampling=Sampling(from_start=True))


def test_bad_files_in_a_folder_get_one_line_and_exit_2(exported, tmp_path, capsys):
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(TEXT[:20000])
    (books / "b.bin").write_bytes(b"\x00\x01binary" * 10)
    src = str(exported("llama", False))
    capsys.readouterr()  # the fixture's own output
    assert main(["score", src, "--calib", str(books), "--samples", "2", "--seq-len", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "b.bin looks binary" in err[0]
    (books / "b.bin").unlink()
    (tmp_path / "empty").mkdir()
    assert main(["score", src, "--calib", str(tmp_path / "empty"), "--samples", "2", "--no-progress"]) == 2
    assert "holds no text files" in capsys.readouterr().err


def test_reading_a_large_text_reads_only_what_the_windows_need(tiny_tokenizer_file, tmp_path, monkeypatch):
    """A text of 200 periods: spread windows read their lines and the digest, never the whole text at once."""
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as handle:
        for _ in range(120):
            handle.write(TEXT)
    reads: list[int] = []
    original = TextSource.lines_from

    def counted(self, start, end):
        text, chars, offsets = original(self, start, end)
        reads.append(len(text))
        return text, chars, offsets

    monkeypatch.setattr(TextSource, "lines_from", counted)
    got = draw_windows(folder, big, role="calib", samples=8, seq_len=64)
    assert got.ids.shape == (8, 64)
    assert len(reads) == 8 and max(reads) <= windows.PERIOD_MAX, "each window reads one run of one period"
    assert got.source["starts"][-1] > big.stat().st_size * 0.8


# -- the BOS convention ---------------------------------------------------------------------------------------------

def _transformers_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


@pytest.mark.parametrize("config, expect_bos", [
    (None, True),                            # the post-processor adds it
    ({"add_bos_token": False}, False),       # tokenizer_config turns it off
])
def test_bos_follows_what_the_tokenizer_does(bos_tokenizer_file, tmp_path, config, expect_bos):
    folder = _folder_with(tmp_path, bos_tokenizer_file, config)
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.bos_id is not None) == expect_bos
    if config is None:  # transformers' tokenizer(text) is the reference (it reads the same post-processor)
        assert _transformers_ids(folder, "Anne Elliot")[0] == tokenizer.bos_id
    got = draw_windows(folder, None, role="calib", samples=3, seq_len=20)
    assert got.ids.shape == (3, 21 if expect_bos else 20) and got.source["bos"] is expect_bos
    assert (got.ids[:, 0] == tokenizer.bos_id).all() if expect_bos else got.real.all()


def test_add_bos_token_prepends_the_declared_bos(tiny_tokenizer_file, tmp_path):
    name = Tokenizer.from_file(str(tiny_tokenizer_file)).id_to_token(VOCAB - 2)
    folder = _folder_with(tmp_path, tiny_tokenizer_file, {"bos_token": name, "add_bos_token": True})
    tokenizer = load_tokenizer(folder)
    assert tokenizer.bos_id == VOCAB - 2
    assert tokenizer.encode("x", special=True)[0] == tokenizer.bos_id


def test_a_tokenizer_without_the_bos_it_declares_is_refused(tiny_tokenizer_file, exported, tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(exported("llama", False), src)
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    capsys.readouterr()  # the fixture's own output
    assert main(["score", str(src), "--samples", "2", "--seq-len", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add_bos_token" in err[0] and "'<s>' is not in the vocabulary" in err[0]


@pytest.fixture
def bos_model(exported, bos_tokenizer_file, tmp_path) -> Path:
    """The tiny llama export with a tokenizer that adds `<bos>` (the graph does not depend on the tokenizer)."""
    folder = tmp_path / "bos-model"
    shutil.copytree(exported("llama", True), folder)
    shutil.copy(bos_tokenizer_file, folder / "tokenizer.json")
    return folder


def test_bos_windows_score_like_torch_hooks_without_the_bos_position(bos_model):
    result = api.score(bos_model, None, samples=3, seq_len=24, progress=False)
    assert result["calibration"]["bos"] is True
    drawn = api.windows_for(bos_model, None, role="calib", samples=3, seq_len=24)
    assert drawn.ids.shape == (3, 25)
    reference = hook_scores(tiny_model("llama"), drawn.ids, skip_first=True)
    for row in result["regions"]:
        assert row["score"] == pytest.approx(reference[(row["kind"], row["layer"])], abs=1e-5)


def test_bos_windows_predict_every_text_token_and_never_the_bos(bos_model):
    import torch

    result = api.evaluate(bos_model, samples=3, seq_len=24, progress=False)
    drawn = api.windows_for(bos_model, None, role="eval", samples=3, seq_len=24)
    with torch.no_grad():  # transformers' own loss: labels are the inputs, shifted inside; the BOS is no label
        ids = torch.tensor(drawn.ids)
        loss = tiny_model("llama")(ids, labels=ids).loss.item()
    assert result["tokens"] == 3 * 24 and result["text"]["bos"] is True
    assert result["perplexity"] == pytest.approx(float(np.exp(loss)), rel=1e-4)


# -- bundled texts of other kinds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["docs", "code", "prose", "dictionary"])
def test_bundled_texts_of_other_kinds_are_named_like_files(name, tiny_tokenizer_file, tmp_path, monkeypatch):
    """`--calib code` reads the bundled file, even where a file of that name is in the working folder (so a
    checkout's own `docs/` cannot shadow the bundled docs); that file is read when given as a path."""
    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    text = bundled_text(name).read_text(encoding="utf-8")
    assert len(text) > 150_000 and "\x00" not in text
    by_name = draw_windows(folder, name, role="calib", samples=4, seq_len=32)
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_file))
    assert by_name.source["file"].endswith(f"{name}.txt")
    assert all(tokenizer.decode(row.tolist()) in text for row in by_name.ids)
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(TEXT[:30000])
    still_bundled = draw_windows(folder, name, role="calib", samples=4, seq_len=32)
    assert all(tokenizer.decode(row.tolist()) in text for row in still_bundled.ids)
    mine = draw_windows(folder, Path(name), role="calib", samples=4, seq_len=32)
    assert all(tokenizer.decode(row.tolist()) in TEXT[:30000] for row in mine.ids)


def test_an_unknown_text_name_lists_the_bundled_ones(exported, capsys):
    assert main(["eval", str(exported("llama", False)), "--text", "poetry", "--samples", "1"]) == 2
    err = capsys.readouterr().err
    assert "text file poetry does not exist" in err and "calib, prose, eval, docs, code" in err


def test_the_standard_library_texts_are_rebuilt_byte_for_byte():
    """scripts/build_bundled_texts.py with the Python the files were made with gives the shipped bytes."""
    import hashlib
    import sys

    if sys.version.split()[0] != "3.11.7":
        pytest.skip("the shipped texts were made from CPython 3.11.7's standard library")
    module = _build_script()
    source = (Path(__file__).resolve().parent.parent / "layerdrop" / "data" / "SOURCE.md").read_text()
    for file_name, text in module.build().items():
        shipped = bundled_text(file_name[:-4]).read_bytes()
        assert text.encode("utf-8") == shipped
        assert f"`{file_name}` SHA-256 `{hashlib.sha256(shipped).hexdigest()}`" in source


def test_the_default_calibration_text_mixes_kinds_and_keeps_the_evaluation_texts_out(tiny_tokenizer_file, tmp_path):
    """The default calibration windows come from all four kinds; no passage of the bundled held-out texts is in it."""
    import hashlib
    import re
    import sysconfig

    raw = bundled_text("calib").read_bytes()
    mixed = raw.decode("utf-8")
    for held_out in ("eval", "docs", "code", "dictionary"):
        lines = {line for line in bundled_text(held_out).read_text(encoding="utf-8").split("\n") if len(line) > 60}
        shared = [line for line in mixed.split("\n") if line in lines]
        assert len(shared) < 5, (held_out, shared[:5])  # a licence line may recur, no passage does
    builder = _build_script()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = {line for part in builder._stdlib_parts(stdlib, builder.MIXED_DOC_MODULES, ())[0]
            for line in part.split("\n")}
    prose = set(bundled_text("prose").read_text(encoding="utf-8").split("\n"))

    def kind(line: str) -> str:
        if re.match(r"^ +\d+ |^Job \d+$", line):
            return "verse"
        return "prose" if line in prose else "docs" if line in docs else "code"

    folder = _folder_with(tmp_path, tiny_tokenizer_file)
    drawn = draw_windows(folder, None, role="calib", samples=64, seq_len=32)
    seen = set()
    for start in drawn.source["starts"]:  # each window starts at a line start: the kind of its first text line
        line = next(line for line in raw[start:start + 4096].decode("utf-8", "ignore").split("\n") if line.strip())
        seen.add(kind(line))
    assert seen == {"prose", "verse", "docs", "code"}
    source = (Path(__file__).resolve().parent.parent / "layerdrop" / "data" / "SOURCE.md").read_text()
    assert f"`calib.txt` SHA-256 `{hashlib.sha256(raw).hexdigest()}`" in source


def test_the_dictionary_text_is_its_entries_cut_at_an_entry(monkeypatch):
    """build_dictionary leaves out the dict header and the preface, removes dictfmt's braces, and cuts before the
    entry that would pass the size; the shipped file starts at the first entry and ends with a whole one."""
    import re

    builder = _build_script()
    raw = ("00-database-short\n     The Devil's Dictionary\n\n   PREFACE\nA, B, c. is no entry.\n\n"
           "ABASEMENT, n.  A decent attitude.   \n\n\n\nACADEMY, n.  [from {ACADEME}]  A school.\n\n"
           "    Said a man, \"Not so.\"\n                G.J.\n\nBRUTE, n.  See {HUSBAND}.\n")
    monkeypatch.setattr(builder, "DICTIONARY_BYTES", 1000)
    assert builder.build_dictionary(raw) == ("ABASEMENT, n.  A decent attitude.\n\nACADEMY, n.  [from ACADEME]  "
                                             "A school.\n\n    Said a man, \"Not so.\"\n                G.J.\n\n"
                                             "BRUTE, n.  See HUSBAND.\n")
    whole = builder.build_dictionary(raw)
    monkeypatch.setattr(builder, "DICTIONARY_BYTES", whole.index("BRUTE"))  # BRUTE would pass it: cut before it
    assert builder.build_dictionary(raw) == whole[:whole.index("BRUTE")].rstrip("\n") + "\n"
    monkeypatch.setattr(builder, "DICTIONARY_BYTES", whole.index("BRUTE") - 1)  # now ACADEMY would pass it too
    assert builder.build_dictionary(raw) == "ABASEMENT, n.  A decent attitude.\n"
    with pytest.raises(ValueError, match="no dictionary entry"):
        builder.build_dictionary("PREFACE\nnothing here\n")
    shipped = bundled_text("dictionary").read_text(encoding="utf-8")
    assert shipped.startswith("ABASEMENT, n.") and "{" not in shipped and len(shipped.encode()) <= 200_000
    last = [m.start() for m in re.finditer(r"^[A-Z][A-Z' .-]*, [a-z]+\.", shipped, re.MULTILINE)][-1]
    assert shipped[last:].startswith("LORD, n.") and shipped.endswith("\n") and not shipped.endswith("\n\n")


def _build_script():
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "build_bundled_texts.py"
    spec = importlib.util.spec_from_file_location("build_bundled_texts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
