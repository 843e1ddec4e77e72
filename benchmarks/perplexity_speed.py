"""Time one perplexity evaluation with the log-softmax in numpy (from the logits) and in ONNX Runtime (the graph's
token log-probabilities, `passes.token_logprobs`), as every search try and every measured row of `plan` runs it.

    python benchmarks/perplexity_speed.py EXPORT [--samples 16] [--from-layer 29] [--runs 3]

Two graphs, each in both forms: the whole model, and the suffix from the hidden state entering attention layer
--from-layer (an alpha-search try near the top of the model: that layer, the final norm and the LM head). Runs
alternate between the two forms; the median of --runs is printed with both perplexities (they agree to about 2e-5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from layerdrop.api.common import open_model, windows_for
from layerdrop.model_folder import copy_model
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, suffix_to_logits
from layerdrop.passes.token_logprobs import with_token_logprobs
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.measure import attention_entries, hidden_states_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--samples", type=int, default=16, help="windows of 256 tokens (plan's search windows: 16)")
    parser.add_argument("--from-layer", type=int, default=29)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.export)
    windows = windows_for(folder.path, None, role="search", samples=args.samples, seq_len=256).ids
    hidden = hidden_states_at(model, folder.path, windows, [args.from_layer],
                              options=RunOptions(threads=args.threads))[args.from_layer]
    suffix = suffix_to_logits(copy_model(model), attention_entries(model)[args.from_layer])
    report = {"samples": args.samples, "from_layer": args.from_layer, "runs": args.runs}
    graphs = [("whole model", model, None),
              (f"suffix from layer {args.from_layer}", suffix, lambda rows: {HIDDEN_INPUT: hidden[rows]})]
    for name, graph, extra in graphs:
        sessions = {"numpy": make_session(graph, folder=folder.path, threads=args.threads),
                    "in graph": make_session(with_token_logprobs(graph), folder=folder.path, threads=args.threads)}
        seconds = {form: [] for form in sessions}
        values = {}
        for _ in range(args.runs):
            for form, session in sessions.items():
                started = time.perf_counter()
                values[form] = perplexity(session, windows, feed_extra=extra).perplexity
                seconds[form].append(time.perf_counter() - started)
        report[name] = {form: {"median_s": round(statistics.median(s), 2), "perplexity": values[form]}
                        for form, s in seconds.items()}
        print(name, json.dumps(report[name]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
