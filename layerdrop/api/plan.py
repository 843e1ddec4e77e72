"""`layerdrop plan`: for a budget, which attention layers go and how, compared with the papers' methods on the
same windows (see `search.planner`)."""

from __future__ import annotations

import time
from pathlib import Path

import onnx_ir as ir

from layerdrop import model_folder
from layerdrop.api.common import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, open_model, rewrite_passes, save_model, windows_for
from layerdrop.api.score import score
from layerdrop.errors import LayerdropError
from layerdrop.formats import PLAN_KEY
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import removed_modules, write_json
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import make_session
from layerdrop.search.measure import branch_means
from layerdrop.search.planner import bypass_search, candidate_pool, plan_attention
from layerdrop.search.selection import attention_count_for, drop_iteratively, lowest_layers, parse_budget
from layerdrop.windows import Sampling, Windows


def plan(
    model_path: Path,
    out_dir: Path,
    *,
    budget: str,
    calib: Path | None = None,
    eval_text: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    search_samples: int = 8,
    eval_samples: int = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    batch_size: int = 1,
    extra: int = 4,
    shift: bool = True,
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Plan the best set of attention drops/bypasses for a budget and write the chosen model.

    The search windows come from the search part of `calib` (disjoint from its calibration windows); the comparison
    table is measured on `eval_text`, which the search never sees (its evaluation part, if it is `calib` itself).
    With `shift`, the planner's moves carry the mean shift, whose means come from calibration windows of `calib`
    (`branch_means`); the other methods are the papers' own.

    Returns:
        {"budget", "attention_layers", "kv_fraction_kept", "pick": {...}, "methods": [{"method", "alphas",
         "shift", "search_ppl", "eval_ppl"}], "baseline": {...}, "search_seconds", "search_text", "eval_text"}

    Raises:
        LayerdropError: a bad budget, model or text.
    """
    folder, model = open_model(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    attention = sorted(r.layer for r in annotated_regions(model) if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions; nothing to plan")
    kind, value, seq = parse_budget(budget, len(attention))
    started = time.perf_counter()
    rows = read_scores(model) or score(folder.path, None, calib=calib, samples=samples, seq_len=seq_len,
                                        sampling=sampling, provider=provider, threads=threads,
                                        progress=progress)["regions"]
    scores = {r["layer"]: r["score"] for r in rows if r["kind"] == "attn"}
    count = attention_count_for(kind, value, seq, model, folder.path, scores, threads)
    session_args = {"provider": provider, "threads": threads}
    texts = _plan_windows(folder.path, calib, eval_text, samples, search_samples, eval_samples, seq_len, sampling)
    calib_windows, search, held_out = texts

    search_args = {**session_args, "batch_size": batch_size}  # sessions, and windows per run in every search
    methods = _paper_methods(model, folder.path, scores, attention, count, calib_windows, search.ids, progress,
                             search_args)
    means = None
    if shift:
        means = branch_means(model, folder.path, calib_windows, candidate_pool(scores, count, extra), **session_args)
    planned = plan_attention(model, folder.path, search.ids, scores, count, extra=extra, means=means,
                             progress=progress, **search_args)
    candidates = [(name, alphas, None) for name, alphas in methods.items()]
    if shift:
        candidates += [("planner (moves with the mean shift)", planned.alphas, means),
                       ("planner's layers and alphas without the shift", planned.alphas, None)]
    else:
        candidates.append(("planner", planned.alphas, None))
    table = [_measured(model, folder.path, name, alphas, row_means, search, held_out, search_args)
             for name, alphas, row_means in candidates]
    pick = min(table, key=lambda row: row["search_ppl"])
    pick_means = {k: means[k] for k in pick["alphas"]} if pick["shift"] else None
    seconds = time.perf_counter() - started
    baseline = make_session(model, folder=folder.path, **session_args)  # still unmodified here
    kept = (len(attention) - count) / len(attention)
    result = {"budget": budget, "attention_layers": count, "kv_fraction_kept": kept,
              "baseline": {"search_ppl": perplexity(baseline, search.ids).perplexity,
                           "eval_ppl": perplexity(baseline, held_out.ids).perplexity},
              "methods": table, "pick": pick, "search_seconds": seconds, "search_text": search.source,
              "eval_text": held_out.source, "planner_log": planned.log}
    write_json(model.metadata_props, PLAN_KEY, {k: v for k, v in result.items() if k != "planner_log"})
    run_passes(model, rewrite_passes([], pick["alphas"], "plan", means=pick_means))
    save_model(model, out_dir, folder, force=force)
    return result


def _plan_windows(folder: Path, calib: Path | None, eval_text: Path | None, samples: int, search_samples: int,
                  eval_samples: int, seq_len: int, sampling: Sampling) -> tuple[Windows, Windows, Windows]:
    """Calibration windows (means, the iterative drop), search windows of the same text, held-out windows."""
    calib_windows = windows_for(folder, calib, role="calib", samples=min(samples, 16), seq_len=seq_len,
                                sampling=sampling)
    digest = calib_windows.source["sha256"]
    search = windows_for(folder, calib, role="search", samples=search_samples, seq_len=seq_len, sampling=sampling,
                         calibration_sha256=digest)
    if sampling.from_start:  # the search windows are the text's last ones: they must not reach the first ones
        try:
            windows_for(folder, calib, role="calib", samples=samples + search_samples, seq_len=seq_len,
                        sampling=sampling)
        except LayerdropError:
            raise LayerdropError(f"with --from-start the calibration text must hold {samples} calibration and "
                                 f"{search_samples} search windows of {seq_len} tokens apart; use a longer text, "
                                 "fewer --samples, or leave out --from-start") from None
    held_out = windows_for(folder, eval_text, role="eval", samples=eval_samples, seq_len=seq_len, sampling=sampling,
                           calibration_sha256=digest)
    return calib_windows, search, held_out


def _paper_methods(model: ir.Model, folder: Path, scores: dict[int, float], attention: list[int], count: int,
                   calib_windows: Windows, search_ids, progress: bool, session_args: dict) -> dict[str, dict]:
    """The methods the planner is compared with, at the same budget: layer -> alpha (0: dropped)."""
    lowest = lowest_layers(scores, count)
    methods = {"paper 1: one-shot drop of the lowest scores": dict.fromkeys(lowest, 0.0)}
    scratch = model_folder.copy_model(model)
    drop_iteratively(scratch, folder, calib_windows, ("attn",), count, progress=progress,
                     provider=session_args["provider"], threads=session_args["threads"])
    methods["paper 1: iterative drop"] = {e["layer"]: 0.0 for e in removed_modules(scratch)}
    methods["HARP: top layers, searched alphas"] = bypass_search(model, folder, search_ids, attention[::-1][:count],
                                                                  progress=progress, **session_args)
    methods["score-selected bypass, searched alphas"] = bypass_search(model, folder, search_ids, lowest,
                                                                       progress=progress, **session_args)
    return methods


def _measured(model: ir.Model, folder: Path, name: str, alphas: dict[int, float], means: dict | None,
              search: Windows, held_out: Windows, search_args: dict) -> dict:
    """One row of the comparison: the rewritten model's perplexity on the search and the held-out windows."""
    candidate = model_folder.copy_model(model)
    run_passes(candidate, rewrite_passes([], alphas, "plan", means=means))
    session = make_session(candidate, folder=folder, provider=search_args["provider"], threads=search_args["threads"])
    batch = search_args["batch_size"]
    return {"method": name, "alphas": {int(k): v for k, v in sorted(alphas.items())}, "shift": means is not None,
            "search_ppl": perplexity(session, search.ids, batch_size=batch).perplexity,
            "eval_ppl": perplexity(session, held_out.ids, batch_size=batch).perplexity}
