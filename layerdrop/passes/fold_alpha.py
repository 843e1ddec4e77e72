"""Rewrite rules: fold a constant that follows a constant projection into the projection's weights.

    Mul(MatMul(x, W), c)             -> MatMul(x, W * c)
    Mul(Add(MatMul(x, W), b), c)     -> Add(MatMul(x, W * c), b * c)
    MatMul(MatMul(x, W), T)          -> MatMul(x, W T)
    MatMul(Add(MatMul(x, W), b), T)  -> Add(MatMul(x, W T), b T)

HARP writes its rescaling as a Mul after the folded V·O projection, and a fitted block run writes its transform
as a MatMul after the MLP's down-projection (ReplaceMe); these rules remove the extra op wherever the constants
allow it and nothing else reads the intermediate values (a post-feedforward norm in between, as in Gemma, keeps
the transform a MatMul of its own).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from layerdrop.passes._ir_utils import constant_array


def _scalar(value: ir.Value) -> bool:
    array = constant_array(value)
    return array is not None and array.size == 1


def _single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


class ScaledMatMul(RewriteRuleClassBase):
    """Mul(MatMul(x, W), c) -> MatMul(x, W * c) for constant W and scalar c."""

    def pattern(self, op, x, w, c):
        return op.Mul(op.MatMul(x, w, _outputs=["projected"]), c)

    def check(self, context, x, w, c, projected, **_) -> MatchResult:
        result = MatchResult()
        if constant_array(w) is None or not _scalar(c):
            return result.fail("weight or scale is not constant")
        if not _single_use(projected) or len(w.uses()) != 1:
            return result.fail("the projection or its weight is shared")
        return result

    def rewrite(self, op, x, w, c, projected, **_):
        matrix, scale = constant_array(w), constant_array(c).reshape(())
        weight = (matrix * scale).astype(matrix.dtype)
        return op.MatMul(x, op.initializer(ir.tensor(weight), name=f"{w.name}_scaled"))


class ScaledMatMulBias(RewriteRuleClassBase):
    """Mul(Add(MatMul(x, W), b), c) -> Add(MatMul(x, W * c), b * c) for constant W, b and scalar c."""

    def pattern(self, op, x, w, b, c):
        return op.Mul(op.Add(op.MatMul(x, w, _outputs=["projected"]), b, _outputs=["biased"]), c)

    def check(self, context, x, w, b, c, projected, biased, **_) -> MatchResult:
        result = MatchResult()
        if constant_array(w) is None or constant_array(b) is None or not _scalar(c):
            return result.fail("weight, bias or scale is not constant")
        if not (_single_use(projected) and _single_use(biased)) or len(w.uses()) != 1 or len(b.uses()) != 1:
            return result.fail("an intermediate value or a constant is shared")
        return result

    def rewrite(self, op, x, w, b, c, projected, biased, **_):
        matrix, shift, scale = constant_array(w), constant_array(b), constant_array(c).reshape(())
        weight = (matrix * scale).astype(matrix.dtype)
        bias = (shift * scale).astype(shift.dtype)
        return op.Add(
            op.MatMul(x, op.initializer(ir.tensor(weight), name=f"{w.name}_scaled")),
            op.initializer(ir.tensor(bias), name=f"{b.name}_scaled"),
        )


class ChainedMatMul(RewriteRuleClassBase):
    """MatMul(MatMul(x, W), T) -> MatMul(x, W T) for constant 2-D W and T."""

    def pattern(self, op, x, w, t):
        return op.MatMul(op.MatMul(x, w, _outputs=["projected"]), t)

    def check(self, context, x, w, t, projected, **_) -> MatchResult:
        result = MatchResult()
        first, second = constant_array(w), constant_array(t)
        if first is None or second is None or first.ndim != 2 or second.ndim != 2:
            return result.fail("the projections are not constant matrices")
        if not _single_use(projected) or len(w.uses()) != 1:
            return result.fail("the projection or its weight is shared")
        return result

    def rewrite(self, op, x, w, t, projected, **_):
        matrix = constant_array(w)
        weight = (matrix.astype(np.float64) @ constant_array(t).astype(np.float64)).astype(matrix.dtype)
        return op.MatMul(x, op.initializer(ir.tensor(weight), name=f"{w.name}_folded"))


class ChainedMatMulBias(RewriteRuleClassBase):
    """MatMul(Add(MatMul(x, W), b), T) -> Add(MatMul(x, W T), b T) for constant W, b, T."""

    def pattern(self, op, x, w, b, t):
        return op.MatMul(op.Add(op.MatMul(x, w, _outputs=["projected"]), b, _outputs=["biased"]), t)

    def check(self, context, x, w, b, t, projected, biased, **_) -> MatchResult:
        result = MatchResult()
        first, second = constant_array(w), constant_array(t)
        if first is None or second is None or constant_array(b) is None or first.ndim != 2 or second.ndim != 2:
            return result.fail("the projections or the bias are not constant")
        if not (_single_use(projected) and _single_use(biased)) or len(w.uses()) != 1 or len(b.uses()) != 1:
            return result.fail("an intermediate value or a constant is shared")
        return result

    def rewrite(self, op, x, w, b, t, projected, biased, **_):
        matrix, shift, transform = constant_array(w), constant_array(b), constant_array(t).astype(np.float64)
        weight = (matrix.astype(np.float64) @ transform).astype(matrix.dtype)
        bias = (shift.astype(np.float64) @ transform).astype(shift.dtype)
        return op.Add(op.MatMul(x, op.initializer(ir.tensor(weight), name=f"{w.name}_folded")),
                      op.initializer(ir.tensor(bias), name=f"{b.name}_folded"))


def fold_chain_rules() -> RewriteRuleSet:
    """The rule set that folds a transform into the projection before it."""
    return RewriteRuleSet([ChainedMatMulBias.rule(), ChainedMatMul.rule()])


def fold_alpha_rules() -> RewriteRuleSet:
    """The rule set that folds HARP's alpha into the V·O projection."""
    return RewriteRuleSet([ScaledMatMulBias.rule(), ScaledMatMul.rule()])
