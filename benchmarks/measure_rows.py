"""Time the perplexities of `plan`'s measured rows run through the whole model and from the baseline's hidden state
at each row's lowest changed layer (`api.plan.measure.Prefix`, what `plan` does), on the windows `plan` measures by
default.

    python benchmarks/measure_rows.py PLAN_DIR [--threads 2]

PLAN_DIR: a `benchmarks/plan_mixed.sh` output folder (its `scored/` export and `plan.json`). Each row's move set is
rebuilt from plan.json: drops and bypasses as they are, fitted maps as zero maps of the same shape (the graph's
work does not depend on their values; a fitted run of blocks is left out). The windows are 16 search windows of the
bundled mixed text and 32 held-out windows each of eval, docs, code and dictionary (144 x 256 tokens). Each row runs
both ways, the order alternating from row to row; printed per row: both times and both perplexities of the search
windows (they agree to float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from layerdrop.api.common import open_model, windows_for
from layerdrop.api.plan.candidates import Candidate
from layerdrop.api.plan.measure import Measure, choose_prefix
from layerdrop.api.plan.texts import HeldOut
from layerdrop.passes.fit_attention import FittedMap
from layerdrop.runtime.session import RunOptions
from layerdrop.windows import bundled_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan_dir", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.plan_dir / "scored")
    report = json.loads((args.plan_dir / "plan.json").read_text())
    calib = windows_for(folder.path, None, role="calib", samples=16, seq_len=256)
    digest = calib.source["sha256"]
    search = windows_for(folder.path, None, role="search", samples=16, seq_len=256, calibration_sha256=digest)
    texts = [windows_for(folder.path, bundled_text(name), role="eval", samples=32, seq_len=256,
                         calibration_sha256=digest) for name in ("eval", "docs", "code", "dictionary")]
    held_out = HeldOut(texts[0], texts[1:], None)
    sets = held_out.sets(search)
    hidden = int(json.loads((folder.path / "config.json").read_text())["hidden_size"])
    candidates = []
    for row in report["methods"]:
        if row["replaced_into"] is not None:
            continue
        fits = {int(k): FittedMap(np.zeros((hidden, hidden), np.float32), np.zeros(hidden, np.float32))
                for k in row["fits"]}
        candidates.append(Candidate(row["method"], {int(k): v for k, v in row["alphas"].items()}, fits=fits or None,
                                    blocks=row["blocks"]))
    windows = sum(len(w.ids) for w in sets.values())
    prefix = choose_prefix(model, candidates, windows, 256)
    ways = {way: Measure(model, folder.path, search, held_out, 1, RunOptions(threads=args.threads), prefix=kept)
            for way, kept in (("whole", None), ("from kept state", prefix))}
    started = time.perf_counter()
    ways["from kept state"].perplexities(model, Candidate("baseline"), sets)
    print(json.dumps({"baseline_s": round(time.perf_counter() - started, 1), "kept_layers": sorted(prefix.entries),
                      "windows": windows}), flush=True)
    totals = {"whole": 0.0, "from kept state": 0.0}
    for index, candidate in enumerate(candidates):
        rewritten = candidate.applied_to(model)
        order = list(ways) if index % 2 == 0 else list(ways)[::-1]
        row = {"method": candidate.name, "starts_at": prefix.start(rewritten, candidate)}
        for way in order:
            started = time.perf_counter()
            found = ways[way].perplexities(rewritten, candidate, sets)
            seconds = time.perf_counter() - started
            totals[way] += seconds
            row[f"{way} s"], row[f"{way} search ppl"] = round(seconds, 1), round(found["search"], 4)
        print(json.dumps(row), flush=True)
    print(json.dumps({"rows": len(candidates), **{f"{k} s": round(v, 1) for k, v in totals.items()}}))


if __name__ == "__main__":
    main()
