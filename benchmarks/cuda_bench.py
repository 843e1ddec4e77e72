"""One prepared benchmark for a GPU (and, with short lengths, for CPU so it cannot rot).

Speed does not depend on weight values, so each model is built on the spot with random weights in a real model's
shape (Llama-3.2-1B: 16 layers, hidden 2048, GQA 32/8 heads; SmolLM2-135M: 30 layers, hidden 576, 9/3 heads),
exported with `layerdrop export --dtype float16`, and rewritten twice: a quarter of the attention layers dropped
(an explicit, spread list) and HARP on the top quarter with a fixed alpha. All three graphs get ONNX Runtime's
fusions (MultiHeadAttention; without them attention at 32k tokens would not fit). Then, side by side:
prefill latency (I/O binding on CUDA), decode tokens/s with the cache kept on the device, the profile-based ideal
of each rewrite, KV bytes per token, peak memory, and scoring time against a PyTorch forward-hook pass.

    bash benchmarks/cuda_bench.sh                       # on the GPU machine (see the wrapper for the wheel)
    python benchmarks/cuda_bench.py --provider cpu --models tiny --seq 64,128 --decode-context 32,64 \\
        --dtype float32 --out /tmp/cuda-bench-cpu       # the CPU form, as CI runs it

Writes OUT/cuda_bench.json and OUT/cuda_bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=65536, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}


def build(name: str, dtype: str, out: Path) -> dict:
    """Random-weight HF folder -> float16 export -> drop and HARP rewrites -> fused copies of all three."""
    import torch
    import transformers

    from layerdrop import api
    from layerdrop.model_folder import save
    from layerdrop.passes.cleanup import cleanup_passes, run_passes
    from layerdrop.passes.ort_fusions import OrtFusionPass

    root = out / name
    layers = SHAPES[name]["num_hidden_layers"]
    quarter = max(1, layers // 4)
    dropped = list(range(1, layers, 4))[:quarter]
    harp = dict.fromkeys(range(layers - 1, layers - 1 - quarter, -1), 0.5)
    start = time.perf_counter()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[name])
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "hf")
    api.export(root / "hf", root / "export", dtype=dtype, force=True)
    seconds = {"export": time.perf_counter() - start}
    folder, model = api.open_model(root / "export")
    run_passes(model, [OrtFusionPass(), *cleanup_passes()])
    save(model, root / "base", source=folder, force=True)
    start = time.perf_counter()
    api.drop(root / "export", root / "drop", targets=[("attn", i) for i in dropped], fuse=True, force=True)
    api.harp(root / "export", root / "harp", alphas=harp, fuse=True, force=True)
    seconds["rewrite"] = time.perf_counter() - start
    return {"root": root, "layers": layers, "dropped": dropped, "harp": harp, "seconds": seconds}


def measure(built: dict, provider: str, seqs: list[int], contexts: list[int], runs: int, threads: int | None) -> dict:
    from layerdrop.model_folder import load
    from layerdrop.passes.metadata import kv_bytes_per_token
    from layerdrop.runtime.bench import decode_tokens_per_second, model_bytes, peak_memory, prefill_latency
    from layerdrop.runtime.session import RunOptions, active_provider, make_session
    from layerdrop.search.measure import branch_ideal

    root = built["root"]
    folders = [root / "base", root / "drop", root / "harp"]
    used = active_provider(make_session(folders[0] / "model.onnx", provider=provider, threads=threads))
    options = RunOptions(used, threads)
    rows: dict = {"prefill": [], "decode": [], "kv_bytes_per_token": [], "model_bytes": [], "peak_memory": []}
    for seq in seqs:
        times = prefill_latency(folders, seq, runs=runs, options=options)
        ideals = [branch_ideal(folders[0], layers, seq, options, runs=1)["ideal"]
                  for layers in (built["dropped"], list(built["harp"]))]
        rows["prefill"].append({"seq": seq, "ms": [t["median_ms"] for t in times], "ideal": ideals})
    for context in contexts:
        speeds = decode_tokens_per_second(folders, prompt_len=context, new_tokens=32, rounds=2,
                                          device_resident=True, options=options)
        rows["decode"].append({"context": context, "tokens_per_s": speeds})
    rows["kv_bytes_per_token"] = [kv_bytes_per_token(load(f)[1]) for f in folders]
    rows["model_bytes"] = [model_bytes(f) for f in folders]
    rows["peak_memory"] = [peak_memory(f, max(seqs), options=options) for f in folders]
    rows["provider"] = used
    return rows


def scoring_time(built: dict, provider: str, dtype: str, windows: int, seq: int, threads: int | None) -> dict:
    """Seconds to score `windows` random windows in ONNX Runtime (session included) and with PyTorch hooks."""
    import torch
    import transformers

    from layerdrop import api
    from layerdrop.runtime.session import RunOptions
    from layerdrop.search.measure import compute_scores
    from layerdrop.windows import Windows

    root = built["root"]
    ids = np.random.RandomState(0).randint(0, SHAPES[root.name]["vocab_size"], size=(windows, seq))
    folder, model = api.open_model(root / "export")
    start = time.perf_counter()
    compute_scores(model, folder.path, Windows(ids, {}), options=RunOptions(provider, threads), progress=False)
    ours = time.perf_counter() - start
    device = "cuda" if provider == "cuda" and torch.cuda.is_available() else "cpu"
    torch_dtype = torch.float16 if dtype == "float16" and device == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch_dtype).to(device).eval()
    # the same 3 scores a layer as layerdrop (attention, MLP, block), from hooks: X before each norm, Y after each Add
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.input_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: captured.__setitem__(f"x{i}", a[0])))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: captured.__setitem__(f"h{i}", a[0])))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: captured.__setitem__(f"y{i}", o[0] if isinstance(o, tuple) else o)))

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)).mean())

    start = time.perf_counter()
    with torch.no_grad():
        for row in ids:
            hf.model(torch.tensor(row[None], device=device))
            for i in range(len(hf.model.layers)):
                x, h, y = captured[f"x{i}"], captured[f"h{i}"], captured[f"y{i}"]
                distance(x, h), distance(h, y), distance(x, y)
    if device == "cuda":
        torch.cuda.synchronize()
    hooks_seconds = time.perf_counter() - start
    for hook in hooks:
        hook.remove()
    return {"windows": windows, "seq": seq, "layerdrop_s": ours, "torch_hooks_s": hooks_seconds, "device": device}


def hardware() -> dict:
    import onnxruntime

    info = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "onnxruntime": onnxruntime.__version__,
            "onnxruntime_package": "onnxruntime-gpu" if "CUDAExecutionProvider" in
            onnxruntime.get_available_providers() else "onnxruntime"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["gpu"] = smi or None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def markdown(result: dict) -> str:
    hw = result["hardware"]
    lines = [f"Hardware: {hw.get('gpu') or 'no GPU'}; {hw['machine']}; {hw['onnxruntime_package']} "
             f"{hw['onnxruntime']}; provider used: see each table.", ""]
    for name, entry in result["models"].items():
        rows = entry["rows"]
        lines += [f"### {name} (random weights, {result['dtype']}, fused; provider {rows['provider']})", "",
                  f"| | base | drop {len(entry['dropped'])} attention layers | HARP top {len(entry['harp'])} "
                  "(alpha 0.5) |", "|---|---|---|---|"]
        for p in rows["prefill"]:
            base, drop, harp = p["ms"]
            lines.append(f"| prefill {p['seq']} tokens, median ms | {base:.1f} | {drop:.1f} ({base / drop:.2f}x, "
                         f"ideal {p['ideal'][0]:.2f}x) | {harp:.1f} ({base / harp:.2f}x, ideal <= "
                         f"{p['ideal'][1]:.2f}x) |")
        for d in rows["decode"]:
            base, drop, harp = d["tokens_per_s"]
            lines.append(f"| decode tokens/s at {d['context']} context | {base:.1f} | {drop:.1f} ({drop / base:.2f}x) "
                         f"| {harp:.1f} ({harp / base:.2f}x) |")
        kv = rows["kv_bytes_per_token"]
        lines.append(f"| KV cache bytes/token | {kv[0]} | {kv[1]} ({kv[1] / kv[0]:.3f}) | {kv[2]} "
                     f"({kv[2] / kv[0]:.3f}) |")
        memory = rows["peak_memory"]
        if all(memory):
            lines.append("| peak memory, one prefill at the longest length (MiB) | "
                         + " | ".join(f"{m / 2**20:.0f}" for m in memory) + " |")
        score = entry["scoring"]
        lines += ["", f"Scoring {score['windows']} x {score['seq']} tokens: layerdrop {score['layerdrop_s']:.1f} s, "
                  f"PyTorch forward hooks ({score['device']}) {score['torch_hooks_s']:.1f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--models", default="llama-3.2-1b,smollm2-135m", help=f"any of {', '.join(SHAPES)}")
    parser.add_argument("--seq", default="1024,4096,16384,32768", help="prefill lengths")
    parser.add_argument("--decode-context", default="1024,16384", help="context lengths for decode")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--score-windows", type=int, default=8)
    parser.add_argument("--score-seq", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench-out/cuda"))
    args = parser.parse_args()
    if args.provider == "cuda":
        import onnxruntime

        if hasattr(onnxruntime, "preload_dlls"):
            onnxruntime.preload_dlls()  # CUDA and cuDNN from PyTorch's wheels
    started = time.perf_counter()
    result = {"hardware": hardware(), "dtype": args.dtype, "models": {}}
    seqs = [int(s) for s in args.seq.split(",")]
    contexts = [int(c) for c in args.decode_context.split(",")]
    for name in args.models.split(","):
        built = build(name, args.dtype, args.out)
        rows = measure(built, args.provider, seqs, contexts, args.runs, args.threads)
        scoring = scoring_time(built, args.provider, args.dtype, args.score_windows, min(args.score_seq, max(seqs)),
                               args.threads)
        result["models"][name] = {"dropped": built["dropped"], "harp": built["harp"], "seconds": built["seconds"],
                                  "rows": rows, "scoring": scoring}
        print(f"[{name}] done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "cuda_bench.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
