"""ReplaceMe's block move. Its selection and its fit equal an independent PyTorch + numpy computation,
the rewritten graph equals PyTorch with the run removed and the transform in place, and the transform is folded
into the down-projection wherever that is exact."""

from __future__ import annotations

import ast
import re

import numpy as np
import onnx
import pytest

from layerdrop import api
from layerdrop.formats import SCOPES_KEY
from layerdrop.model_folder import save
from layerdrop.search.blocks import replaceme, replaceme_runs, with_replaced_run
from layerdrop.windows import Windows
from tests.conftest import ALL_FAMILIES
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB, logits, perplexity, replaceme_reference, tiny_model

RIDGE = 1e-2


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_replaceme_equals_torch_and_numpy(exported, family, rng, tmp_path):
    folder, model = api.open_model(exported(family, True))
    windows = rng.randint(0, VOCAB, size=(4, 24))
    fit = replaceme(model, folder.path, Windows(windows, {}), 2, ridges=(RIDGE,))
    reference, start, transform = replaceme_reference(tiny_model(family), windows, 2, RIDGE)
    assert fit.start == start
    np.testing.assert_allclose(fit.transform, transform, atol=1e-4)
    save(with_replaced_run(model, fit.start, 2, fit.transform), tmp_path / "replaced", source=folder)
    ids = rng.randint(0, VOCAB, size=(1, 11))
    np.testing.assert_allclose(ort_logits(tmp_path / "replaced", ids), logits(reference, ids), atol=1e-4, rtol=0)
    info = api.inspect(tmp_path / "replaced")
    removed = set(range(start + 1, start + 3))
    assert {r["layer"] for r in info["regions"]}.isdisjoint(removed) and not set(info["kv_layers"]) & removed
    graph = onnx.load(tmp_path / "replaced" / "model.onnx", load_external_data=False).graph
    scopes = [ast.literal_eval(p.value) for n in graph.node for p in n.metadata_props if p.key == SCOPES_KEY]
    layers = {int(m.group(1)) for entries in scopes for e in entries if (m := re.search(r"layers\.(\d+)$", e))}
    assert layers and not layers & removed, "no node of the removed blocks is left"


def test_runs_of_several_lengths_from_one_pass_each_equal_torch_and_numpy(exported, rng):
    """A speedup plan fits runs of three lengths: one selection pass and one statistics pass serve them all, and
    each run is the one PyTorch selects and fits alone."""
    folder, model = api.open_model(exported("llama", True))
    windows = rng.randint(0, VOCAB, size=(4, 24))
    runs = replaceme_runs(model, folder.path, Windows(windows, {}), [2, 1], ridges=(RIDGE,))
    assert sorted(runs) == [1, 2]
    for count, fit in runs.items():
        _, start, transform = replaceme_reference(tiny_model("llama"), windows, count, RIDGE)
        assert (fit.start, fit.count) == (start, count)
        np.testing.assert_allclose(fit.transform, transform, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_ridge_is_judged_by_the_perplexity_of_its_replaced_model(exported, family, rng):
    """The ridge's validation runs from the state entering the run's first kept block: every ridge's perplexity
    equals PyTorch's for the model with that run replaced by that ridge's transform, and the lowest is kept."""
    folder, model = api.open_model(exported(family, True))
    windows, validation = rng.randint(0, VOCAB, size=(4, 24)), rng.randint(0, VOCAB, size=(3, 16))
    ridges = (1e-3, 1.0)
    fit = replaceme_runs(model, folder.path, Windows(windows, {}), [2], validation=validation, ridges=ridges)[2]
    expected = {}
    for ridge in ridges:
        reference, start, transform = replaceme_reference(tiny_model(family), windows, 2, ridge)
        expected[ridge] = perplexity(reference, validation)
    assert fit.start == start
    assert [t["ridge"] for t in fit.trials] == list(ridges)
    np.testing.assert_allclose([t["perplexity"] for t in fit.trials], [expected[r] for r in ridges], rtol=1e-4)
    assert fit.ridge == min(expected, key=expected.get)


@pytest.mark.parametrize("family, folded", [("llama", True), ("gemma3", False)])
def test_the_transform_is_folded_into_the_down_projection_where_exact(exported, family, folded, rng):
    folder, model = api.open_model(exported(family, True))
    replaced = with_replaced_run(model, 0, 2, np.eye(32) * 0.5)
    names = set(replaced.graph.initializers)
    assert ("layerdrop.replaceme.0.transform" in names) is not folded
