"""The memory guard: a heavy command whose estimated peak memory is over the limit (--memory-limit, else
$LAYERDROP_MEMORY_LIMIT, else 16 GB) or whose output the disk cannot hold is refused before it starts, in one line,
exit 2, with nothing written; the option it names as fitting does fit. Estimates read parameters from file headers,
checked here against PyTorch's and numpy's own counts."""

from __future__ import annotations

import math
import shutil

import pytest

from layerdrop import memory
from layerdrop.cli import main
from tests.gguf_files import TENSORS, write_gguf
from tests.torch_reference import tiny_model


def _parameters(family: str) -> int:
    return sum(p.numel() for p in tiny_model(family).parameters())


def _export(capsys, tmp_path, folder, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["export", str(folder), "-o", str(tmp_path / "out"), *extra])
    return code, capsys.readouterr().err


def _refused_with_nothing_written(code: int, err: str, tmp_path) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == []


def test_parameters_of_a_folder_are_what_torch_counts(hf_folder):
    assert memory.parameter_count(hf_folder("qwen2")) == _parameters("qwen2")


def test_a_gguf_header_states_its_metadata_and_parameters_without_reading_tensors(tmp_path):
    header = memory.gguf_header(write_gguf(tmp_path / "m.gguf", "qwen2", "Tiny Qwen"))
    assert header.metadata["general.architecture"] == "qwen2" and header.metadata["general.name"] == "Tiny Qwen"
    assert header.metadata["qwen2.block_count"] == 1
    assert header.parameters == sum(math.prod(shape) for shape in TENSORS.values())


def test_an_export_over_a_stated_memory_limit_is_refused_before_it_starts(hf_folder, capsys, tmp_path):
    estimate = memory.export_peak(_parameters("qwen2"), "float32")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(estimate - 1))
    _refused_with_nothing_written(code, err, tmp_path)


def test_the_memory_limit_can_be_stated_in_the_environment(hf_folder, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, "1KB")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"))
    _refused_with_nothing_written(code, err, tmp_path)


def test_where_float16_fits_the_refused_float32_export_names_it_and_it_passes(hf_folder, capsys, tmp_path):
    parameters = _parameters("qwen2")
    limit = memory.export_peak(parameters, "float16")
    assert limit < memory.export_peak(parameters, "float32")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(limit))
    _refused_with_nothing_written(code, err, tmp_path)
    assert "--dtype float16" in err
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(limit), "--dtype", "float16")
    assert code == 0 and (tmp_path / "out" / "model.onnx").is_file(), err


def test_an_export_the_disk_cannot_hold_is_refused_before_it_starts(hf_folder, capsys, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    needed = 4 * _parameters("qwen2")
    monkeypatch.setattr("layerdrop.memory.shutil.disk_usage", lambda _path: usage._replace(free=needed - 1))
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"))
    _refused_with_nothing_written(code, err, tmp_path)


@pytest.mark.parametrize("text, size", [("16GB", 16 * 1000**3), ("1.5GiB", 1_610_612_736), ("123", 123)])
def test_sizes_read_with_decimal_and_binary_units(text, size):
    assert memory.parse_size(text) == size
