"""Issue 16: time and quality of the fit move on its own (`search.fit.fit_attention`), as `layerdrop plan` runs it.

    python benchmarks/fit_speed.py EXPORT [--layers 29,28,26,25,22,9,7,3] [--samples 64] [--search-samples 8]

Fits the layers bottom-up on windows of the default text (--samples x 256 calibration windows, 64 as in `plan`; each
layer's ridge chosen on --search-samples search windows: 8 as in the README's figures, `plan` now takes 16), prints
the seconds the fit took, the chosen ridges, and the fitted model's perplexity on the search windows and on 32 x 256
held-out windows (the bundled eval text). Run it from a checkout of another commit (PYTHONPATH=that checkout) to
compare two versions of the fit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop.api.common import open_model, rewrite_passes, windows_for
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.fit import fit_attention

DEFAULT_LAYERS = "29,28,26,25,22,9,7,3"  # the 8 lowest-scored attention layers of SmolLM2 on the default text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--layers", default=DEFAULT_LAYERS)
    parser.add_argument("--samples", type=int, default=64, help="calibration windows of the fit")
    parser.add_argument("--search-samples", type=int, default=8, help="search windows the ridges are chosen on")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.export)
    layers = [int(k) for k in args.layers.split(",")]
    calib = windows_for(folder.path, None, role="calib", samples=args.samples, seq_len=256)
    search = windows_for(folder.path, None, role="search", samples=args.search_samples, seq_len=256,
                         calibration_sha256=calib.source["sha256"])
    held_out = windows_for(folder.path, None, role="eval", samples=32, seq_len=256,
                           calibration_sha256=calib.source["sha256"])
    started = time.perf_counter()
    try:  # this version's fit takes the search windows as Windows; earlier ones took their ids
        fit = fit_attention(model, folder.path, calib, layers, validation=search,
                            options=RunOptions(threads=args.threads))
    except (AttributeError, TypeError):
        fit = fit_attention(model, folder.path, calib, layers, validation=search.ids,
                            options=RunOptions(threads=args.threads))
    seconds = time.perf_counter() - started
    run_passes(model, rewrite_passes([], {}, "fit", fits=fit.maps))
    session = make_session(model, folder=folder.path, threads=args.threads)
    print(json.dumps({"layers": layers, "samples": args.samples, "fit_seconds": round(seconds, 1), "ridges": fit.ridges,
                      "search_ppl": round(perplexity(session, search.ids).perplexity, 2),
                      "held_out_ppl": round(perplexity(session, held_out.ids).perplexity, 2)}))


if __name__ == "__main__":
    main()
