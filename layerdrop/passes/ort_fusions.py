"""Rewrite pass: ONNX Runtime's transformer fusions (RMSNorm, skip-RMSNorm, rotary, SDPA/MHA, GQA where it
matches), through onnxscript's ORT fusion rules.

Apply it last, after every layerdrop rewrite: fused graphs hide the residual Adds inside fused norms, so
analysis and drops belong before fusion, never after it.
"""

from __future__ import annotations

import json

import onnx_ir as ir

FUSIONS_KEY = "layerdrop.ort_fusions"


class OrtFusionPass(ir.passes.InPlacePass):
    """Fuse for ONNX Runtime and record the count of each fusion under model metadata `layerdrop.ort_fusions`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        metadata = dict(model.metadata_props)
        model, counts = optimize_for_ort(model)
        self.counts = {name: int(count) for name, count in sorted(counts.items()) if count}
        model.metadata_props.update(metadata)
        model.metadata_props[FUSIONS_KEY] = json.dumps(self.counts, sort_keys=True)
        return ir.passes.PassResult(model, modified=bool(self.counts))
