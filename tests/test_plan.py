"""`layerdrop plan`: the planner honours its budget exactly, compares the papers' methods on the same windows
with figures equal to PyTorch's, and writes a model equal to the PyTorch reference for the chosen moves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from layerdrop import api
from layerdrop.cli import main
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB, logits, tiny_model
from tests.torch_reference import planned as planned_reference

NO_TASK = ["--accuracy-items", "0", "--validation-items", "0"]  # no lm-eval items: those are tested once


@pytest.fixture(scope="module")
def planned(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "model"
    report = tmp_path_factory.mktemp("plan-json") / "plan.json"
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(out), "--budget", "kv=0.5", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--extra", "1",
                 "--moves", "drop,bypass,shift", "--json", str(report), "--no-progress"])
    assert code == 0
    return out, json.loads(report.read_text())


def test_plan_honours_the_budget_exactly(planned, exported):
    out, result = planned
    assert result["attention_layers"] == 2 and result["kv_fraction_kept"] == 0.5
    assert len(result["pick"]["alphas"]) == 2
    for row in result["methods"]:
        assert len(row["alphas"]) == 2, row
    assert api.inspect(out)["kv_bytes_per_token"] * 2 == api.inspect(exported("llama", True))["kv_bytes_per_token"]
    assert len(api.inspect(out)["kv_layers"]) == 2


def test_every_method_is_compared_and_the_pick_is_measured_like_torch(planned, exported):
    """The table's figures for the pick are PyTorch's perplexities of the planned model on the same windows."""
    from tests.torch_reference import perplexity as torch_perplexity

    _, result = planned
    folder = exported("llama", True)
    alphas = {int(k): v for k, v in result["pick"]["alphas"].items()}
    means = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    reference = planned_reference(tiny_model("llama"), alphas, means if result["pick"]["shift"] else None)
    digest = means.source["sha256"]  # search windows come from the calibration text's own search part
    search = api.windows_for(folder, None, role="search", samples=2, seq_len=32, calibration_sha256=digest).ids
    held_out = api.windows_for(folder, None, role="eval", samples=2, seq_len=32, calibration_sha256=digest).ids
    assert result["pick"]["search_ppl"] == pytest.approx(torch_perplexity(reference, search), rel=1e-4)
    assert result["pick"]["eval_ppl"] == pytest.approx(torch_perplexity(reference, held_out), rel=1e-4)
    names = {row["method"] for row in result["methods"]}
    assert {"planner (moves with the mean shift)", "paper 1: one-shot drop of the lowest scores",
            "paper 1: iterative drop", "HARP: top layers, searched alphas",
            "score-selected bypass, searched alphas"} <= names


def test_every_rows_fidelity_to_the_baseline_is_pytorchs_on_the_first_held_out_windows(planned, exported):
    """Each row's KL(baseline || row) and top-1 agreement on the fidelity windows (the held-out windows the
    baseline's log-probabilities fit in) are PyTorch's for the same moves; the table shows them."""
    from scipy.special import log_softmax

    from layerdrop.api.reports import plan_table

    _, result = planned
    folder = exported("llama", True)
    means = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    held_out = api.windows_for(folder, None, role="eval", samples=2, seq_len=32,
                               calibration_sha256=means.source["sha256"])
    assert result["fidelity_text"]["starts"] == held_out.source["starts"] and result["fidelity_text"]["tokens"] == 64
    base = log_softmax(logits(tiny_model("llama"), held_out.ids).astype(np.float64), axis=-1)
    for row in result["methods"]:
        alphas = {int(k): v for k, v in row["alphas"].items()}
        other = log_softmax(logits(planned_reference(tiny_model("llama"), alphas, means if row["shift"] else None),
                                   held_out.ids).astype(np.float64), axis=-1)
        kl = (np.exp(base) * (base - other)).sum(-1).mean()
        assert row["kl"] == pytest.approx(kl, rel=1e-3, abs=1e-7), row["method"]
        assert row["top1_agreement"] == pytest.approx(np.mean(base.argmax(-1) == other.argmax(-1))), row["method"]
    assert "KL from the baseline" in plan_table(result) and f"{result['pick']['kl']:.4f}" in plan_table(result)


def test_the_fidelity_windows_hold_what_the_reference_bytes_allow():
    from layerdrop.api.plan.measure import FIDELITY_BYTES, fidelity_windows
    from layerdrop.windows import Windows

    held = Windows(np.arange(32 * 256).reshape(32, 256), {"starts": list(range(32)), "samples": 32, "seq_len": 256})
    small = fidelity_windows(held, 49152)  # SmolLM2's vocabulary: whole windows
    assert small.ids.shape == (FIDELITY_BYTES // (4 * 49152 * 256), 256) and small.source["starts"] == [0, 1, 2, 3, 4]
    large = fidelity_windows(held, 2 * FIDELITY_BYTES // 1024)  # a vocabulary where 256 tokens do not fit
    assert large.ids.shape == (1, 128) and large.source["seq_len"] == 128
    np.testing.assert_array_equal(large.ids, held.ids[:1, :128])


def test_rows_run_from_the_baselines_kept_states_like_torch(exported):
    """A measured row runs from the baseline's hidden state at its lowest changed layer, kept from the baseline's
    own runs on every window set; its perplexities are still PyTorch's for the same moves."""
    from layerdrop.api.common import open_model
    from layerdrop.api.plan.candidates import Candidate
    from layerdrop.api.plan.measure import Measure, choose_prefix
    from layerdrop.api.plan.texts import HeldOut
    from layerdrop.runtime.session import RunOptions
    from layerdrop.windows import bundled_text
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", True)
    _, model = open_model(folder)
    windows = {role: api.windows_for(folder, None, role=role, samples=2, seq_len=32) for role in ("search", "eval")}
    docs = api.windows_for(folder, bundled_text("docs"), role="eval", samples=2, seq_len=32)
    held_out = HeldOut(windows["eval"], [docs], None)
    candidates = [Candidate("drop 2 and 3", {2: 0.0, 3: 0.0}), Candidate("bypass 3", {3: 0.5}),
                  Candidate("drop 1, bypass 3", {1: 0.0, 3: 0.3}), Candidate("drop 0", {0: 0.0})]
    prefix = choose_prefix(model, candidates, 6, 32)
    assert sorted(prefix.entries) == [1, 2, 3]  # layer 0 saves nothing
    measure = Measure(model, folder, windows["search"], held_out, 4, RunOptions(threads=1), prefix=prefix)
    measure.row(Candidate("baseline"))
    assert {k: v["eval"].shape for k, v in prefix.states.items()} == {k: (2, 32, 32) for k in (1, 2, 3)}
    for candidate, start in zip(candidates, (2, 3, 1, None)):
        row = measure.row(candidate)
        assert prefix.start(model, candidate) == start
        reference = planned_reference(tiny_model("llama"), candidate.alphas)
        assert row.search_ppl == pytest.approx(torch_perplexity(reference, windows["search"].ids), rel=1e-4)
        assert row.eval_ppl == pytest.approx(torch_perplexity(reference, windows["eval"].ids), rel=1e-4)
        assert list(row.also_eval_ppl.values())[0] == pytest.approx(torch_perplexity(reference, docs.ids), rel=1e-4)


