"""Scoring speed: layerdrop's ORT scoring vs a plain ORT forward vs PyTorch forward hooks.

    python benchmarks/bench_scoring.py --model out/smollm2-kv --hf ~/.cache/layerdrop/SmolLM2-135M-Instruct

Same 32 x 256 calibration tokens for all three, 2 threads each; prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.torch_reference

import torch
import transformers

from layerdrop.api import open_model, windows_for
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.measure import compute_scores
from tests.torch_reference import hook_scores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True, help="exported model folder")
    parser.add_argument("--hf", type=Path, required=True, help="the same model as a Hugging Face folder")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench-out/scoring.json"))
    args = parser.parse_args()

    windows = windows_for(args.model, Path("prose"), role="calib", samples=args.samples, seq_len=args.seq_len)
    folder, model = open_model(args.model)
    start = time.perf_counter()
    scores = compute_scores(model, folder.path, windows, options=RunOptions(threads=args.threads), progress=False)
    ort_scoring = time.perf_counter() - start

    start = time.perf_counter()  # both ORT timings include creating the session
    session = make_session(folder.onnx_path, threads=args.threads)
    for row in windows.ids:
        session.run(["logits"], prefill_feed(session, row[None]))
    plain = time.perf_counter() - start

    torch.set_num_threads(args.threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    start = time.perf_counter()
    reference = hook_scores(hf, windows.ids, skip_first=windows.bos)
    hooks = time.perf_counter() - start
    worst = max(abs(s.score - reference[(s.kind, s.layer)]) for s in scores)

    result = {"machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
              "tokens": f"{args.samples} x {args.seq_len}", "ort_scoring_s": ort_scoring, "ort_forward_s": plain,
              "torch_hooks_s": hooks, "max_score_diff_vs_torch": worst}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("| run | time |\n|---|---|")
    print(f"| layerdrop scoring (ORT, LM head cut) | {ort_scoring:.1f} s |")
    print(f"| plain ORT forward (with LM head) | {plain:.1f} s |")
    print(f"| PyTorch forward hooks | {hooks:.1f} s |")
    print(f"max |S_ort - S_torch| = {worst:.2e}; hooks/scoring = {hooks / ort_scoring:.2f}x, "
          f"forward/scoring = {plain / ort_scoring:.2f}x")


if __name__ == "__main__":
    main()
