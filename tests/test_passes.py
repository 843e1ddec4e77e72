"""Each pass on a small hand-built decoder graph, the way onnx-ir tests its own passes: the graph is two layers
of (Mul-norm, single-head attention over a KV cache, MLP), and the reference is the same function in numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxscript.rewriter import RewritePass

from layerdrop.errors import LayerdropError
from layerdrop.formats import DROPPED_KEY, HEAD_DIM_KEY, HEADS_KEY, KV_HEADS_KEY, KV_LAYERS_KEY, REGION_KEY
from layerdrop.passes.attach_scores import AttachScoresPass, read_scores
from layerdrop.passes.calibration_taps import calibration_model
from layerdrop.passes.cleanup import cleanup_passes, run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import FindResidualsPass
from layerdrop.passes.fold_alpha import fold_alpha_rules
from layerdrop.passes.gated_search import GatedBypassPass, move_feeds
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, suffix_to_logits
from layerdrop.passes.harp_bypass import HarpBypassPass
from layerdrop.passes.metadata import read_json
from layerdrop.passes.prune_kv_cache import PruneKvCachePass
from layerdrop.runtime.scoring import ModuleScore

D = 4
LAYERS = 2
WEIGHTS = np.random.RandomState(7)
W = {f"{name}{i}": WEIGHTS.randn(D, D).astype(np.float32) * 0.5 for i in range(LAYERS)
     for name in ("q", "k", "v", "o", "u", "d")}
W.update({f"g{i}": (1 + 0.2 * WEIGHTS.randn(D)).astype(np.float32) for i in range(LAYERS)})
W.update({f"m{i}": (1 + 0.2 * WEIGHTS.randn(D)).astype(np.float32) for i in range(LAYERS)})
W["lm"] = WEIGHTS.randn(D, 6).astype(np.float32)


def decoder_graph() -> ir.Model:
    """x [T, 4] and a KV cache per layer -> logits [T, 6] and the new cache."""
    nodes, inputs, outputs = [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D])], []
    stream = "x"
    for i in range(LAYERS):
        for part in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", TensorProto.FLOAT, ["P", D]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{part}", TensorProto.FLOAT, None))
        p = f"l{i}"
        nodes += [
            helper.make_node("Mul", [stream, f"g{i}"], [f"{p}.n"]),
            *[helper.make_node("MatMul", [f"{p}.n", f"{w}{i}"], [f"{p}.{w}"]) for w in "qkv"],
            helper.make_node("Concat", [f"past_key_values.{i}.key", f"{p}.k"], [f"present.{i}.key"], axis=0),
            helper.make_node("Concat", [f"past_key_values.{i}.value", f"{p}.v"], [f"present.{i}.value"], axis=0),
            helper.make_node("Transpose", [f"present.{i}.key"], [f"{p}.kt"], perm=[1, 0]),
            helper.make_node("MatMul", [f"{p}.q", f"{p}.kt"], [f"{p}.s"]),
            helper.make_node("Softmax", [f"{p}.s"], [f"{p}.p"], axis=-1),
            helper.make_node("MatMul", [f"{p}.p", f"present.{i}.value"], [f"{p}.a"]),
            helper.make_node("MatMul", [f"{p}.a", f"o{i}"], [f"{p}.o"]),
            helper.make_node("Add", [stream, f"{p}.o"], [f"{p}.h"]),
            helper.make_node("Mul", [f"{p}.h", f"m{i}"], [f"{p}.mn"]),
            helper.make_node("MatMul", [f"{p}.mn", f"u{i}"], [f"{p}.u"]),
            helper.make_node("Relu", [f"{p}.u"], [f"{p}.r"]),
            helper.make_node("MatMul", [f"{p}.r", f"d{i}"], [f"{p}.dn"]),
            helper.make_node("Add", [f"{p}.h", f"{p}.dn"], [f"{p}.y"]),
        ]
        stream = f"{p}.y"
    nodes.append(helper.make_node("MatMul", [stream, "lm"], ["logits"]))
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 6]))
    initializers = [onnx.numpy_helper.from_array(array, name) for name, array in W.items()]
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.serde.deserialize_model(proto)
    model.metadata_props.update({HEADS_KEY: "1", KV_HEADS_KEY: "1", HEAD_DIM_KEY: str(D)})
    return model


def _reference(x, past, drop=(), alphas=None, shifts=None):
    """numpy: logits and each layer's input; `drop` as (kind, layer), `alphas` layer -> HARP alpha."""
    alphas, shifts = alphas or {}, shifts or {}
    entering = []
    for i in range(LAYERS):
        entering.append(x)
        n = x * W[f"g{i}"]
        if ("attn", i) in drop:
            o = 0.0
        elif i in alphas:  # every token attends only to itself: (n W_v) W_o, scaled
            o = alphas[i] * (n @ W[f"v{i}"] @ W[f"o{i}"]) + shifts.get(i, 0.0)
        else:
            k = np.concatenate([past[i][0], n @ W[f"k{i}"]])
            v = np.concatenate([past[i][1], n @ W[f"v{i}"]])
            s = (n @ W[f"q{i}"]) @ k.T
            p = np.exp(s - s.max(-1, keepdims=True))
            o = (p / p.sum(-1, keepdims=True)) @ v @ W[f"o{i}"]
        h = x + o
        x = h if ("mlp", i) in drop else h + np.maximum((h * W[f"m{i}"]) @ W[f"u{i}"], 0) @ W[f"d{i}"]
    return x @ W["lm"], entering


