"""Issue 16: how much of each attention layer a linear map predicts, per token and with the previous token too.

    python benchmarks/previous_token_error.py SCORED [--calib prose] [--samples 64] [--held-out 16]

For every attention layer, maps from its normalized input X_t (and from [X_t, X_{t-1}], `search.fit.with_previous`)
to its branch output are fitted on --samples x 256 windows of --calib (the unmodified model's states, ridge chosen
among `search.fit.RIDGES` on the held-out prose), and their squared error is printed on --held-out windows of each
bundled held-out text, relative to that text's own variance of the branch (1.0: no better than the text's mean).
SCORED: an export scored on --calib (`layerdrop score bench-out/smollm2-kv -o bench-out/prose-scored --calib prose`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from layerdrop.api.common import open_model, windows_for
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.graph_cuts import with_outputs
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session
from layerdrop.search.fit import RIDGES, normal_equations, solve_ridge, validation_error, with_previous
from layerdrop.windows import bundled_text, resolve_text

HELD_OUT = ("eval", "docs", "code", "dictionary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--calib", default="prose")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.scored)
    regions = sorted((r for r in annotated_regions(model) if r.kind == "attn"), key=lambda r: r.layer)
    names = [name for r in regions for name in (r.norm_output.name, r.branch_output.name)]
    session = make_session(with_outputs(model, names), folder=folder.path, threads=args.threads)
    calib = windows_for(folder.path, resolve_text(args.calib), role="calib", samples=args.samples, seq_len=256)
    texts = {"fit": calib, **{name: windows_for(folder.path, bundled_text(name), role="eval", samples=args.held_out,
                                                seq_len=256, calibration_sha256=calib.source["sha256"])
                              for name in HELD_OUT}}
    stats: dict = {}  # (text, layer, previous) -> (G, C, |Y - mean|^2, |Y|^2)
    for text, windows in texts.items():
        for row in range(len(windows.ids)):
            outputs = session.run(names, prefill_feed(session, windows.ids[row:row + 1]))
            real = windows.real[row]
            for index, region in enumerate(regions):
                states, target = outputs[2 * index], outputs[2 * index + 1][0][real].astype(np.float64)
                for previous in (False, True):
                    x = (with_previous(states) if previous else states)[0][real]
                    g, c = normal_equations(x, target)
                    key = (text, region.layer, previous)
                    old = stats.get(key, (0.0, 0.0, 0.0, 0.0))
                    stats[key] = (old[0] + g, old[1] + c, old[2] + float(np.sum((target - target.mean(0)) ** 2)),
                                  old[3] + float(np.sum(target ** 2)))
        print(f"captured {text}", flush=True)
    print("| layer | map of | ridge | " + " | ".join(HELD_OUT) + " |")
    print("|---|---|---|" + "---|" * len(HELD_OUT))
    for region in regions:
        for previous in (False, True):
            gram, cross, _, _ = stats[("fit", region.layer, previous)]
            errors = {}
            for ridge in RIDGES:
                weight, bias = solve_ridge(gram, cross, ridge)
                errors[ridge] = [validation_error(*stats[(t, region.layer, previous)][:2],
                                                  stats[(t, region.layer, previous)][3], weight, bias)
                                 / stats[(t, region.layer, previous)][2] for t in HELD_OUT]
            ridge = min(errors, key=lambda r: errors[r][0])
            print(f"| {region.layer} | {'X_t, X_t-1' if previous else 'X_t'} | {ridge:g} | "
                  + " | ".join(f"{e:.3f}" for e in errors[ridge]) + " |", flush=True)


if __name__ == "__main__":
    main()