def test_planned_model_equals_torch_reference_for_the_chosen_moves(planned, exported, rng):
    out, result = planned
    alphas = {int(k): v for k, v in result["pick"]["alphas"].items()}
    # the planner's means come from calibration windows of the calibration text
    windows = api.windows_for(exported("llama", True), None, role="calib", samples=4, seq_len=32)
    ids = rng.randint(0, VOCAB, size=(1, 10))
    reference_model = planned_reference(tiny_model("llama"), alphas, windows if result["pick"]["shift"] else None)
    reference = logits(reference_model, ids)
    np.testing.assert_allclose(ort_logits(out, ids), reference, atol=1e-4, rtol=0)


def test_the_shifted_planner_is_compared_with_the_same_moves_unshifted(planned):
    _, result = planned
    rows = {row["method"]: row for row in result["methods"]}
    shifted = rows["planner (moves with the mean shift)"]
    plain = rows["planner's layers and alphas without the shift"]
    assert shifted["shift"] and not plain["shift"] and shifted["alphas"] == plain["alphas"]
    assert not any(row["shift"] for name, row in rows.items() if not name.startswith("planner"))


def test_no_shift_plans_with_the_papers_moves_only(exported, tmp_path, rng):
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "model"), "--budget", "attn=1",
                 "--samples", "4", "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--extra",
                 "1", "--no-shift", "--moves", "drop,bypass", "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    assert [row["shift"] for row in result["methods"]] == [False] * 5 and result["moves"] == ["bypass", "drop"]
    assert result["methods"][-1]["method"] == "planner" and not result["pick"]["fits"]
    alphas = {int(k): v for k, v in result["pick"]["alphas"].items()}
    ids = rng.randint(0, VOCAB, size=(1, 10))
    reference = logits(planned_reference(tiny_model("llama"), alphas), ids)
    np.testing.assert_allclose(ort_logits(tmp_path / "model", ids), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("budget,message", [("attn=0", "from 1 to 4"), ("attn=9", "from 1 to 4"),
                                            ("kv=1.5", "fraction"), ("speed=2", "use attn=N"),
                                            ("attn=x", "not a number")])
def test_bad_budget_is_refused(exported, tmp_path, capsys, budget, message):
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "p"), "--budget", budget])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("previous", [False, True])
def test_fit_moves_plan_fitted_layers_equal_to_torch(exported, tmp_path, rng, previous):
    """--moves fit: the pick is a fitted row, and the written model is PyTorch's with maps fitted independently on
    the planner's calibration windows with the ridges it chose; with --fit-previous, maps of the previous token's
    state too, each carried as a one-token state in place of the layer's cache."""
    from layerdrop.api.reports import plan_table
    from tests.helpers import session
    from tests.torch_reference import fitted

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "model"), "--budget", "attn=2", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--moves", "fit",
                 "--json", str(report), "--no-progress", *([] if previous else ["--fit-per-token"])])
    assert code == 0
    result = json.loads(report.read_text())
    pick = result["pick"]
    assert pick["moves"] == ["fit"] and len(pick["fits"]) == 2 and not pick["alphas"]
    assert len(api.inspect(tmp_path / "model")["kv_layers"]) == 2
    windows = api.windows_for(folder, None, role="calib", samples=4, seq_len=32).ids
    model = tiny_model("llama")
    for layer in pick["fits"]:  # bottom-up, each with its own ridge, as the planner fitted them
        model, _ = fitted(model, windows, [layer], pick["ridges"][str(layer)], previous=previous)
    inputs = {i.name for i in session(tmp_path / "model").get_inputs()}
    assert {n for n in inputs if n.endswith(".conv_state")} == (
        {f"past_key_values.{k}.conv_state" for k in pick["fits"]} if previous else set())
    assert (tmp_path / "model" / "genai_config.json").exists()  # onnxruntime-genai carries the states too
    assert result["fit_previous"] == previous
    assert ("fit = fitted map of the token and the previous one" in plan_table(result)) == previous
    ids = rng.randint(0, VOCAB, size=(1, 10))
    np.testing.assert_allclose(ort_logits(tmp_path / "model", ids), logits(model, ids), atol=1e-4, rtol=0)


