"""`layerdrop harp`: replace attention by HARP's rescaled V·O map, with given or searched alphas."""

from __future__ import annotations

import time
from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import (
    DEFAULT_SEQ_LEN,
    calibration_sha256,
    fusion_note,
    fusions,
    guard_memory,
    int4_write_back,
    open_model,
    rewrite_passes,
    save_model,
    windows_for,
)
from layerdrop.errors import LayerdropError
from layerdrop.formats import HARP_SEARCH_KEY
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import kv_layer_map, write_json
from layerdrop.runtime.session import RunOptions
from layerdrop.search.alpha_search import greedy_alpha_search
from layerdrop.windows import Sampling


def harp(
    model_path: Path,
    out_dir: Path,
    *,
    alphas: dict[int, float] | None = None,
    top: int | None = None,
    search: bool = False,
    search_text: Path | None = None,
    samples: int = 8,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    force: bool = False,
    progress: bool = True,
    fuse: bool = False,
    quantize: str | None = None,
    keep_float: bool = False,
    memory_limit: int | None = None,
) -> dict:
    """Replace attention by the rescaled V·O map (SPEC §4) in chosen layers, and write the folder.

    Either explicit `alphas` (layer -> alpha), or `top` K layers with `search` (greedy, top-down, over
    {0, 0.1, ..., 1}, by perplexity on search windows of `search_text`, default the bundled calibration text), or
    `top` K with alpha = 1; the search runs as `options` says. On an int4 graph (MatMulNBits) V and O are read
    back exactly, the V·O matrix is computed in float64 and written back as MatMulNBits at the graph's block size,
    unless `keep_float`. An estimated peak memory (the search's session, the quantizer's copies of the weights) over
    `memory_limit` is refused before anything is written (`guard_memory`).

    Returns:
        {"alphas": {...}, "trials": [...], "search_seconds": s, "kv_layers": [...], "fusions": {...}}

    Raises:
        LayerdropError: no or conflicting selection, bad layers or alphas, or memory over the limit.
    """
    if bool(alphas) == (top is not None):
        raise LayerdropError("say which layers: either --alpha LAYER=A,... or --top K (with --search)")
    if search and top is None:
        raise LayerdropError("--search goes with --top K")
    folder, model = open_model(model_path)
    guard_memory("harp", [folder.path], memory_limit, copies=int(search), tokens=options.batch_size * seq_len,
                 quantizes=quantize is not None or bool(int4_write_back(model, keep_float)))
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    attention = sorted(r.layer for r in annotated_regions(model) if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions to bypass")
    trials: list[dict] = []
    seconds = 0.0
    if top is not None:
        if not 1 <= top <= len(attention):
            raise LayerdropError(f"--top {top} is out of range: the model has {len(attention)} attention layers")
        layers = attention[::-1][:top]
        alphas = {layer: 1.0 for layer in layers}
        if search:
            windows = windows_for(folder.path, search_text, role="search", samples=samples, seq_len=seq_len,
                                  sampling=sampling, calibration_sha256=calibration_sha256(model))
            start = time.perf_counter()
            found = greedy_alpha_search(model, folder.path, windows.ids, layers, progress=progress,
                                        options=options)
            seconds = time.perf_counter() - start
            alphas, trials = found.alphas, found.trials
            write_json(model.metadata_props, HARP_SEARCH_KEY,
                       {"text": windows.source, "trials": trials, "seconds": round(seconds, 1)})
    model = run_passes(model, [*rewrite_passes([], alphas, "harp", fuse=fuse, quantize=quantize),
                               *int4_write_back(model, keep_float or quantize is not None)])
    save_model(model, out_dir, folder, force=force)
    return {"alphas": {int(k): v for k, v in alphas.items()}, "trials": trials, "search_seconds": seconds,
            "kv_layers": kv_layer_map(model), "fusions": fusions(model), "fusion_note": fusion_note(model)}
