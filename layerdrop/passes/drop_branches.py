"""Rewrite pass: delete residual branches (Layer Drop, Block Drop, Joint Layer Drop; SPEC §3).

A dropped region's residual Add is bypassed: every consumer of Y reads X instead. The branch and its norm then
reach no output and go with dead-code elimination; shared subgraphs (rotary tables, masks) stay while anything
still reads them. KV-cache inputs and outputs are left to `PruneKvCachePass`.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import REGION_KEY
from layerdrop.passes.find_residuals import ResidualRegion, annotated_regions
from layerdrop.passes.metadata import record_removals, removal_record


def expand_targets(regions: list[ResidualRegion], targets: Iterable[tuple[str, int]]) -> list[ResidualRegion]:
    """Resolve (kind, layer) targets, kind in attn/mlp/block, into regions in graph order.

    Raises:
        LayerdropError: a target names a module that does not exist (or was removed already) or repeats one.
    """
    by_key = {(r.kind, r.layer): r for r in regions}
    chosen: list[ResidualRegion] = []
    for kind, layer in targets:
        for k in ("attn", "mlp") if kind == "block" else (kind,):
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
    """Make the consumers of each region's residual sum read its skip input, resolving chains of drops; the
    regions' annotations go (their Adds no longer carry the stream)."""
    replacement: dict[ir.Value, ir.Value] = {}
    for region in regions:
        source = region.skip
        while source in replacement:
            source = replacement[source]
        region.output.replace_all_uses_with(source, replace_graph_outputs=True)
        replacement[region.output] = source
        region.add.metadata_props.pop(REGION_KEY, None)


class DropBranchesPass(ir.passes.InPlacePass):
    """Delete the branches of the named modules (rewire only; run cleanup after).

    Args:
        targets: (kind, layer) pairs with kind "attn", "mlp" or "block".
        reason: a short note stored with each dropped module (e.g. "attn-8 one-shot").

    Reads the regions `FindResidualsPass` annotated; records every dropped module with its score and KV entries
    under model metadata `layerdrop.dropped`.

    Raises:
        LayerdropError: unknown or repeated modules, or a model without region annotations.
    """

    def __init__(self, targets: Iterable[tuple[str, int]], reason: str = "explicit") -> None:
        super().__init__()
        self.targets = list(targets)
        self.reason = reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        chosen = expand_targets(annotated_regions(model), self.targets)
        record_removals(model, [removal_record(region, "drop", self.reason) for region in chosen])
        bypass(chosen)
        return ir.passes.PassResult(model, modified=bool(chosen))