def test_self_samples_join_the_fits_calibration_windows_like_torch(exported, tmp_path, rng):
    """--self-samples 3: the written pick is PyTorch's model with maps fitted on the calibration windows and 3
    windows PyTorch samples from the unmodified model with the same draws (seed 0, a first token among the
    tokenizer's ordinary tokens), with the ridges the planner chose."""
    from tests.torch_reference import fitted, sampled

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "model"), "--budget", "attn=2", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--moves", "fit",
                 "--self-samples", "3", "--fit-per-token", "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    pick = result["pick"]
    assert pick["moves"] == ["fit"] and result["fit_text"]["self_samples"] == 3
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    special = {token["id"] for token in tokenizer["added_tokens"] if token["special"]}
    first = np.array([i for i in range(min(len(tokenizer["model"]["vocab"]), VOCAB)) if i not in special])
    calib = api.windows_for(folder, None, role="calib", samples=4, seq_len=32).ids
    windows = np.concatenate([calib, sampled(tiny_model("llama"), 3, calib.shape[1], first, seed=0)])
    model = tiny_model("llama")
    for layer in pick["fits"]:
        model, _ = fitted(model, windows, [layer], pick["ridges"][str(layer)])
    ids = rng.randint(0, VOCAB, size=(1, 10))
    np.testing.assert_allclose(ort_logits(tmp_path / "model", ids), logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--self-samples", "-1"], "--self-samples '-1': give 0"),
    (["--self-samples", "2", "--moves", "drop,bypass"], "--self-samples adds windows to the fits' calibration"),
    (["--fit-previous", "--moves", "drop,bypass"], "--fit-previous shapes the fitted attention maps: allow fit"),
])
def test_bad_self_samples_are_refused(exported, tmp_path, capsys, args, message):
    code = main(["plan", str(exported("llama", True)), "-o", str(tmp_path / "m"), "--budget", "attn=2", *args])
    assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_the_fit_search_measures_each_layers_map_like_torch_and_adds_layers_greedily(exported, tmp_path):
    """Each pool layer's map fitted alone (PyTorch hooks and numpy's lstsq on the planner's calibration windows, with
    the ridge it chose) gives, in PyTorch, the perplexity the planner logged for it; the first layer it takes is the
    best alone, and its row fits the layers it chose."""
    from tests.torch_reference import fitted
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, "--fit-per-token", str(folder), "-o", str(tmp_path / "model"),
                 "--budget", "attn=2", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--moves", "fit", "--extra", "1",
                 "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    calib = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    search = api.windows_for(folder, None, role="search", samples=2, seq_len=32,
                             calibration_sha256=calib.source["sha256"]).ids
    solo = [entry for entry in result["planner_log"] if entry["stage"] == "solo"]
    assert len(solo) == 3  # the pool: 2 + 1 extra
    for entry in solo:
        reference, _ = fitted(tiny_model("llama"), calib.ids, [entry["layer"]], entry["ridge"])
        assert entry["perplexity"] == pytest.approx(torch_perplexity(reference, search), rel=1e-4)
    greedy = [entry["layer"] for entry in result["planner_log"] if entry["stage"] == "greedy"]
    assert greedy[0] == min(solo, key=lambda e: (e["perplexity"], e["layer"]))["layer"] and len(greedy) == 2
    rows = [row for row in result["methods"] if row["method"].startswith("planner: fitted maps")]
    assert len(rows) == 1 and rows[0]["fits"] == sorted(greedy)


def test_the_planner_chooses_fit_drop_or_bypass_for_each_layer_like_torch(exported, tmp_path):
    """--per-layer-moves: after the fit search, each chosen layer's move is chosen again among its map, a drop and
    its shifted bypass. The refine stage's last figure is PyTorch's perplexity with those moves (the maps fitted alone,
    as the search tries them; the means from PyTorch hooks), and the written pick is PyTorch's model with the
    shifted bypasses in place and the maps fitted bottom-up on it, with the ridges the planner chose: the row's
    search figure is that model's perplexity. These windows give a row with a bypass and a fit."""
    from tests.torch_reference import fitted, with_maps
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, "--fit-per-token", str(folder), "-o", str(tmp_path / "model"),
                 "--budget", "attn=2", "--samples",
                 "16", "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--extra", "1",
                 "--per-layer-moves", "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    row = result["methods"][-1]
    assert row["method"] == "planner: the fit, drop or bypass it chose for each layer"
    assert row["alphas"] and row["fits"] and row["shift"]  # a mixed pick: the case under test
    assert set(row["moves"]) == {"fit", "shift", "bypass" if any(row["alphas"].values()) else "drop"}
    alphas = {int(k): v for k, v in row["alphas"].items()}
    calib = api.windows_for(folder, None, role="calib", samples=16, seq_len=32)
    search = api.windows_for(folder, None, role="search", samples=2, seq_len=32,
                             calibration_sha256=calib.source["sha256"]).ids
    log = result["planner_log"]
    refine = [entry for entry in log if entry["stage"] == "refine"]
    assert [entry["layer"] for entry in refine] == sorted({*alphas, *row["fits"]}, reverse=True)
    solo_ridges = {entry["layer"]: entry["ridge"] for entry in log if entry["stage"] == "solo"}
    solo_maps = {k: fitted(tiny_model("llama"), calib.ids, [k], solo_ridges[k])[1][k] for k in row["fits"]}
    searched = with_maps(planned_reference(tiny_model("llama"), alphas, calib), solo_maps)
    assert refine[-1]["perplexity"] == pytest.approx(torch_perplexity(searched, search), rel=1e-4)
    model = planned_reference(tiny_model("llama"), alphas, calib)
    for layer in row["fits"]:
        model, _ = fitted(model, calib.ids, [layer], row["ridges"][str(layer)])
    assert row["search_ppl"] == pytest.approx(torch_perplexity(model, search), rel=1e-4)  # the row's own graph


