"""How a speedup budget's timings behave on this machine (issue 16): the first timed runs of a new session after one
and after two warm-ups, and the speedups of 12 and 13 fitted attention layers and of 10 removed blocks from many
alternating runs (the step a block and a layer make at 1024 tokens).

    python benchmarks/timing_noise.py SCORED [--pairs 30] [--json OUT]

SCORED: a SmolLM2 export (scored or not). The fitted maps are timed as zero maps: their cost is their shape.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop import model_folder
from layerdrop.runtime.bench import paired_speedup
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.selection import PrefillMeter

LAYERS = [29, 28, 27, 26, 25, 22, 17, 14, 13, 12, 9, 7, 6]  # the mixed text's 13 lowest-scored, in that order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--pairs", type=int, default=30, help="alternating runs per structure")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    folder, model = model_folder.load(args.scored)
    base = make_session(model, folder=folder.path, threads=2)
    meter = PrefillMeter(model, folder.path, args.seq, base, runs=5, options=RunOptions(threads=2))
    result: dict = {"warmup": [], "speedups": {}}
    print("first timed runs of a fresh session (ms), base / new, runs alternating:")
    for warmup, layers in ((1, 6), (2, 7), (1, 8), (2, 9)):  # a new structure each time, the base shared
        fresh = make_session(meter.structure([], LAYERS[:layers]), folder=folder.path, threads=2)
        found = paired_speedup(base, fresh, args.seq, runs=4, warmup=warmup)
        base_ms, ms = [round(x) for x in found["base_runs_ms"]], [round(x) for x in found["runs_ms"]]
        print(f"  {warmup} warm-up(s), {layers} maps: {base_ms} / {ms}", flush=True)
        result["warmup"].append({"warmup": warmup, "maps": layers, "base_ms": base_ms, "ms": ms})
    for name, blocks, attention in (("12 maps", [], LAYERS[:12]), ("13 maps", [], LAYERS),
                                    ("10 blocks", list(range(10, 20)), [])):
        started = time.perf_counter()
        speedup = meter.speedup(blocks, attention, runs=args.pairs)
        result["speedups"][name] = speedup
        print(f"{name}: {speedup:.3f}x from {args.pairs} alternating pairs ({time.perf_counter() - started:.0f} s)",
              flush=True)
    if args.json:
        result["timings"] = meter.record()["timings"]
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
