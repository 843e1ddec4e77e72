"""The residual-region finder, on hand-built graphs and on exported graphs of five families."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from layerdrop.errors import LayerdropError
from layerdrop.model_folder import load
from layerdrop.passes.find_residuals import REGION_KEY, FindResidualsPass, find_residual_regions
from tests.conftest import ALL_FAMILIES


def _weight(name: str, shape) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT, shape, np.ones(int(np.prod(shape)), np.float32))


def _two_layer_graph() -> ir.Model:
    """x -> [norm -> q,k,v -> softmax -> o] + x -> [norm -> up -> down] + ..., twice; plus a mask Add decoy."""
    nodes, inits = [], []
    stream = "x"
    for layer in range(2):
        p = f"l{layer}"
        inits += [_weight(f"{p}.{w}", [4, 4]) for w in ("q", "k", "v", "o", "up", "down")]
        nodes += [
            helper.make_node("Mul", [stream, stream], [f"{p}.sq"]),
            helper.make_node("Sqrt", [f"{p}.sq"], [f"{p}.rms"]),
            helper.make_node("Div", [stream, f"{p}.rms"], [f"{p}.n1"]),
            helper.make_node("MatMul", [f"{p}.n1", f"{p}.q"], [f"{p}.qo"]),
            helper.make_node("MatMul", [f"{p}.n1", f"{p}.k"], [f"{p}.ko"]),
            helper.make_node("MatMul", [f"{p}.n1", f"{p}.v"], [f"{p}.vo"]),
            helper.make_node("Transpose", [f"{p}.ko"], [f"{p}.kt"], perm=[1, 0]),
            helper.make_node("MatMul", [f"{p}.qo", f"{p}.kt"], [f"{p}.s"]),
            helper.make_node("Add", [f"{p}.s", "mask"], [f"{p}.sm"]),
            helper.make_node("Softmax", [f"{p}.sm"], [f"{p}.p"]),
            helper.make_node("MatMul", [f"{p}.p", f"{p}.vo"], [f"{p}.a"]),
            helper.make_node("MatMul", [f"{p}.a", f"{p}.o"], [f"{p}.ao"]),
            helper.make_node("Add", [stream, f"{p}.ao"], [f"{p}.h"]),
            helper.make_node("Abs", [f"{p}.h"], [f"{p}.n2"]),
            helper.make_node("MatMul", [f"{p}.n2", f"{p}.up"], [f"{p}.u"]),
            helper.make_node("Relu", [f"{p}.u"], [f"{p}.r"]),
            helper.make_node("MatMul", [f"{p}.r", f"{p}.down"], [f"{p}.d"]),
            helper.make_node("Add", [f"{p}.h", f"{p}.d"], [f"{p}.y"]),
        ]
        stream = f"{p}.y"
    # The mask feeds every layer's scores: "mask + f(mask)" Adds exist but are not on the residual stream.
    nodes.insert(0, helper.make_node("Relu", ["mask_in"], ["mask"]))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("mask_in", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info(stream, TensorProto.FLOAT, [3, 4])], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))


def test_finder_on_hand_built_graph_finds_stream_regions_only():
    model = _two_layer_graph()
    regions = find_residual_regions(model.graph)
    assert [(r.kind, r.layer, r.add.outputs[0].name, r.skip.name) for r in regions] == [
        ("attn", 0, "l0.h", "x"), ("mlp", 0, "l0.y", "l0.h"), ("attn", 1, "l1.h", "l0.y"), ("mlp", 1, "l1.y", "l1.h")]
    assert regions[0].norm_output.name == "l0.n1"
    assert regions[1].norm_output.name == "l0.n2"
    branch_ops = [n.op_type for n in regions[1].branch]
    assert branch_ops == ["Abs", "MatMul", "Relu", "MatMul"]


def test_find_residuals_pass_only_annotates():
    model = _two_layer_graph()
    before = onnx.printer.to_text(ir.serde.serialize_model(model).graph)
    result = FindResidualsPass()(model)
    annotated = [json.loads(n.metadata_props[REGION_KEY]) for n in model.graph if REGION_KEY in n.metadata_props]
    assert [(a["kind"], a["layer"]) for a in annotated] == [("attn", 0), ("mlp", 0), ("attn", 1), ("mlp", 1)]
    assert result.model.metadata_props["layerdrop.num_layers"] == "2"
    assert onnx.printer.to_text(ir.serde.serialize_model(model).graph) == before


def test_graph_without_residuals_is_refused():
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [_weight("w", [1, 1, 3, 3])])
    model = ir.serde.deserialize_model(helper.make_model(graph))
    with pytest.raises(LayerdropError, match="no residual regions"):
        find_residual_regions(model.graph)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv", "plain"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_regions_of_exported_families_with_and_without_metadata(exported, family, kv_cache):
    _, model = load(exported(family, kv_cache))
    regions = find_residual_regions(model.graph)
    assert [(r.kind, r.layer) for r in regions] == [(k, i) for i in range(4) for k in ("attn", "mlp")]
    for region in regions:
        if region.kind == "attn" and kv_cache:
            i = region.layer
            assert region.kv_inputs == [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            assert region.kv_outputs == [f"present.{i}.key", f"present.{i}.value"]
        else:
            assert region.kv_inputs == region.kv_outputs == []
        assert region.norm_output is not None
    for node in model.graph:
        node.metadata_props.clear()
    stripped = find_residual_regions(model.graph)
    assert [(r.kind, r.layer, r.add.name, r.skip.name) for r in stripped] == [
        (r.kind, r.layer, r.add.name, r.skip.name) for r in regions]