def test_a_search_text_makes_every_choice_and_the_estimates_stay_on_the_calibration_text(exported, tmp_path):
    """--search-text: the maps are fitted on the calibration text's windows, while the ridge of each is the one
    with the least squared error on windows of the search text (numpy on PyTorch hooks), and the search column is
    PyTorch's perplexity on those windows."""
    from layerdrop.search.fit import RIDGES
    from tests.torch_reference import attention_io, fitted
    from tests.torch_reference import perplexity as torch_perplexity

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, "--fit-per-token", str(folder), "-o", str(tmp_path / "model"),
                 "--budget", "attn=1", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--moves", "fit", "--extra", "1",
                 "--search-text", "docs", "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    assert result["search_text"]["file"] == "docs.txt" and result["fit_text"]["file"] == "calib.txt"
    calib = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    search = api.windows_for(folder, "docs", role="search", samples=2, seq_len=32,
                             calibration_sha256=calib.source["sha256"])
    pick = result["pick"]
    (layer,) = pick["fits"]
    x, y = attention_io(tiny_model("llama"), search.ids, layer)
    if search.source["bos"]:  # the fit leaves the BOS out
        keep = np.arange(len(x)) % search.ids.shape[1] != 0
        x, y = x[keep], y[keep]
    references = {ridge: fitted(tiny_model("llama"), calib.ids, [layer], ridge) for ridge in RIDGES}
    errors = {ridge: float(np.sum((x @ maps[layer][0] + maps[layer][1] - y) ** 2))
              for ridge, (_, maps) in references.items()}
    chosen = pick["ridges"][str(layer)]
    assert errors[chosen] <= min(errors.values()) * (1 + 1e-6)
    assert pick["search_ppl"] == pytest.approx(torch_perplexity(references[chosen][0], search.ids), rel=1e-4)


@pytest.mark.parametrize("held_out", [[], ["--also-eval", "code"]])
def test_a_search_text_that_is_held_out_is_refused(exported, tmp_path, capsys, held_out):
    search = "code" if held_out else "eval"  # the --eval text by default, or an --also-eval one
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "p"), "--budget", "attn=1",
                 "--samples", "4", "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32",
                 "--search-text", search, *held_out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not (tmp_path / "p").exists()
    assert f"--search-text {search}.txt is also a held-out text" in err[0]


@pytest.mark.parametrize("moves", ["fit", "drop,bypass,shift"])
def test_per_layer_moves_without_both_kinds_of_move_are_refused(exported, tmp_path, capsys, moves):
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "p"), "--budget", "attn=1",
                 "--moves", moves, "--per-layer-moves"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "allow fit and drop or bypass" in err[0] and not (tmp_path / "p").exists()


def test_unknown_move_words_are_refused(exported, tmp_path, capsys):
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "p"), "--budget", "attn=1",
                 "--moves", "drop,teleport"])
    assert code == 2 and "bad --moves 'drop,teleport'" in capsys.readouterr().err


def test_a_blocks_budget_compares_shortgpt_and_replaceme_and_writes_the_pick(exported, tmp_path, rng):
    from tests.torch_reference import replaced, replaceme_reference

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "model"), "--budget", "blocks=1", "--samples", "4",
                 "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--json", str(report),
                 "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    names = [row["method"] for row in result["methods"]]
    assert names == ["ShortGPT-style block drop of the lowest block scores",
                     "ReplaceMe: its selection and fitted transform"]
    pick = result["pick"]
    assert len(pick["blocks"]) == 1 and len(api.inspect(tmp_path / "model")["kv_layers"]) == 3
    if pick["replaced_into"] is None:
        reference = replaced(tiny_model("llama"), [("block", pick["blocks"][0])])
    else:
        windows = api.windows_for(folder, None, role="calib", samples=4, seq_len=32).ids
        reference, start, _ = replaceme_reference(tiny_model("llama"), windows, 1,
                                                  pick["ridges"][str(pick["replaced_into"])])
        assert start == pick["replaced_into"]
    ids = rng.randint(0, VOCAB, size=(1, 10))
    np.testing.assert_allclose(ort_logits(tmp_path / "model", ids), logits(reference, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("args", [["--budget", "blocks=1", "--moves", "drop"], ["--budget", "attn=1", "--moves",
                                                                              "blocks"]])
def test_moves_that_cannot_meet_the_budget_are_refused(exported, tmp_path, capsys, args):
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "p"), *args])
    assert code == 2 and "cannot meet this budget" in capsys.readouterr().err


def test_default_moves_leave_out_fits_the_windows_cannot_support(exported, tmp_path, capsys):
    """Too few calibration tokens for a fit (hidden size + 1): by default the planner says so and plans without
    fit rows; asked for by name, it refuses with the same reason."""
    folder = exported("llama", True)
    few = ["--samples", "1", "--search-samples", "1", "--eval-samples", "1", "--seq-len", "8", "--no-progress"]
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "model"), "--budget", "attn=1", "--extra", "1",
                 "--json", str(report), *few])
    assert code == 0
    result = json.loads(report.read_text())
    assert "fit" not in result["moves"] and not any(row["fits"] for row in result["methods"])
    assert len(result["skipped"]) == 1 and "a fit needs at least" in result["skipped"][0]
    assert result["skipped"][0] in capsys.readouterr().err  # the reason is also said to the user
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "fit"), "--budget", "attn=1", "--moves", "fit",
                 *few])
    assert code == 2 and "a fit needs at least" in capsys.readouterr().err
    assert not (tmp_path / "fit").exists()
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "blocks"), "--budget", "blocks=1", "--json",
                 str(report), *few])
    assert code == 0
    result = json.loads(report.read_text())
    assert [row["method"] for row in result["methods"]] == ["ShortGPT-style block drop of the lowest block scores"]
    assert "ReplaceMe row left out" in result["skipped"][0]


