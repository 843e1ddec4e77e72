"""The onnxruntime-genai workflow on the default model (issue 7), timed, with its numbers for the README.

    python benchmarks/genai_workflow.py --out out/genai --json bench-out/genai.json

1. onnxruntime-genai's model builder turns the cached Hugging Face folder of SmolLM2 into an fp32 CPU folder;
2. layerdrop scores it, drops the 8 lowest-scored attention layers (plain, and with --fuse) and bypasses the top
   two attention layers with HARP;
3. perplexity of each on the bundled held-out text, prefill latency at 1024 tokens, and 32 greedy tokens from
   onnxruntime-genai compared with a plain ONNX Runtime session on the same folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the tests' helpers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out/genai"))
    parser.add_argument("--json", type=Path, default=Path("bench-out/genai.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--from-start", action="store_true", help="windows from the start of each text")
    args = parser.parse_args()

    from layerdrop import api
    from layerdrop.api import bench as compare
    from layerdrop.export.default_model import default_model_folder
    from layerdrop.runtime.generate import greedy_generate
    from layerdrop.runtime.session import make_session
    from layerdrop.windows import Sampling, load_tokenizer
    from tests.genai_helpers import genai_greedy, run_builder

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    built, scored = args.out / "built", args.out / "scored"
    timings = {}
    start = time.perf_counter()
    run_builder(default_model_folder(), built)
    timings["build"] = time.perf_counter() - start
    start = time.perf_counter()
    api.score(built, scored, calib=Path("prose"), threads=args.threads, progress=False)
    timings["score"] = time.perf_counter() - start
    folders = {"builder": built}
    for name, fuse in (("attn8", False), ("attn8 --fuse", True)):
        start = time.perf_counter()
        folders[name] = args.out / name.replace(" --", "-")
        api.drop(scored, folders[name], counts={"attn": 8}, fuse=fuse, threads=args.threads)
        timings[f"drop {name}"] = time.perf_counter() - start
    folders["harp 29,28"] = args.out / "harp"
    api.harp(scored, folders["harp 29,28"], alphas={29: 0.5, 28: 0.3})

    prompt = load_tokenizer(built).encode("The capital of France is")
    rows = {}
    for name, folder in folders.items():
        ppl = api.evaluate(folder, threads=args.threads, progress=False,
                           sampling=Sampling(from_start=args.from_start))["perplexity"]
        ours, _ = greedy_generate(make_session(folder / "model.onnx", threads=args.threads), np.array([prompt]), 32)
        theirs = genai_greedy(folder, prompt, 32)
        rows[name] = {"perplexity": ppl, "kv_bytes_per_token": api.inspect(folder)["kv_bytes_per_token"],
                      "genai_equals_ort": theirs == ours[:len(theirs)], "genai_tokens": len(theirs),
                      "text": load_tokenizer(built).decode(theirs)}
    for name in ("attn8", "attn8 --fuse"):
        result = compare(built, folders[name], seqs=(1024,), batch=1, runs=3, decode_tokens=16, provider="cpu",
                         threads=args.threads)
        rows[name]["bench_vs_builder"] = result
    report = {"timings_s": timings, "models": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    for name, row in rows.items():
        print(f"{name:<14} ppl {row['perplexity']:8.2f}  KV {row['kv_bytes_per_token']} B/token  "
              f"genai==ORT {row['genai_equals_ort']} ({row['genai_tokens']} tokens)  {row['text'][:60]!r}")
    print(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
