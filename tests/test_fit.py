"""The fit move. An attention branch replaced by Norm(X) W + b fitted bottom-up on calibration states
equals a PyTorch model with maps fitted independently (hooks and numpy's lstsq) on the same windows."""

from __future__ import annotations

import numpy as np
import pytest

from layerdrop import api
from layerdrop.errors import LayerdropError
from layerdrop.formats import is_past, is_state_past
from layerdrop.model_folder import save
from layerdrop.passes.cleanup import run_passes
from layerdrop.search.fit import fit_attention, normal_equations, solo_fits, solve_ridge
from layerdrop.windows import Windows
from tests.conftest import ALL_FAMILIES
from tests.helpers import ort_logits, session
from tests.torch_reference import VOCAB, attention_io, fitted, logits, tiny_model, with_maps

LAYERS = [1, 3]
RIDGE = 1e-2


def test_the_ridge_solve_is_numpys_least_squares(rng):
    x, y = rng.randn(200, 6), rng.randn(200, 6)
    weight, bias = solve_ridge(*normal_equations(x, y), RIDGE)
    a = np.concatenate([x, np.ones((200, 1))], axis=1)
    lam = RIDGE * np.mean(np.sum(a * a, axis=0))
    reference = np.linalg.lstsq(np.concatenate([a, np.sqrt(lam) * np.eye(7)]),
                                np.concatenate([y, np.zeros((7, 6))]), rcond=None)[0]
    np.testing.assert_allclose(weight, reference[:-1], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(bias, reference[-1], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("family,cache,previous", [(f, True, False) for f in ALL_FAMILIES]
                         + [(f, True, True) for f in ALL_FAMILIES] + [("llama", False, True)])
def test_fitted_attention_equals_torch_with_independently_fitted_maps(exported, family, cache, previous, rng,
                                                                      tmp_path):
    """Maps fitted bottom-up equal lstsq on PyTorch's states, and the rewritten graph PyTorch's model with those maps;
    the layers' KV inputs go. With `previous` (--fit-previous) the maps read [Norm(X)_t, Norm(X)_{t-1}], and in a
    graph with a cache each fitted layer carries a one-token state instead."""
    folder, model = api.open_model(exported(family, cache))
    windows = rng.randint(0, VOCAB, size=(4, 24))
    fit = fit_attention(model, folder.path, Windows(windows, {}), LAYERS, ridges=(RIDGE,), previous=previous)
    reference, maps = fitted(tiny_model(family), windows, LAYERS, RIDGE, previous=previous)
    for layer in LAYERS:  # the maps themselves, and the model they make
        width = fit.maps[layer].weight.shape[1]
        assert fit.maps[layer].weight.shape == ((1 + previous) * width, width) and fit.maps[layer].previous == previous
        np.testing.assert_allclose(fit.maps[layer].weight, maps[layer][0], atol=1e-4)
        np.testing.assert_allclose(fit.maps[layer].bias, maps[layer][1], atol=1e-4)
    run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
    save(model, tmp_path / "fitted", source=folder)
    ids = rng.randint(0, VOCAB, size=(1, 11))
    np.testing.assert_allclose(ort_logits(tmp_path / "fitted", ids), logits(reference, ids), atol=1e-4, rtol=0)
    inputs = [i.name for i in session(tmp_path / "fitted").get_inputs()]
    states = [n for n in inputs if is_state_past(n)]
    if not cache:
        assert not states
        return
    assert [n for n in inputs if is_past(n)] == [f"past_key_values.{i}.{p}" for i in (0, 1) for p in ("key", "value")]
    info = api.inspect(tmp_path / "fitted")
    assert info["kv_layers"] == [0, 2]
    assert sorted(states) == [f"past_key_values.{layer}.{part}" for layer in LAYERS if previous
                              for part in ("conv_state", "recurrent_state")]
    assert info["state_layers"] == (LAYERS if previous else [])
    floats = (width + 1) * len(LAYERS) if previous else 0  # conv_state d, recurrent_state 1; float32: 4 bytes each
    assert info["state_bytes_per_sequence"] == 4 * floats


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_solo_fits_and_the_gated_fit_graph_equal_torch_with_maps_fitted_alone(exported, family, rng):
    """The fit search's pieces: every layer's map fitted alone on the unmodified model (one run for all), and the
    gated graph in which any set of them replaces attention, against PyTorch hooks, lstsq and PyTorch's loss."""
    from layerdrop.search.alpha_search import GatedSuffix
    from tests.torch_reference import perplexity as torch_perplexity
    from tests.torch_reference import with_maps

    folder, model = api.open_model(exported(family, True))
    windows, search = rng.randint(0, VOCAB, size=(4, 24)), rng.randint(0, VOCAB, size=(2, 16))
    solo = solo_fits(model, folder.path, Windows(windows, {}), LAYERS, ridges=(RIDGE,))
    torch_model = tiny_model(family)
    maps = {layer: fitted(torch_model, windows, [layer], RIDGE)[1][layer] for layer in LAYERS}
    for layer in LAYERS:
        np.testing.assert_allclose(solo.maps[layer].weight, maps[layer][0], atol=1e-4)
        np.testing.assert_allclose(solo.maps[layer].bias, maps[layer][1], atol=1e-4)
    suffix = GatedSuffix(model, folder.path, search, LAYERS, fits=solo.maps)
    for moved in ([LAYERS[1]], LAYERS):
        expected = torch_perplexity(with_maps(torch_model, {k: maps[k] for k in moved}), search)
        assert suffix.perplexity(dict.fromkeys(moved, 0.0), LAYERS[0]) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_mixed_gated_graph_equals_torch_with_fits_drops_and_shifted_bypasses(exported, family, rng):
    """The planner's refine stage: one graph in which each layer keeps its attention, takes its fitted map, or its
    mean-shifted V·O bypass at any alpha (0: a drop), against PyTorch with the same modules replaced (maps fitted
    there with lstsq, means from PyTorch hooks); also run from the state a lower layer's move leaves."""
    from layerdrop.passes.gated_search import FIT
    from layerdrop.search.alpha_search import GatedSuffix
    from layerdrop.search.measure import branch_means
    from tests.torch_reference import perplexity as torch_perplexity
    from tests.torch_reference import planned, with_maps

    folder, model = api.open_model(exported(family, True))
    windows, search = Windows(rng.randint(0, VOCAB, size=(4, 24)), {}), rng.randint(0, VOCAB, size=(2, 16))
    solo = solo_fits(model, folder.path, windows, LAYERS, ridges=(RIDGE,))
    means = branch_means(model, folder.path, windows, LAYERS)
    suffix = GatedSuffix(model, folder.path, search, LAYERS, means, fits=solo.maps, mixed=True)
    torch_model = tiny_model(family)
    maps = {layer: fitted(torch_model, windows.ids, [layer], RIDGE)[1][layer] for layer in LAYERS}
    for moves in ({1: FIT, 3: 0.3}, {1: 0.0, 3: FIT}, {1: 0.6}, {3: FIT}, {1: FIT, 3: FIT}, {1: 0.0, 3: 1.0}):
        alphas = {k: v for k, v in moves.items() if v != FIT}
        reference = with_maps(planned(torch_model, alphas, windows) if alphas else torch_model,
                              {k: maps[k] for k, v in moves.items() if v == FIT})
        expected = torch_perplexity(reference, search)
        assert suffix.perplexity(moves, LAYERS[0]) == pytest.approx(expected, rel=1e-4), moves
        if len(moves) == 2:  # the upper layer's move run from the state the lower one's leaves
            (low, low_move), (high, high_move) = sorted(moves.items())
            split = suffix.perplexity({high: high_move}, high, below={low: low_move})
            assert split == pytest.approx(expected, rel=1e-4), moves


def test_each_layers_ridge_is_the_one_with_the_least_error_on_the_validation_windows(exported, rng):
    folder, model = api.open_model(exported("llama", True))
    calib, validation = rng.randint(0, VOCAB, size=(3, 24)), rng.randint(0, VOCAB, size=(2, 24))
    ridges = (1e-3, 1e-1, 1.0)
    fit = fit_attention(model, folder.path, Windows(calib, {}), [1, 2], validation=validation, ridges=ridges)
    torch_model = tiny_model("llama")
    for layer in (1, 2):  # layer 2's validation states come from the model with layer 1's chosen map in place
        below, _ = fitted(torch_model, calib, [1], fit.ridges[1]) if layer == 2 else (torch_model, None)
        x, y = attention_io(below, validation, layer)
        expected = {}
        for ridge in ridges:
            weight, bias = fitted(below, calib, [layer], ridge)[1][layer]
            expected[ridge] = float(np.sum((x @ weight + bias - y) ** 2)) / len(x)
        tried = {t["ridge"]: t["error"] for t in fit.trials if t["layer"] == layer}
        assert tried == pytest.approx(expected, rel=1e-3)
        assert fit.ridges[layer] == min(expected, key=expected.get)


def test_a_fit_on_fewer_tokens_than_the_hidden_size_is_refused(exported, rng):
    folder, model = api.open_model(exported("llama", True))
    with pytest.raises(LayerdropError, match="at least 33 calibration tokens"):
        fit_attention(model, folder.path, Windows(rng.randint(0, VOCAB, size=(1, 20)), {}), [1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_previous_tokens_state_is_carried_from_step_to_step_and_padding_is_masked(exported, family, rng,
                                                                                       tmp_path):
    """Greedy decoding of a left-padded batch through the cache, prefilled 3 tokens at a time (so a piece boundary
    falls inside the padding), gives each prompt the tokens and logits PyTorch gives it alone, without a cache."""
    from layerdrop.runtime.bench import device_greedy
    from layerdrop.runtime.generate import greedy_batch, left_pad
    from tests.torch_reference import greedy

    folder, model = api.open_model(exported(family, True))
    windows = rng.randint(0, VOCAB, size=(4, 24))
    fit = fit_attention(model, folder.path, Windows(windows, {}), LAYERS, ridges=(RIDGE,), previous=True)
    run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
    save(model, tmp_path / "fitted", source=folder)
    reference = with_maps(tiny_model(family), fit.maps)
    prompts = [list(rng.randint(0, VOCAB, size=7)), list(rng.randint(0, VOCAB, size=2))]
    ids, mask = left_pad(prompts, 0)
    tokens, found = greedy_batch(session(tmp_path / "fitted"), ids, mask, 5, keep_logits=True, prefill_chunk=3)
    for row, prompt in enumerate(prompts):
        expected_tokens, expected_logits = greedy(reference, np.array([prompt]), 5)
        assert tokens[row] == expected_tokens
        np.testing.assert_allclose(np.array(found[row]), np.array(expected_logits), atol=1e-4, rtol=0)
    # the bench's decoding, which binds each step's outputs as the next step's inputs on the device
    assert device_greedy(session(tmp_path / "fitted"), np.array([prompts[0]]), 5) == greedy(
        reference, np.array([prompts[0]]), 5)[0]


def test_the_gated_fit_graph_takes_maps_that_read_the_previous_token(exported, rng):
    """The fit search's graph with maps of [X_t, X_{t-1}]: any set of them in place of attention, against PyTorch's
    loss with the same maps."""
    from layerdrop.search.alpha_search import GatedSuffix
    from tests.torch_reference import perplexity as torch_perplexity

    folder, model = api.open_model(exported("llama", True))
    windows, search = rng.randint(0, VOCAB, size=(4, 24)), rng.randint(0, VOCAB, size=(2, 16))
    solo = solo_fits(model, folder.path, Windows(windows, {}), LAYERS, ridges=(RIDGE,), previous=True)
    torch_model = tiny_model("llama")
    suffix = GatedSuffix(model, folder.path, search, LAYERS, fits=solo.maps)
    for moved in ([LAYERS[1]], LAYERS):
        expected = torch_perplexity(with_maps(torch_model, {k: solo.maps[k] for k in moved}), search)
        assert suffix.perplexity(dict.fromkeys(moved, 0.0), LAYERS[0]) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("previous", [False, True])
def test_a_map_whose_rows_do_not_match_its_previous_flag_is_refused(exported, previous):
    """A map says whether it reads the previous token; one with the other flag's rows (d for 2d, 2d for d) is
    refused, the graph left as it was."""
    from layerdrop.errors import LayerdropError
    from layerdrop.passes.fit_attention import FitAttentionPass, FittedMap

    _, model = api.open_model(exported("llama", True))
    nodes = len(list(model.graph))
    width = 32
    wrong = FittedMap(np.zeros(((2 - previous) * width, width), np.float32), np.zeros(width, np.float32), previous)
    with pytest.raises(LayerdropError):
        FitAttentionPass({1: wrong})(model)
    assert len(list(model.graph)) == nodes
