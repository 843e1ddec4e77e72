"""lm-evaluation-harness adapter: local tasks through `layerdrop` (ONNX Runtime) against lm-eval's own `hf` model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from layerdrop import api  # noqa: E402
from layerdrop.cli import main  # noqa: E402
from layerdrop.formats import LOGITS_FROM  # noqa: E402
from tests.lm_eval_tasks import write_local_task  # noqa: E402
from tests.torch_reference import replaced  # noqa: E402

MC = [
    {"question": "The capital of France is", "choices": [" Paris", " a small dog", " blue"], "answer": 0},
    {"question": "Anne Elliot was a woman of", "choices": [" sense", " the sea and the ships", " nine"], "answer": 0},
    {"question": "She walked to the", "choices": [" house", " window of the room", " moon"], "answer": 1},
    {"question": "It was a truth", "choices": [" universally acknowledged", " lie", " a"], "answer": 0},
    {"question": "Captain Wentworth had", "choices": [" money", " no", " a very great deal of"], "answer": 2},
]
GEN = [
    {"question": "Question: what is two and two?\nAnswer:", "answer": " four"},
    {"question": "Sir Walter Elliot, of Kellynch Hall, in", "answer": " Somersetshire"},
    {"question": "The", "answer": " end"},
]
ROLL = [{"text": "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, "
                 "never took up any book but the Baronetage."}]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A folder of three local tasks (multiple choice, generation, rolling log-likelihood) over JSON files."""
    folder = tmp_path_factory.mktemp("tasks")
    write_local_task(folder, "ld_mc", MC, output_type="multiple_choice", doc_to_text="{{question}}",
                     doc_to_choice="{{choices}}", doc_to_target="{{answer}}", metrics=["acc", "acc_norm"])
    write_local_task(folder, "ld_gen", GEN, output_type="generate_until", doc_to_text="{{question}}",
                     doc_to_target="{{answer}}", metrics=["exact_match"],
                     generation_kwargs={"until": ["\n\n", "."], "max_gen_toks": 12, "do_sample": False})
    write_local_task(folder, "ld_roll", ROLL, output_type="loglikelihood_rolling", doc_to_text="",
                     doc_to_target="{{text}}", metrics=["word_perplexity", "bits_per_byte"])
    return folder


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _evaluate(model, tasks: Path, names=("ld_mc", "ld_gen", "ld_roll"), max_length=None) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    return evaluator.simple_evaluate(model=model, tasks=list(names), task_manager=TaskManager(include_path=str(tasks)),
                                     log_samples=True, bootstrap_iters=0)


def _hf_model(torch_model, folder: Path, batch_size: int = 3, max_length: int | None = None):
    """lm-eval's own `hf` model over a PyTorch model, with the folder's tokenizer."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    eos = torch_model.config.eos_token_id
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.pad_token = tokenizer.eos_token
    return HFLM(pretrained=torch_model, tokenizer=tokenizer, batch_size=batch_size, device="cpu",
                max_length=max_length)


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _loglikelihoods(results: dict, task: str) -> np.ndarray:
    values = []
    for resps in _responses(results, task):
        for resp in resps:
            value = resp[0]
            values.append(value[0] if isinstance(value, (list, tuple)) else value)
    return np.array(values, dtype=np.float64)


def _greedy_flags(results: dict, task: str) -> list[bool]:
    return [bool(resp[0][1]) for resps in _responses(results, task) for resp in resps]


def _compare(ours: dict, reference: dict) -> None:
    for task in ("ld_mc", "ld_roll"):
        a, b = _loglikelihoods(ours, task), _loglikelihoods(reference, task)
        assert a.shape == b.shape and a.size > 0
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=task)
    assert _greedy_flags(ours, "ld_mc") == _greedy_flags(reference, "ld_mc")
    assert _responses(ours, "ld_gen") == _responses(reference, "ld_gen")


def _hf_reference(hf_folder, family: str = "llama"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_folder(family)).eval()


@pytest.mark.parametrize("kv_cache,batch_size", [(True, 4), (False, 1)])
def test_adapter_matches_lm_eval_hf_model(exported, hf_folder, tasks, kv_cache, batch_size):
    from layerdrop.runtime.harness import LayerdropLM

    folder = exported("llama", kv_cache)
    ours = _evaluate(LayerdropLM(path=str(folder), provider="cpu", batch_size=batch_size), tasks)
    reference = _evaluate(_hf_model(_hf_reference(hf_folder), folder), tasks)
    _compare(ours, reference)
    # the random-weight model writes something: generation was really exercised
    assert any(r[0] for r in _responses(ours, "ld_gen"))


class _RecordingSession:
    """An ONNX Runtime session that records, for each run, the shape of its token ids and its past's length."""

    def __init__(self, session) -> None:
        self.session, self.runs = session, []

    def run(self, names, feed):
        past = max((v.shape[2] for k, v in feed.items() if k.startswith("past_key_values")), default=0)
        self.runs.append((feed["input_ids"].shape, past))
        return self.session.run(names, feed)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_choices_of_one_context_run_the_context_once_and_match_lm_eval_hf_model(exported, hf_folder, tasks):
    from layerdrop.runtime.harness import LayerdropLM

    folder = exported("llama", True)
    lm = LayerdropLM(path=str(folder), provider="cpu", batch_size=8)
    lm.session = _RecordingSession(lm.session)
    ours = _evaluate(lm, tasks, names=("ld_mc",))
    reference = _evaluate(_hf_model(_hf_reference(hf_folder), folder), tasks, names=("ld_mc",))
    np.testing.assert_allclose(_loglikelihoods(ours, "ld_mc"), _loglikelihoods(reference, "ld_mc"), atol=1e-4, rtol=0)
    assert _greedy_flags(ours, "ld_mc") == _greedy_flags(reference, "ld_mc")
    prefills = [shape for shape, past in lm.session.runs if past == 0]
    after = [shape for shape, past in lm.session.runs if past > 0]
    # every question's context but its last token ran once, and all choices after it
    assert sum(rows * length for rows, length in prefills) == sum(len(lm.tok_encode(d["question"])) - 1 for d in MC)
    assert sum(rows for rows, _ in after) == sum(len(d["choices"]) for d in MC)


