"""Greedy alpha search for rescaled V·O bypasses (HARP, SPEC §4), measured by perplexity in ONNX Runtime.

Layers are searched one at a time, top-down. While layer l is searched, the layers above it are bypassed with
their chosen alphas and the layers below still have full attention, so the hidden state entering layer l is the
same for every candidate: it is computed once for all layers from the unmodified model. Each candidate then
runs only a suffix graph that starts at layer l and takes alpha as an input -- one session per layer, not per
candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from tqdm import tqdm

from layerdrop.errors import LayerdropError
from layerdrop.model_folder import copy_model
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import find_residual_regions
from layerdrop.passes.harp_bypass import HarpBypassPass
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))
ALPHA_INPUT = "layerdrop_alpha"
HIDDEN_INPUT = "layerdrop_hidden"


def hidden_states_at(model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int], **session_args
                     ) -> dict[int, np.ndarray]:
    """The hidden state entering each layer's attention, for every window: {layer: [n, seq, d]}."""
    copy = copy_model(model)
    by_layer = {r.layer: r for r in find_residual_regions(copy.graph) if r.kind == "attn"}
    copy.graph.outputs.clear()
    for layer in layers:
        if by_layer[layer].skip not in copy.graph.outputs:
            copy.graph.outputs.append(by_layer[layer].skip)
    RemoveUnusedNodesPass()(copy)
    session = make_session(copy, folder=folder, **session_args)
    names = [by_layer[layer].skip.name for layer in layers]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for row in windows:
        for name, array in zip(names, session.run(names, prefill_feed(session, row[None]))):
            parts[name].append(array)
    return {layer: np.concatenate(parts[name]) for layer, name in zip(layers, names)}


def suffix_model(model: ir.Model, start_layer: int, moves: dict[int, float | str], drops: list[tuple[str, int]]
                 ) -> ir.Model:
    """A copy of `model` that starts at the attention of `start_layer` (input `layerdrop_hidden`) and returns
    logits, with `moves` (layer -> alpha or an input name) bypassed by HARP and `drops` removed."""
    copy = copy_model(model)
    # The hidden state entering `start_layer`, found before any rewrite: it survives them all, even when the
    # layer's own attention is removed (alpha 0).
    entry = next((r.skip for r in find_residual_regions(copy.graph) if r.layer == start_layer), None)
    if entry is None:
        raise LayerdropError(f"layer {start_layer} has no residual region to start a suffix graph from")
    passes = []
    if drops:
        passes.append(DropBranchesPass(drops, reason="search"))
    if moves:
        passes.append(HarpBypassPass(moves))
    run_passes(copy, passes)
    hidden = ir.Value(name=HIDDEN_INPUT, shape=entry.shape, type=entry.type)
    entry.replace_all_uses_with(hidden)
    copy.graph.inputs.append(hidden)
    logits = next(v for v in copy.graph.outputs if v.name == "logits")
    copy.graph.outputs.clear()
    copy.graph.outputs.append(logits)
    RemoveUnusedNodesPass()(copy)
    return copy


@dataclass
class SearchResult:
    """Chosen alphas (layer -> alpha) and every perplexity tried, in search order."""

    alphas: dict[int, float] = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)


def greedy_alpha_search(
    model: ir.Model,
    folder: Path,
    windows: np.ndarray,
    layers: list[int],
    *,
    fixed: dict[int, float] | None = None,
    grid: tuple[float, ...] = ALPHA_GRID,
    progress: bool = True,
    on_trial: Callable[[dict], None] | None = None,
    **session_args,
) -> SearchResult:
    """Choose an alpha for each of `layers`, in the order given (top-down for HARP), by held-out perplexity.

    Args:
        fixed: layers already bypassed with known alphas (kept while searching).
        windows: token windows [n, seq] of held-out text.
    """
    result = SearchResult()
    chosen = dict(fixed or {})
    hidden = hidden_states_at(model, folder, windows, list(layers), **session_args)
    bar = tqdm(total=len(layers) * len(grid), desc="alpha search", unit="try", disable=not progress, leave=False)
    for layer in layers:
        moves: dict[int, float | str] = {**chosen, layer: ALPHA_INPUT}
        session = make_session(suffix_model(model, layer, moves, []), folder=folder, **session_args)
        best = None
        states = hidden[layer]
        for alpha in grid:
            value = np.asarray(alpha, dtype=np.float32)
            ppl = perplexity(session, windows,
                             feed_extra=lambda rows, a=value, h=states: {HIDDEN_INPUT: h[rows], ALPHA_INPUT: a})
            trial = {"layer": layer, "alpha": alpha, "perplexity": ppl.perplexity}
            result.trials.append(trial)
            if on_trial:
                on_trial(trial)
            if best is None or ppl.perplexity < best[1]:
                best = (alpha, ppl.perplexity)
            bar.set_postfix(layer=layer, best=f"{best[1]:.2f}@{best[0]}")
            bar.update()
        chosen[layer] = best[0]
        result.alphas[layer] = best[0]
    bar.close()
    return result