def _fixed_speedups(monkeypatch, measured: list) -> None:
    """Measured speedups replaced by fixed ones (real ones are noisy at this size): attention 10%, MLP 5% of each
    prefill; every structure asked for is appended to `measured` as (blocks, attention layers)."""
    from layerdrop.search.selection import PrefillMeter

    def speedup(meter, blocks=(), attention=(), runs=None):
        blocks, attention = sorted(blocks), sorted(set(attention) - set(blocks))
        measured.append((blocks, attention))
        return 100.0 / (100.0 - 15.0 * len(blocks) - 10.0 * len(attention))

    monkeypatch.setattr(PrefillMeter, "speedup", speedup)


def test_a_speedup_budget_can_be_met_with_whole_blocks(exported, tmp_path, capsys, monkeypatch):
    """`--budget speedup=X --moves blocks`: the fewest lowest-scored blocks whose measured prefill reaches X (by
    fixed speedups: two for 1.3x), compared as ShortGPT and ReplaceMe rows; a speedup no blocks reach (measured for
    real) is refused."""
    from tests.torch_reference import hook_scores

    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    small = ["--samples", "4", "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--no-progress"]
    measured: list = []
    with monkeypatch.context() as patch:
        _fixed_speedups(patch, measured)
        code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "model"), "--budget", "speedup=1.3@32",
                     "--moves", "blocks", "--json", str(report), *small])
    assert code == 0
    result = json.loads(report.read_text())
    assert result["attention_layers"] == 2 and result["moves"] == ["blocks"]
    assert [row["method"] for row in result["methods"]] == ["ShortGPT-style block drop of the lowest block scores",
                                                            "ReplaceMe: its selection and fitted transform"]
    assert len(api.inspect(tmp_path / "model")["kv_layers"]) == 2
    windows = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    scores = hook_scores(tiny_model("llama"), windows.ids)
    order = sorted((s, layer) for (kind, layer), s in scores.items() if kind == "block")
    assert result["methods"][0]["blocks"] == sorted(layer for _, layer in order[:2])
    assert all(not attention for _, attention in measured)  # blocks alone, lowest-scored first
    assert {tuple(blocks) for blocks, _ in measured} >= {tuple(sorted(layer for _, layer in order[:n])) for n in (1, 2)}
    code = main(["plan", *NO_TASK, str(folder), "-o", str(tmp_path / "far"), "--budget", "speedup=1000@32",
                 "--moves", "blocks", *small])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "out of reach by removing whole blocks" in err[-1] and not (tmp_path / "far").exists()


def test_the_prefill_meter_times_what_the_moves_leave(exported):
    """Sizing measures a rewrite of the structure the moves leave: blocks gone with their caches, attention layers
    as one MatMul + Add from their normalized input (zeros: only the time counts), or gone with `maps` off; that
    graph computes what PyTorch does with those blocks and layers removed, and its speedup is a timed ratio."""
    from layerdrop.api.common import open_model
    from layerdrop.passes.find_residuals import annotated_regions
    from layerdrop.runtime.feeds import is_past, prefill_feed
    from layerdrop.runtime.session import make_session
    from layerdrop.search.selection import PrefillMeter
    from tests.torch_reference import replaced

    folder, model = open_model(exported("llama", True))
    base = make_session(model, folder=folder.path)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(1, 16))
    for maps in (True, False):
        meter = PrefillMeter(model, folder.path, 32, base, runs=2, maps=maps)
        structure = meter.structure([1], [3])
        kinds = {(r.kind, r.layer) for r in annotated_regions(structure)}
        assert kinds == {("attn", 0), ("mlp", 0), ("attn", 2), ("mlp", 2), ("mlp", 3)} | ({("fit", 3)} if maps
                                                                                           else set())
        assert len([v for v in structure.graph.inputs if is_past(v.name)]) == 4  # key and value of layers 0, 2
        # a zero map adds nothing: the same logits as PyTorch with block 1 and attention 3 removed
        reference = logits(replaced(tiny_model("llama"), [("block", 1), ("attn", 3)]), ids)
        session = make_session(structure, folder=folder.path)
        np.testing.assert_allclose(session.run(["logits"], prefill_feed(session, ids))[0], reference, atol=1e-4)
        assert meter.speedup([1], [3]) > 0 and list(meter.measured) == [(frozenset({1}), frozenset({3}))]


def test_graphs_of_one_structure_share_one_pooled_timing(exported):
    """The same ops on the same weight shapes are one structure, whichever layers moved and whatever the weights (a
    fitted map in layer 1 or 3; a fitted run folded into a down-projection, or the same number of blocks dropped);
    the meter times a structure once, tops it up when asked for more runs, and its figure is the ratio of the
    medians of all its runs."""
    import statistics

    from layerdrop.api.common import open_model
    from layerdrop.runtime.session import make_session
    from layerdrop.search.blocks import with_replaced_run
    from layerdrop.search.selection import PrefillMeter, structure_key

    folder, model = open_model(exported("llama", True))
    meter = PrefillMeter(model, folder.path, 32, make_session(model, folder=folder.path), runs=2)
    rng = np.random.default_rng(0)
    one, three = meter.structure([], [1]), meter.structure([], [3])
    assert structure_key(one) == structure_key(three) != structure_key(meter.structure([], [1, 3]))
    dropped = PrefillMeter(model, folder.path, 32, None, maps=False).structure([], [1])
    assert structure_key(one) != structure_key(dropped)
    folded = with_replaced_run(model, 0, 1, rng.normal(size=(32, 32)).astype(np.float32))
    assert structure_key(folded) == structure_key(meter.structure([1], []))
    assert structure_key(folded) != structure_key(meter.structure([2, 3], []))
    first = meter.speedup([], [1])
    assert meter.timed(three, 2) == (first, 2, structure_key(one))  # layer 3's map: layer 1's timing, no new runs
    speedup, runs, key = meter.timed(three, 5)  # topped up to 5 runs
    base_ms, ms = meter.timings[key]
    assert runs == len(base_ms) == len(ms) == 5 and speedup == statistics.median(base_ms) / statistics.median(ms)


