"""`layerdrop score`: S = 1 - cos(X, Y) of every module on calibration text, attached to the graph."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, guard_memory, open_model, save_model, windows_for
from layerdrop.passes.attach_scores import AttachScoresPass
from layerdrop.passes.cleanup import run_passes
from layerdrop.runtime.session import RunOptions
from layerdrop.search.measure import compute_scores
from layerdrop.search.selection import rank_overlap
from layerdrop.windows import Sampling


def score(
    model_path: Path,
    out_dir: Path | None = None,
    *,
    calib: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    force: bool = False,
    progress: bool = True,
    compare: Path | None = None,
    top_n: int = 8,
    memory_limit: int | None = None,
) -> dict:
    """Score every module of a model on calibration text; write the scored folder if `out_dir` is given; with
    `compare`, score on that text too and report how many of the `top_n` lowest modules the rankings share.
    `options` says how ONNX Runtime runs the graph (`options.batch_size` windows a run). An estimated peak memory
    (one ONNX Runtime session) over `memory_limit` is refused first (`guard_memory`).

    Returns:
        {"calibration": {...}, "regions": [{"layer", "kind", "score", "norm_ratio"}, ...], "compare"?: {...}}

    Raises:
        LayerdropError: bad model or text, an output that would overwrite something, or memory over the limit.
    """
    guard_memory("score", [model_path], memory_limit, tokens=options.batch_size * seq_len)
    folder, model = open_model(model_path)
    if out_dir is not None:
        model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    measure = {"options": options, "progress": progress}
    windows = windows_for(folder.path, calib, role="calib", samples=samples, seq_len=seq_len, sampling=sampling)
    scores = compute_scores(model, folder.path, windows, **measure)
    result = {"calibration": windows.source, "regions": [asdict(s) for s in scores]}
    if compare is not None:
        other = windows_for(folder.path, compare, role="calib", samples=samples, seq_len=seq_len, sampling=sampling)
        rows = [asdict(s) for s in compute_scores(model, folder.path, other, **measure)]
        result["compare"] = {"calibration": other.source, **rank_overlap(result["regions"], rows, top_n)}
    run_passes(model, [AttachScoresPass(scores, windows.source)])
    if out_dir is not None:
        save_model(model, out_dir, folder, force=force)
    return result
