"""Calibration scores from ONNX Runtime equal PyTorch forward hooks; score/inspect commands."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from layerdrop import api
from layerdrop.api import open_model
from layerdrop.cli import main
from layerdrop.errors import LayerdropError
from layerdrop.passes.calibration_taps import calibration_model
from layerdrop.search.measure import compute_scores
from layerdrop.windows import Sampling, Windows, bundled_text
from tests.conftest import ALL_FAMILIES
from tests.torch_reference import VOCAB, hook_scores, tiny_model


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv", "plain"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_scores_match_torch_hooks(exported, family, kv_cache, rng):
    folder, model = open_model(exported(family, kv_cache))
    windows = rng.randint(0, VOCAB, size=(3, 24))
    scores = compute_scores(model, folder.path, Windows(windows, {}), options=api.RunOptions(batch_size=2),
                            progress=False)
    reference = hook_scores(tiny_model(family), windows)
    assert len(scores) == 12
    for s in scores:
        assert s.score == pytest.approx(reference[(s.kind, s.layer)], abs=1e-5), (s.kind, s.layer)
        assert s.norm_ratio > 0


def test_calibration_copy_never_computes_the_lm_head(exported):
    _, model = open_model(exported("llama", True))
    calib, rows = calibration_model(model)
    ops = {n.op_type for n in calib.graph}
    lm_head = [n for n in calib.graph if n.op_type == "MatMul" and any(
        i is not None and i.shape is not None and VOCAB in list(i.shape) for i in n.inputs)]
    assert not lm_head and "Softmax" in ops
    assert {o.name for o in calib.graph.outputs} == {name for row in rows for name in row[2:]}
    assert len(model.graph.outputs) == 9, "the original model is not modified"


def test_score_command_writes_scored_folder_and_json(exported, tmp_path, capsys):
    src = exported("llama", True)
    out, report = tmp_path / "scored", tmp_path / "scores.json"
    assert main(["score", str(src), "-o", str(out), "--samples", "4", "--seq-len", "32", "--json", str(report),
                 "--no-progress"]) == 0
    data = json.loads(report.read_text())
    assert data["calibration"]["samples"] == 4 and data["calibration"]["seq_len"] == 32
    assert data["calibration"]["file"] == "calib.txt"
    assert {(r["kind"], r["layer"]) for r in data["regions"]} == {
        (k, i) for i in range(4) for k in ("attn", "mlp", "block")}
    proto = onnx.load(out / "model.onnx", load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["layerdrop.calibration"])["sha256"] == data["calibration"]["sha256"]
    scored = [n for n in proto.graph.node if any(p.key == "layerdrop.score" for p in n.metadata_props)]
    assert len(scored) == 8
    # inspect reads the same scores back from the scored folder
    info = api.inspect(out)
    by_key = {(r["kind"], r["layer"]): r["score"] for r in info["regions"]}
    for row in data["regions"]:
        if row["kind"] != "block":
            assert by_key[(row["kind"], row["layer"])] == row["score"]
    assert main(["inspect", str(out), "--plot", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "attn S" in capsys.readouterr().out


def test_scores_come_from_the_calibration_windows(exported, tiny_tokenizer_file):
    """From the start, the score equals the hook computation on exactly the first windows of the whole text's
    tokens (no special tokens)."""
    from tokenizers import Tokenizer

    folder = exported("qwen2", False)
    result = api.score(folder, None, samples=3, seq_len=40, sampling=Sampling(from_start=True), progress=False)
    ids = Tokenizer.from_file(str(tiny_tokenizer_file)).encode(
        bundled_text("calib").read_text(), add_special_tokens=False).ids
    windows = np.array(ids[:120]).reshape(3, 40)
    reference = hook_scores(tiny_model("qwen2"), windows)
    for row in result["regions"]:
        assert row["score"] == pytest.approx(reference[(row["kind"], row["layer"])], abs=1e-5)


def test_compare_reports_rank_overlap(exported, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text(bundled_text("eval").read_text()[:20000])
    code = main(["score", str(exported("llama", False)), "--samples", "4", "--seq-len", "32", "--compare",
                 str(other), "--top-n", "3", "--json", str(tmp_path / "c.json"), "--no-progress"])
    assert code == 0
    compare = json.loads((tmp_path / "c.json").read_text())["compare"]
    assert compare["n"] == 3 and 0 <= compare["shared"] <= 3
    assert compare["shared"] == len(set(map(tuple, compare["first"])) & set(map(tuple, compare["second"])))
    assert "rank overlap" in capsys.readouterr().out


def test_text_too_short_says_how_many_windows_it_holds(exported, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A short text. " * 20)
    with pytest.raises(LayerdropError, match=r"too little text for 50 windows of 64 tokens .*\(1 fit\)"):
        api.score(exported("llama", False), None, calib=short, samples=50, seq_len=64, progress=False)
    with pytest.raises(LayerdropError, match=r"holds \d+ tokens = \d windows of 64; asked for 50"):
        api.score(exported("llama", False), None, calib=short, samples=50, seq_len=64,
                  sampling=Sampling(from_start=True), progress=False)