def test_interleaved_runs_warm_each_runner_its_own_count_then_alternate():
    """`_interleaved` runs each runner its own number of untimed warm-ups (a fresh session two, a warm base one),
    then alternates them, timing each run."""
    from layerdrop.runtime.bench import _interleaved

    order = []
    runners = [lambda: order.append("base"), lambda: order.append("new")]
    times = _interleaved(runners, 3, [1, 2])
    assert order == ["base", "new", "new"] + ["base", "new"] * 3
    assert [len(t) for t in times] == [3, 3] and all(ms >= 0 for t in times for ms in t)
    order.clear()
    _interleaved(runners, 1, 2)
    assert order == ["base", "new", "base", "new", "base", "new"]


def test_the_sizing_confirms_its_count_with_the_tables_runs():
    """A count that reaches the budget on the sizing's few runs but falls short on the table's is not taken: the
    search goes on to the next count that holds on the confirming runs."""
    from layerdrop.search.selection import PrefillMeter, count_for_speedup

    scores = {layer: float(layer) for layer in range(10)}
    asked = []

    class Noisy(PrefillMeter):
        def speedup(self, blocks=(), attention=(), runs=None):
            count, runs = len(attention), runs or self.runs
            asked.append((count, runs))
            saved = 0.03 * count + (0.02 if count == 4 and runs < 5 else 0.0)  # 4 looks faster on 3 runs
            self.measured[(frozenset(blocks), frozenset(attention))] = 1 / (1 - saved)
            return 1 / (1 - saved)

    value = 1 / (1 - 0.13)  # 5 layers save 0.15; 4 save 0.12 (0.14 on 3 runs)
    assert count_for_speedup(value, Noisy(None, None, 64, None, runs=3, confirm_runs=5), scores, ("attn",)) == 5
    assert (4, 5) in asked and asked[-1] == (5, 5)
    asked.clear()
    assert count_for_speedup(value, Noisy(None, None, 64, None, runs=3), scores, ("attn",)) == 4  # no confirming


def test_no_row_fits_every_attention_layer_where_attention_cannot_reach_the_block_rows_speed():
    """Where the block rows are faster than attention alone can be (every attention layer but one, which keeps the
    cache the past length is read from), the row matched to the block rows' speed is left out with a note, even
    when the planner's pool would hold every layer."""
    from layerdrop.api.plan.budget import row_counts
    from layerdrop.search.selection import PrefillMeter, parse_budget

    class Linear(PrefillMeter):  # a block saves 0.35 of prefill, an attention layer 0.1
        def speedup(self, blocks=(), attention=(), runs=None):
            blocks, attention = frozenset(blocks), frozenset(attention)
            found = 1 / (1 - 0.35 * len(blocks) - 0.1 * len(attention - blocks))
            self.measured[(blocks, attention)] = found
            return found

    scores = {layer: float(layer) for layer in range(4)}
    skipped = []
    counts = row_counts(parse_budget("speedup=1.4", 4), Linear(None, None, 64, None), scores, scores,
                        frozenset({"blocks", "fit"}), 1, skipped)
    assert (counts.attention, counts.blocks) == (3, 1)  # 1.43x by 3 layers, 1.54x by a block: out of their reach
    assert counts.matched is None
    assert skipped == ["no row of fitted attention at the block rows' 1.538x: attention alone does not reach it"]


def _speedup_plan(exported, tmp_path, monkeypatch, value: float):
    """`plan --budget speedup=VALUE@32 --moves blocks,fit` on the tiny Llama with fixed sizing speedups; returns its
    folder and the report's path."""
    _fixed_speedups(monkeypatch, [])
    folder = exported("llama", True)
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, "--fit-per-token", str(folder), "-o", str(tmp_path / "model"), "--budget",
                 f"speedup={value}@32",
                 "--moves", "blocks,fit", "--samples", "4", "--search-samples", "2", "--eval-samples", "2",
                 "--seq-len", "32", "--speedup-runs", "2", "--json", str(report)])
    assert code == 0
    return folder, report


