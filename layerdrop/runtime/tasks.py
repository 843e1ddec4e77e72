"""Offline lm-eval tasks over local rows, and the next-tokens multiple-choice task the planner's accuracy column uses.

The task goes through lm-eval's own machinery (a task YAML over a local JSON Lines file, `TaskManager`,
`simple_evaluate`) and the `layerdrop` lm-eval model, so its accuracy is what `lm_eval` itself reports.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NEXT_TOKENS_TASK = "layerdrop_next_tokens"
CHOICES = 4  # the true continuation and three others


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


def next_tokens_rows(windows: np.ndarray, decode, continuation: int, seed: int = 0) -> list[dict]:
    """Multiple-choice items from token windows [n, context + continuation]: the context is a window's first
    tokens, the choices its own last `continuation` tokens and those of three other windows, shuffled (seeded).

    `decode(ids) -> str` turns tokens back into text (special tokens such as a BOS left out); lm-eval tokenizes
    context and choice again, as it does for any task.
    """
    windows = np.asarray(windows)
    if len(windows) < CHOICES:
        raise ValueError(f"a multiple-choice task needs at least {CHOICES} windows")
    rng = np.random.default_rng(seed)
    rows = []
    for index, window in enumerate(windows):
        others = rng.choice([j for j in range(len(windows)) if j != index], CHOICES - 1, replace=False)
        choices = [decode(windows[j][-continuation:].tolist()) for j in (index, *others)]
        order = rng.permutation(CHOICES)
        rows.append({"context": decode(window[:-continuation].tolist()),
                     "choices": [choices[k] for k in order], "answer": int(np.argmax(order == 0))})
    return rows


@dataclass
class ChoiceScores:
    """lm-eval's accuracy on multiple-choice rows, and each item's outcome (1.0 right, 0.0 wrong) in row order, as
    lm-eval logged it: two models on the same items can be compared item by item (`paired_difference`)."""

    accuracy: float
    correct: np.ndarray


def choice_scores(lm, rows: list[dict]) -> ChoiceScores:
    """Accuracy (lm-eval's `acc`) of an lm-eval model on multiple-choice `rows` ({"context", "choices", "answer"}),
    with each item's outcome from lm-eval's logged samples. The task manager indexes this task alone, not
    lm-eval's own (which took 15-35 s a call here)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data are local; never ask a hub
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="layerdrop-task-") as folder:
        write_local_task(Path(folder), NEXT_TOKENS_TASK, rows, output_type="multiple_choice",
                         doc_to_text="{{context}}", doc_to_choice="{{choices}}", doc_to_target="{{answer}}",
                         metrics=["acc"])
        results = evaluator.simple_evaluate(model=lm, tasks=[NEXT_TOKENS_TASK], bootstrap_iters=0, log_samples=True,
                                            task_manager=TaskManager(include_path=folder, include_defaults=False),
                                            verbosity="ERROR")
    correct = np.zeros(len(rows))
    for sample in results["samples"][NEXT_TOKENS_TASK]:
        correct[sample["doc_id"]] = sample["acc"]
    return ChoiceScores(float(results["results"][NEXT_TOKENS_TASK]["acc,none"]), correct)


def paired_difference(correct: np.ndarray, baseline: np.ndarray) -> tuple[float, float]:
    """(mean difference, its standard error) of two models' outcomes on the same items: the accuracy one gains
    over the other, and how much of that the choice of items could make (the sample standard deviation of the
    item-by-item differences over the square root of the item count). Items both get right or both get wrong add
    nothing to the difference, so it is tighter than two accuracies' own errors.

    Raises:
        ValueError: the outcomes are not of the same items (lengths differ), or there are fewer than two.
    """
    first, second = np.asarray(correct, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if first.shape != second.shape or first.ndim != 1 or len(first) < 2:
        raise ValueError(f"paired outcomes need two vectors of the same items (got {first.shape} and {second.shape})")
    differences = first - second
    return float(differences.mean()), float(differences.std(ddof=1) / np.sqrt(len(differences)))
