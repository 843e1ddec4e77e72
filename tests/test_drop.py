"""Drops equal the PyTorch model with those modules replaced by identity; KV pruning; selection."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from layerdrop import api
from layerdrop.cli import main
from layerdrop.runtime.generate import greedy_generate
from tests.conftest import ALL_FAMILIES
from tests.helpers import ort_logits, session
from tests.torch_reference import VOCAB, greedy, logits, replaced, tiny_model

TOL = 1e-4
CASES = {
    "attn": [("attn", 0), ("attn", 2)],
    "mlp": [("mlp", 1), ("mlp", 3)],
    "block": [("block", 1)],
    "mixed": [("attn", 0), ("attn", 1), ("mlp", 1), ("block", 3)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_drop_matches_torch_with_identity_modules(exported, family, case, tmp_path, rng):
    out = tmp_path / "dropped"
    api.drop(exported(family, False), out, targets=CASES[case])
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    ids = rng.randint(0, VOCAB, size=(2, 13))
    reference = logits(replaced(tiny_model(family), CASES[case]), ids)
    np.testing.assert_allclose(ort_logits(out, ids), reference, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_kv_drop_prefill_and_ten_greedy_steps_equal_torch(exported, family, tmp_path, rng):
    targets = [("attn", 0), ("mlp", 2), ("attn", 3)]
    out = tmp_path / "dropped"
    result = api.drop(exported(family, True), out, targets=targets)
    assert result["kv_layers"] == [1, 2]
    sess = session(out)
    assert [i.name for i in sess.get_inputs()][3:] == [f"past_key_values.{i}.{p}" for i in (0, 1)
                                                       for p in ("key", "value")]
    assert [o.name for o in sess.get_outputs()] == ["logits"] + [f"present.{i}.{p}" for i in (0, 1)
                                                                 for p in ("key", "value")]
    prompt = rng.randint(0, VOCAB, size=(1, 7))
    tokens, step_logits = greedy_generate(sess, prompt, 10)
    ref_tokens, ref_logits = greedy(replaced(tiny_model(family), targets), prompt, 10)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(step_logits), np.stack(ref_logits), atol=TOL, rtol=0)


def test_kv_bytes_shrink_to_the_kept_fraction_and_weights_leave_the_data_file(exported, tmp_path):
    src = exported("llama", True)
    out = tmp_path / "dropped"
    api.drop(src, out, targets=[("attn", 1), ("attn", 2), ("attn", 3)])
    before, after = api.inspect(src), api.inspect(out)
    assert after["kv_bytes_per_token"] * 4 == before["kv_bytes_per_token"] * 1
    assert before["kv_bytes_per_token"] == 4 * 2 * (2 * 8 * 4)  # layers x (k, v) x heads*head_dim*float32
    assert (out / "model.onnx.data").stat().st_size < (src / "model.onnx.data").stat().st_size
    proto = onnx.load(out / "model.onnx", load_external_data=False)
    used = {i for n in proto.graph.node for i in n.input}
    assert all(t.name in used for t in proto.graph.initializer)
    assert not any("self_attn.q_proj" in t.name and ".1." in t.name for t in proto.graph.initializer)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["layerdrop.kv_layers"]) == [0]


def test_second_drop_keeps_original_layer_numbers(exported, tmp_path, rng):
    first, second = tmp_path / "a", tmp_path / "b"
    api.drop(exported("mistral", True), first, targets=[("attn", 1)])
    result = api.drop(first, second, targets=[("attn", 2)])
    assert result["kv_layers"] == [0, 3]
    assert [(e["kind"], e["layer"]) for e in result["dropped"]] == [("attn", 1), ("attn", 2)]
    prompt = rng.randint(0, VOCAB, size=(1, 5))
    tokens, _ = greedy_generate(session(second), prompt, 6)
    assert tokens == greedy(replaced(tiny_model("mistral"), [("attn", 1), ("attn", 2)]), prompt, 6)[0]


@pytest.fixture(scope="module")
def scored_llama(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("scored") / "model"
    report = api.score(exported("llama", True), out, samples=4, seq_len=32, progress=False)
    return out, report["regions"]


@pytest.mark.parametrize("flag,kinds,count", [("attn", ("attn",), 2), ("mlp", ("mlp",), 1),
                                               ("block", ("block",), 1), ("joint", ("attn", "mlp"), 3)])
def test_score_based_selection_takes_the_lowest_scores(scored_llama, tmp_path, flag, kinds, count):
    folder, rows = scored_llama
    result = api.drop(folder, tmp_path / "out", counts={flag: count})
    pool = sorted((r for r in rows if r["kind"] in kinds), key=lambda r: r["score"])[:count]
    expected = {(k, r["layer"]) for r in pool for k in (("attn", "mlp") if r["kind"] == "block" else (r["kind"],))}
    assert {(e["kind"], e["layer"]) for e in result["dropped"]} == expected
    assert all(e["score"] is not None for e in result["dropped"] if flag != "block")


def test_joint_drop_is_not_the_sum_of_a_blocks_scores(scored_llama, tmp_path):
    folder, rows = scored_llama
    result = api.drop(folder, tmp_path / "out", counts={"joint": 4})
    lowest = sorted((r for r in rows if r["kind"] != "block"), key=lambda r: r["score"])[:4]
    assert sorted((e["kind"], e["layer"]) for e in result["dropped"]) == sorted((r["kind"], r["layer"]) for r in lowest)


def test_iterative_drop_rescores_the_pruned_graph(scored_llama, tmp_path, rng):
    folder, rows = scored_llama
    result = api.drop(folder, tmp_path / "out", counts={"attn": 2}, iterative=True, samples=4, seq_len=32,
                      progress=False)
    dropped = [(e["kind"], e["layer"]) for e in result["dropped"]]
    first = min((r for r in rows if r["kind"] == "attn"), key=lambda r: r["score"])
    assert dropped[0] == ("attn", first["layer"]) and len(set(dropped)) == 2
    assert all("iterative" in e["reason"] for e in result["dropped"])
    ids = rng.randint(0, VOCAB, size=(1, 9))
    np.testing.assert_allclose(ort_logits(tmp_path / "out", ids),
                               logits(replaced(tiny_model("llama"), dropped), ids), atol=TOL, rtol=0)


def test_score_based_drop_on_unscored_model_says_run_score_first(exported, tmp_path, capsys):
    assert main(["drop", str(exported("llama", False)), "-o", str(tmp_path / "o"), "--attn", "2"]) == 2
    err = capsys.readouterr().err
    assert "run `layerdrop score`" in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("args,message", [
    (["--drop", "attn:9"], "no attn module in layer 9"),
    (["--drop", "attn:1", "--drop", "block:1"], "names a module twice"),
    (["--drop", "attn:1", "--attn", "2"], "either --drop"),
    (["--joint", "2", "--attn", "1"], "do not combine"),
    (["--attn", "0"], "at least 1"),
    (["--drop", "head:1"], "KIND one of attn, mlp, block"),
])
def test_bad_selection_is_one_clear_line(exported, tmp_path, capsys, args, message):
    code = main(["drop", str(exported("llama", False)), "-o", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_drop_cli_reports_and_writes_json(scored_llama, tmp_path, capsys):
    folder, _ = scored_llama
    assert main(["drop", str(folder), "-o", str(tmp_path / "o"), "--attn", "1", "--json",
                 str(tmp_path / "d.json")]) == 0
    assert "dropped attn:" in capsys.readouterr().out
    assert json.loads((tmp_path / "d.json").read_text())["dropped"][0]["reason"] == "attn-1 one-shot"


def test_fused_drop_still_matches_torch(exported, tmp_path, rng, capsys):
    out = tmp_path / "fused"
    assert main(["drop", str(exported("llama", True)), "-o", str(out), "--drop", "attn:1", "--fuse"]) == 0
    assert "ONNX Runtime fusions:" in capsys.readouterr().out
    proto = onnx.load(out / "model.onnx", load_external_data=False)
    fusions = json.loads({p.key: p.value for p in proto.metadata_props}["layerdrop.ort_fusions"])
    assert fusions, "at least one ORT fusion applies to a Llama graph"
    assert any(n.domain == "com.microsoft" for n in proto.graph.node)
    ids = rng.randint(0, VOCAB, size=(1, 9))
    np.testing.assert_allclose(ort_logits(out, ids), logits(replaced(tiny_model("llama"), [("attn", 1)]), ids),
                               atol=TOL, rtol=0)