def test_a_speedup_budget_mixes_a_fitted_run_with_fitted_attention(exported, tmp_path, monkeypatch):
    """`--budget speedup=X --moves blocks,fit`: besides the attention rows and the block rows, a row with
    ReplaceMe's run of fewer blocks and the lowest-scored attention layers outside it fitted on the model with the
    run in place, sized by measured prefill (fixed speedups here); its perplexity is PyTorch's with the run and the
    map fitted independently (numpy's lstsq on PyTorch hooks), and every row has its KV share and a measured
    speedup."""
    from layerdrop.api.reports import plan_table
    from tests.torch_reference import fitted, hook_scores, replaceme_reference
    from tests.torch_reference import perplexity as torch_perplexity

    # 1.3x: attention alone needs 3 layers (70 left), blocks alone 2 (70 left), a run of 1 block + 1 layer (75 left)
    folder, report = _speedup_plan(exported, tmp_path, monkeypatch, 1.3)
    result = json.loads(report.read_text())
    assert result["attention_layers"] == 3 and result["block_count"] == 2 and result["speedup_tokens"] == 32
    rows = {row["method"]: row for row in result["methods"]}
    mixed = rows.pop("ReplaceMe's run of 1 blocks, attention fit on 1 lowest-scored")
    assert {"ShortGPT-style block drop of the lowest block scores", "ReplaceMe: its selection and fitted transform",
            "attention fit on the lowest-scored layers", "paper 1: iterative drop"} <= set(rows)
    windows = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    reference, start, _ = replaceme_reference(tiny_model("llama"), windows.ids, 1, mixed["run_ridge"])
    assert mixed["replaced_into"] == start and mixed["blocks"] == [start + 1] and mixed["moves"] == ["blocks", "fit"]
    scores = hook_scores(tiny_model("llama"), windows.ids)  # the plan scored the unscored model on these windows
    lowest = min((s, layer) for (kind, layer), s in scores.items() if kind == "attn" and layer != start + 1)[1]
    assert mixed["fits"] == [lowest] and mixed["kv_kept"] == 0.5
    reference, _ = fitted(reference, windows.ids, [lowest], mixed["ridges"][str(lowest)])
    search = api.windows_for(folder, None, role="search", samples=2, seq_len=32,
                             calibration_sha256=windows.source["sha256"]).ids
    assert mixed["search_ppl"] == pytest.approx(torch_perplexity(reference, search), rel=1e-4)
    for row in result["methods"]:
        assert row["speedup"] > 0 and 0 <= row["kv_kept"] < 1 and row["speedup_runs"] >= 2
    structures = {}  # rows of one structure share one timing: the two fits of 3 layers, the two drops of 3
    for row in result["methods"]:
        structures.setdefault(row["structure"], set()).add(row["speedup"])
    assert all(len(figures) == 1 for figures in structures.values())
    assert rows["attention fit on the lowest-scored layers"]["structure"] == rows["planner: fitted maps on the "
                                                                                  "layers it chose"]["structure"]
    assert len(structures) < len(result["methods"])
    table = plan_table(result)
    assert "prefill speedup at 32 tokens" in table
    assert f"| {lowest}:fit; blocks {start + 1}-{start + 1} into {start} |" in table


def test_fits_get_a_row_at_the_block_rows_speed_where_blocks_overshoot(exported, tmp_path, monkeypatch):
    """Under a speedup budget, where the block rows' measured speedup is above the attention rows' (a block is a
    coarser step), the planner's greedy search goes on past its count and a row fits the first layers it takes
    that reach the block rows' speedup (fixed speedups: 1.2x takes 2 layers at 1.25x and 2 blocks at 1.43x, which
    3 layers match); its layers extend the planner's, and its perplexity is PyTorch's with the same layers fitted
    independently, bottom-up."""
    from tests.torch_reference import fitted
    from tests.torch_reference import perplexity as torch_perplexity

    folder, report = _speedup_plan(exported, tmp_path, monkeypatch, 1.2)
    result = json.loads(report.read_text())
    assert result["attention_layers"] == 2 and result["block_count"] == 2
    rows = {row["method"]: row for row in result["methods"]}
    matched = rows["planner: fitted maps on the 3 layers it chose first, at the block rows' speed"]
    planner = next(row for name, row in rows.items() if name.startswith("planner: fitted maps on the layers"))
    assert len(matched["fits"]) == 3 and set(planner["fits"]) < set(matched["fits"])
    assert matched["structure"] != planner["structure"]  # timed on its own (the table's timing is real here)
    assert matched["kv_kept"] == 0.25 and matched["moves"] == ["fit"]
    windows = api.windows_for(folder, None, role="calib", samples=4, seq_len=32)
    reference = tiny_model("llama")
    for layer in matched["fits"]:  # bottom-up: each layer fitted on the states the maps below it leave
        reference, _ = fitted(reference, windows.ids, [layer], matched["ridges"][str(layer)])
    search = api.windows_for(folder, None, role="search", samples=2, seq_len=32,
                             calibration_sha256=windows.source["sha256"]).ids
    assert matched["search_ppl"] == pytest.approx(torch_perplexity(reference, search), rel=1e-4)
    greedy = [entry for entry in result["planner_log"] if entry["stage"].startswith("greedy")]
    assert [entry["stage"] for entry in greedy] == ["greedy", "greedy", "greedy, past the budget"]
    assert {greedy[0]["layer"], greedy[1]["layer"]} == set(planner["fits"])
    assert set(matched["fits"]) - set(planner["fits"]) == {greedy[2]["layer"]}


def test_move_words_each_budget_takes():
    """attn and kv budgets take the attention moves, blocks=N the blocks move alone, a speedup any mix (all by
    default)."""
    from layerdrop.api.plan import MOVES, parse_moves
    from layerdrop.errors import LayerdropError

    assert parse_moves(None, "speedup") == frozenset(MOVES)
    assert parse_moves(None, "kv") == frozenset(MOVES) - {"blocks"}
    assert parse_moves(None, "blocks") == {"blocks"}
    assert parse_moves("blocks,fit", "speedup") == {"blocks", "fit"}
    for words, kind in (("blocks,fit", "blocks"), ("fit,blocks", "attn"), ("blocks,shift", "speedup")):
        with pytest.raises(LayerdropError):
            parse_moves(words, kind)


