"""Exported graphs of five families compute the PyTorch model's logits, with and without KV cache."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from layerdrop.cli import main
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.generate import greedy_generate
from tests.conftest import ALL_FAMILIES
from tests.helpers import ort_logits, session
from tests.torch_reference import VOCAB, greedy, logits, tiny_model

TOL = 1e-4


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv", "plain"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_exported_logits_match_torch(exported, family, kv_cache, rng):
    folder = exported(family, kv_cache)
    ids = rng.randint(0, VOCAB, size=(2, 11))
    np.testing.assert_allclose(ort_logits(folder, ids), logits(tiny_model(family), ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_exported_graph_signature_and_metadata(exported, family):
    model = onnx.load(exported(family, True) / "model.onnx", load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs[3:] == [f"past_key_values.{i}.{kv}" for i in range(4) for kv in ("key", "value")]
    assert outputs == ["logits"] + [f"present.{i}.{kv}" for i in range(4) for kv in ("key", "value")]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["layerdrop.num_layers"] == "4"
    assert meta["layerdrop.family"] == json.loads((exported(family, True) / "config.json").read_text())["model_type"]
    assert any(p.key == "pkg.torch.onnx.name_scopes" for n in model.graph.node for p in n.metadata_props)
    plain = onnx.load(exported(family, False) / "model.onnx", load_external_data=False)
    assert [i.name for i in plain.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in plain.graph.output] == ["logits"]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "qwen3"])
def test_decode_step_with_past_equals_full_sequence(exported, family, rng):
    sess = session(exported(family, True))
    ids = rng.randint(0, VOCAB, size=(1, 9))
    full = sess.run(["logits"], prefill_feed(sess, ids))[0]
    names = [o.name for o in sess.get_outputs()]
    prefix = dict(zip(names, sess.run(names, prefill_feed(sess, ids[:, :8]))))
    feed = {n.replace("present.", "past_key_values."): v for n, v in prefix.items() if n.startswith("present.")}
    feed.update(input_ids=ids[:, 8:], attention_mask=np.ones((1, 9), np.int64), position_ids=np.array([[8]]))
    step = sess.run(["logits"], feed)[0]
    np.testing.assert_allclose(step[0, -1], full[0, -1], atol=TOL, rtol=0)


def test_greedy_decoding_with_cache_equals_torch(exported, rng):
    folder = exported("llama", True)
    prompt = rng.randint(0, VOCAB, size=(1, 6))
    tokens, step_logits = greedy_generate(session(folder), prompt, 10)
    ref_tokens, ref_logits = greedy(tiny_model("llama"), prompt, 10)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(step_logits), np.stack(ref_logits), atol=TOL, rtol=0)


def test_padded_batch_excludes_padding_by_mask(exported, rng):
    folder = exported("llama", False)
    ids = rng.randint(0, VOCAB, size=(2, 8))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    got = ort_logits(folder, ids, mask)
    want = logits(tiny_model("llama"), ids[1:, 3:])
    np.testing.assert_allclose(got[1, 3:], want[0], atol=TOL, rtol=0)


def test_export_cli_writes_a_complete_folder(hf_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(hf_folder("llama")), "-o", str(out), "--no-kv-cache"]) == 0
    assert {"config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder may be left behind"
    assert main(["export", str(hf_folder("llama")), "-o", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
