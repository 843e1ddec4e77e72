"""Issue 16: HARP's greedy alpha search (SPEC §4) on SmolLM2's top layers, with the layers settled above the swept
one gated (every trial's graph also computes their attention; the way before 2026-12-04) and written into the
sweep's graph as bypasses (now), as the speedup plan runs it: 16 x 256 search windows of the bundled mixed text.

    python benchmarks/alpha_search_time.py SCORED [--top 12]

Prints the seconds of each way, and whether they chose the same alphas and measured the same perplexities.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop.api.common import open_model, windows_for
from layerdrop.runtime.session import RunOptions
from layerdrop.search import alpha_search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.scored)
    calib = windows_for(folder.path, None, role="calib", samples=64, seq_len=256)
    search = windows_for(folder.path, None, role="search", samples=16, seq_len=256,
                         calibration_sha256=calib.source["sha256"])
    layers = sorted(alpha_search.attention_entries(model), reverse=True)[:args.top]
    written = alpha_search.GatedSuffix.perplexity

    def gated(self, moves, start=None, below=None, fixed=None):  # every settled layer gated, as before
        return written(self, {**(fixed or {}), **moves}, start, below)

    found = {}
    for way, method in (("gated", gated), ("written", written)):
        alpha_search.GatedSuffix.perplexity = method
        started = time.perf_counter()
        result = alpha_search.greedy_alpha_search(model, folder.path, search.ids, layers, progress=False,
                                                  options=RunOptions(threads=args.threads))
        found[way] = (time.perf_counter() - started, result)
    alpha_search.GatedSuffix.perplexity = written
    (before, old), (after, new) = found["gated"], found["written"]
    worst = max(abs(a["perplexity"] / b["perplexity"] - 1) for a, b in zip(old.trials, new.trials))
    print(json.dumps({"layers": layers, "alphas": new.alphas, "same_alphas": old.alphas == new.alphas,
                      "largest_relative_perplexity_difference": worst, "seconds_gated": round(before, 1),
                      "seconds_written": round(after, 1)}))


if __name__ == "__main__":
    main()
