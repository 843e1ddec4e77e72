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
from layerdrop.passes.harp_bypass import (
    HarpBypassPass,
    expanded_value_projection,
    head_layout,
    initializer,
    output_projection,
)
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import make_session
from layerdrop.windows import Windows

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))
ALPHA_INPUT = "layerdrop_alpha"
KEEP_INPUT = "layerdrop_keep"
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


def branch_means(model: ir.Model, folder: Path, windows: Windows, layers: list[int], **session_args
                 ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For each attention layer, the calibration means (float64, [d]) of its branch output, m_B, and of its
    unscaled V·O bypass P (alpha 1), m_P, both on the unmodified model's hidden states (the mean shift's
    constants, see `HarpBypassPass`), over the windows' text tokens (a BOS is left out).

    Two graphs: the model itself, returning each layer's input and branch output; and a copy where the layers
    are bypassed and each bypass reads that layer's input from the first run instead of the rewritten stream.
    """
    layers = sorted(layers)
    original = copy_model(model)
    regions = {r.layer: r for r in find_residual_regions(original.graph) if r.kind == "attn"}
    original.graph.outputs.clear()
    for layer in layers:
        original.graph.outputs.extend([regions[layer].skip, regions[layer].branch_output])
    RemoveUnusedNodesPass()(original)

    bypassed = copy_model(model)
    regions = {r.layer: r for r in find_residual_regions(bypassed.graph) if r.kind == "attn"}
    readers = {layer: [(node, index) for node in regions[layer].branch for index, inp in enumerate(node.inputs)
                       if inp is regions[layer].skip] for layer in layers}
    adds = {layer: regions[layer].add for layer in layers}
    run_passes(bypassed, [HarpBypassPass(dict.fromkeys(layers, 1.0))])
    bypassed.graph.outputs.clear()
    for layer in layers:
        state = ir.Value(name=f"{HIDDEN_INPUT}_{layer}", shape=regions[layer].skip.shape, type=regions[layer].skip.type)
        bypassed.graph.inputs.append(state)
        for node, index in readers[layer]:
            node.replace_input_with(index, state)
        add = adds[layer]
        projected = add.inputs[1] if add.inputs[0] is regions[layer].skip else add.inputs[0]
        projected.name = f"layerdrop_bypass_{layer}"
        bypassed.graph.outputs.append(projected)
    RemoveUnusedNodesPass()(bypassed)

    first = make_session(original, folder=folder, **session_args)
    second = make_session(bypassed, folder=folder, **session_args)
    sums = {layer: [0.0, 0.0] for layer in layers}
    for row, real in zip(windows.ids, windows.real):
        arrays = first.run(None, prefill_feed(first, row[None]))
        states = {f"{HIDDEN_INPUT}_{layer}": arrays[2 * i] for i, layer in enumerate(layers)}
        projected = second.run(None, prefill_feed(second, row[None], extra=states))
        for i, layer in enumerate(layers):
            sums[layer][0] += arrays[2 * i + 1][0, real].astype(np.float64).sum(0)
            sums[layer][1] += projected[i][0, real].astype(np.float64).sum(0)
    tokens = int(windows.real.sum())
    return {layer: (pair[0] / tokens, pair[1] / tokens) for layer, pair in sums.items()}


def _from_hidden_to_logits(model: ir.Model, entry: ir.Value) -> ir.Model:
    """Cut `model` (a copy) so that it starts at `entry` (fed as input `layerdrop_hidden`) and returns logits."""
    hidden = ir.Value(name=HIDDEN_INPUT, shape=entry.shape, type=entry.type)
    entry.replace_all_uses_with(hidden)
    model.graph.inputs.append(hidden)
    logits = next(v for v in model.graph.outputs if v.name == "logits")
    model.graph.outputs.clear()
    model.graph.outputs.append(logits)
    RemoveUnusedNodesPass()(model)
    return model


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
    return _from_hidden_to_logits(copy, entry)


def gated_suffix_model(model: ir.Model, start_layer: int, layers: list[int],
                       means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> ir.Model:
    """One graph for every move set over `layers`: a suffix from `start_layer` (input `layerdrop_hidden`) in
    which each of those layers reads two scalar inputs, `layerdrop_keep_<layer>` (bool) and
    `layerdrop_alpha_<layer>` (float). Kept, the layer is the original; otherwise its branch is HARP's
    alpha * V·O map (mean-shifted where `means` has the layer), as `HarpBypassPass` writes it.

    The output projection reads Where(keep, attention heads, Norm(X) W_V'), so a post-attention norm (Gemma-2)
    applies to both; then the branch is scaled by Where(keep, 1, alpha) (+ Where(keep, 0, m_B - alpha m_P)).
    """
    copy = copy_model(model)
    graph = copy.graph
    regions = {r.layer: r for r in find_residual_regions(graph) if r.kind == "attn"}
    if start_layer not in regions:
        raise LayerdropError(f"layer {start_layer} has no attention region to start a suffix graph from")
    entry = regions[start_layer].skip
    heads, kv_heads, head_dim = head_layout(copy)

    def scalar_input(name: str, data_type: ir.DataType) -> ir.Value:
        value = ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(data_type))
        graph.inputs.append(value)
        return value

    for layer in layers:
        region = regions[layer]
        prefix = f"layerdrop.gate.{layer}"
        keep = scalar_input(f"{KEEP_INPUT}_{layer}", ir.DataType.BOOL)
        alpha = scalar_input(f"{ALPHA_INPUT}_{layer}", ir.DataType.FLOAT)
        w_v, b_v = expanded_value_projection(region, heads, kv_heads, head_dim)
        o_node, *_ = output_projection(region)
        nodes = [ir.node("MatMul", [region.norm_output, initializer(graph, f"{prefix}.v", w_v)])]
        if b_v is not None:
            nodes.append(ir.node("Add", [nodes[-1].outputs[0], initializer(graph, f"{prefix}.v_bias", b_v)]))
        nodes.append(ir.node("Where", [keep, o_node.inputs[0], nodes[-1].outputs[0]]))
        graph.insert_before(o_node, nodes)
        o_node.replace_input_with(0, nodes[-1].outputs[0])

        one = initializer(graph, f"{prefix}.one", np.asarray(1, dtype=np.float32))
        zero = initializer(graph, f"{prefix}.zero", np.asarray(0, dtype=np.float32))
        scale = ir.node("Where", [keep, one, alpha])
        tail = [scale, ir.node("Mul", [region.branch_output, scale.outputs[0]])]
        if means is not None and layer in means:
            branch_mean, bypass_mean = (np.asarray(m, dtype=np.float32) for m in means[layer])
            shift = ir.node("Mul", [initializer(graph, f"{prefix}.bypass_mean", bypass_mean), alpha])
            offset = ir.node("Sub", [initializer(graph, f"{prefix}.branch_mean", branch_mean), shift.outputs[0]])
            gated = ir.node("Where", [keep, zero, offset.outputs[0]])
            tail += [shift, offset, gated, ir.node("Add", [tail[-1].outputs[0], gated.outputs[0]])]
        graph.insert_before(region.add, tail)
        branch_index = 1 if region.add.inputs[1] is region.branch_output else 0
        region.add.replace_input_with(branch_index, tail[-1].outputs[0])

    return _from_hidden_to_logits(copy, entry)


class GatedSuffix:
    """Perplexities of move sets over a fixed pool of layers without building a graph per move set: one
    `gated_suffix_model` session for the current start layer (rebuilt only when the start changes), fed the
    hidden states entering that layer, computed once from the unmodified model."""

    def __init__(self, model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int],
                 means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None, **session_args) -> None:
        self.model, self.folder, self.windows, self.layers = model, folder, windows, sorted(layers)
        self.means, self.session_args = means, session_args
        self.hidden = hidden_states_at(model, folder, windows, self.layers, **session_args)
        self.start, self.session = None, None

    def _session(self, start: int):
        if start != self.start:
            self.session = None  # free the old graph's weights before building the next
            graph = gated_suffix_model(self.model, start, [k for k in self.layers if k >= start], self.means)
            self.start, self.session = start, make_session(graph, folder=self.folder, **self.session_args)
        return self.session

    def perplexity(self, moves: dict[int, float], start: int | None = None) -> float:
        """Perplexity with `moves` (layer -> alpha) applied and every other pool layer kept, run from the pool
        layer `start` (default: the lowest moved layer; a fixed start saves building a graph per start)."""
        unknown = sorted(set(moves) - set(self.layers))
        if unknown:
            raise LayerdropError(f"layers {unknown} are not in the search pool {self.layers}")
        start = min(moves) if start is None else min(start, *moves)
        session, states = self._session(start), self.hidden[start]
        extra = {}
        for layer in (k for k in self.layers if k >= start):
            extra[f"{KEEP_INPUT}_{layer}"] = np.asarray(layer not in moves)
            extra[f"{ALPHA_INPUT}_{layer}"] = np.asarray(moves.get(layer, 1.0), dtype=np.float32)
        return perplexity(session, self.windows,
                          feed_extra=lambda rows: {**extra, HIDDEN_INPUT: states[rows]}).perplexity


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
