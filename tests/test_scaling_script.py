"""benchmarks/scaling.py: every stage runs in its own process and reports that process's wall time, CPU time and
peak memory, with the plan's phases, and a rerun measures only what is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torch_reference import VOCAB

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
    # another model's figures stay beside a rerun's where they were measured on the same machine at the same sizes,
    # with the commit they were measured at named on the page
    other = {**result, "model": "other-model", "parameters": result["parameters"] * 2, "commit": "1" * 40}
    elsewhere = {**report["machine"], "cpu": "another CPU"}
    for machine, quick, kept in ((report["machine"], True, True), (elsewhere, True, False), (report["machine"], False,
                                                                                             False)):
        old = {**report, "commit": "0" * 40, "machine": machine, "quick": quick, "results": [other, result]}
        (tmp_path / "scaling.json").write_text(json.dumps(old))
        assert subprocess.run(args, capture_output=True, text=True, timeout=300).returncode == 0
        entries = {r["model"]: r for r in json.loads((tmp_path / "scaling.json").read_text())["results"]}
        assert set(entries) == ({result["model"], "other-model"} if kept else {result["model"]})
        if kept:
            assert entries["other-model"]["commit"] == "1" * 40 and entries[result["model"]]["commit"] != "1" * 40
            assert "other-model at commit 1111111111" in (tmp_path / "scaling.md").read_text()
    (tmp_path / "scaling.json").write_text(json.dumps(report))
    (tmp_path / "scaling.md").unlink()
    rendered = subprocess.run([*args[:2], "--render-only", "--out", str(tmp_path)], capture_output=True, text=True)
    assert rendered.returncode == 0 and (tmp_path / "scaling.md").read_text() == page, rendered.stderr[-2000:]


def test_the_scaling_script_measures_a_builder_graph_and_serves_the_plan_with_genai(tiny_tokenizer_file, tmp_path):
    """--builder int4: the first stage is onnxruntime-genai's model builder, the same commands rewrite its graph, and
    onnxruntime-genai serves the plan's output; the entry sits beside an export's with its own commit."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install -e '.[genai]')")
    import onnx
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)  # head size 16, which the CPU GQA kernel takes
    folder = tmp_path / "tiny-llama"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    shutil.copy(tiny_tokenizer_file, folder / "tokenizer.json")
    earlier = {"model": "earlier-model", "parameters": 1e9, "layers": 2, "hidden_size": 8, "vocab_size": 8,
               "stages": {"export": {"wall_s": 1.0, "cpu_s": 1.0, "peak_rss_bytes": 1e8}}}
    (tmp_path / "scaling.json").write_text(json.dumps({"commit": "e" * 40, "date": "2026-01-01T00:00:00",
                                                       "quick": True, "results": [earlier], **_machine()}))
    args = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), str(folder), "--builder", "int4", "--quick",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path), "--threads", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "scaling.json").read_text())
    entries = {r["model"]: r for r in report["results"]}
    result = entries["tiny-llama (builder int4)"]
    assert result["graph"] == "builder int4" and result["commit"] == report["commit"]
    assert entries["earlier-model"]["commit"] == "e" * 40  # kept, with the commit it was measured at
    assert list(result["stages"]) == ["export", "score", "drop", "plan", "eval", "bench", "genai"]
    built = tmp_path / "work" / "tiny-llama-builder-int4" / "export"
    graph = onnx.load(str(built / "model.onnx"), load_external_data=False)
    assert {"MatMulNBits", "GroupQueryAttention"} <= {n.op_type for n in graph.graph.node}
    # parameters: the model's own count (the packed int4 weights counted as K x N), from PyTorch
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["layers"] == 4 and result["hidden_size"] == 64
    served = result["stages"]["genai"]["served"]
    assert served["new_tokens"] > 0 and served["tokens_per_s"] > 0
    page = (tmp_path / "scaling.md").read_text()
    assert "builder int4 --quick" in page and report["commit"][:10] in page and "e" * 10 in page
    assert f"served the plan's output of tiny-llama (builder int4): {served['new_tokens']} tokens" in page
    # the builder graph's stages carried to 8B as well, in proportion to its parameters (a drop as measured)
    paper = page.split("From tiny-llama (builder int4)")[1]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in paper.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")}
    assert list(rows) == list(result["stages"])
    factor = 8e9 / result["parameters"]
    for name, stage in result["stages"].items():
        assert float(rows[name][2]) == round(stage["wall_s"] * (1 if name == "drop" else factor))


def _machine() -> dict:
    """The machine fields of this machine's report, so that an earlier entry counts as measured here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reproduce import provenance

    return {"machine": provenance()["machine"]}


def test_a_model_that_fails_is_left_out_and_named(tmp_path):
    """A stage that fails (here an export of a folder that is not a model) leaves that model out, names it, exits 1
    and writes nothing where nothing was measured."""
    (tmp_path / "not-a-model").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), str(tmp_path / "not-a-model"),
                           "--quick", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "not-a-model left out" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "scaling.json").exists() and not (tmp_path / "out" / "scaling.md").exists()
    # --builder on something with no Hugging Face folder: the same, before any stage runs
    done = subprocess.run([*done.args, "--builder", "int4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "needs a Hugging Face folder" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
