"""Does a fitted map gain from the causal running mean of its input? An A/B on the same layers.

    python benchmarks/fit_mean_study.py SCORED_FOLDER OUT LAYERS   (e.g. 4,6,22,25,26,28,29)

Fits maps of [x_t, x_{t-1}] and of [x_t, x_{t-1}, mean of x_0..x_t] bottom-up on 48 windows of 256 tokens of the
bundled mix (ridges chosen on 8 search windows), writes both models, then compares them with `layerdrop eval --vs`
on 16 windows of 256 tokens of prose (eval), docs and code, and on the first 300 items of LAMBADA, HellaSwag, PIQA and
ARC-Easy.
"""

import subprocess
import sys
from pathlib import Path

from layerdrop import api
from layerdrop.api.common import save_model, windows_for
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.session import RunOptions
from layerdrop.search.fit import fit_attention


def main() -> None:
    scored, out, layers = Path(sys.argv[1]), Path(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    folder, _ = api.open_model(scored)
    calib = windows_for(folder.path, None, role="calib", samples=48, seq_len=256)
    search = windows_for(folder.path, None, role="search", samples=8, seq_len=256)
    for mean in (False, True):
        folder, model = api.open_model(scored)
        fit = fit_attention(model, folder.path, calib, layers, validation=search, previous=True, mean=mean,
                            options=RunOptions(threads=1))
        print("mean" if mean else "previous", "ridges", fit.ridges, flush=True)
        run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
        save_model(model, out / ("mean" if mean else "previous"), folder, force=True)
    pair = [str(out / "previous"), "--vs", str(out / "mean"), "--threads", "1", "--no-progress"]
    for text in ("eval", "docs", "code"):
        subprocess.run(["layerdrop", "eval", *pair, "--text", text, "--samples", "16", "--seq-len", "256"], check=True)
    subprocess.run(["layerdrop", "eval", *pair, "--tasks", "lambada_openai,hellaswag,piqa,arc_easy", "--limit", "300"],
                   check=True)


if __name__ == "__main__":
    main()
