"""`layerdrop drop`: delete attention/MLP branches or whole blocks, by name or by score."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from layerdrop import model_folder
from layerdrop.api.common import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    fusion_note,
    fusions,
    guard_memory,
    open_model,
    rewrite_passes,
    save_model,
    windows_for,
)
from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import kv_layer_map, removed_modules
from layerdrop.runtime.session import RunOptions
from layerdrop.search.selection import drop_iteratively, select_lowest, selection_kinds
from layerdrop.windows import Sampling


def drop(
    model_path: Path,
    out_dir: Path,
    *,
    targets: list[tuple[str, int]] | None = None,
    counts: dict[str, int] | None = None,
    iterative: bool = False,
    calib: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    force: bool = False,
    progress: bool = True,
    fuse: bool = False,
    quantize: str | None = None,
    memory_limit: int | None = None,
) -> dict:
    """Drop modules and write the pruned folder (with `fuse`, ONNX Runtime fusions applied after the drop; with
    `quantize="int4"`, ONNX Runtime's int4 quantizer after that). An estimated peak memory (a session per re-score
    of `iterative`, the quantizer's copies of the weights) over `memory_limit` is refused first (`guard_memory`).

    Args:
        targets: explicit (kind, layer) pairs, kind in attn/mlp/block.
        counts: score-based selection: {"attn": n, "mlp": n, "block": n, "joint": n} (joint: the n lowest of
            attention and MLP together). Uses the scores `score` attached, unless `iterative`, which re-scores
            the pruned graph on `calib` after each single drop, run as `options` says.

    Returns:
        {"dropped": [...], "kv_layers": [...], "nodes": {"before", "after"}, "fusions": {...}}

    Raises:
        LayerdropError: no or conflicting selection, unknown modules, an unscored model for score-based selection,
            or memory over the limit.
    """
    counts = {k: v for k, v in (counts or {}).items() if v is not None}
    _check_selection(targets, counts, iterative)
    guard_memory("drop", [model_path], memory_limit, copies=int(iterative), tokens=options.batch_size * seq_len,
                 quantizes=quantize is not None)
    folder, model = open_model(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    nodes_before = len(model.graph)
    _check_kinds_exist(model, targets or [], counts)
    passes: list[ir.passes.PassBase] = []
    if targets:
        passes.append(DropBranchesPass(targets, reason="explicit"))
    elif not iterative:
        rows = read_scores(model)
        if not rows:
            raise LayerdropError(f"{model_path} has no scores; run `layerdrop score` on it first")
        for kinds, count in selection_kinds(counts):
            label = "joint" if len(kinds) > 1 else kinds[0]
            passes.append(DropBranchesPass(select_lowest(rows, kinds, count), reason=f"{label}-{count} one-shot"))
    else:
        windows = windows_for(folder.path, calib, role="calib", samples=samples, seq_len=seq_len, sampling=sampling)
        for kinds, count in selection_kinds(counts):
            drop_iteratively(model, folder.path, windows, kinds, count, options, progress)
    model = run_passes(model, [*passes, *rewrite_passes([], {}, "", fuse=fuse, quantize=quantize)])
    save_model(model, out_dir, folder, force=force)
    return {"fusions": fusions(model), "fusion_note": fusion_note(model), "dropped": removed_modules(model),
            "kv_layers": kv_layer_map(model),
            "nodes": {"before": nodes_before, "after": len(model.graph)}}


def _check_selection(targets, counts: dict[str, int], iterative: bool) -> None:
    if bool(targets) == bool(counts):
        raise LayerdropError("say what to drop: either --drop KIND:LAYERS or one of --attn/--mlp/--block/--joint")
    if counts.get("joint") is not None and len(counts) > 1:
        raise LayerdropError("--joint already chooses among attention and MLP; do not combine it with other counts")
    if counts.get("block") is not None and len(counts) > 1:
        raise LayerdropError("--block cannot be combined with --attn/--mlp/--joint; drop blocks in a separate run")
    if iterative and not counts:
        raise LayerdropError("--iterative goes with a score-based count (--attn/--mlp/--block/--joint)")


def _check_kinds_exist(model: ir.Model, targets: list[tuple[str, int]], counts: dict[str, int]) -> None:
    present = {r.kind for r in annotated_regions(model)}
    wanted = {k for k, _ in targets} | {k for k in counts if k in ("attn", "mlp")}
    if "joint" in counts and "attn" not in present:
        wanted.add("attn")
    for kind in wanted - {"block"}:
        if kind not in present:
            raise LayerdropError(f"this graph has no {kind} regions; nothing of that kind can be dropped")
