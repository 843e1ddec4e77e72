"""Int4 in: graphs from onnxruntime-genai's builder with `-p int4` (MatMulNBits). Weights are read back
exactly (checked against ONNX Runtime's own kernel), and score, drop and HARP equal a PyTorch model that holds
those dequantized weights, with the same modules replaced."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import TensorProto, helper, numpy_helper

from layerdrop import api
from layerdrop.model_folder import load
from layerdrop.passes.matmul_nbits import dequantized_weight
from layerdrop.runtime.generate import greedy_generate
from layerdrop.runtime.session import make_session
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB, hook_scores, logits, replaced

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install -e '.[genai]')")
from tests.genai_helpers import genai_greedy, run_builder  # noqa: E402

NO_TASK = ["--accuracy-items", "0", "--validation-items", "0"]  # no lm-eval items: those are tested once

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tiny_tokenizer_file):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("int4")
    model.save_pretrained(root / "hf")
    shutil.copy(tiny_tokenizer_file, root / "hf" / "tokenizer.json")
    return root / "hf"


@pytest.fixture(scope="module", params=["1", "4"], ids=["level1", "level4"])
def built(hf, request):
    """The builder's int4 graph; accuracy level 1 keeps activations in float32 (exact comparisons), 4 is what the
    builder writes for CPU by default (int8 activations)."""
    return run_builder(hf, hf.parent / f"built-{request.param}", precision="int4",
                       extra_options=[f"accuracy_level={request.param}"])


def _matmul_nbits(folder):
    _, model = load(folder)
    return {node.name: node for node in model.graph if node.op_type == "MatMulNBits"}


def test_weights_are_read_back_as_onnx_runtime_multiplies_them(built):
    for node in list(_matmul_nbits(built).values())[:4]:
        weight = dequantized_weight(node)
        k, n = weight.shape
        attrs = {key: a.value for key, a in node.attributes.items()}
        inits = [numpy_helper.from_array(v.const_value.numpy(), f"w{j}") for j, v in enumerate(node.inputs[1:])]
        graph = helper.make_graph([helper.make_node("MatMulNBits", ["x", *[t.name for t in inits]], ["y"],
                                                    domain="com.microsoft", **attrs)], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])], inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid("com.microsoft", 1)])
        import onnxruntime as ort

        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
        np.testing.assert_allclose(got, weight, atol=1e-7, rtol=0)


def _dequantized_torch(hf, built) -> torch.nn.Module:
    """The Hugging Face model with every Linear replaced by the int4 graph's dequantized weight."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64).eval()
    config = model.config
    head = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    nodes = _matmul_nbits(built)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            qkv = dequantized_weight(nodes[f"/model/layers.{i}/attn/qkv_proj/MatMul_Q4"]).T
            for proj, rows in ((layer.self_attn.q_proj, slice(0, q)), (layer.self_attn.k_proj, slice(q, q + kv)),
                               (layer.self_attn.v_proj, slice(q + kv, q + 2 * kv))):
                proj.weight.copy_(torch.tensor(qkv[rows]))
            layer.self_attn.o_proj.weight.copy_(torch.tensor(dequantized_weight(
                nodes[f"/model/layers.{i}/attn/o_proj/MatMul_Q4"]).T))
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(torch.tensor(dequantized_weight(
                    nodes[f"/model/layers.{i}/mlp/{name}/MatMul_Q4"]).T))
        model.lm_head.weight.copy_(torch.tensor(dequantized_weight(nodes["/lm_head/MatMul_Q4"]).T))
    return model


def test_score_drop_and_harp_equal_torch_on_the_dequantized_weights(hf, built, tmp_path, rng, request):
    if "level4" in request.node.name:
        pytest.skip("exact comparisons need float activations (accuracy level 1)")
    reference = _dequantized_torch(hf, built)
    result = api.score(built, tmp_path / "scored", samples=3, seq_len=24, progress=False)
    windows = api.windows_for(built, None, role="calib", samples=3, seq_len=24).ids
    expected = hook_scores(reference, windows)
    for row in result["regions"]:
        assert row["score"] == pytest.approx(expected[(row["kind"], row["layer"])], abs=1e-5), row
    ids = rng.randint(0, VOCAB, size=(1, 12))
    api.drop(tmp_path / "scored", tmp_path / "drop", targets=[("attn", 1), ("mlp", 2)])
    np.testing.assert_allclose(ort_logits(tmp_path / "drop", ids),
                               logits(replaced(reference, [("attn", 1), ("mlp", 2)]), ids), atol=TOL, rtol=0)
    alphas = {3: 0.5, 2: 0.0}
    api.harp(built, tmp_path / "harp", alphas=alphas, keep_float=True)
    np.testing.assert_allclose(ort_logits(tmp_path / "harp", ids),
                               logits(replaced(reference, [("attn", 2)], {3: 0.5}), ids), atol=TOL, rtol=0)


