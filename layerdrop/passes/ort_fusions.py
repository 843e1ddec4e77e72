"""Rewrite pass: ONNX Runtime's transformer fusions (RMSNorm, skip-RMSNorm, rotary, SDPA/MHA, GQA where it
matches), through onnxscript's ORT fusion rules, after putting the rotary frequencies of a torch.export graph in
the form those rules read where GroupQueryAttention computes what the graph did (`group_query_attention.py`).

Apply it last, after every layerdrop rewrite: fused graphs hide the residual Adds inside fused norms, so
analysis and drops belong before fusion, never after it.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from layerdrop.formats import FUSION_NOTE_KEY, FUSIONS_KEY


class OrtFusionPass(ir.passes.InPlacePass):
    """Fuse for ONNX Runtime and record the count of each fusion under model metadata `layerdrop.ort_fusions` (and,
    under `layerdrop.ort_fusions.note`, why GroupQueryAttention was kept from forming, when it was)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.without_group_query_attention: str | None = None  # why, when it was kept from forming

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        from layerdrop.passes.group_query_attention import group_query_attention_blocker, rope_frequency_rules

        metadata = dict(model.metadata_props)
        self.without_group_query_attention = group_query_attention_blocker(model)
        rewritten_frequencies = 0
        if self.without_group_query_attention is None:
            rewritten_frequencies = rope_frequency_rules().apply_to_model(model)
        model, counts = optimize_for_ort(model)
        counts = {**counts, "rope_frequencies": rewritten_frequencies}
        self.counts = {name: int(count) for name, count in sorted(counts.items()) if count}
        model.metadata_props.update(metadata)
        model.metadata_props[FUSIONS_KEY] = json.dumps(self.counts, sort_keys=True)
        model.metadata_props.pop(FUSION_NOTE_KEY, None)
        if self.without_group_query_attention is not None:
            model.metadata_props[FUSION_NOTE_KEY] = f"no GroupQueryAttention: {self.without_group_query_attention}"
        return ir.passes.PassResult(model, modified=bool(self.counts))
