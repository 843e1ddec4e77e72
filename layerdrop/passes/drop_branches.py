"""Rewrite pass: delete residual branches (Layer Drop, Block Drop, Joint Layer Drop; SPEC §3).

A dropped region's residual Add is bypassed: every consumer of Y reads X instead. The branch and its norm then
reach no output and go with dead-code elimination; shared subgraphs (rotary tables, masks) stay while anything
still reads them. KV-cache inputs and outputs are left to `PruneKvCachePass`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import SCORE_KEY
from layerdrop.passes.find_residuals import REGION_KEY, ResidualRegion, annotated_regions

DROPPED_KEY = "layerdrop.dropped"


def removed_modules(model: ir.Model) -> list[dict]:
    """The modules earlier rewrites removed or bypassed, from model metadata (oldest first)."""
    return json.loads(model.metadata_props.get(DROPPED_KEY, "[]"))


def region_score(region: ResidualRegion) -> dict | None:
    """The calibration score attached to a region's Add by `layerdrop score`, or None."""
    text = region.add.metadata_props.get(SCORE_KEY)
    return json.loads(text) if text else None


def removal_record(region: ResidualRegion, how: str, reason: str, **extra) -> dict:
    """The `layerdrop.dropped` entry for a region a rewrite removes or bypasses (with what PruneKvCachePass needs)."""
    return {"kind": region.kind, "layer": region.layer, "how": how, "reason": reason, "score": region_score(region),
            "kv_inputs": region.kv_inputs, "kv_outputs": region.kv_outputs, **extra}


def expand_targets(regions: list[ResidualRegion], targets: Iterable[tuple[str, int]]) -> list[ResidualRegion]:
    """Resolve (kind, layer) targets, kind in attn/mlp/block, into regions in graph order.

    Raises:
        LayerdropError: a target names a module that does not exist (or was removed already) or repeats one.
    """
    by_key = {(r.kind, r.layer): r for r in regions}
    chosen: list[ResidualRegion] = []
    for kind, layer in targets:
        kinds = ("attn", "mlp") if kind == "block" else (kind,)
        for k in kinds:
            region = by_key.get((k, layer))
            if region is None:
                present = sorted({r.layer for r in regions if r.kind == k})
                span = f"layers {present[0]}..{present[-1]}" if present else "no layers"
                raise LayerdropError(f"there is no {k} module in layer {layer} to drop (this graph has {k} in {span})")
            if region in chosen:
                raise LayerdropError(f"{k}:{layer} is named twice; name each module once")
            chosen.append(region)
    order = {id(r): i for i, r in enumerate(regions)}
    return sorted(chosen, key=lambda r: order[id(r)])


def bypass(regions: list[ResidualRegion]) -> None:
    """Make the consumers of each region's residual sum read its skip input, resolving chains of drops."""
    replacement: dict[ir.Value, ir.Value] = {}
    for region in regions:
        source = region.skip
        while source in replacement:
            source = replacement[source]
        region.output.replace_all_uses_with(source, replace_graph_outputs=True)
        replacement[region.output] = source


class DropBranchesPass(ir.passes.InPlacePass):
    """Delete the branches of the named modules (rewire only; run cleanup after).

    Args:
        targets: (kind, layer) pairs with kind "attn", "mlp" or "block".
        reason: a short note stored with each dropped module (e.g. "attn-8 one-shot").

    Records every dropped module with its score and KV entries under model metadata `layerdrop.dropped`.
    """

    def __init__(self, targets: Iterable[tuple[str, int]], reason: str = "explicit") -> None:
        super().__init__()
        self.targets = list(targets)
        self.reason = reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        regions = annotated_regions(model)
        chosen = expand_targets(regions, self.targets)
        history = removed_modules(model)
        for region in chosen:
            history.append(removal_record(region, "drop", self.reason))
            region.add.metadata_props.pop(REGION_KEY, None)
        bypass(chosen)
        model.metadata_props[DROPPED_KEY] = json.dumps(history, sort_keys=True)
        return ir.passes.PassResult(model, modified=bool(chosen))
