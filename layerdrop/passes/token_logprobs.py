"""Rewrite pass: add an output with the log-probability of each next token, so perplexity needs no logits copy.

    layerdrop_token_logprobs[b, t] = LogSoftmax(logits[b, t])[input_ids[b, t + 1]]     t < seq - 1

A log-softmax over a large vocabulary in numpy is single-threaded and needs the [batch, seq, vocab] logits
copied out of ONNX Runtime; its LogSoftmax runs on every thread and never hands them back. It sums in float32, so a
perplexity from it can differ from a float64 one in the last few digits. The logits stay an
output (the same session serves lm-eval), but a session built from this graph computes the log-softmax on every
run, so prefill timings use a graph without it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import TOKEN_LOGPROBS
from layerdrop.model_folder import copy_model
from layerdrop.passes._ir_utils import add_initializer


class TokenLogprobsPass(ir.passes.InPlacePass):
    """Add the output `layerdrop_token_logprobs` [batch, seq - 1] (float32) after the `logits` output, reading the
    targets from `input_ids`, which becomes a graph input if the graph does not read it (a suffix that starts at a
    hidden state). Logits of another float type are cast to float32 first. A graph that has the output already is
    left as it is.

    Raises:
        LayerdropError: the graph has no `logits` output, or its opset is older than 13.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if any(v.name == TOKEN_LOGPROBS for v in graph.outputs):
            return ir.passes.PassResult(model, modified=False)
        logits = next((v for v in graph.outputs if v.name == "logits"), None)
        if logits is None:
            raise LayerdropError("the graph has no logits output to take token log-probabilities from")
        if graph.opset_imports.get("", 0) < 13:
            raise LayerdropError("token log-probabilities need a graph of opset 13 or later; re-export the model")
        ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
        if ids is None:
            ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
            graph.inputs.append(ids)
        one, minus_one = _index(graph, "one", 1), _index(graph, "minus_one", -1)
        zero, end = _index(graph, "zero", 0), _index(graph, "end", np.iinfo(np.int64).max)
        scores = logits
        if logits.dtype not in (None, ir.DataType.FLOAT):
            scores = _append(graph, "Cast", [logits], "logits_float", to=ir.DataType.FLOAT)
        targets = _append(graph, "Slice", [ids, one, end, one], "targets")  # ids[:, 1:]
        scores = _append(graph, "Slice", [scores, zero, minus_one, one], "predicting")  # logits[:, :-1]
        log_probs = _append(graph, "LogSoftmax", [scores], "log_softmax", axis=-1)
        picked = _append(graph, "GatherElements", [log_probs, _append(graph, "Unsqueeze", [targets, minus_one],
                                                                         "target_index")], "picked", axis=-1)
        output = _append(graph, "Squeeze", [picked, minus_one], "squeezed")
        output.name = TOKEN_LOGPROBS
        output.type, output.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", "predicted"])
        graph.outputs.append(output)
        return ir.passes.PassResult(model, modified=True)


def _index(graph: ir.Graph, name: str, value: int) -> ir.Value:
    return add_initializer(graph, f"layerdrop_logprobs_{name}", np.array([value], np.int64))


def _append(graph: ir.Graph, op: str, inputs: list[ir.Value], name: str, **attributes) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes, name=f"layerdrop_logprobs_{name}", num_outputs=1)
    node.outputs[0].name = f"layerdrop_logprobs_{name}"
    graph.append(node)
    return node.outputs[0]


def with_token_logprobs(model: ir.Model) -> ir.Model:
    """A copy of `model` with the token log-probability output (`TokenLogprobsPass`); `model` is not changed."""
    copy = copy_model(model)
    TokenLogprobsPass()(copy)
    return copy
