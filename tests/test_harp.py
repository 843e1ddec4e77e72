"""HARP bypass equals an independent PyTorch V·O implementation; greedy alpha search."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from layerdrop import api
from layerdrop.api import open_model
from layerdrop.cli import main
from layerdrop.runtime.generate import greedy_generate
from tests.conftest import ALL_FAMILIES
from tests.helpers import ort_logits, session
from tests.torch_reference import VOCAB, greedy, logits, replaced, tiny_model

TOL = 1e-4
ALPHAS = {3: 0.8, 2: 0.3, 1: 0.0}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_harp_matches_torch_vo_map(exported, family, tmp_path, rng):
    out = tmp_path / "harp"
    api.harp(exported(family, False), out, alphas=ALPHAS)
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    ids = rng.randint(0, VOCAB, size=(2, 12))
    reference = logits(replaced(tiny_model(family), [], ALPHAS), ids)
    np.testing.assert_allclose(ort_logits(out, ids), reference, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2", "gemma3", "qwen3"])
def test_harp_kv_graph_prefill_and_ten_decode_steps(exported, family, tmp_path, rng):
    out = tmp_path / "harp"
    result = api.harp(exported(family, True), out, alphas=ALPHAS)
    assert result["kv_layers"] == [0]
    prompt = rng.randint(0, VOCAB, size=(1, 6))
    tokens, step_logits = greedy_generate(session(out), prompt, 10)
    ref_tokens, ref_logits = greedy(replaced(tiny_model(family), [], ALPHAS), prompt, 10)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(step_logits), np.stack(ref_logits), atol=TOL, rtol=0)


def test_harp_folds_alpha_and_removes_qk(exported, tmp_path):
    out = tmp_path / "harp"
    api.harp(exported("llama", False), out, alphas={3: 0.5})
    proto = onnx.load(out / "model.onnx", load_external_data=False)
    assert sum(n.op_type == "Softmax" for n in proto.graph.node) == 3
    names = {t.name for t in proto.graph.initializer}
    assert any(n.startswith("layerdrop.harp.3.vo") for n in names)
    assert "layerdrop.harp.3.alpha" not in names, "alpha is folded into the V·O matrix"
    assert not any("layers.3.self_attn.q_proj" in n or "layers.3.self_attn.k_proj" in n for n in names)
    _, model = open_model(out)
    entry = json.loads(model.metadata_props["layerdrop.dropped"])[0]
    assert (entry["how"], entry["layer"], entry["alpha"]) == ("harp", 3, 0.5)


def test_gemma2_keeps_alpha_after_the_post_attention_norm(exported, tmp_path):
    out = tmp_path / "harp"
    api.harp(exported("gemma2", False), out, alphas={2: 0.5})
    proto = onnx.load(out / "model.onnx", load_external_data=False)
    assert "layerdrop.harp.2.alpha" in {t.name for t in proto.graph.initializer}


def test_every_alpha_the_search_tries_is_measured_like_torch(exported, tmp_path):
    """HARP's greedy search, top-down: each trial's perplexity (a gated suffix graph from cached hidden states)
    is PyTorch's for the model with the layers above at their chosen alphas and this layer at the trial's."""
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", True)
    out = tmp_path / "searched"
    result = api.harp(folder, out, top=2, search=True, samples=2, seq_len=32, progress=False)
    assert [t["layer"] for t in result["trials"]] == [3] * 11 + [2] * 11
    windows = api.windows_for(folder, None, role="search", samples=2, seq_len=32).ids
    for trial in result["trials"][::4]:
        above = {3: result["alphas"][3]} if trial["layer"] == 2 else {}
        reference = replaced(tiny_model("llama"), [("attn", k) for k, a in {**above, trial["layer"]: trial["alpha"]}
                                                   .items() if a == 0],
                             {k: a for k, a in {**above, trial["layer"]: trial["alpha"]}.items() if a > 0})
        assert trial["perplexity"] == pytest.approx(torch_perplexity(reference, windows), rel=1e-4), trial
    reference = replaced(tiny_model("llama"), [("attn", k) for k, a in result["alphas"].items() if a == 0],
                         {k: a for k, a in result["alphas"].items() if a > 0})
    ids = windows[:1]
    np.testing.assert_allclose(ort_logits(out, ids), logits(reference, ids), atol=TOL, rtol=0)


def test_harp_cli_explicit_and_errors(exported, tmp_path, capsys):
    src = str(exported("llama", False))
    assert main(["harp", src, "-o", str(tmp_path / "a"), "--alpha", "3=0.8,2=0.2"]) == 0
    assert "HARP alphas 3=0.8, 2=0.2" in capsys.readouterr().out
    for args, message in [(["--alpha", "3=1.5"], "outside [0, 1]"), (["--alpha", "3=x"], "not a number"),
                          (["--alpha", "7=0.5"], "no attention to bypass"), (["--top", "9"], "out of range"),
                          (["--search"], "either --alpha"), (["--alpha", "3=0.5,3=0.2"], "twice")]:
        assert main(["harp", src, "-o", str(tmp_path / "b"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)


def test_inspect_and_drop_after_harp_on_a_scored_folder(exported, tmp_path, capsys):
    """A scored folder keeps its scores through HARP; inspect lists the bypassed layer, and a later drop works."""
    scored = tmp_path / "scored"
    api.score(exported("llama", True), scored, samples=2, seq_len=16, progress=False)
    api.harp(scored, tmp_path / "harp", alphas={3: 0.5})
    report = api.inspect(tmp_path / "harp")
    assert [(r["kind"], r["layer"]) for r in report["regions"] if r["layer"] == 3][0] == ("harp", 3)
    assert main(["inspect", str(tmp_path / "harp")]) == 0
    assert "attn:3(alpha 0.5)" in capsys.readouterr().out
    api.drop(tmp_path / "harp", tmp_path / "then-drop", counts={"attn": 1})
    removed = api.inspect(tmp_path / "then-drop")["removed"]
    assert [(r["how"], r["layer"]) for r in removed][0] == ("harp", 3) and len(removed) == 2


def test_a_com_microsoft_attention_op_with_packed_weights_is_refused_in_one_line(tmp_path, capsys):
    """The com.microsoft Attention op holds q, k and v in one weight input of its own layout: HARP cannot take V
    out of it. One line, exit 2, nothing written, the input untouched (drops still work on such a graph)."""
    import hashlib

    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.RandomState(0)
    hidden, vocab = 16, 32

    def weight(name, *shape):
        return numpy_helper.from_array(rng.randn(*shape).astype(np.float32) * 0.1, name)

    nodes, weights, stream = [helper.make_node("Gather", ["embed", "input_ids"], ["h0"])], [], "h0"
    for layer in range(2):  # norm -> Attention -> Add, norm -> SiLU MLP -> Add
        n, a, m = f"attn_norm{layer}", f"mlp_norm{layer}", f"l{layer}"
        nodes += [helper.make_node("SimplifiedLayerNormalization", [stream, n], [f"{n}_out"], axis=-1, epsilon=1e-6),
                  helper.make_node("Attention", [f"{n}_out", f"{m}_qkv", f"{m}_qkv_bias"], [f"{m}_attn"],
                                   domain="com.microsoft", num_heads=2, unidirectional=1),
                  helper.make_node("Add", [stream, f"{m}_attn"], [f"{m}_mid"]),
                  helper.make_node("SimplifiedLayerNormalization", [f"{m}_mid", a], [f"{a}_out"], axis=-1,
                                   epsilon=1e-6),
                  helper.make_node("MatMul", [f"{a}_out", f"{m}_up"], [f"{m}_up_out"]),
                  helper.make_node("Sigmoid", [f"{m}_up_out"], [f"{m}_gate"]),
                  helper.make_node("Mul", [f"{m}_up_out", f"{m}_gate"], [f"{m}_silu"]),
                  helper.make_node("MatMul", [f"{m}_silu", f"{m}_down"], [f"{m}_mlp"]),
                  helper.make_node("Add", [f"{m}_mid", f"{m}_mlp"], [f"{m}_out"])]
        weights += [weight(n, hidden), weight(a, hidden), weight(f"{m}_qkv", hidden, 3 * hidden),
                    weight(f"{m}_qkv_bias", 3 * hidden), weight(f"{m}_up", hidden, 2 * hidden),
                    weight(f"{m}_down", 2 * hidden, hidden)]
        stream = f"{m}_out"
    nodes += [helper.make_node("SimplifiedLayerNormalization", [stream, "final_norm"], ["final"], axis=-1,
                               epsilon=1e-6),
              helper.make_node("MatMul", ["final", "lm_head"], ["logits"])]
    weights += [weight("embed", vocab, hidden), weight("final_norm", hidden), weight("lm_head", hidden, vocab)]
    graph = helper.make_graph(
        nodes, "attention-op", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", vocab])], weights)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    for key, value in (("layerdrop.num_attention_heads", "2"), ("layerdrop.num_kv_heads", "2"),
                       ("layerdrop.head_dim", "8"), ("layerdrop.num_layers", "2")):
        model.metadata_props.add(key=key, value=value)
    folder = tmp_path / "attention-op"
    folder.mkdir()
    onnx.save(model, folder / "model.onnx")
    before = hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(["harp", str(folder), "-o", str(tmp_path / "out"), "--alpha", "0=0.5"]) == 2
    err = capsys.readouterr().err
    assert "com.microsoft Attention op" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    assert hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest() == before
    assert main(["drop", str(folder), "-o", str(tmp_path / "dropped"), "--drop", "attn:0"]) == 0


def test_searches_sharing_a_cache_measure_a_move_set_once(exported, monkeypatch):
    """Two top-down searches that start at the same layer (HARP's and the score-selected one in `plan`) share
    their first sweep through the cache; what the second measures itself is still PyTorch's perplexity."""
    from layerdrop.search import alpha_search
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", False)
    _, model = open_model(folder)
    windows = api.windows_for(folder, None, role="search", samples=2, seq_len=32).ids
    measured = []
    original = alpha_search.GatedSuffix.perplexity
    monkeypatch.setattr(alpha_search.GatedSuffix, "perplexity", lambda self, moves, start=None, **kw:
                        measured.append(dict(moves)) or original(self, moves, start, **kw))
    cache: dict = {}
    first = alpha_search.greedy_alpha_search(model, folder, windows, [3, 2], progress=False, cache=cache)
    second = alpha_search.greedy_alpha_search(model, folder, windows, [3, 1], progress=False, cache=cache)
    assert len(measured) == 11 * 3, "layer 3's sweep is measured once for both searches"
    assert second.alphas[3] == first.alphas[3]
    assert second.trials[:11] == first.trials[:11]
    for trial in second.trials[11::5]:
        moves = {3: second.alphas[3], 1: trial["alpha"]}
        reference = replaced(tiny_model("llama"), [("attn", k) for k, a in moves.items() if a == 0],
                             {k: a for k, a in moves.items() if a > 0})
        assert trial["perplexity"] == pytest.approx(torch_perplexity(reference, windows), rel=1e-4), trial


def test_a_sweep_writes_the_layers_settled_above_into_its_graph(exported):
    """While a layer is swept, the layers settled above it are bypassed in the graph itself, not gated: none of
    their attention is computed (their perplexities are checked against PyTorch above)."""
    from layerdrop.search import alpha_search

    folder = exported("llama", False)
    _, model = open_model(folder)
    windows = api.windows_for(folder, None, role="search", samples=1, seq_len=16).ids
    suffix = alpha_search.GatedSuffix(model, folder, windows, [1, 2, 3])
    gated, settled = suffix._gated(1), suffix._gated(1, {3: 0.4, 2: 0.0})
    inputs = {v.name for v in settled.graph.inputs}
    assert "layerdrop_keep_1" in inputs and not inputs & {"layerdrop_keep_2", "layerdrop_keep_3"}
    def attention_ops(graph) -> int:
        return sum(n.op_type in ("Softmax", "Attention") for n in graph)

    assert attention_ops(settled.graph) == attention_ops(gated.graph) - 2
