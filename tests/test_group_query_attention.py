"""Fused exports get GroupQueryAttention (rotary inside, the KV heads unrepeated) where it computes what the graph
did, and keep MultiHeadAttention where it would not (a head size ONNX Runtime's CPU kernel refuses, a soft cap, a
sliding window); either way the fused graph equals PyTorch, in prefill, in cached greedy decoding and in batches."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest

from layerdrop import api, model_folder
from layerdrop.cli import main
from layerdrop.runtime.generate import greedy_batch, greedy_generate
from layerdrop.runtime.session import make_session
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB, greedy, logits, replaced, tiny_model

TOL = 1e-4


def _ops(folder) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(folder / "model.onnx", load_external_data=False).graph.node)


def _metadata(folder) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(folder / "model.onnx", load_external_data=False).metadata_props}


def _session(folder):
    source, model = model_folder.load(folder)
    return make_session(model, folder=source.path)


@pytest.mark.parametrize("family", ["llama-h16", "qwen3-h16", "gemma3-h16"])
def test_fused_export_has_group_query_attention_and_matches_torch(exported, tmp_path, rng, family):
    """Llama, Qwen3 (q/k norms) and Gemma 3 (q/k norms, query scaling, pre- and post-norms): every attention is
    one GroupQueryAttention, and prefill logits and cached greedy decoding equal PyTorch."""
    out = tmp_path / "fused"
    api.fuse(exported(family, True), out)
    ops = _ops(out)
    assert ops["GroupQueryAttention"] == 4 and ops["MultiHeadAttention"] == 0 and ops["Expand"] == 0
    assert "no GroupQueryAttention" not in _metadata(out).get("layerdrop.ort_fusions.note", "")
    model = tiny_model(family)
    ids = rng.randint(0, VOCAB, size=(1, 13))
    np.testing.assert_allclose(ort_logits(out, ids), logits(model, ids), atol=TOL, rtol=0)
    tokens, step_logits = greedy_generate(_session(out), ids, 6)
    reference_tokens, reference_logits = greedy(model, ids, 6)
    assert tokens == reference_tokens
    np.testing.assert_allclose(np.stack(step_logits), np.stack(reference_logits), atol=TOL, rtol=0)


def test_a_batch_is_prefilled_row_by_row_in_pieces_and_decoded_together(exported, tmp_path, rng):
    """GroupQueryAttention takes several new tokens over a past for one row only: `rows_alone` prefills each row
    through the cache in pieces, then the batch decodes together (the bench's generation-memory run)."""
    out = tmp_path / "fused"
    api.fuse(exported("llama-h16", True), out)
    ids = rng.randint(0, VOCAB, size=(3, 11))
    tokens, _ = greedy_batch(_session(out), ids, np.ones_like(ids), 5, prefill_chunk=4, rows_alone=True)
    model = tiny_model("llama-h16")
    assert tokens == [greedy(model, ids[row:row + 1], 5)[0] for row in range(3)]


def test_drop_then_fuse_keeps_group_query_attention_on_the_kept_layers(exported, tmp_path, rng, capsys):
    out = tmp_path / "dropped"
    assert main(["drop", str(exported("llama-h16", True)), "-o", str(out), "--drop", "attn:1", "--fuse"]) == 0
    assert "gqa x3" in capsys.readouterr().out
    assert _ops(out)["GroupQueryAttention"] == 3
    names = {i.name for i in onnx.load(out / "model.onnx", load_external_data=False).graph.input}
    assert sum(name.startswith("past_key_values.") for name in names) == 2 * 3  # the dropped layer's cache is gone
    model = replaced(tiny_model("llama-h16"), [("attn", 1)])
    ids = rng.randint(0, VOCAB, size=(1, 10))
    np.testing.assert_allclose(ort_logits(out, ids), logits(model, ids), atol=TOL, rtol=0)
    tokens, _ = greedy_generate(_session(out), ids, 5)
    assert tokens == greedy(model, ids, 5)[0]


@pytest.mark.parametrize("family,reason", [
    ("llama", "head size 8 is not a multiple of 16"),
    ("gemma2", "soft cap"),
    ("gemma3-h16-sliding", "sliding window"),
])
def test_group_query_attention_is_kept_from_forming_where_it_would_change_the_result(
        exported, tmp_path, rng, capsys, family, reason):
    out = tmp_path / "fused"
    assert main(["fuse", str(exported(family, True)), "-o", str(out)]) == 0
    assert reason in capsys.readouterr().out
    assert reason in _metadata(out)["layerdrop.ort_fusions.note"]
    assert _ops(out)["GroupQueryAttention"] == 0
    assert "gqa" not in json.loads(_metadata(out)["layerdrop.ort_fusions"])
    ids = rng.randint(0, VOCAB, size=(1, 12))  # longer than the sliding window (6)
    np.testing.assert_allclose(ort_logits(out, ids), logits(tiny_model(family), ids), atol=TOL, rtol=0)