def test_harp_writes_int4_back_and_genai_serves_it(built, tmp_path, rng):
    alphas = {3: 0.5, 2: 0.0}
    api.harp(built, tmp_path / "int4", alphas=alphas)
    api.harp(built, tmp_path / "float", alphas=alphas, keep_float=True)
    ops = [n.op_type for n in onnx.load(tmp_path / "int4" / "model.onnx", load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == len(_matmul_nbits(built)) - 3 and "MatMul" not in ops
    ids = rng.randint(0, VOCAB, size=(1, 12))
    a, b = ort_logits(tmp_path / "int4", ids), ort_logits(tmp_path / "float", ids)
    assert (a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b) > 0.99  # only V·O re-quantized
    prompt = [int(t) for t in rng.randint(0, VOCAB, size=8)]
    ours, _ = greedy_generate(make_session(tmp_path / "int4" / "model.onnx"), np.array([prompt]), 12)
    assert genai_greedy(tmp_path / "int4", prompt, 12) == ours


def test_an_int4_builder_folder_goes_through_score_plan_eval_and_bench_and_genai_serves_it(built, tmp_path, rng,
                                                                                          capsys):
    """The issue's whole path on the builder's int4 graph, as a user runs it: score, plan (every move, fits
    included, written back as MatMulNBits), eval and bench; onnxruntime-genai generates from the planned folder
    what a plain ONNX Runtime session generates."""
    from layerdrop.cli import main

    scored, planned = tmp_path / "scored", tmp_path / "planned"
    assert main(["score", str(built), "-o", str(scored), "--samples", "4", "--seq-len", "32", "--no-progress"]) == 0
    assert main(["plan", *NO_TASK, str(scored), "-o", str(planned), "--budget", "attn=1", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--fit-samples", "4", "--seq-len", "32",
                 "--extra", "1", "--no-progress"]) == 0
    ops = [n.op_type for n in onnx.load(planned / "model.onnx", load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 3 and "MatMulNBits" in ops
    capsys.readouterr()
    assert main(["eval", str(planned), "--samples", "2", "--seq-len", "32", "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["bench", str(built), str(planned), "--seq", "16", "--runs", "1", "--decode", "2",
                 "--threads", "1"]) == 0
    assert "prefill 16 tokens" in capsys.readouterr().out
    prompt = [int(t) for t in rng.randint(0, VOCAB, size=8)]
    ours, _ = greedy_generate(make_session(planned / "model.onnx"), np.array([prompt]), 12)
    assert genai_greedy(planned, prompt, 12) == ours


def test_a_matmul_nbits_layout_that_cannot_be_read_back_is_refused_in_one_line(built, tmp_path, capsys):
    """HARP must read V and O back; an 8-bit MatMulNBits (not what the builder's int4 writes) is refused, with
    nothing written and the input untouched."""
    from layerdrop.cli import main

    damaged = tmp_path / "eight-bit"
    shutil.copytree(built, damaged)
    proto = onnx.load(damaged / "model.onnx", load_external_data=False)
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits" and "o_proj" in node.name and "layers.3" in node.name:
            for attribute in [a for a in node.attribute if a.name == "bits"]:
                node.attribute.remove(attribute)
            node.attribute.append(helper.make_attribute("bits", 8))
    onnx.save(proto, damaged / "model.onnx")
    before = (damaged / "model.onnx").read_bytes()
    capsys.readouterr()
    assert main(["harp", str(damaged), "-o", str(tmp_path / "out"), "--alpha", "3=0.5"]) == 2
    err = capsys.readouterr().err
    assert "MatMulNBits with 8 bits cannot be read back" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and (damaged / "model.onnx").read_bytes() == before
