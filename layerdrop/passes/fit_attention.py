"""Rewrite pass: replace attention branches by fitted linear maps, Norm(X) W + b (the planner's `fit` move).

The whole branch goes, with the family's post-attention norm if it has one (Gemma): the residual Add then reads
one MatMul + Add from the branch's normalized input. W and b come from a least-squares fit on calibration hidden
states (`search.fit`); this pass only writes them. The layer's KV cache goes with `PruneKvCachePass`.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import REGION_KEY
from layerdrop.passes.find_residuals import ResidualRegion, attention_regions
from layerdrop.passes.harp_bypass import initializer
from layerdrop.passes.metadata import record_removals, removal_record


class FitAttentionPass(ir.passes.InPlacePass):
    """Replace the attention branch of each layer in `maps` (layer -> (W [d, d], b [d])) by Norm(X) W + b.

    Reads the regions `FindResidualsPass` annotated; records each layer (how = "fit") under `layerdrop.dropped`.

    Raises:
        LayerdropError: a layer has no attention region, or a map does not fit the hidden size.
    """

    def __init__(self, maps: dict[int, tuple[np.ndarray, np.ndarray]], reason: str = "fit") -> None:
        super().__init__()
        self.maps = dict(maps)
        self.reason = reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = attention_regions(model, self.maps, "replace")
        entries = []
        for layer in sorted(self.maps):
            region = regions[layer]
            fit_branch(graph, region, *self.maps[layer])
            entries.append(removal_record(region, "fit", self.reason))
            # structure alone would call this branch an MLP now; the annotation keeps what it was
            region.add.metadata_props[REGION_KEY] = json.dumps({**region.annotation(), "kind": "fit"}, sort_keys=True)
        record_removals(model, entries)
        return ir.passes.PassResult(model, modified=bool(self.maps))


def fit_branch(graph: ir.Graph, region: ResidualRegion, weight: np.ndarray, bias: np.ndarray,
               keep: ir.Value | None = None) -> None:
    """Make the residual Add of `region` read Norm(X) W + b instead of the branch; with `keep` (a boolean scalar
    input), Where(keep, branch, Norm(X) W + b), so one graph computes both. The one place that writes the map;
    `FitAttentionPass` and the gated search graph both call it.

    Raises:
        LayerdropError: the branch has no normalized input to fit from.
    """
    if region.norm_output is None:
        raise LayerdropError(f"layer {region.layer}: the attention branch has no normalized input to fit")
    dtype = region.skip.dtype.numpy() if region.skip.dtype is not None else np.float32
    prefix = f"layerdrop.fit.{region.layer}"
    project = ir.node("MatMul", [region.norm_output, initializer(graph, f"{prefix}.weight",
                                                                 np.asarray(weight).astype(dtype))])
    shift = ir.node("Add", [project.outputs[0], initializer(graph, f"{prefix}.bias", np.asarray(bias).astype(dtype))])
    nodes = [project, shift]
    skip_index = 0 if region.add.inputs[0] is region.skip else 1
    if keep is not None:
        nodes.append(ir.node("Where", [keep, region.add.inputs[1 - skip_index], shift.outputs[0]]))
    graph.insert_before(region.add, nodes)
    region.add.replace_input_with(1 - skip_index, nodes[-1].outputs[0])
