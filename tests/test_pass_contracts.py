"""Every pass keeps the onnx-ir pass contract on a small hand-built graph: where there is nothing to do it reports
`modified is False` and leaves the graph as it was; where it does work it reports `modified is True`; on an input
it must refuse it raises LayerdropError."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter import RewritePass

from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import AttachScoresPass
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import FindResidualsPass
from layerdrop.passes.fit_attention import FitAttentionPass
from layerdrop.passes.fold_alpha import fold_alpha_rules, fold_chain_rules
from layerdrop.passes.gated_search import GatedBypassPass, GatedFitPass, GatedMixedPass
from layerdrop.passes.group_query_attention import rope_frequency_rules
from layerdrop.passes.harp_bypass import HarpBypassPass
from layerdrop.passes.ort_fusions import OrtFusionPass
from layerdrop.passes.prune_kv_cache import PruneKvCachePass
from layerdrop.passes.quantize_int4 import QuantizeInt4Pass
from layerdrop.passes.replace_blocks import ReplaceBlocksPass
from layerdrop.passes.token_logprobs import TokenLogprobsPass
from layerdrop.passes.unfuse_skip_norm import UnfuseSkipNormPass
from layerdrop.runtime.scoring import ModuleScore
from tests.test_passes import D, decoder_graph

MAP = (np.eye(D, dtype=np.float32), np.zeros(D, dtype=np.float32))


def _graph_bytes(model: ir.Model) -> bytes:
    """The graph (nodes, their metadata, initializers, inputs and outputs) as serialized bytes."""
    return ir.serde.serialize_model(model).graph.SerializeToString()


def _annotated() -> ir.Model:
    return run_passes(decoder_graph(), [FindResidualsPass()])


def _dropped_then(*targets) -> ir.Model:
    """The annotated decoder with `targets` dropped (the branches still in the graph: no cleanup ran)."""
    return run_passes(_annotated(), [DropBranchesPass(list(targets))])


def _with_logprobs() -> ir.Model:
    return run_passes(decoder_graph(), [TokenLogprobsPass()])


def _scored() -> ir.Model:
    return run_passes(_annotated(), [AttachScoresPass([ModuleScore(0, "attn", 0.25, 1.5)], {"file": "t.txt"})])


def _proto_model(nodes, inputs, outputs, initializers=(), opset: int = 18, microsoft: bool = False) -> ir.Model:
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if microsoft else [])
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=opsets))


def _tensor(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _no_residuals() -> ir.Model:
    """x -> Relu -> logits: nothing a decoder pass can work on. The node is named, as exporters name every node
    (onnxscript's optimizer names an unnamed one)."""
    return _proto_model([helper.make_node("Relu", ["x"], ["logits"], name="relu")], [_tensor("x", [2, D])],
                        [_tensor("logits", [2, D])])


def _skip_norm(stats_used: bool = False) -> ir.Model:
    """A com.microsoft SkipSimplifiedLayerNormalization (its mean output a graph output with `stats_used`)."""
    gamma = numpy_helper.from_array(np.ones(D, np.float32), "gamma")
    outputs = ["y", "mean" if stats_used else ""]
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["a", "b", "gamma"], outputs, domain="com.microsoft",
                            epsilon=1e-5, name="fused")
    graph_outputs = [_tensor("y", [2, D])] + ([_tensor("mean", None)] if stats_used else [])
    return _proto_model([node], [_tensor("a", [2, D]), _tensor("b", [2, D])], graph_outputs, [gamma],
                        opset=17, microsoft=True)


def _matmul(k: int, n: int) -> ir.Model:
    """x [2, k] @ W [k, n] with a constant W."""
    weight = numpy_helper.from_array(np.random.RandomState(0).randn(k, n).astype(np.float32), "w")
    return _proto_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_tensor("x", [2, k])],
                        [_tensor("y", [2, n])], [weight])