def _run(model: ir.Model, feeds: dict) -> dict:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


@pytest.fixture
def data(rng):
    x = rng.randn(5, D).astype(np.float32)
    past = [(rng.randn(3, D).astype(np.float32), rng.randn(3, D).astype(np.float32)) for _ in range(LAYERS)]
    feeds = {"x": x, **{f"past_key_values.{i}.{part}": past[i][j] for i in range(LAYERS)
                        for j, part in enumerate(("key", "value"))}}
    return x, past, feeds


def _annotated() -> ir.Model:
    model = decoder_graph()
    run_passes(model, [FindResidualsPass()])
    return model


def test_find_residuals_annotates_once_and_then_reports_no_change():
    model = decoder_graph()
    first = FindResidualsPass()(model)
    annotated = [read_json(n.metadata_props, REGION_KEY, {}) for n in model.graph if REGION_KEY in n.metadata_props]
    assert first.modified and [(a["kind"], a["layer"], a["kv_inputs"]) for a in annotated] == [
        ("attn", 0, ["past_key_values.0.key", "past_key_values.0.value"]), ("mlp", 0, []),
        ("attn", 1, ["past_key_values.1.key", "past_key_values.1.value"]), ("mlp", 1, [])]
    assert not FindResidualsPass()(model).modified


def test_rewrite_passes_refuse_a_model_without_annotations():
    for rewrite in (DropBranchesPass([("attn", 0)]), HarpBypassPass({1: 0.5}), GatedBypassPass([1])):
        with pytest.raises(LayerdropError, match="run FindResidualsPass"):
            run_passes(decoder_graph(), [rewrite])


def test_drop_branches_rewires_and_cleanup_removes_the_branch(data):
    x, past, feeds = data
    model = _annotated()
    run_passes(model, [DropBranchesPass([("attn", 0), ("mlp", 1)], reason="test"), *cleanup_passes()])
    left = {out.name for node in model.graph for out in node.outputs}
    assert not left & {"l0.s", "l0.p", "l0.a", "l0.o", "l0.h", "l1.mn", "l1.u", "l1.r", "l1.dn", "l1.y"}
    assert {"l0.k", "present.0.key"} <= left, "the cache outputs stay until PruneKvCachePass removes them"
    expected, _ = _reference(x, past, drop={("attn", 0), ("mlp", 1)})
    np.testing.assert_allclose(_run(model, feeds)["logits"], expected, atol=1e-5)
    assert [(e["kind"], e["layer"], e["reason"]) for e in read_json(model.metadata_props, DROPPED_KEY, [])] == [
        ("attn", 0, "test"), ("mlp", 1, "test")]


def test_prune_kv_cache_removes_the_dropped_layers_cache_and_renumbers(data):
    x, past, feeds = data
    model = _annotated()
    run_passes(model, [DropBranchesPass([("attn", 0)]), PruneKvCachePass(), *cleanup_passes()])
    assert [v.name for v in model.graph.inputs] == ["x", "past_key_values.0.key", "past_key_values.0.value"]
    assert [v.name for v in model.graph.outputs] == ["logits", "present.0.key", "present.0.value"]
    assert read_json(model.metadata_props, KV_LAYERS_KEY, None) == [1]
    renamed = {"x": x, "past_key_values.0.key": past[1][0], "past_key_values.0.value": past[1][1]}
    out = _run(model, renamed)
    np.testing.assert_allclose(out["logits"], _reference(x, past, drop={("attn", 0)})[0], atol=1e-5)
    np.testing.assert_allclose(out["present.0.key"][3:], _reference(x, past, drop={("attn", 0)})[1][1] * W["g1"]
                               @ W["k1"], atol=1e-5)
    assert not PruneKvCachePass()(model).modified


def test_harp_bypass_is_the_scaled_vo_map_with_alpha_folded_in(data):
    x, past, feeds = data
    model = _annotated()
    run_passes(model, [HarpBypassPass({1: 0.5}), RewritePass(fold_alpha_rules()), PruneKvCachePass(),
                       *cleanup_passes()])
    np.testing.assert_allclose(_run(model, feeds)["logits"], _reference(x, past, alphas={1: 0.5})[0], atol=1e-5)
    folded = model.graph.initializers["layerdrop.harp.1.vo_scaled"].const_value.numpy()
    np.testing.assert_allclose(folded, 0.5 * W["v1"] @ W["o1"], rtol=1e-6)
    assert [n.op_type for n in model.graph].count("Softmax") == 1
    assert [v.name for v in model.graph.inputs] == ["x", "past_key_values.0.key", "past_key_values.0.value"]


