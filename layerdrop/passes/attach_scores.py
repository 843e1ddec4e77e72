"""Analysis pass: attach calibration scores to the residual regions they belong to.

Each region's Add gets node metadata `layerdrop.score` ({"score", "norm_ratio"}); a block's score goes on the
Add that ends the block under `layerdrop.block_score`. The model metadata `layerdrop.calibration` records the
calibration text (file, SHA-256, windows). The graph itself is not changed.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from layerdrop.formats import BLOCK_SCORE_KEY, CALIBRATION_KEY, SCORE_KEY
from layerdrop.passes.find_residuals import ResidualRegion, annotated_regions
from layerdrop.passes.metadata import read_json, write_json


class AttachScoresPass(ir.passes.InPlacePass):
    """Write module scores (objects with layer, kind, score, norm_ratio) into the annotated regions' metadata.

    Raises:
        LayerdropError: the model has no region annotations.
    """

    def __init__(self, scores: Iterable, calibration: dict) -> None:
        super().__init__()
        self.scores = list(scores)
        self.calibration = calibration

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        regions = annotated_regions(model)
        by_key = {(r.kind, r.layer): r for r in regions}
        last_of_layer = {r.layer: r for r in regions}
        writes = [(model.metadata_props, CALIBRATION_KEY, self.calibration)]
        for score in self.scores:
            entry = {"score": score.score, "norm_ratio": score.norm_ratio}
            if score.kind == "block":
                writes.append((last_of_layer[score.layer].add.metadata_props, BLOCK_SCORE_KEY, entry))
            else:
                writes.append((by_key[(score.kind, score.layer)].add.metadata_props, SCORE_KEY, entry))
        modified = False
        for props, key, value in writes:
            modified |= read_json(props, key, None) != value
            write_json(props, key, value)
        return ir.passes.PassResult(model, modified=modified)


def read_scores(model: ir.Model, regions: list[ResidualRegion] | None = None) -> list[dict]:
    """The attached scores as rows {"layer", "kind", "score", "norm_ratio"}; [] for an unscored model.

    Pass the model's `regions` when they are already rebuilt, to skip rebuilding them again.
    """
    rows = []
    for region in regions if regions is not None else annotated_regions(model):
        meta = region.add.metadata_props
        if SCORE_KEY in meta:
            rows.append({"layer": region.layer, "kind": region.kind, **read_json(meta, SCORE_KEY, {})})
        if BLOCK_SCORE_KEY in meta:
            rows.append({"layer": region.layer, "kind": "block", **read_json(meta, BLOCK_SCORE_KEY, {})})
    order = {"attn": 0, "harp": 0, "fit": 0, "mlp": 1, "block": 2}
    return sorted(rows, key=lambda r: (r["layer"], order[r["kind"]]))