def _scaled_matmul(weight_is_input: bool = False) -> ir.Model:
    """Mul(MatMul(x, W), c) with a constant scalar c; W an initializer, or also a graph input (overridable)."""
    weight = numpy_helper.from_array(np.random.RandomState(0).randn(D, D).astype(np.float32), "w")
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "c")
    inputs = [_tensor("x", [2, D])] + ([_tensor("w", [D, D])] if weight_is_input else [])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Mul", ["p", "c"], ["y"])]
    return _proto_model(nodes, inputs, [_tensor("y", [2, D])], [weight, scale])


def _chained_matmul() -> ir.Model:
    """MatMul(MatMul(x, W), T) with constant W and T."""
    rng = np.random.RandomState(0)
    weights = [numpy_helper.from_array(rng.randn(D, D).astype(np.float32), name) for name in ("w", "t")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("MatMul", ["p", "t"], ["y"])]
    return _proto_model(nodes, [_tensor("x", [2, D])], [_tensor("y", [2, D])], weights)


def _rope_angles() -> ir.Model:
    """position_ids [B, S] -> Unsqueeze(-1) -> Cast -> Mul inv_freq [E], the angles as recent transformers write
    them."""
    inv_freq = numpy_helper.from_array((1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32), "inv_freq")
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "axes"], ["u"]),
             helper.make_node("Cast", ["u"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "inv_freq"], ["angles"])]
    ids = helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"])
    return _proto_model(nodes, [ids], [_tensor("angles", ["B", "S", 4])], [inv_freq, axes])


def _rules(rules) -> Callable[[], ir.passes.PassBase]:
    return lambda: RewritePass(rules)


# (name, the pass, a model it has nothing to do on, a model it rewrites)
CASES = [
    ("find residuals", FindResidualsPass, _annotated, decoder_graph),
    ("attach scores", lambda: AttachScoresPass([ModuleScore(0, "attn", 0.25, 1.5)], {"file": "t.txt"}),
     _scored, _annotated),
    ("drop branches", lambda: DropBranchesPass([("attn", 0)]), None, _annotated),
    ("drop nothing", lambda: DropBranchesPass([]), _annotated, None),
    ("harp bypass", lambda: HarpBypassPass({1: 0.5}), None, _annotated),
    ("harp bypass of no layer", lambda: HarpBypassPass({}), _annotated, None),
    ("fit attention", lambda: FitAttentionPass({0: MAP}), None, _annotated),
    ("fit no layer", lambda: FitAttentionPass({}), _annotated, None),
    ("replace blocks", lambda: ReplaceBlocksPass(0, 1, np.eye(D)), None, _annotated),
    ("replace no block", lambda: ReplaceBlocksPass(0, 0, np.eye(D)), _annotated, None),
    ("gated bypass", lambda: GatedBypassPass([1]), None, _annotated),
    ("gated bypass of no layer", lambda: GatedBypassPass([]), _annotated, None),
    ("gated fit", lambda: GatedFitPass({0: MAP}), None, _annotated),
    ("gated fit of no layer", lambda: GatedFitPass({}), _annotated, None),
    ("gated mix", lambda: GatedMixedPass({1: MAP}), None, _annotated),
    ("gated mix of no layer", lambda: GatedMixedPass({}), _annotated, None),
    ("prune kv cache", PruneKvCachePass, _annotated, lambda: _dropped_then(("attn", 0))),
    ("token logprobs", TokenLogprobsPass, _with_logprobs, decoder_graph),
    ("unfuse skip norm", UnfuseSkipNormPass, decoder_graph, _skip_norm),
    ("quantize int4", lambda: QuantizeInt4Pass(block_size=16), _no_residuals, lambda: _matmul(32, 8)),
    ("ort fusions", OrtFusionPass, _no_residuals, None),
    ("fold alpha", _rules(fold_alpha_rules()), _chained_matmul, _scaled_matmul),
    ("fold chain", _rules(fold_chain_rules()), _scaled_matmul, _chained_matmul),
    ("rope frequencies", _rules(rope_frequency_rules()), _scaled_matmul, _rope_angles),
]


