"""Rewrite passes for searches: one graph in which chosen attention layers can be kept or bypassed at any alpha
(`GatedBypassPass`), kept or replaced by a fitted map (`GatedFitPass`), or any of the three (`GatedMixedPass`).

Each layer l of the pool reads a scalar input `layerdrop_keep_<l>` (bool): kept, it is the original attention.
Otherwise, in a bypass graph, its branch is HARP's alpha * V·O map (mean-shifted where `means` has the layer), with
alpha the input `layerdrop_alpha_<l>`, written by the same `bypass_attention` that `HarpBypassPass` uses; in a
fit graph, the layer's map Norm(X) W + b, written by the same `fit_branch` that `FitAttentionPass` uses. A search
then feeds move sets as inputs instead of building a graph for each. In a mixed graph, a layer also reads
`layerdrop_fit_<l>` (bool): set, its branch is the fitted map, whatever its keep and alpha inputs say.

A move set maps layers to moves: an alpha (0: drop, or the constant mean with the shift), or `FIT`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerdrop.passes.find_residuals import attention_regions
from layerdrop.passes.fit_attention import FittedMap, fit_branch
from layerdrop.passes.harp_bypass import bypass_attention, head_layout

ALPHA_INPUT = "layerdrop_alpha"
KEEP_INPUT = "layerdrop_keep"
FIT_INPUT = "layerdrop_fit"
FIT = "fit"  # the move "replace by the layer's fitted map"


class GatedBypassPass(ir.passes.InPlacePass):
    """Give each attention layer of `layers` a keep input and an alpha input (module docstring).

    Raises:
        LayerdropError: a layer has no attention region, or its V/O projections cannot be located.
    """

    def __init__(self, layers: list[int], means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        super().__init__()
        self.layers = sorted(layers)
        self.means = dict(means or {})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = attention_regions(model, self.layers, "search")
        layout = head_layout(model)
        for layer in self.layers:
            keep = ir.Value(name=f"{KEEP_INPUT}_{layer}", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL))
            alpha = ir.Value(name=f"{ALPHA_INPUT}_{layer}", shape=ir.Shape([]),
                             type=ir.TensorType(regions[layer].skip.dtype or ir.DataType.FLOAT))
            graph.inputs.extend([keep, alpha])
            bypass_attention(graph, regions[layer], layout, alpha, self.means.get(layer), keep=keep)
        return ir.passes.PassResult(model, modified=bool(self.layers))


class GatedFitPass(ir.passes.InPlacePass):
    """Give each attention layer of `maps` (layer -> FittedMap) a keep input choosing between its attention and its map
    (module docstring).

    Raises:
        LayerdropError: a layer has no attention region with a normalized input.
    """

    def __init__(self, maps: dict[int, FittedMap]) -> None:
        super().__init__()
        self.maps = dict(maps)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        regions = attention_regions(model, sorted(self.maps), "search")
        for layer in sorted(self.maps):
            keep = ir.Value(name=f"{KEEP_INPUT}_{layer}", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL))
            model.graph.inputs.append(keep)
            fit_branch(model.graph, regions[layer], self.maps[layer], keep=keep)
        return ir.passes.PassResult(model, modified=bool(self.maps))


class GatedMixedPass(ir.passes.InPlacePass):
    """Give each attention layer of `maps` (layer -> FittedMap) keep, alpha and fit inputs: its attention, its V·O
    bypass at any alpha (mean-shifted where `means` has the layer) or its fitted map (module docstring).

    Raises:
        LayerdropError: a layer has no attention region with a normalized input, or its V/O projections cannot be
            located.
    """

    def __init__(self, maps: dict[int, FittedMap],
                 means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        super().__init__()
        self.maps = dict(maps)
        self.means = dict(means or {})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = attention_regions(model, sorted(self.maps), "search")
        layout = head_layout(model)
        for layer in sorted(self.maps):
            region = regions[layer]
            keep, fitted = (ir.Value(name=f"{name}_{layer}", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL))
                            for name in (KEEP_INPUT, FIT_INPUT))
            alpha = ir.Value(name=f"{ALPHA_INPUT}_{layer}", shape=ir.Shape([]),
                             type=ir.TensorType(region.skip.dtype or ir.DataType.FLOAT))
            graph.inputs.extend([keep, alpha, fitted])
            bypass_attention(graph, region, layout, alpha, self.means.get(layer), keep=keep)
            unfitted = ir.node("Not", [fitted])
            graph.insert_before(region.add, [unfitted])
            fit_branch(graph, region, self.maps[layer], keep=unfitted.outputs[0])  # reads the gated bypass
        return ir.passes.PassResult(model, modified=bool(self.maps))


def move_feeds(layers: list[int], moves: dict[int, float | str], dtype=np.float32) -> dict[str, np.ndarray]:
    """The keep, alpha and fit inputs of a gated graph over `layers` for `moves` (layer -> alpha or `FIT`; others
    kept); a graph reads those it has."""
    feeds = {}
    for layer in layers:
        move = moves.get(layer, 1.0)
        feeds[f"{KEEP_INPUT}_{layer}"] = np.asarray(layer not in moves)
        feeds[f"{ALPHA_INPUT}_{layer}"] = np.asarray(1.0 if move == FIT else move, dtype=dtype)
        feeds[f"{FIT_INPUT}_{layer}"] = np.asarray(move == FIT)
    return feeds
