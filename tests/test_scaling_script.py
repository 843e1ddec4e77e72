"""benchmarks/scaling.py: every stage runs in its own process and reports that process's wall time, CPU time and
peak memory, with the plan's phases, and a rerun measures only what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_scaling_script_measures_each_stage_in_its_own_process_and_resumes(hf_folder, tmp_path):
    folder = hf_folder("llama")
    args = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), str(folder), "--quick", "--work",
            str(tmp_path / "work"), "--out", str(tmp_path), "--threads", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "scaling.json").read_text())
    (result,) = report["results"]
    assert list(result["stages"]) == ["export", "score", "drop", "plan", "eval", "bench"]
    assert result["layers"] == json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for name, stage in result["stages"].items():
        # a fresh Python process importing onnxruntime holds tens of MB; none of these tiny runs needs GBs
        assert 30e6 < stage["peak_rss_bytes"] < 4e9, name
        assert 0 < stage["cpu_s"] and 0 < stage["wall_s"], name
    phases = result["stages"]["plan"]["phases"]
    assert phases and phases[0]["started_s"] >= 0
    assert sum(p["seconds"] for p in phases) <= result["stages"]["plan"]["wall_s"] + 1
    assert (tmp_path / "work" / folder.name / "plan" / "model.onnx").is_file()
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[4] for line in rows[1:] if "plan:" not in line] == list(result["stages"])
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stderr.count("measured before, kept") == 6, again.stderr[-2000:]
    assert json.loads((tmp_path / "scaling.json").read_text())["results"][0]["stages"] == result["stages"]
    page = (tmp_path / "scaling.md").read_text()
    assert report["commit"][:10] in page
    assert [line for line in page.splitlines() if line.startswith("| ")][:len(rows)] == rows
    # on paper, each stage of the model carried to 8B parameters in proportion to its parameters
    factor = 8e9 / result["parameters"]
    paper = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.split("## Carried to 8B")[1].splitlines()
             if line.startswith("| ") and not line.startswith("| stage")}
    assert list(paper) == list(result["stages"])
    for name, stage in result["stages"].items():
        grows = 1 if name == "drop" else factor  # a drop reads no weights
        assert float(paper[name][2]) == round(stage["wall_s"] * grows)
        assert abs(float(paper[name][4]) - stage["peak_rss_bytes"] / 1e9 * grows) <= 0.05
    # another model's figures stay beside a rerun's only where they were measured at the same commit and machine
    other = {**result, "model": "other-model", "parameters": result["parameters"] * 2}
    for commit, kept in ((report["commit"], True), ("0" * 40, False)):
        (tmp_path / "scaling.json").write_text(json.dumps({**report, "commit": commit, "results": [other, result]}))
        assert subprocess.run(args, capture_output=True, text=True, timeout=300).returncode == 0
        models = {r["model"] for r in json.loads((tmp_path / "scaling.json").read_text())["results"]}
        assert models == ({result["model"], "other-model"} if kept else {result["model"]})
    (tmp_path / "scaling.json").write_text(json.dumps(report))
    (tmp_path / "scaling.md").unlink()
    rendered = subprocess.run([*args[:2], "--render-only", "--out", str(tmp_path)], capture_output=True, text=True)
    assert rendered.returncode == 0 and (tmp_path / "scaling.md").read_text() == page, rendered.stderr[-2000:]
