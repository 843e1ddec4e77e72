"""Time of the graph edit itself (issue 4): load the graph (weights stay on disk), drop 8 attention layers, prune
the KV cache, clean up. Saving, which must write the weights, is timed separately.

    python benchmarks/bench_edit.py --model out/scored
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from layerdrop import api
from layerdrop.model_folder import save
from layerdrop.passes.cleanup import run_passes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", default="2,5,8,11,14,17,20,23")
    args = parser.parse_args()
    targets = [("attn", int(x)) for x in args.layers.split(",")]
    start = time.perf_counter()
    folder, model = api.open_model(args.model)
    loaded = time.perf_counter()
    before = len(model.graph)
    run_passes(model, api.rewrite_passes(targets, {}, "bench"))
    edited = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder.path.parent) as tmp:
        save(model, Path(tmp) / "out", source=folder)
        saved = time.perf_counter()
    print(f"load {loaded - start:.2f} s, edit {edited - loaded:.2f} s ({before} -> {len(model.graph)} nodes), "
          f"save {saved - edited:.2f} s")


if __name__ == "__main__":
    main()
