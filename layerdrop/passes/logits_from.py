"""Rewrite pass: an optional input that says from which position on the graph computes logits.

    logits = LMHead(hidden[:, layerdrop_logits_from:, :])      layerdrop_logits_from defaults to 0: every position

A multiple-choice item needs the next-token distribution at its answer's positions only, but a graph computes the
LM head at every position, and ONNX Runtime runs every node whatever outputs a caller asks for. On Gemma 3 270M the
head (262,144 words x 640) is most of a token's multiply-adds, so the context of an item costs more in the head than
in all its layers. Fed the length of the sequence, the graph computes no logits at all (a run that only fills the KV
cache); fed an earlier position, the logits of that position on. The input is an initializer too, so a caller that
does not feed it gets the graph's usual output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerdrop.formats import LOGITS_FROM, TOKEN_LOGPROBS
from layerdrop.model_folder import copy_model
from layerdrop.passes._ir_utils import add_initializer, constant_array

HEADS = {("", "MatMul"), ("com.microsoft", "MatMulNBits")}
# ops between the head and the logits output that act on each position alone (a cast, Gemma's soft cap, a bias)
POSITIONWISE = {"Cast", "Tanh", "Mul", "Div", "Add", "Sub"}


class LogitsFromPass(ir.passes.InPlacePass):
    """Add the optional graph input `layerdrop_logits_from` (int64 [1], default 0) and slice the hidden state the
    LM head reads from that position on. Left as it is (not modified): a graph that has the input already, one with
    the token log-probability output (its targets follow every position), one whose logits are not [batch, seq,
    vocab], or one whose logits do not come from a MatMul or MatMulNBits through per-position ops only."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
        if LOGITS_FROM in names or TOKEN_LOGPROBS in names:
            return ir.passes.PassResult(model, modified=False)
        head = _lm_head(graph)
        if head is None:
            return ir.passes.PassResult(model, modified=False)
        start = add_initializer(graph, LOGITS_FROM, np.array([0], np.int64))
        graph.inputs.append(start)  # an input too: a caller may feed another position
        end = add_initializer(graph, "layerdrop_logits_end", np.array([np.iinfo(np.int64).max], np.int64))
        axis = add_initializer(graph, "layerdrop_logits_axis", np.array([1], np.int64))
        node = ir.node("Slice", [head.inputs[0], start, end, axis], name="layerdrop_logits_from_slice",
                       num_outputs=1)
        node.outputs[0].name = "layerdrop_logits_hidden"
        graph.insert_before(head, node)
        head.replace_input_with(0, node.outputs[0])
        return ir.passes.PassResult(model, modified=True)


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    """The MatMul (or MatMulNBits) the `logits` output comes from through per-position ops, if the logits are
    [batch, seq, vocab] and its activation is the first input; else None."""
    logits = next((v for v in graph.outputs if v.name == "logits"), None)
    if logits is None or logits.shape is None or len(logits.shape) != 3:
        return None
    value = logits
    while (node := value.producer()) is not None:
        if (node.domain or "", node.op_type) in HEADS:
            activation = node.inputs[0]
            if activation is None or (activation.shape is not None and len(activation.shape) != 3):
                return None
            return node
        if node.op_type not in POSITIONWISE or node.domain not in ("", "ai.onnx"):
            return None
        arrays = [(v, constant_array(v)) for v in node.inputs if v is not None]
        moving = [v for v, array in arrays if array is None]
        # a constant other input must not vary along the sequence: a scalar or one value per word
        if len(moving) != 1 or any(array is not None and array.ndim > 1 for _, array in arrays):
            return None
        value = moving[0]
    return None


def with_logits_from(model: ir.Model) -> ir.Model:
    """A copy of `model` with the `layerdrop_logits_from` input where `LogitsFromPass` can add it; `model` is not
    changed."""
    copy = copy_model(model)
    LogitsFromPass()(copy)
    return copy
