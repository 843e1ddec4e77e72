"""GroupQueryAttention on layerdrop's own exports: the rotary frequencies in the form onnxscript's ORT fusions read,
and the conditions under which the GroupQueryAttention those fusions then form computes what the graph did.

Recent transformers write the rotary angles as `position_ids[..., None].float() * inv_freq`; onnxscript's
cos/sin-cache fusion reads the older `inv_freq[None, :, None] @ position_ids[:, None, :]` followed by a
transpose. On the newer form no cos/sin cache forms, so neither does GroupQueryAttention (it needs
com.microsoft RotaryEmbedding): the fusions stop at MultiHeadAttention on KV heads repeated by Expand, and the
rotation stays a dozen small ops a layer, slower than the model builder's GroupQueryAttention.
`rope_frequency_rules` writes the same product in the older form before the fusions run; with an inner dimension
of 1 the MatMul is the same single multiplication:

    Mul(Cast(Unsqueeze(position_ids, [-1])), inv_freq[E])
        -> Transpose(MatMul(inv_freq[1, E, 1], Cast(Unsqueeze(position_ids, [1]))), [0, 2, 1])

onnxscript's GQA rule then keeps neither the attention's scale nor a sliding window, and ONNX Runtime's CPU kernel
takes head sizes that are multiples of 16 only; `group_query_attention_blocker` says, from the unfused graph, why
GroupQueryAttention must not form (and the rule is then not applied, so the fusions stop at MultiHeadAttention as
before). The GroupQueryAttention takes its positions from position_ids (0, 1, ... per row) and ignores the
attention mask, as onnxruntime-genai feeds it: exact on unpadded and right-padded rows, not on left-padded ones.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from layerdrop.passes._ir_utils import constant_array

# Ops a causal + padding mask is built from in a torch.export graph; a sliding window adds Sub and Greater.
_MASK_OPS = frozenset({"Shape", "Squeeze", "Unsqueeze", "Add", "Range", "LessOrEqual", "And", "Cast", "GatherND",
                       "Concat", "Expand", "Where", "Reshape", "Constant", "Gather", "Slice", "Equal", "Not",
                       "Identity"})
_HEAD_SIZE_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention kernel


class RopeFrequenciesAsMatMul(RewriteRuleClassBase):
    """The rotary angles `position_ids[..., None] * inv_freq` (graph input position_ids [B, S], constant float
    inv_freq [E]) as `(inv_freq[1, E, 1] @ position_ids[:, None, :]).transpose(1, 2)`."""

    def pattern(self, op, position_ids, axes, inv_freq):
        positions = op.Cast(op.Unsqueeze(position_ids, axes), to=ir.DataType.FLOAT)
        return op.Mul(positions, inv_freq)

    def check(self, context, position_ids, axes, inv_freq, **_) -> MatchResult:
        result = MatchResult()
        if not position_ids.is_graph_input() or position_ids.shape is None or len(position_ids.shape) != 2:
            return result.fail("not the [batch, seq] position_ids input")
        axes_value, frequencies = constant_array(axes), constant_array(inv_freq)
        if axes_value is None or axes_value.reshape(-1).tolist() not in ([-1], [2]):
            return result.fail("not unsqueezed on the last axis")
        if frequencies is None or frequencies.dtype != np.float32 or frequencies.ndim != 1:
            return result.fail("inv_freq is not a constant float vector")
        return result

    def rewrite(self, op, position_ids, inv_freq, **_):
        column = op.initializer(ir.tensor(constant_array(inv_freq).reshape(1, -1, 1)), name=f"{inv_freq.name}_column")
        positions = op.Cast(op.Unsqueeze(position_ids, op.Constant(value_ints=[1])), to=ir.DataType.FLOAT)
        return op.Transpose(op.MatMul(column, positions), perm=[0, 2, 1])


def rope_frequency_rules() -> RewriteRuleSet:
    """The rule above, for either operand order of the Mul."""
    return RewriteRuleSet([RopeFrequenciesAsMatMul.rule()], commute=True)


def group_query_attention_blocker(model: ir.Model) -> str | None:
    """Why GroupQueryAttention must not replace the graph's attention, or None when it may.

    Every Softmax of the unfused graph must be plain scaled dot-product attention as torch.export writes it,
    `Softmax(Mul(Q, a) @ Mul(K^T, b) + mask)` with a * b = 1 / sqrt(head size), a head size ONNX Runtime's CPU
    kernel takes, and a mask computed from the attention mask and shapes by causal comparisons only (no sliding
    window). A graph without Softmax (a builder graph, already fused) has nothing to block.
    """
    for node in model.graph:
        if node.op_type == "Softmax":
            reason = _plain_attention_blocker(node)
            if reason is not None:
                return reason
    return None


def _plain_attention_blocker(softmax: ir.Node) -> str | None:
    scores = softmax.inputs[0].producer()
    if scores is None or scores.op_type != "Add":
        return "an attention without an additive mask"
    product = next((v.producer() for v in scores.inputs if v.producer() and v.producer().op_type == "MatMul"), None)
    if product is None:
        return "an attention whose scores are not a plain Q K^T product (a soft cap, say)"
    mask = scores.inputs[1] if scores.inputs[0] is product.outputs[0] else scores.inputs[0]
    factors = []
    for operand in product.inputs:
        scaling = operand.producer()
        if scaling is None or scaling.op_type != "Mul" or len(scaling.inputs) != 2:
            return "an attention whose scale is not where torch.export writes it"
        constants = [c for c in (constant_array(v) for v in scaling.inputs) if c is not None and c.size == 1]
        if len(constants) != 1:
            return "an attention whose scale is not a constant"
        factors.append(float(constants[0].reshape(())))
    query = product.inputs[0]
    head_size = query.shape[-1] if query.shape is not None and len(query.shape) == 4 else None
    if not isinstance(head_size, int):
        return "an attention whose head size is not known"
    if head_size % _HEAD_SIZE_MULTIPLE:
        return (f"head size {head_size} is not a multiple of {_HEAD_SIZE_MULTIPLE} "
                "(ONNX Runtime's CPU GroupQueryAttention kernel refuses it)")
    if not math.isclose(factors[0] * factors[1], 1 / math.sqrt(head_size), rel_tol=1e-5):
        return f"attention scale {factors[0] * factors[1]:.6g} is not 1/sqrt({head_size}) (the fusion drops it)"
    if not _causal_padding_mask(mask):
        return "an attention mask that is not causal + padding (a sliding window, say)"
    return None


def _causal_padding_mask(mask: ir.Value) -> bool:
    """Whether `mask` comes from the attention_mask input and shapes through causal comparisons only."""
    stack, seen, causal, reads_attention_mask = [mask], set(), False, False
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value.is_graph_input():
            reads_attention_mask |= value.name == "attention_mask"
            continue
        node = value.producer()
        if node is None:
            continue  # an initializer
        if node.op_type not in _MASK_OPS:
            return False
        causal |= node.op_type == "LessOrEqual"
        if node.op_type != "Shape":  # a Shape reads no values of its input
            stack.extend(node.inputs)
    return causal and reads_attention_mask
