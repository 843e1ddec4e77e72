"""The cleanup every rewrite ends with: dead code, unused opsets, topological order (onnx-ir's common passes)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from layerdrop.errors import LayerdropError


def cleanup_passes() -> list[ir.passes.PassBase]:
    """Dead-code elimination (nodes and initializers), unused opsets, topological sort."""
    return [
        common_passes.RemoveUnusedNodesPass(),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.TopologicalSortPass(),
    ]


def run_passes(model: ir.Model, passes: list[ir.passes.PassBase]) -> ir.Model:
    """Run `passes` in order on `model` in place, surfacing a LayerdropError raised inside any of them."""
    try:
        return ir.passes.Sequential(*passes)(model).model
    except ir.passes.PassError as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, LayerdropError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise
