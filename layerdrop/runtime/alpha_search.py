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


def suffix_model(model: ir.Model, start_layer: int, moves: dict[int, float | str]) -> ir.Model:
    """A copy of `model` that starts at the attention of `start_layer` (input `layerdrop_hidden`) and returns
    logits, with `moves` (layer -> alpha, or the name of an alpha input) bypassed by HARP."""
    copy = copy_model(model)
    # The hidden state entering `start_layer`, found before any rewrite: it survives them all, even when the
    # layer's own attention is removed (alpha 0).
    entry = next((r.skip for r in find_residual_regions(copy.graph) if r.layer == start_layer), None)
    if entry is None:
        raise LayerdropError(f"layer {start_layer} has no residual region to start a suffix graph from")
    if moves:
        run_passes(copy, [HarpBypassPass(moves)])
    hidden = ir.Value(name=HIDDEN_INPUT, shape=entry.shape, type=entry.type)
    entry.replace_all_uses_with(hidden)
    copy.graph.inputs.append(hidden)
    logits = next(v for v in copy.graph.outputs if v.name == "logits")
    copy.graph.outputs.clear()
    copy.graph.outputs.append(logits)
    RemoveUnusedNodesPass()(copy)
    return copy


def suffix_perplexity(model: ir.Model, folder: Path, windows: np.ndarray, hidden: dict[int, np.ndarray],
                      moves: dict[int, float], **session_args) -> float:
    """Perplexity with `moves` applied, run from the cached hidden state entering the lowest changed layer."""
    start = min(moves)
    session = make_session(suffix_model(model, start, dict(moves)), folder=folder, **session_args)
    states = hidden[start]
    return perplexity(session, windows, feed_extra=lambda rows: {HIDDEN_INPUT: states[rows]}).perplexity


def alpha_sweep(model: ir.Model, folder: Path, windows: np.ndarray, hidden: dict[int, np.ndarray],
                fixed: dict[int, float], layer: int, *, grid: tuple[float, ...] = ALPHA_GRID,
                on_value: Callable[[float, float], None] | None = None, **session_args) -> dict[float, float]:
    """Perplexity for each alpha of `layer` with the `fixed` bypasses kept: one suffix session from the lowest
    changed layer (its hidden state taken from `hidden`), alpha fed as an input."""
    moves: dict[int, float | str] = {**fixed, layer: ALPHA_INPUT}
    start = min(moves)
    session = make_session(suffix_model(model, start, moves), folder=folder, **session_args)
    states = hidden[start]
    results: dict[float, float] = {}
    for alpha in grid:
        value = np.asarray(alpha, dtype=np.float32)
        results[alpha] = perplexity(session, windows, feed_extra=lambda rows, a=value: {
            HIDDEN_INPUT: states[rows], ALPHA_INPUT: a}).perplexity
        if on_value:
            on_value(alpha, results[alpha])
    return results


def best_alpha(sweep: dict[float, float]) -> float:
    """The alpha with the lowest perplexity (the smaller alpha on a tie)."""
    return min(sweep, key=lambda alpha: (sweep[alpha], alpha))


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
    grid: tuple[float, ...] = ALPHA_GRID,
    progress: bool = True,
    **session_args,
) -> SearchResult:
    """Choose an alpha for each of `layers`, in the order given (top-down for HARP), by held-out perplexity.

    Args:
        windows: token windows [n, seq] of held-out text.
    """
    result = SearchResult()
    hidden = hidden_states_at(model, folder, windows, list(layers), **session_args)
    bar = tqdm(total=len(layers) * len(grid), desc="alpha search", unit="try", disable=not progress, leave=False)
    for layer in layers:
        def tried(alpha: float, value: float, layer: int = layer) -> None:
            result.trials.append({"layer": layer, "alpha": alpha, "perplexity": value})
            best = min(t["perplexity"] for t in result.trials if t["layer"] == layer)
            bar.set_postfix(layer=layer, best=f"{best:.2f}")
            bar.update()

        sweep = alpha_sweep(model, folder, windows, hidden, result.alphas, layer, grid=grid, on_value=tried,
                            **session_args)
        result.alphas[layer] = best_alpha(sweep)
    bar.close()
    return result