@pytest.mark.parametrize("curve", ["linear", "convex", "steps"])
def test_speedup_sizing_finds_the_fewest_modules(curve):
    """The count a speedup budget takes is the fewest lowest-scored modules whose measured speedup reaches it, as
    a scan over every count finds, for savings that grow linearly, faster than linearly or in uneven steps; on a
    smooth curve it measures a few counts, not all of them; out of reach is refused with the measured figure."""
    from layerdrop.errors import LayerdropError
    from layerdrop.search.selection import PrefillMeter, count_for_speedup, lowest_layers

    rng = np.random.default_rng(3)
    scores = {layer: float(s) for layer, s in enumerate(rng.random(30))}
    order = lowest_layers(scores, 29)
    steps = rng.random(30) * 0.02
    saved = {"linear": lambda n: 0.012 * n, "convex": lambda n: 0.0005 * n * n,
             "steps": lambda n: float(steps[:n].sum())}[curve]

    class Fixed(PrefillMeter):
        def speedup(self, blocks=(), attention=(), runs=None):
            assert not blocks and list(attention) == order[:len(attention)]  # the lowest-scored first
            self.measured[(frozenset(blocks), frozenset(attention))] = 1 / (1 - saved(len(attention)))
            return 1 / (1 - saved(len(attention)))

    for value in (1.05, 1.1, 1.2):
        meter = Fixed(None, None, 64, None)
        fewest = min(n for n in range(1, 30) if 1 / (1 - saved(n)) >= value)
        assert count_for_speedup(value, meter, scores, ("attn",)) == fewest
        assert len(meter.measured) <= 5
    with pytest.raises(LayerdropError, match=r"out of reach by removing attention alone.*all 29 give"):
        count_for_speedup(1 / (1 - saved(29)) + 0.5, Fixed(None, None, 64, None), scores, ("attn",))


def test_under_a_speedup_budget_the_pick_must_reach_it_in_the_tables_timing():
    """Under a speedup budget the pick is made among the rows whose measured speedup reaches it; where none does,
    among all, with the reason."""
    from layerdrop.api.plan import PlanRow, choose_pick

    def row(method: str, search_ppl: float, speedup: float) -> PlanRow:
        return PlanRow(method, {}, [], False, {}, [], None, None, [], 1.0, search_ppl, search_ppl, speedup=speedup)

    base = row("baseline", 20.0, 1.0)
    rows = [row("fast, worse", 30.8, 1.34), row("best, just short", 26.5, 1.29), row("fastest, worst", 80.0, 1.37)]
    assert choose_pick(rows, base, "search", 1.333)[:2] == (rows[0], None)
    assert choose_pick(rows, base, "search", None)[:2] == (rows[1], None)  # no speedup budget: all rows
    pick, short, _ = choose_pick(rows, base, "search", 1.5)
    assert pick is rows[1] and "no row reached 1.5x" in short and "1.37x" in short


def test_held_out_texts_that_share_a_file_name_keep_a_column_each(exported, tmp_path):
    """Two --also-eval texts named alike (in different folders) are two columns, each labelled with its hash."""
    from layerdrop.api.reports import plan_table

    texts = []
    for name, source in (("a", "docs"), ("b", "code")):
        folder = tmp_path / name
        folder.mkdir()
        texts.append(folder / "notes.txt")
        texts[-1].write_text((Path(__file__).parents[1] / "layerdrop" / "data" / f"{source}.txt").read_text())
    report = tmp_path / "plan.json"
    code = main(["plan", *NO_TASK, str(exported("llama", True)), "-o", str(tmp_path / "m"), "--budget", "attn=1",
                 "--moves", "drop", "--samples", "4", "--search-samples", "2", "--eval-samples", "2", "--seq-len",
                 "32", "--validation-samples", "0", "--also-eval", str(texts[0]), "--also-eval", str(texts[1]),
                 "--json", str(report), "--no-progress"])
    assert code == 0
    result = json.loads(report.read_text())
    labels = list(result["baseline"]["also_eval_ppl"])
    assert len(labels) == 2 and all(label.startswith("notes.txt #") for label in labels)
    values = result["baseline"]["also_eval_ppl"]
    assert values[labels[0]] != values[labels[1]]
    assert all(f"held-out ppl ({label})" in plan_table(result) for label in labels)


def test_the_plan_report_names_what_went_which_texts_and_a_command_that_makes_the_same_plan(exported, tmp_path,
                                                                                          capsys):
    """The printed report (also plan-report.md in the output) lists the layers the written model lost, every text
    the columns come from, how to run the output, and a command that, run again, writes the same pick."""
    import shlex

    folder = exported("llama", True)
    args = ["--budget", "attn=2", "--moves", "drop", "--samples", "4", "--search-samples", "2", "--eval-samples",
            "2", "--seq-len", "32", "--extra", "1", "--also-eval", "code", *NO_TASK, "--validation-samples", "2"]
    capsys.readouterr()
    assert main(["plan", str(folder), "-o", str(tmp_path / "first"), *args, "--json", str(tmp_path / "a.json"),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    report = (tmp_path / "first" / "plan-report.md").read_text()
    assert report.strip() in printed
    first = json.loads((tmp_path / "a.json").read_text())
    layers = sorted(int(k) for k in first["pick"]["alphas"])
    assert f"attention layers {', '.join(map(str, layers))}: dropped" in report
    assert "code.txt" in report and first["search_text"]["file"] in report and "model.onnx" in report
    command = report.split("Reproduce:")[1].split("```sh")[1].split("```")[0].strip()
    words = shlex.split(command)
    assert words[:2] == ["layerdrop", "plan"]
    words[words.index("-o") + 1] = str(tmp_path / "again")
    assert main([*words[1:], "--json", str(tmp_path / "b.json"), "--no-progress"]) == 0
    again = json.loads((tmp_path / "b.json").read_text())
    untimed = [[{k: v for k, v in row.items() if k not in ("speedup", "speedup_runs")} for row in report["methods"]]
               for report in (first, again)]
    assert again["pick"]["alphas"] == first["pick"]["alphas"] and untimed[0] == untimed[1]
