"""int4 graphs in and out on the default model (issue 17), with their numbers for the README.

    python benchmarks/int4_workflow.py --out out/int4 --json bench-out/int4.json

In: onnxruntime-genai's model builder writes SmolLM2 as `-p int4 -e cpu` (MatMulNBits); layerdrop scores it,
drops its 7 lowest-scored attention layers, and bypasses the top two with HARP (29=0.5, 28=0.3), the V·O matrix
written back as MatMulNBits at the graph's block size, and with `--keep-float` in float.
Out: layerdrop's own float export, quantized (`layerdrop quantize`), and the same drop quantized after the drop
(`drop --quantize int4`).
For each: perplexity on the bundled held-out text (32 x 256 tokens, spread windows), file bytes, whether
onnxruntime-genai's 32 greedy tokens equal a plain ONNX Runtime session's; and prefill at 1024 tokens and decode
speed of each int4 drop against its int4 base, alternating in one run, with the profile-based ideal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

PROSE = Path("prose")  # the calibration text of the README's figures (the default is now the mixed `calib`)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the tests' helpers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/int4"))
    parser.add_argument("--json", type=Path, default=Path("bench-out/int4.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--export", type=Path, help="layerdrop's KV export of SmolLM2 (default: exported here)")
    args = parser.parse_args()

    from layerdrop import api
    from layerdrop.export.default_model import default_model_folder
    from layerdrop.runtime.bench import model_bytes
    from layerdrop.runtime.generate import greedy_generate
    from layerdrop.runtime.session import make_session
    from layerdrop.windows import load_tokenizer
    from tests.genai_helpers import genai_greedy, run_builder

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    out, threads = args.out, args.threads
    seconds: dict[str, float] = {}

    def timed(name: str, call, *a, **k):
        start = time.perf_counter()
        value = call(*a, **k)
        seconds[name] = time.perf_counter() - start
        print(f"{name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)
        return value

    built = timed("builder -p int4", run_builder, default_model_folder(), out / "built",
                  precision="int4")
    timed("score", api.score, built, out / "scored", calib=PROSE, threads=threads, progress=False)
    timed("drop 7", api.drop, out / "scored", out / "built-attn7", counts={"attn": 7}, threads=threads)
    alphas = {29: 0.5, 28: 0.3}
    timed("harp int4", api.harp, out / "scored", out / "built-harp", alphas=alphas, threads=threads, progress=False)
    timed("harp float", api.harp, out / "scored", out / "built-harp-float", alphas=alphas, keep_float=True,
          threads=threads, progress=False)
    export = args.export or timed("export", api.export, None, out / "export")
    timed("quantize", api.quantize, export, out / "export-int4")
    timed("score export", api.score, export, out / "export-scored", calib=PROSE, threads=threads, progress=False)
    timed("drop 7 --quantize int4", api.drop, out / "export-scored", out / "export-attn7-int4", counts={"attn": 7},
          quantize="int4", threads=threads)

    folders = {"builder int4, as built": built, "builder int4, 7 attention layers dropped": out / "built-attn7",
               "builder int4, HARP 29,28 (MatMulNBits)": out / "built-harp",
               "builder int4, HARP 29,28 (--keep-float)": out / "built-harp-float",
               "layerdrop export, float32": Path(export), "layerdrop export, quantized": out / "export-int4",
               "layerdrop export, 7 dropped, then quantized": out / "export-attn7-int4"}
    tokenizer = load_tokenizer(built)
    prompt = tokenizer.encode("The capital of France is")
    rows = {}
    for name, folder in folders.items():
        ppl = api.evaluate(folder, threads=threads, progress=False)["perplexity"]
        ours, _ = greedy_generate(make_session(folder / "model.onnx", threads=threads), np.array([prompt]), 32)
        theirs = genai_greedy(folder, prompt, 32)
        rows[name] = {"perplexity": ppl, "bytes": model_bytes(folder),
                      "kv_bytes_per_token": api.inspect(folder)["kv_bytes_per_token"],
                      "genai_equals_ort": theirs == ours[:len(theirs)], "genai_tokens": len(theirs)}
        print(f"{name}: ppl {ppl:.2f}", file=sys.stderr, flush=True)
    speed = {}
    for name, (base, pruned) in {"builder int4": (built, out / "built-attn7"),
                                 "layerdrop int4": (out / "export-int4", out / "export-attn7-int4")}.items():
        speed[name] = api.bench(base, pruned, seqs=(1024,), runs=5, decode_tokens=32, threads=threads)
    report = {"seconds": seconds, "models": rows, "speed": speed}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["| SmolLM2-135M-Instruct | perplexity | file bytes | KV bytes/token | genai = ORT |",
             "|---|---|---|---|---|"]
    for name, row in report["models"].items():
        lines.append(f"| {name} | {row['perplexity']:.2f} | {row['bytes']:,} | {row['kv_bytes_per_token']} | "
                     f"{'yes' if row['genai_equals_ort'] else 'NO'} ({row['genai_tokens']} tokens) |")
    lines += ["", f"| {next(iter(report['speed'].values()))['machine']} | int4 base | int4, 7 dropped | speedup "
                  "| ideal | share of ideal |", "|---|---|---|---|---|---|"]
    for name, result in report["speed"].items():
        entry = result["prefill"][0]
        lines.append(f"| {name}: prefill 1024 tokens, median ms | {entry['base']['median_ms']:.0f} | "
                     f"{entry['pruned']['median_ms']:.0f} | {entry['speedup']:.2f}x | {entry['ideal']:.2f}x | "
                     f"{entry['speedup'] / entry['ideal']:.2f} |")
        decode = result["decode_tokens_per_s"]
        lines.append(f"| {name}: decode tokens/s | {decode['base']:.1f} | {decode['pruned']:.1f} | "
                     f"{decode['pruned'] / decode['base']:.2f}x | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