@pytest.mark.parametrize("make_pass, make_model", [(c[1], c[2]) for c in CASES if c[2]],
                         ids=[c[0] for c in CASES if c[2]])
def test_a_pass_with_nothing_to_do_reports_no_change_and_leaves_the_graph_equal(make_pass, make_model):
    model = make_model()
    before = _graph_bytes(model)
    result = make_pass()(model)
    assert result.modified is False
    assert _graph_bytes(result.model) == before


@pytest.mark.parametrize("make_pass, make_model", [(c[1], c[3]) for c in CASES if c[3]],
                         ids=[c[0] for c in CASES if c[3]])
def test_a_pass_that_rewrites_reports_the_change(make_pass, make_model):
    model = make_model()
    before = _graph_bytes(model)
    result = make_pass()(model)
    assert result.modified is True
    assert _graph_bytes(result.model) != before


# (name, the pass, a model it must refuse)
REFUSALS = [
    ("find residuals: no residual stream", FindResidualsPass, _no_residuals),
    ("attach scores: no annotations", lambda: AttachScoresPass([], {}), decoder_graph),
    ("drop branches: no such layer", lambda: DropBranchesPass([("attn", 5)]), _annotated),
    ("drop branches: a module named twice", lambda: DropBranchesPass([("attn", 0), ("block", 0)]), _annotated),
    ("drop branches: no annotations", lambda: DropBranchesPass([("attn", 0)]), decoder_graph),
    ("harp bypass: no such layer", lambda: HarpBypassPass({5: 0.5}), _annotated),
    ("fit attention: no such layer", lambda: FitAttentionPass({5: MAP}), _annotated),
    ("replace blocks: no block to carry the transform", lambda: ReplaceBlocksPass(5, 1, np.eye(D)), _annotated),
    ("replace blocks: the run passes the last block", lambda: ReplaceBlocksPass(0, 3, np.eye(D)), _annotated),
    ("gated bypass: no such layer", lambda: GatedBypassPass([5]), _annotated),
    ("gated fit: no such layer", lambda: GatedFitPass({5: MAP}), _annotated),
    ("gated mix: no such layer", lambda: GatedMixedPass({5: MAP}), _annotated),
    ("token logprobs: no logits output", TokenLogprobsPass, lambda: _proto_model(
        [helper.make_node("Relu", ["x"], ["y"])], [_tensor("x", [2, D])], [_tensor("y", [2, D])])),
    ("token logprobs: opset older than 13", TokenLogprobsPass, lambda: _proto_model(
        [helper.make_node("Relu", ["x"], ["logits"])], [_tensor("x", [2, D])], [_tensor("logits", [2, D])],
        opset=12)),
    ("unfuse skip norm: a training statistic is read", UnfuseSkipNormPass, lambda: _skip_norm(stats_used=True)),
]


@pytest.mark.parametrize("make_pass, make_model", [(r[1], r[2]) for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_pass_refuses_what_it_cannot_rewrite_and_leaves_the_graph_equal(make_pass, make_model):
    model = make_model()
    before = _graph_bytes(model)
    with pytest.raises(LayerdropError):
        make_pass()(model)
    assert _graph_bytes(model) == before


def test_prune_kv_cache_refuses_to_remove_every_layers_cache_that_is_still_read():
    with pytest.raises(LayerdropError):
        PruneKvCachePass()(_dropped_then(("attn", 0), ("attn", 1)))


def test_a_rule_leaves_an_initializer_that_is_also_a_graph_input_alone():
    """A caller may feed another value for such an initializer, so folding it into a constant would change what
    the model computes."""
    model = _scaled_matmul(weight_is_input=True)
    before = _graph_bytes(model)
    assert RewritePass(fold_alpha_rules())(model).modified is False
    assert _graph_bytes(model) == before
