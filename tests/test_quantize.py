"""Int4 out: ONNX Runtime's MatMulNBits quantizer after the rewrite (remove first, then quantize)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from layerdrop import api
from layerdrop.cli import main
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB


def _constant_matmuls(folder) -> int:
    """MatMuls whose second input is a 2-D initializer (what the quantizer turns into MatMulNBits)."""
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    return sum(1 for n in graph.node if n.op_type == "MatMul" and len(shapes.get(n.input[1], [])) == 2)


def _ops(folder) -> list[str]:
    return [n.op_type for n in onnx.load(folder / "model.onnx", load_external_data=False).graph.node]


def test_quantize_writes_matmul_nbits_for_every_weight_and_stays_close(exported, tmp_path, rng, capsys):
    source = exported("llama", True)
    capsys.readouterr()
    assert main(["quantize", str(source), "-o", str(tmp_path / "q"), "--block-size", "16", "--json",
                 str(tmp_path / "q.json")]) == 0
    report = json.loads((tmp_path / "q.json").read_text())
    assert _ops(tmp_path / "q").count("MatMulNBits") == report["matmul_nbits"] == _constant_matmuls(source) > 0
    assert report["bytes"]["after"] < report["bytes"]["before"]
    ids = rng.randint(0, VOCAB, size=(1, 12))
    base, quantized = ort_logits(source, ids), ort_logits(tmp_path / "q", ids)
    cosine = (base * quantized).sum() / np.linalg.norm(base) / np.linalg.norm(quantized)
    assert cosine > 0.99, cosine
    meta = {p.key: p.value for p in onnx.load(tmp_path / "q" / "model.onnx", load_external_data=False).metadata_props}
    assert json.loads(meta["layerdrop.quantization"])["block_size"] == 16 and "layerdrop.family" in meta


def test_a_drop_is_removed_first_then_quantized(exported, tmp_path):
    source = exported("llama", True)
    api.drop(source, tmp_path / "d", targets=[("attn", 1)], quantize="int4")
    assert _ops(tmp_path / "d").count("MatMulNBits") == _constant_matmuls(source) - 4  # q, k, v, o of layer 1 went
    assert api.inspect(tmp_path / "d")["kv_layers"] == [0, 2, 3]


def test_served_by_genai_after_drop_and_quantization(exported, tmp_path, rng):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from layerdrop.runtime.generate import greedy_generate
    from layerdrop.runtime.session import make_session
    from tests.genai_helpers import genai_greedy

    api.drop(exported("llama", True), tmp_path / "d", targets=[("attn", 2)], quantize="int4")
    prompt = [int(t) for t in rng.randint(0, VOCAB, size=8)]
    ours, _ = greedy_generate(make_session(tmp_path / "d" / "model.onnx"), np.array([prompt]), 12)
    assert genai_greedy(tmp_path / "d", prompt, 12) == ours


def test_a_tied_lm_head_is_quantized_too_before_and_after_fusion(exported, tmp_path, rng):
    """Gemma ties its LM head to the embedding: the head multiplies by the table transposed (a MatMul after a
    Transpose; a FusedMatMul with transB once fused), which ONNX Runtime's quantizer skips. It gets its own
    transposed constant (exactly PyTorch's logits before quantization) and becomes a MatMulNBits as well; the
    embedding's Gather keeps the float table."""
    from layerdrop.api.common import save_model
    from layerdrop.model_folder import load
    from layerdrop.passes.quantize_int4 import _untie_transposed_weights
    from tests.torch_reference import logits, tiny_model

    source = exported("gemma3", True)
    api.fuse(source, tmp_path / "fused")
    assert "FusedMatMul" in _ops(tmp_path / "fused")
    ids = rng.randint(0, VOCAB, size=(1, 12))
    expected = logits(tiny_model("gemma3"), ids)
    for name, folder in (("plain", source), ("fused", tmp_path / "fused")):
        loaded, model = load(folder)
        assert _untie_transposed_weights(model) == 1
        save_model(model, tmp_path / f"{name}-untied", loaded, force=False)
        np.testing.assert_allclose(ort_logits(tmp_path / f"{name}-untied", ids), expected, atol=1e-4)
        api.quantize(folder, tmp_path / f"{name}-q", block_size=16)
        ops = _ops(tmp_path / f"{name}-q")
        assert ops.count("MatMulNBits") == _constant_matmuls(source) + 1, name  # every projection and the head
        assert "FusedMatMul" not in ops and "Gather" in ops
        got = ort_logits(tmp_path / f"{name}-q", ids)
        cosine = (got * expected).sum() / np.linalg.norm(got) / np.linalg.norm(expected)
        assert cosine > 0.9, (name, cosine)  # int4 rounding of every matrix of a random model; a wrong head: ~0
