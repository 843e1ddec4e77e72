"""Offline lm-eval tasks over local rows, for the tests and the harness benchmark."""

from __future__ import annotations

import json
from pathlib import Path


def write_local_task(folder: Path, name: str, rows: list[dict], *, output_type: str, doc_to_text: str,
                     doc_to_target: str, metrics: list[str], doc_to_choice: str | None = None,
                     generation_kwargs: dict | None = None) -> Path:
    """Write an lm-eval task over local rows: `name.jsonl` and `name.yaml` in `folder` (use it as --include-path).

    Values go into the YAML as JSON, which YAML reads as written (stop strings with newlines included).
    """
    folder = Path(folder)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
              "test_split": "test", "output_type": output_type, "doc_to_text": doc_to_text,
              "doc_to_target": doc_to_target, "metric_list": [{"metric": m} for m in metrics]}
    if doc_to_choice is not None:
        config["doc_to_choice"] = doc_to_choice
    if generation_kwargs is not None:
        config["generation_kwargs"] = generation_kwargs
    path = folder / f"{name}.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in config.items()), encoding="utf-8")
    return path
