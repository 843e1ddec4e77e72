"""Issue 16: ReplaceMe's runs of several lengths, fitted one by one (`search.blocks.replaceme` each) and together
(`search.blocks.replaceme_runs`: one selection pass and one statistics pass for them all), as a speedup plan fits
them: the 9 blocks of the SmolLM2 plan at 1.333x and the runs of 3 and 6 it mixes with attention moves.

    python benchmarks/replaceme_runs.py SCORED [--counts 9,3,6]

Prints the seconds of each way and whether they chose the same runs, ridges and transforms. The windows are the
plan's defaults: 64 x 256 of the bundled mixed text for the fits, 16 of its search part for the ridges.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from layerdrop.api.common import open_model, windows_for
from layerdrop.runtime.session import RunOptions
from layerdrop.search.blocks import replaceme, replaceme_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--counts", default="9,3,6")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    folder, model = open_model(args.scored)
    fit_windows = windows_for(folder.path, None, role="calib", samples=64, seq_len=256)
    search = windows_for(folder.path, None, role="search", samples=16, seq_len=256,
                         calibration_sha256=fit_windows.source["sha256"])
    started = time.perf_counter()
    alone = {n: replaceme(model, folder.path, fit_windows, n, validation=search.ids,
                          options=RunOptions(threads=args.threads))
             for n in counts}
    one_by_one = time.perf_counter() - started
    started = time.perf_counter()
    together = replaceme_runs(model, folder.path, fit_windows, counts, validation=search.ids,
                              options=RunOptions(threads=args.threads))
    shared = time.perf_counter() - started
    same = all((alone[n].start, alone[n].ridge) == (together[n].start, together[n].ridge)
               and np.allclose(alone[n].transform, together[n].transform, rtol=0, atol=1e-6) for n in counts)
    print(json.dumps({"counts": counts, "runs": {n: [together[n].start, together[n].ridge] for n in counts},
                      "seconds_one_by_one": round(one_by_one, 1), "seconds_together": round(shared, 1),
                      "same_runs_ridges_and_transforms": same}))


if __name__ == "__main__":
    main()
