"""Issue 16: how far can fitted maps calibrated on one kind of text go on another, if the layers are chosen with the
held-out kind in view? An upper bound for the cross-kind goal, not a method: the choice sees the evaluation kind.

    python benchmarks/cross_kind_oracle.py SCORED [--calib prose] [--oracle code] [--budget 8] [--self-samples 64]

Maps are fitted as `plan --calib prose --self-samples N` fits them (64 x 256 windows of --calib, plus N windows the
model writes itself), each layer's ridge chosen on 16 search windows of --oracle; the planner's lazy greedy
(`search.planner.plan_fits`) then chooses --budget of all attention layers by perplexity on those same 16 windows
of --oracle. The pick, fitted bottom-up, is measured on 32 x 256 held-out windows of the bundled eval, docs, code and
dictionary texts (the --oracle text's held-out windows may share text with its search windows: the bound is
optimistic). SCORED: a scored export with a KV cache (`layerdrop score`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop.api.common import open_model, rewrite_passes, windows_for
from layerdrop.api.plan import with_self_samples
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import make_session
from layerdrop.search.fit import fit_attention, solo_fits
from layerdrop.search.measure import attention_entries
from layerdrop.search.planner import plan_fits
from layerdrop.windows import bundled_text, resolve_text

HELD_OUT = ("eval", "docs", "code", "dictionary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--calib", default="prose", help="the fits' calibration text (a bundled name or a file)")
    parser.add_argument("--oracle", default="code", help="the text the layers and ridges are chosen on")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--self-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    folder, model = open_model(args.scored)
    calib = windows_for(folder.path, resolve_text(args.calib), role="calib", samples=64, seq_len=256)
    sha = calib.source["sha256"]
    search = windows_for(folder.path, resolve_text(args.oracle), role="search", samples=16, seq_len=256,
                         calibration_sha256=sha)
    held_out = {name: windows_for(folder.path, bundled_text(name), role="eval", samples=32, seq_len=256,
                                  calibration_sha256=sha) for name in HELD_OUT}
    if args.self_samples:
        calib = with_self_samples(model, folder.path, calib, args.self_samples, 0, True, {"threads": args.threads})
    layers = sorted(attention_entries(model))
    scores = dict.fromkeys(layers, 0.0)  # every layer is in the pool: the scores do not matter
    solo = solo_fits(model, folder.path, calib, layers, validation=search, threads=args.threads)
    planned = plan_fits(model, folder.path, search.ids, scores, args.budget, solo=solo,
                        extra=len(layers) - args.budget, threads=args.threads)
    chosen = sorted(planned.fits)
    _, fitted = open_model(args.scored)
    fit = fit_attention(fitted, folder.path, calib, chosen, validation=search, threads=args.threads)
    run_passes(fitted, rewrite_passes([], {}, "fit", fits=fit.maps))
    rows = {}
    for name, candidate in (("baseline", model), ("oracle pick", fitted)):
        session = make_session(candidate, folder=folder.path, threads=args.threads)
        rows[name] = {"search_ppl": round(perplexity(session, search.ids).perplexity, 2),
                      **{f"{k}_ppl": round(perplexity(session, w.ids).perplexity, 2) for k, w in held_out.items()}}
    print(json.dumps({"calib": args.calib, "oracle": args.oracle, "self_samples": args.self_samples,
                      "layers": chosen, "order": planned.order, "ridges": fit.ridges, **rows,
                      "ratios": {k: round(rows["oracle pick"][k] / rows["baseline"][k], 3) for k in rows["baseline"]},
                      "minutes": round((time.perf_counter() - started) / 60, 1)}), flush=True)


if __name__ == "__main__":
    main()
