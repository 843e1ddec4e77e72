"""Issue 16: fitted maps with and without the model's own windows (`plan --self-samples`), on fixed layers.

    python benchmarks/self_samples.py SCORED [--calib prose] [--search-text calib] [--layers 29,28,25,22,17,9,7,6]
        [--self-samples 64]

Fits the layers bottom-up (as `plan` fits its pick) on 64 x 256 windows of --calib, and again on those plus
--self-samples windows the model writes itself (`runtime.generate.sample_windows`, as `plan` draws them), each
layer's ridge chosen on 16 search windows (of --search-text, else of --calib's search part), and prints for each
the search perplexity and the perplexity on 32 x 256 held-out windows of the bundled eval, docs, code and dictionary
texts. SCORED: a scored export with a KV cache (`layerdrop score`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerdrop.api.common import open_model, rewrite_passes, windows_for
from layerdrop.api.plan.texts import with_self_samples
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.fit import fit_attention
from layerdrop.windows import bundled_text, resolve_text

HELD_OUT = ("eval", "docs", "code", "dictionary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--calib", default=None, help="calibration text: a bundled name or a file (default: the mix)")
    parser.add_argument("--search-text", default=None, help="the text the ridges are chosen on (a bundled name)")
    parser.add_argument("--layers", default="29,28,25,22,17,9,7,6")
    parser.add_argument("--self-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    layers = [int(k) for k in args.layers.split(",")]
    folder, unmodified = open_model(args.scored)  # sampled from as it is; each fit below opens its own copy
    calib_text = resolve_text(args.calib)
    calib = windows_for(folder.path, calib_text, role="calib", samples=64, seq_len=256)
    sha = calib.source["sha256"]  # as `plan` draws its search windows: of --search-text, else of --calib
    search = windows_for(folder.path, resolve_text(args.search_text) if args.search_text else calib_text,
                         role="search", samples=16, seq_len=256, calibration_sha256=sha)
    held_out = {name: windows_for(folder.path, bundled_text(name), role="eval", samples=32, seq_len=256,
                                  calibration_sha256=sha) for name in HELD_OUT}
    variants = {"calibration text": calib}
    if args.self_samples:
        variants[f"plus {args.self_samples} self-samples"] = with_self_samples(
            unmodified, folder.path, calib, args.self_samples, 0, False, RunOptions(threads=args.threads))
    for name, windows in variants.items():
        _, model = open_model(args.scored)
        fit = fit_attention(model, folder.path, windows, layers, validation=search,
                            options=RunOptions(threads=args.threads))
        run_passes(model, rewrite_passes([], {}, "fit", fits=fit.maps))
        session = make_session(model, folder=folder.path, threads=args.threads)
        row = {"fits on": name, "layers": layers, "ridges": fit.ridges,
               "search_ppl": round(perplexity(session, search.ids).perplexity, 2)}
        row.update({f"{k}_ppl": round(perplexity(session, w.ids).perplexity, 2) for k, w in held_out.items()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
