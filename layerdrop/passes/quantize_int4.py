"""Rewrite pass: int4 weights through ONNX Runtime's own quantizer (`MatMulNBitsQuantizer`).

Every MatMul with a constant 2-D weight becomes a com.microsoft MatMulNBits with 4-bit blocks, the format
onnxruntime-genai's model builder writes for `-p int4`. A tied LM head multiplies by the embedding transposed
(MatMul after a Transpose, or com.microsoft FusedMatMul with transB after fusion), which the quantizer does not
take: it gets its own transposed constant first (`_untie_transposed_weights`), so the largest matrix of a
small model is quantized too (the embedding's Gather keeps the float table). Run it last, after every removal
(remove first, then quantize: the quantizer then never spends time or bytes on weights that go, and fitted or
folded matrices are quantized as what they finally are). The weights are read into memory for the quantizer.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from layerdrop.formats import QUANTIZATION_KEY
from layerdrop.passes._ir_utils import add_initializer
from layerdrop.passes.metadata import write_json

# The model builder's level for CPU int4: int8 activations in MatMulNBits, which decode faster than float
# activations (level 0) for a small loss of perplexity.
DEFAULT_ACCURACY_LEVEL = 4


class QuantizeInt4Pass(ir.passes.PassBase):
    """MatMul -> MatMulNBits (4 bits, `block_size` weights per scale, symmetric or with zero points; ONNX Runtime's
    `accuracy_level`, 4 by default: int8 activations on CPU, 0: float activations)."""

    in_place = False
    changes_input = True

    def __init__(self, block_size: int = 32, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                 symmetric: bool = True) -> None:
        super().__init__()
        self.block_size, self.accuracy_level, self.symmetric = block_size, accuracy_level, symmetric

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        try:  # ONNX Runtime's quantization module configures the root logger to INFO when imported
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        finally:
            root.setLevel(level)
            root.handlers[:] = handlers

        _untie_transposed_weights(model)
        for value in model.graph.initializers.values():  # the quantizer reads weights from the proto itself
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)
        metadata = dict(model.metadata_props)
        proto = ir.serde.serialize_model(model)
        logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
        quantizer = MatMulNBitsQuantizer(proto, bits=4, block_size=self.block_size, is_symmetric=self.symmetric,
                                         accuracy_level=self.accuracy_level)
        quantizer.process()
        quantized = ir.serde.deserialize_model(quantizer.model.model)
        quantized.metadata_props.update(metadata)
        count = sum(1 for node in quantized.graph if node.op_type == "MatMulNBits")
        write_json(quantized.metadata_props, QUANTIZATION_KEY,
                   {"bits": 4, "block_size": self.block_size, "accuracy_level": self.accuracy_level,
                    "symmetric": self.symmetric, "matmul_nbits": count})
        return ir.passes.PassResult(quantized, modified=count > 0)


def _untie_transposed_weights(model: ir.Model) -> int:
    """MatMul(x, Transpose(W)) and FusedMatMul(x, W, transB=1) with a constant 2-D W (and no other attribute that
    changes the product) -> MatMul(x, W^T) with W^T a new constant; returns how many were rewritten."""
    import numpy as np

    count = 0
    for node in list(model.graph):
        weight, transposer = None, None
        if node.op_type == "MatMul" and node.domain == "" and node.inputs[1] is not None:
            producer = node.inputs[1].producer()
            perm = producer.attributes.get("perm") if producer is not None else None
            if (producer is not None and producer.op_type == "Transpose" and producer.inputs[0] is not None
                    and producer.inputs[0].const_value is not None and perm is not None
                    and list(perm.as_ints()) == [1, 0]):
                weight, transposer = producer.inputs[0], producer
        elif node.op_type == "FusedMatMul" and node.domain == "com.microsoft":
            attrs = {k: a.value for k, a in node.attributes.items()}
            plain = attrs.get("transB") == 1 and not attrs.get("transA") and attrs.get("alpha", 1.0) == 1.0 \
                and not attrs.get("transBatchA") and not attrs.get("transBatchB")
            if plain and node.inputs[1] is not None and node.inputs[1].const_value is not None:
                weight = node.inputs[1]
        if weight is None or len(weight.const_value.shape) != 2:
            continue
        table = weight.const_value.numpy()
        name = f"{weight.name}.transposed_for_matmul"
        transposed = add_initializer(model.graph, name, np.ascontiguousarray(table.T))
        matmul = ir.node("MatMul", [node.inputs[0], transposed], name=f"{node.name}_untied")
        old, new = node.outputs[0], matmul.outputs[0]
        new.shape, new.type = old.shape, old.type
        model.graph.insert_after(node, matmul)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        output_name = old.name
        model.graph.remove(node, safe=True)
        new.name = output_name
        if transposer is not None and not transposer.outputs[0].uses():
            model.graph.remove(transposer, safe=True)
        count += 1
    return count
