"""The GPU benchmark script runs in its CPU form (short lengths, a tiny model), so it cannot rot while no
GPU is lent; and its device-resident decode loop generates what PyTorch generates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from layerdrop.runtime.bench import device_greedy
from tests.helpers import session
from tests.torch_reference import VOCAB, greedy, tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_bench.py"


def test_cuda_bench_runs_in_its_cpu_form(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--provider", "cpu", "--models", "tiny", "--seq", "32,64",
                           "--decode-context", "16", "--dtype", "float32", "--runs", "1", "--score-windows", "1",
                           "--score-seq", "32", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "cuda_bench.json").read_text())
    rows = result["models"]["tiny"]["rows"]
    assert rows["provider"] == "cpu" and [p["seq"] for p in rows["prefill"]] == [32, 64]
    assert all(len(p["ms"]) == 3 and all(t > 0 for t in p["ms"]) and all(i > 1 for i in p["ideal"])
               for p in rows["prefill"])
    base, dropped, harp = rows["kv_bytes_per_token"]
    assert dropped * 4 == base * 3 and harp * 4 == base * 3  # a quarter of 4 layers lose their cache
    assert all(s > 0 for s in rows["decode"][0]["tokens_per_s"])
    assert "| prefill 64 tokens, median ms |" in (tmp_path / "cuda_bench.md").read_text()


def test_device_resident_decoding_equals_torch_greedy(exported, rng):
    prompt = rng.randint(0, VOCAB, size=(1, 7))
    tokens = device_greedy(session(exported("llama", True)), prompt, 10)
    assert tokens == greedy(tiny_model("llama"), prompt, 10)[0]
