"""The planner's mean shift: its means from ONNX Runtime equal PyTorch hooks; mean-shifted bypasses equal
a PyTorch reference (prefill and decode); the region finder still sees every layer after a branch became its mean."""

from __future__ import annotations

import numpy as np
import pytest

from layerdrop import api
from layerdrop.api import open_model
from layerdrop.model_folder import save
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import find_residual_regions
from layerdrop.runtime.generate import greedy_generate
from layerdrop.search.measure import branch_means
from layerdrop.windows import Windows
from tests.helpers import ort_logits, session
from tests.torch_reference import VOCAB, greedy, logits, planned, replaced, tiny_model
from tests.torch_reference import branch_means as torch_branch_means

ALPHAS = {3: 0.6, 2: 0.0, 1: 0.3}  # 2: replaced by its mean
FAMILIES = ["llama", "qwen2", "gemma2", "phi3", "gemma3", "qwen3"]


def _shifted(exported, family, tmp_path, rng, kv_cache=True):
    """(output folder, reference model): ORT rewrite with ORT means; PyTorch reference with hook means."""
    folder, model = open_model(exported(family, kv_cache))
    windows = Windows(rng.randint(0, VOCAB, size=(3, 16)), {})
    means = branch_means(model, folder.path, windows, sorted(ALPHAS))
    run_passes(model, api.rewrite_passes([], ALPHAS, "test", means=means))
    out = tmp_path / "shifted"
    save(model, out, source=folder)
    return out, planned(tiny_model(family), ALPHAS, windows)


@pytest.mark.parametrize("family", FAMILIES)
def test_branch_means_equal_torch_hooks(exported, family, rng):
    folder, model = open_model(exported(family, True))
    windows = rng.randint(0, VOCAB, size=(3, 16))
    ours = branch_means(model, folder.path, Windows(windows, {}), [0, 2, 3])
    reference = torch_branch_means(tiny_model(family), windows, [0, 2, 3])
    assert set(ours) == {0, 2, 3}
    for layer in ours:
        for mine, theirs in zip(ours[layer], reference[layer]):
            assert np.abs(theirs).max() > 1e-3  # not trivially zero
            np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mean_shifted_bypass_equals_torch(exported, family, tmp_path, rng):
    out, reference_model = _shifted(exported, family, tmp_path, rng, kv_cache=False)
    ids = rng.randint(0, VOCAB, size=(2, 12))
    np.testing.assert_allclose(ort_logits(out, ids), logits(reference_model, ids), atol=1e-4, rtol=0)
    plain = logits(replaced(tiny_model(family), [], ALPHAS), ids)
    assert np.abs(plain - logits(reference_model, ids)).max() > 1e-3, "the shift must change the model"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_mean_shifted_kv_graph_decodes_like_torch_and_drops_the_cache(exported, family, tmp_path, rng):
    out, reference_model = _shifted(exported, family, tmp_path, rng)
    assert api.inspect(out)["kv_layers"] == [0]
    prompt = rng.randint(0, VOCAB, size=(1, 6))
    tokens, step_logits = greedy_generate(session(out), prompt, 10)
    ref_tokens, ref_logits = greedy(reference_model, prompt, 10)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(step_logits), np.stack(ref_logits), atol=1e-4, rtol=0)


def test_regions_are_found_through_a_branch_replaced_by_its_mean(exported, tmp_path, rng):
    out, _ = _shifted(exported, "llama", tmp_path, rng)
    _, model = open_model(out)
    kinds = {(r.layer, r.kind) for r in find_residual_regions(model.graph)}
    assert kinds == {(0, "attn"), (0, "mlp"), (1, "harp"), (1, "mlp"), (2, "mlp"), (3, "harp"), (3, "mlp")}
    for node in model.graph:  # structure alone: no annotations, no provenance
        node.metadata_props.clear()
    stripped = find_residual_regions(model.graph)
    assert len(stripped) == 7 and [r.kind for r in stripped].count("attn") == 1
    names = {v.name for v in model.graph.initializers.values()}
    assert "layerdrop.harp.2.mean" in names and "layerdrop.harp.3.shift" in names


def test_inspect_shows_the_shift_and_a_later_drop_still_matches_torch(exported, tmp_path, rng, capsys):
    from layerdrop.cli import main

    out, reference_model = _shifted(exported, "llama", tmp_path, rng, kv_cache=False)
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "attn:2(alpha 0.0, mean shift)" in text and "attn:3(alpha 0.6, mean shift)" in text
    api.drop(out, tmp_path / "then-drop", targets=[("mlp", 2)])  # the MLP right after the constant branch
    reference_model.model.layers[2].mlp.forward = lambda hidden_states: hidden_states * 0
    ids = rng.randint(0, VOCAB, size=(2, 12))
    np.testing.assert_allclose(ort_logits(tmp_path / "then-drop", ids), logits(reference_model, ids), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_search_graph_equals_torch_with_the_same_moves(exported, family, rng):
    """The planner evaluates every move set in one gated graph; each perplexity must be PyTorch's for the model
    with those layers replaced (mean-shifted with constants PyTorch computes itself on the same windows)."""
    from layerdrop.search.alpha_search import GatedSuffix
    from tests.torch_reference import perplexity as torch_perplexity

    folder, model = open_model(exported(family, True))
    windows = Windows(rng.randint(0, VOCAB, size=(2, 16)), {})
    means = branch_means(model, folder.path, windows, [1, 2, 3])
    for shifted in (False, True):
        gated = GatedSuffix(model, folder.path, windows.ids, [1, 2, 3], means if shifted else None)
        for moves in ({3: 0.5}, {2: 0.0, 3: 1.0}, {1: 0.3, 2: 0.0}, {1: 0.0, 2: 0.7, 3: 0.2}):
            reference = torch_perplexity(planned(tiny_model(family), moves, windows if shifted else None), windows.ids)
            assert gated.perplexity(moves) == pytest.approx(reference, rel=1e-4), (shifted, moves)
            assert gated.perplexity(moves, start=1) == pytest.approx(reference, rel=1e-4), (shifted, moves)