def test_harp_bypass_with_the_mean_shift_adds_the_constant(data):
    x, past, feeds = data
    model = _annotated()
    m_b, m_p = np.arange(D, dtype=np.float64), np.ones(D)
    run_passes(model, [HarpBypassPass({0: 0.3, 1: 0.0}, means={0: (m_b, m_p), 1: (m_b, m_p)}), *cleanup_passes()])
    shifts = {0: m_b - 0.3 * m_p, 1: m_b}  # alpha 0 leaves the branch's mean alone
    expected = _reference(x, past, alphas={0: 0.3, 1: 0.0}, shifts=shifts)[0]
    np.testing.assert_allclose(_run(model, feeds)["logits"], expected, atol=1e-5)


@pytest.mark.parametrize("moves", [{}, {0: 0.3}, {1: 0.0}, {0: 1.0, 1: 0.7}])
def test_one_gated_graph_computes_every_move_set(data, moves):
    x, past, feeds = data
    model = _annotated()
    run_passes(model, [GatedBypassPass([0, 1])])
    got = _run(model, {**feeds, **move_feeds([0, 1], moves)})["logits"]
    np.testing.assert_allclose(got, _reference(x, past, alphas=moves)[0], atol=1e-5)


def test_calibration_taps_are_the_norms_and_dot_products_of_each_region(data):
    x, past, feeds = data
    calib, rows = calibration_model(_annotated())
    out = _run(calib, feeds)
    stream = [x]
    model_x = x
    for i in range(LAYERS):  # every value on the residual stream: layer input, after attention, after MLP
        n = model_x * W[f"g{i}"]
        k = np.concatenate([past[i][0], n @ W[f"k{i}"]])
        v = np.concatenate([past[i][1], n @ W[f"v{i}"]])
        s = (n @ W[f"q{i}"]) @ k.T
        p = np.exp(s - s.max(-1, keepdims=True))
        h = model_x + (p / p.sum(-1, keepdims=True)) @ v @ W[f"o{i}"]
        model_x = h + np.maximum((h * W[f"m{i}"]) @ W[f"u{i}"], 0) @ W[f"d{i}"]
        stream += [h, model_x]
    spans = {("attn", 0): (0, 1), ("mlp", 0): (1, 2), ("attn", 1): (2, 3), ("mlp", 1): (3, 4),
             ("block", 0): (0, 2), ("block", 1): (2, 4)}
    assert {(kind, layer) for kind, layer, *_ in rows} == set(spans)
    for kind, layer, x_norm2, y_norm2, dot in rows:
        a, b = (stream[i].astype(np.float64) for i in spans[(kind, layer)])
        np.testing.assert_allclose(out[x_norm2], (a * a).sum(-1), rtol=1e-5)
        np.testing.assert_allclose(out[y_norm2], (b * b).sum(-1), rtol=1e-5)
        np.testing.assert_allclose(out[dot], (a * b).sum(-1), rtol=1e-5)
    assert "lm" not in calib.graph.initializers, "nothing after the last region is computed"


def test_a_suffix_from_a_hidden_state_computes_the_rest_of_the_model(data):
    x, past, feeds = data
    model = _annotated()
    expected, entering = _reference(x, past)
    suffix = suffix_to_logits(model, "l0.y")
    assert [v.name for v in suffix.graph.inputs] == [HIDDEN_INPUT, "past_key_values.1.key", "past_key_values.1.value"]
    got = _run(suffix, {**feeds, HIDDEN_INPUT: entering[1]})["logits"]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert len(model.graph.outputs) == 5, "the model it was cut from is unchanged"


def test_attach_scores_writes_metadata_only():
    model = _annotated()
    before = onnx.printer.to_text(ir.serde.serialize_model(model).graph)
    scores = [ModuleScore(0, "attn", 0.25, 1.5), ModuleScore(1, "mlp", 0.5, 2.0), ModuleScore(1, "block", 0.75, 3.0)]
    run_passes(model, [AttachScoresPass(scores, {"file": "t.txt"})])
    assert read_scores(model) == [{"layer": 0, "kind": "attn", "score": 0.25, "norm_ratio": 1.5},
                                  {"layer": 1, "kind": "mlp", "score": 0.5, "norm_ratio": 2.0},
                                  {"layer": 1, "kind": "block", "score": 0.75, "norm_ratio": 3.0}]
    assert onnx.printer.to_text(ir.serde.serialize_model(model).graph) == before