class _StartRecordingSession(_RecordingSession):
    """Records the position each run's logits start at (0 where the feed does not say) and their shape."""

    def run(self, names, feed):
        out = self.session.run(names, feed)
        if "logits" in names:
            self.runs.append((int(feed.get(LOGITS_FROM, [0])[0]), feed["input_ids"].shape, out[0].shape))
        elif LOGITS_FROM in feed:
            self.runs.append((int(feed[LOGITS_FROM][0]), feed["input_ids"].shape, None))
        return out


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_head_run_only_where_answers_need_it_matches_lm_eval_hf_model(exported, hf_folder, tasks, kv_cache):
    """`eval --tasks` runs the LM head from the first position an answer needs (`passes.logits_from`): contexts
    that only fill the cache get no logits, and a batch's logits start at its earliest answer."""
    from layerdrop.api.evaluate import task_model
    from layerdrop.runtime.session import RunOptions

    folder = exported("llama", kv_cache)
    lm = task_model(folder, RunOptions(batch_size=4), progress=False)
    lm.session = _StartRecordingSession(lm.session)
    ours = _evaluate(lm, tasks)
    _compare(ours, _evaluate(_hf_model(_hf_reference(hf_folder), folder), tasks))
    started = [(start, ids, logits) for start, ids, logits in lm.session.runs if start > 0]
    assert started  # the head really ran on fewer positions
    for start, ids, logits in started:
        assert logits is None or logits[1] == ids[1] - start
    if kv_cache:  # the contexts run once to fill the cache, without logits
        assert any(logits is None and start == ids[1] for start, ids, logits in started)


def test_fused_group_query_attention_graph_matches_lm_eval_hf_model(exported, hf_folder, tasks, tmp_path):
    """GroupQueryAttention reads positions, not the mask, and takes padding on the right only: log-likelihoods come
    from right-padded batches and generation runs one prompt at a time, so the fused graph matches too."""
    from layerdrop.runtime.harness import LayerdropLM

    fused = tmp_path / "fused"
    api.fuse(exported("llama-h16", True), fused)
    graph = onnx.load(fused / "model.onnx", load_external_data=False).graph
    assert "GroupQueryAttention" in {n.op_type for n in graph.node}
    ours = _evaluate(LayerdropLM(path=str(fused), batch_size=4), tasks)
    reference = _evaluate(_hf_model(_hf_reference(hf_folder, "llama-h16"), fused), tasks)
    _compare(ours, reference)
    assert any(r[0] for r in _responses(ours, "ld_gen"))


def test_pruned_folder_matches_torch_with_modules_removed(exported, hf_folder, tasks, tmp_path):
    from layerdrop.runtime.harness import LayerdropLM

    targets = [("attn", 1), ("mlp", 2), ("block", 3)]
    pruned = tmp_path / "pruned"
    api.drop(exported("llama", True), pruned, targets=targets)
    ours = _evaluate(LayerdropLM(path=str(pruned), batch_size=3), tasks)
    reference = _evaluate(_hf_model(replaced(_hf_reference(hf_folder), targets), pruned), tasks)
    _compare(ours, reference)
    base = _evaluate(LayerdropLM(path=str(exported("llama", True))), tasks, names=("ld_mc",))
    assert not np.allclose(_loglikelihoods(base, "ld_mc"), _loglikelihoods(ours, "ld_mc"), atol=1e-3)


