"""Quality of every rewrite on the default model (issues 4 and 5): perplexity on the bundled evaluation text.

    python benchmarks/quality.py --model out/scored --json bench-out/quality.json

The model folder must be scored (`layerdrop score`). Rewrites are applied in memory; each is evaluated through
ONNX Runtime on the same windows of the bundled evaluation text (Northanger Abbey), which no selection or
search ever sees: scores come from the start of the calibration text and HARP's search uses its end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop import api
from layerdrop.model_folder import copy_model
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.metadata import removed_modules
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.alpha_search import greedy_alpha_search
from layerdrop.search.selection import drop_iteratively, select_lowest
from layerdrop.windows import Sampling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True, help="a scored model folder")
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--search-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--from-start", action="store_true", help="windows from the start of each text")
    parser.add_argument("--json", type=Path, default=Path("bench-out/quality.json"))
    args = parser.parse_args()

    folder, model = api.open_model(args.model)
    rows = read_scores(model)
    attention = sorted(r["layer"] for r in rows if r["kind"] == "attn")
    sampling = Sampling(from_start=args.from_start)
    held_out = api.windows_for(folder.path, None, role="eval", samples=args.eval_samples, seq_len=args.seq_len,
                               sampling=sampling).ids
    search = api.windows_for(folder.path, None, role="search", samples=args.search_samples, seq_len=args.seq_len,
                             sampling=sampling).ids

    def ppl(drops=(), alphas=None) -> float:
        candidate = copy_model(model)
        run_passes(candidate, api.rewrite_passes(list(drops), alphas or {}, "bench"))
        return perplexity(make_session(candidate, folder=folder.path, threads=args.threads), held_out).perplexity

    def lowest(kinds, n):
        return select_lowest(rows, kinds, n)

    table = [("baseline", ppl())]
    for kind, counts in (("attn", (4, 8, 12)), ("mlp", (4, 8)), ("block", (4,))):
        for n in counts:
            table.append((f"{kind}-{n} one-shot", ppl(lowest((kind,), n))))
    table.append(("joint-8 one-shot", ppl(lowest(("attn", "mlp"), 8))))
    scratch = copy_model(model)
    calib = api.windows_for(folder.path, Path("prose"), role="calib", samples=16, seq_len=args.seq_len,
                            sampling=sampling)
    drop_iteratively(scratch, folder.path, calib, ("attn",), 8, RunOptions(threads=args.threads), True)
    iterative = [(e["kind"], e["layer"]) for e in removed_modules(scratch)]
    table.append(("attn-8 iterative", ppl(iterative)))
    top8 = attention[::-1][:8]
    start = time.perf_counter()
    searched = greedy_alpha_search(model, folder.path, search, top8, options=RunOptions(threads=args.threads)).alphas
    search_seconds = time.perf_counter() - start
    table.append(("HARP top-8, searched alphas", ppl(alphas=searched)))
    table.append(("HARP top-8, alpha = 1", ppl(alphas=dict.fromkeys(top8, 1.0))))
    table.append(("attention drop of the top 8", ppl([("attn", layer) for layer in top8])))

    result = {"rows": [{"model": name, "perplexity": value} for name, value in table],
              "harp_alphas": searched, "harp_search_seconds": search_seconds, "iterative_attn8": iterative,
              "one_shot_attn8": lowest(("attn",), 8), "eval_tokens": int(held_out.size)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("| model | perplexity |\n|---|---|")
    for name, value in table:
        print(f"| {name} | {value:.2f} |")
    alphas = " ".join(f"{layer}:{alpha:g}" for layer, alpha in sorted(searched.items(), reverse=True))
    print(f"HARP alphas (layer:alpha) {alphas}; search {search_seconds:.0f} s")
    print(f"one-shot attn-8 {sorted(lowest(('attn',), 8))}; iterative {sorted(iterative)}")


if __name__ == "__main__":
    main()
