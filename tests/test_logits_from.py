"""The LM head's start position (`LogitsFromPass`) on small hand-built graphs, against numpy."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerdrop.formats import LOGITS_FROM
from layerdrop.passes.logits_from import LogitsFromPass, with_logits_from
from layerdrop.passes.token_logprobs import with_token_logprobs

VOCAB, D, CAP = 11, 5, 3.0
RNG = np.random.default_rng(5)
EMBED = RNG.standard_normal((VOCAB, D)).astype(np.float32)
HEAD = (3 * RNG.standard_normal((D, VOCAB))).astype(np.float32)
BIAS = RNG.standard_normal(VOCAB).astype(np.float32)


def _model(after_head: str = "softcap", logits_shape=("batch", "seq", VOCAB)) -> ir.Model:
    """input_ids -> embedding -> RMS-free norm stand-in (Mul) -> LM head -> what `after_head` says -> logits.

    after_head: "softcap" (Gemma's cap / tanh / cap), "bias" (a per-word bias, then a cast to float16), or
    "softmax" (an op the pass does not look through).
    """
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["hidden"]),
             helper.make_node("Mul", ["hidden", "two"], ["normed"]),
             helper.make_node("MatMul", ["normed", "head"], ["scores"])]
    kind = TensorProto.FLOAT
    if after_head == "softcap":
        nodes += [helper.make_node("Div", ["scores", "cap"], ["scaled"]), helper.make_node("Tanh", ["scaled"], ["t"]),
                  helper.make_node("Mul", ["t", "cap"], ["logits"])]
    elif after_head == "bias":
        kind = TensorProto.FLOAT16
        nodes += [helper.make_node("Add", ["scores", "bias"], ["biased"]),
                  helper.make_node("Cast", ["biased"], ["logits"], to=kind)]
    else:
        nodes += [helper.make_node("Softmax", ["scores"], ["logits"], axis=-1)]
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", kind, list(logits_shape))],
        [numpy_helper.from_array(a, n) for a, n in ((EMBED, "embed"), (HEAD, "head"), (BIAS, "bias"),
                                                     (np.array(2.0, np.float32), "two"),
                                                     (np.array(CAP, np.float32), "cap"))])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def _reference(ids: np.ndarray, after_head: str) -> np.ndarray:
    scores = (2.0 * EMBED[ids]) @ HEAD
    if after_head == "softcap":
        return CAP * np.tanh(scores / CAP)
    return (scores + BIAS).astype(np.float16)


@pytest.mark.parametrize("after_head", ["softcap", "bias"])
def test_the_logits_start_where_the_input_says_and_every_position_by_default(after_head):
    ids = RNG.integers(0, VOCAB, (3, 9))
    model = _model(after_head)
    assert LogitsFromPass()(model).modified
    session = _session(model)
    assert LOGITS_FROM in {i.name for i in session.get_overridable_initializers()}
    assert LOGITS_FROM not in {i.name for i in session.get_inputs()}  # a caller need not feed it
    expected = _reference(ids, after_head)
    np.testing.assert_allclose(session.run(["logits"], {"input_ids": ids})[0], expected, atol=1e-3)
    for start in (0, 4, 8):
        got = session.run(["logits"], {"input_ids": ids, LOGITS_FROM: np.array([start])})[0]
        assert got.shape == (3, 9 - start, VOCAB)
        np.testing.assert_allclose(got, expected[:, start:], atol=1e-3)
    # fed the sequence's length, it computes no logits (a run that only fills a cache)
    assert session.run(["logits"], {"input_ids": ids, LOGITS_FROM: np.array([9])})[0].shape == (3, 0, VOCAB)


def test_the_slice_is_before_the_head_so_the_head_runs_on_fewer_positions():
    model = with_logits_from(_model())
    head = next(node for node in model.graph if node.op_type == "MatMul")
    assert head.inputs[0].producer().op_type == "Slice"
    assert head.inputs[0].producer().inputs[0].producer().op_type == "Mul"  # the norm stand-in is before it


def test_the_pass_changes_a_graph_once_and_the_copy_leaves_the_given_model_alone():
    model = _model()
    copy = with_logits_from(model)
    assert LOGITS_FROM not in {v.name for v in model.graph.inputs}
    assert LOGITS_FROM in {v.name for v in copy.graph.inputs}
    assert not LogitsFromPass()(copy).modified
    assert sum(node.op_type == "Slice" for node in copy.graph) == 1


@pytest.mark.parametrize("case", ["softmax", "rank two", "token log-probabilities", "no logits"])
def test_graphs_it_cannot_slice_safely_are_left_as_they_are(case):
    if case == "softmax":  # an op it does not know between the head and the logits
        model = _model("softmax")
    elif case == "rank two":  # logits [tokens, vocab]: axis 1 would be the vocabulary
        model = _model(logits_shape=("tokens", VOCAB))
    elif case == "token log-probabilities":  # their targets follow every position of the logits
        model = with_token_logprobs(_model())
    else:
        model = _model()
        model.graph.outputs[0].name = "scores_out"
    before = ir.to_proto(model).SerializeToString()
    assert not LogitsFromPass()(model).modified
    assert ir.to_proto(model).SerializeToString() == before