def test_maps_that_read_the_previous_token_match_lm_eval_hf_model(exported, hf_folder, tasks, tmp_path):
    """Log-likelihoods of a model whose fitted maps read the previous token (a context run into the cache, its
    one-token states carried to the choices) equal lm-eval's `hf` model with the same maps in PyTorch."""
    from layerdrop.model_folder import save
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.runtime.harness import LayerdropLM
    from layerdrop.search.fit import fit_attention
    from layerdrop.windows import Windows
    from tests.torch_reference import VOCAB, with_maps

    folder, model = api.open_model(exported("llama", True))
    windows = np.random.RandomState(3).randint(0, VOCAB, size=(4, 24))
    fit = fit_attention(model, folder.path, Windows(windows, {}), [1, 3], ridges=(1e-2,), previous=True)
    run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
    out = tmp_path / "fitted"
    save(model, out, source=folder)
    names = ("ld_mc", "ld_roll")  # lm-eval's hf model generates through its cache, which the PyTorch maps do not read
    ours = _evaluate(LayerdropLM(path=str(out), batch_size=3), tasks, names=names)
    reference = _evaluate(_hf_model(with_maps(_hf_reference(hf_folder), fit.maps), out), tasks, names=names)
    for task in names:
        a, b = _loglikelihoods(ours, task), _loglikelihoods(reference, task)
        assert a.shape == b.shape and a.size > 0
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=task)


def test_long_context_is_truncated_like_hf(exported, hf_folder, tasks):
    """Contexts longer than max_length keep their last tokens, as lm-eval's hf model does."""
    from layerdrop.runtime.harness import LayerdropLM

    folder = exported("llama", True)
    model = LayerdropLM(path=str(folder), max_length=24)
    assert max(len(model.tok_encode(r["question"] + c)) for r in MC for c in r["choices"]) > 25  # truncation happens
    ours = _evaluate(model, tasks, names=("ld_mc", "ld_roll"))
    reference = _evaluate(_hf_model(_hf_reference(hf_folder), folder, max_length=24), tasks, names=("ld_mc", "ld_roll"))
    for task in ("ld_mc", "ld_roll"):
        np.testing.assert_allclose(_loglikelihoods(ours, task), _loglikelihoods(reference, task), atol=1e-4)


def test_lm_eval_command_finds_the_layerdrop_model(exported, tasks, tmp_path):
    out = tmp_path / "results"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "layerdrop", "--model_args",
                           f"path={exported('llama', True)},provider=cpu", "--tasks", "ld_mc",
                           "--include_path", str(tasks), "--limit", "2", "--output_path", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ld_mc" in done.stdout and "acc" in done.stdout


