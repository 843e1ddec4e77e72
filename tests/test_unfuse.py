"""Fused skip-norms split into Add + norm compute what ONNX Runtime's fused kernels compute, and expose the residual."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerdrop.errors import LayerdropError
from layerdrop.passes.unfuse_skip_norm import UnfuseSkipNormPass

D = 16


def _graph(op: str, with_bias: bool, use_stats: bool = False) -> onnx.ModelProto:
    """x -> MatMul(w1) = branch;  (x, branch) -> skip-norm -> out0 -> MatMul(w2) -> y;  out3 (the sum) -> z."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(rng.randn(D, D).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.randn(D, D).astype(np.float32), "w2"),
             numpy_helper.from_array((1 + 0.3 * rng.randn(D)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.randn(D)).astype(np.float32), "beta"),
             numpy_helper.from_array((0.1 * rng.randn(D)).astype(np.float32), "bias")]
    inputs = ["x", "branch", "gamma"]
    if op == "SkipLayerNormalization":
        inputs += ["beta", "bias" if with_bias else ""]
    elif with_bias:
        inputs += ["bias"]
    outputs = ["normed", "mean" if use_stats else "", "", "total"]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["branch"]),
             helper.make_node(op, inputs, outputs, domain="com.microsoft", epsilon=1e-5, name="fused"),
             helper.make_node("MatMul", ["normed", "w2"], ["y"]),
             helper.make_node("Identity", ["total"], ["z"])]
    graph_outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, D]) for n in ("y", "z")]
    if use_stats:
        graph_outputs.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, D])],
                              graph_outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y", "z"], {"x": x})


@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_skip_norm_equals_the_fused_kernel(op, with_bias):
    proto = _graph(op, with_bias)
    x = np.random.RandomState(1).randn(2, 5, D).astype(np.float32)
    expected = _run(proto, x)
    model = ir.serde.deserialize_model(proto)
    assert UnfuseSkipNormPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert op not in ops and "Add" in ops
    got = _run(ir.serde.serialize_model(model), x)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    # the residual Add now reads the skip input directly
    adds = [n for n in model.graph if n.op_type == "Add" and any(i is not None and i.name == "x" for i in n.inputs)]
    assert len(adds) == 1


def test_skip_norm_whose_statistics_are_used_is_refused():
    model = ir.serde.deserialize_model(_graph("SkipLayerNormalization", False, use_stats=True))
    with pytest.raises(LayerdropError, match="training statistic"):
        UnfuseSkipNormPass()(model)
