"""The token log-probability output (`TokenLogprobsPass`) on small hand-built graphs, against numpy in float64."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerdrop.errors import LayerdropError
from layerdrop.formats import TOKEN_LOGPROBS
from layerdrop.passes.token_logprobs import TokenLogprobsPass, with_token_logprobs
from layerdrop.runtime.evaluate import perplexity

VOCAB, D = 11, 5
RNG = np.random.default_rng(3)
EMBED = RNG.standard_normal((VOCAB, D)).astype(np.float32)
HEAD = (3 * RNG.standard_normal((D, VOCAB))).astype(np.float32)


def _model(*, from_hidden: bool = False, half: bool = False) -> ir.Model:
    """input_ids -> embedding -> LM head -> logits (cast to float16 with `half`); or, `from_hidden`, a suffix that
    starts at a hidden state and has no input_ids."""
    nodes = [helper.make_node("MatMul", ["hidden", "head"], ["scores"])]
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", D])]
    if not from_hidden:
        nodes.insert(0, helper.make_node("Gather", ["embed", "input_ids"], ["hidden"]))
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
    kind = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    nodes.append(helper.make_node("Cast", ["scores"], ["logits"], to=kind))
    logits = helper.make_tensor_value_info("logits", kind, ["batch", "seq", VOCAB])
    graph = helper.make_graph(nodes, "lm", inputs, [logits], [numpy_helper.from_array(EMBED, "embed"),
                                                              numpy_helper.from_array(HEAD, "head")])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def _reference(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log p(ids[:, t + 1]) under logits[:, t], in float64."""
    values = logits[:, :-1].astype(np.float64)
    values -= values.max(-1, keepdims=True)
    log_probs = values - np.log(np.exp(values).sum(-1, keepdims=True))
    return np.take_along_axis(log_probs, ids[:, 1:, None], -1)[..., 0]


@pytest.mark.parametrize("half", [False, True])
def test_token_logprobs_are_the_log_softmax_of_the_logits_at_the_next_token(half):
    ids = RNG.integers(0, VOCAB, (3, 9))
    model = _model(half=half)
    TokenLogprobsPass()(model)
    got = _session(model).run([TOKEN_LOGPROBS], {"input_ids": ids})[0]
    logits = (EMBED[ids] @ HEAD).astype(np.float16 if half else np.float32)
    assert got.shape == (3, 8)
    np.testing.assert_allclose(got, _reference(logits, ids), atol=1e-5)


def test_a_suffix_without_input_ids_gets_them_as_an_input():
    ids = RNG.integers(0, VOCAB, (2, 7))
    hidden = RNG.standard_normal((2, 7, D)).astype(np.float32)
    model = with_token_logprobs(_model(from_hidden=True))
    got = _session(model).run([TOKEN_LOGPROBS], {"hidden": hidden, "input_ids": ids})[0]
    np.testing.assert_allclose(got, _reference(hidden @ HEAD, ids), atol=1e-5)


def test_perplexity_reads_the_graphs_log_probabilities_and_matches_numpy():
    windows = RNG.integers(0, VOCAB, (4, 10))
    expected = np.exp(-_reference(EMBED[windows] @ HEAD, windows).mean())
    for model in (_model(), with_token_logprobs(_model())):
        assert perplexity(_session(model), windows, batch_size=3).perplexity == pytest.approx(expected, rel=1e-6)


def test_the_pass_adds_the_output_once_and_leaves_the_given_model_alone():
    model = _model()
    copy = with_token_logprobs(model)
    assert [v.name for v in model.graph.outputs] == ["logits"]
    assert [v.name for v in copy.graph.outputs] == ["logits", TOKEN_LOGPROBS]
    assert not TokenLogprobsPass()(copy).modified
    assert [v.name for v in copy.graph.outputs] == ["logits", TOKEN_LOGPROBS]


def test_a_graph_without_logits_is_refused():
    model = _model()
    model.graph.outputs[0].name = "scores_out"
    with pytest.raises(LayerdropError, match="no logits output"):
        TokenLogprobsPass()(model)