def test_pth_hook_is_installed_and_quiet_where_layerdrop_cannot_be_imported(tmp_path):
    import ast
    import site

    setup = ast.parse((Path(__file__).parents[1] / "setup.py").read_text())
    line = next(node.value.value for node in setup.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LINE")
    installed = [Path(d) / "layerdrop-lm-eval.pth" for d in site.getsitepackages()]
    assert any(path.is_file() and path.read_text() == line for path in installed)
    # -S: no site-packages, so layerdrop is not importable (a moved or deleted editable checkout)
    done = subprocess.run([sys.executable, "-S", "-c", line], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""


def test_cli_eval_tasks_side_by_side(exported, tasks, tmp_path, capsys):
    pruned = tmp_path / "pruned"
    api.drop(exported("llama", True), pruned, targets=[("attn", 1)])
    report = tmp_path / "report.json"
    code = main(["eval", str(exported("llama", True)), "--vs", str(pruned), "--tasks", "ld_mc,ld_gen",
                 "--include-path", str(tasks), "--limit", "3", "--json", str(report), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "ld_mc" in out and "acc" in out and "±" in out and "difference" in out
    assert "ld_gen" in out and "generations" in out.lower()
    data = json.loads(report.read_text())
    rows = {(r["task"], r["metric"]): r for r in data["tasks"]}
    row = rows[("ld_mc", "acc")]
    assert row["difference"] == pytest.approx(row["scores"][1] - row["scores"][0])


def test_cli_eval_unknown_task_is_one_line(exported, tmp_path, capsys):
    code = main(["eval", str(exported("llama", True)), "--tasks", "no_such_task_xyz"])
    err = capsys.readouterr().err
    assert code == 2 and "no_such_task_xyz" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_adapter_follows_a_bos_tokenizer_like_lm_evals_hf(exported, hf_folder, tasks, bos_tokenizer_file, tmp_path):
    """With a tokenizer that puts a BOS first (Gemma's kind), the adapter encodes and conditions as `hf` does."""
    from layerdrop.runtime.harness import LayerdropLM
    from tests.torch_reference import VOCAB

    folder = tmp_path / "bos"
    shutil.copytree(exported("llama", True), folder)
    shutil.copy(bos_tokenizer_file, folder / "tokenizer.json")
    ours_model = LayerdropLM(path=str(folder), batch_size=3)
    assert ours_model.tok_encode("Anne")[0] == VOCAB - 1 and ours_model.prefix_token_id == VOCAB - 1
    reference_model = _hf_model(_hf_reference(hf_folder), folder)
    reference_model.tokenizer.bos_token = reference_model.tokenizer.convert_ids_to_tokens(VOCAB - 1)
    assert reference_model.tok_encode("Anne") == ours_model.tok_encode("Anne")
    _compare(_evaluate(ours_model, tasks), _evaluate(reference_model, tasks))


def test_plan_accuracy_column_matches_lm_eval_hf_model(exported, hf_folder, tmp_path):
    """`plan`'s accuracy column: the baseline's and the one-shot drop's accuracy on the plan's own items, and each
    item's outcome, equal lm-eval's `hf` model on the PyTorch model (the drop's with the same attention layers
    replaced by zero branches); the retained share is their ratio, and the difference and its paired standard error
    are those of the reference's outcomes (counted from the items the two get differently); a second held-out text
    gets its own perplexity column."""
    from layerdrop.api.reports import plan_table
    from layerdrop.runtime.tasks import choice_scores

    folder = exported("llama", True)
    texts = api.PlanTexts(samples=4, search_samples=2, eval_samples=2, seq_len=32, accuracy_items=40,
                          validation_items=0, also_eval=(Path("code"),))
    result = api.plan(folder, tmp_path / "plan", budget="attn=1", texts=texts, extra=1, moves="drop,bypass",
                      progress=False).to_dict()
    items = result["accuracy_task"]
    assert result["accuracy_items"] == 40 and len(items) == 40
    assert all(len(item["choices"]) == 4 and item["context"] for item in items)
    assert len({item["choices"][item["answer"]] for item in items}) > 30  # the true continuations differ
    torch_model = _hf_reference(hf_folder)
    base = choice_scores(_hf_model(torch_model, folder), items)
    assert result["baseline"]["accuracy"] == pytest.approx(base.accuracy)
    assert result["baseline"]["accuracy_correct"] == base.correct.tolist()
    assert np.mean(base.correct) == pytest.approx(base.accuracy)
    row = next(r for r in result["methods"] if r["method"].startswith("paper 1: one-shot"))
    targets = [("attn", layer) for layer in row["alphas"]]
    expected = choice_scores(_hf_model(replaced(torch_model, targets), folder), items)
    assert row["accuracy"] == pytest.approx(expected.accuracy)
    assert row["accuracy_correct"] == expected.correct.tolist()
    assert row["accuracy_retained"] == pytest.approx(100 * expected.accuracy / base.accuracy)
    gained = int(np.sum((expected.correct == 1) & (base.correct == 0)))
    lost = int(np.sum((expected.correct == 0) & (base.correct == 1)))
    assert gained + lost > 0  # the drop changes some answers, so the check below has something to check
    n = len(items)
    difference = (gained - lost) / n
    variance = (gained + lost - n * difference**2) / (n - 1)  # of the item-by-item differences, from the counts
    assert row["accuracy_difference"] == pytest.approx(100 * difference)
    assert row["accuracy_difference_se"] == pytest.approx(100 * np.sqrt(variance / n))
    assert set(row["also_eval_ppl"]) == {"code.txt"} and row["also_eval_ppl"]["code.txt"] > 1
    table = plan_table(result)
    assert "held-out ppl (code.txt)" in table and "accuracy, 40 items (retained)" in table
    assert f"{row['accuracy_difference']:+.1f} ± {row['accuracy_difference_se']:.1f}" in table


def test_paired_difference_of_outcomes():
    """The difference of two models' outcomes on the same items and its standard error: a hand count (3 items
    gained, 1 lost of 8: +0.25, and the differences' sample variance (4 - 8 * 0.25**2) / 7), and a refusal of
    outcomes that are not of the same items."""
    from layerdrop.runtime.tasks import paired_difference

    row = np.array([1, 1, 1, 0, 1, 0, 1, 0])
    base = np.array([0, 0, 0, 1, 1, 0, 1, 0])
    difference, error = paired_difference(row, base)
    assert difference == pytest.approx(0.25)
    assert error == pytest.approx(np.sqrt((4 - 8 * 0.25**2) / 7 / 8))
    assert paired_difference(base, base) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same items"):
        paired_difference(row, base[:-1])
