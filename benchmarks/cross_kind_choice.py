"""Issue 16's cross-kind goal: fitted maps calibrated on one kind of text (prose), measured on others. How much can
the choice of layers do, and on what must it be made?

    python benchmarks/cross_kind_choice.py SCORED [--calib prose] [--choose-on calib] [--extra 22]
        [--criterion mean|worst] [--self-samples 64]

Maps are fitted as `plan --calib prose --self-samples 64` fits them (64 x 256 windows of --calib, plus 64 windows
the model writes itself), each layer's ridge chosen on the search windows (those of the first text of --choose-on
only, with --ridges-on-first). The search windows: --per-text (16) of each text of --choose-on (`calib`, the bundled
mix, as the README's cross-kind run; `code`, the held-out kind itself, for an upper bound that no planner can have:
those windows may share text with the held-out ones; `self`, windows the model writes itself from other draws than
the fits' samples; `repeat`, --repeats windows of random tokens repeated once, whose second half is predictable only
by in-context copying; any file; several joined by +, as `calib+repeat`). The planner's lazy greedy
(`search.planner.plan_fits`) then chooses --budget layers of the --budget + --extra lowest-scored (22 and more: every
layer of SmolLM2) on those windows, by their perplexity (`--criterion mean`, what `plan` does) or by the mean loss
increase of the worst quarter of them against the unmodified model (`worst`: a choice that guards the kind it hurts
most). The pick, fitted bottom-up as `plan` fits it, is measured on 32 x 256 held-out windows of the bundled eval,
docs, code and dictionary texts.
SCORED: an export with a KV cache scored on --calib (`layerdrop score --calib prose`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import layerdrop.search.alpha_search as alpha_search
from layerdrop.api.common import open_model, rewrite_passes, windows_for
from layerdrop.api.plan.texts import ordinary_tokens, with_self_samples
from layerdrop.formats import TOKEN_LOGPROBS
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.evaluate import Perplexity, perplexity
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.search.fit import fit_attention, solo_fits
from layerdrop.search.planner import candidate_pool, plan_fits
from layerdrop.windows import Windows, bundled_text, load_tokenizer, resolve_text

HELD_OUT = ("eval", "docs", "code", "dictionary")


def window_losses(session, windows: np.ndarray, feed_extra=None) -> np.ndarray:
    """Each window's mean next-token loss (the session's graph has token log-probabilities, or logits)."""
    in_graph = any(o.name == TOKEN_LOGPROBS for o in session.get_outputs())
    losses = []
    for row in range(len(windows)):
        ids = windows[row:row + 1]
        extra = feed_extra(slice(row, row + 1)) if feed_extra else None
        found = session.run([TOKEN_LOGPROBS if in_graph else "logits"], prefill_feed(session, ids, extra=extra))[0]
        if in_graph:
            losses.append(-found.astype(np.float64).mean())
        else:
            from layerdrop.runtime.evaluate import token_nll
            losses.append(token_nll(found, ids).mean())
    return np.array(losses)


def repeated_windows(folder: Path, calib: Windows, count: int) -> np.ndarray:
    """`count` windows as wide as the calibration's: random ordinary tokens (after the BOS where the windows have
    one), then the same tokens again, so the second half is predictable only by copying from the context."""
    ordinary = ordinary_tokens(load_tokenizer(folder), folder)
    width = calib.ids.shape[1] - calib.bos
    half = np.random.default_rng(2).choice(ordinary, (count, (width + 1) // 2))
    rows = np.concatenate([half, half], axis=1)[:, :width]
    if calib.bos:
        rows = np.concatenate([calib.ids[:count, :1], rows], axis=1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("--calib", default="prose", help="the fits' calibration text (a bundled name or a file)")
    parser.add_argument("--choose-on", default="calib", help="the text the layers and ridges are chosen on")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--extra", type=int, default=22)
    parser.add_argument("--criterion", choices=("mean", "worst"), default="mean")
    parser.add_argument("--self-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-text", type=int, default=16, help="search windows of each text of --choose-on")
    parser.add_argument("--repeats", type=int, default=4, help="windows of `repeat` in --choose-on")
    parser.add_argument("--ridges-on-first", action="store_true",
                        help="choose the ridges on the first text of --choose-on only (the layers on all of them)")
    args = parser.parse_args()
    started = time.perf_counter()
    folder, model = open_model(args.scored)
    calib = windows_for(folder.path, resolve_text(args.calib), role="calib", samples=64, seq_len=256)
    sha = calib.source["sha256"]
    parts = []
    for text in args.choose_on.split("+"):
        if text == "self":  # windows the model writes itself, from other draws than the fits' samples
            empty = Windows(calib.ids[:0], {}, calib.bos)
            parts.append(with_self_samples(model, folder.path, empty, args.per_text, 1, False,
                                           RunOptions(threads=args.threads)))
        elif text == "repeat":  # in-context copying: random ordinary tokens, then the same tokens again
            parts.append(Windows(repeated_windows(folder.path, calib, args.repeats), {}, calib.bos))
        else:
            parts.append(windows_for(folder.path, resolve_text(text), role="search", samples=args.per_text,
                                     seq_len=256, calibration_sha256=sha))
    search = Windows(np.concatenate([p.ids for p in parts]), parts[0].source, calib.bos)
    ridge_windows = parts[0] if args.ridges_on_first else search
    held_out = {name: windows_for(folder.path, bundled_text(name), role="eval", samples=32, seq_len=256,
                                  calibration_sha256=sha) for name in HELD_OUT}
    if args.self_samples:
        calib = with_self_samples(model, folder.path, calib, args.self_samples, 0, False,
                                  RunOptions(threads=args.threads))
    scores = {r["layer"]: r["score"] for r in read_scores(model) if r["kind"] == "attn"}
    if args.criterion == "worst":  # every search evaluation reads the worst quarter's loss increase instead
        unmodified = window_losses(make_session(model, folder=folder.path, threads=args.threads), search.ids)
        worst = max(1, len(unmodified) // 4)
        plain = alpha_search.perplexity

        def guarded(session, windows, *, feed_extra=None, **kwargs):
            if windows is not search.ids:
                return plain(session, windows, feed_extra=feed_extra, **kwargs)
            increase = window_losses(session, windows, feed_extra) - unmodified
            return Perplexity(float(np.sort(increase)[-worst:].mean()), windows.size)

        alpha_search.perplexity = guarded
    pool = candidate_pool(scores, args.budget, args.extra)
    solo = solo_fits(model, folder.path, calib, pool, validation=ridge_windows,
                     options=RunOptions(threads=args.threads))
    planned = plan_fits(model, folder.path, search.ids, scores, args.budget, solo=solo, extra=args.extra,
                        progress=False, options=RunOptions(threads=args.threads))
    if args.criterion == "worst":
        alpha_search.perplexity = plain
    chosen = sorted(planned.fits)
    _, fitted = open_model(args.scored)
    fit = fit_attention(fitted, folder.path, calib, chosen, validation=ridge_windows,
                        options=RunOptions(threads=args.threads))
    run_passes(fitted, rewrite_passes([], {}, "fit", fits=fit.maps))
    rows = {}
    for name, candidate in (("baseline", model), ("pick", fitted)):
        session = make_session(candidate, folder=folder.path, threads=args.threads)
        rows[name] = {"search_ppl": round(perplexity(session, search.ids).perplexity, 2),
                      **{f"{k}_ppl": round(perplexity(session, w.ids).perplexity, 2) for k, w in held_out.items()}}
    print(json.dumps({"calib": args.calib, "choose_on": args.choose_on, "criterion": args.criterion,
                      "pool": pool, "self_samples": args.self_samples, "layers": chosen, "order": planned.order,
                      "ridges": fit.ridges, **rows,
                      "ratios": {k: round(rows["pick"][k] / rows["baseline"][k], 3) for k in rows["baseline"]},
                      "minutes": round((time.perf_counter() - started) / 60, 1)}), flush=True)


if __name__ == "__main__":
    main()
