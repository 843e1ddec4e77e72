"""Rewrite pass: int4 weights through ONNX Runtime's own quantizer (`MatMulNBitsQuantizer`).

Every MatMul with a constant 2-D weight becomes a com.microsoft MatMulNBits with 4-bit blocks, the format
onnxruntime-genai's model builder writes for `-p int4`. Run it last, after every removal (remove first, then
quantize: the quantizer then never spends time or bytes on weights that go, and fitted or folded matrices are
quantized as what they finally are). The weights are read into memory for the quantizer.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from layerdrop.formats import QUANTIZATION_KEY
from layerdrop.passes.metadata import write_json


class QuantizeInt4Pass(ir.passes.PassBase):
    """MatMul -> MatMulNBits (4 bits, `block_size` weights per scale, symmetric or with zero points)."""

    in_place = False
    changes_input = True

    def __init__(self, block_size: int = 32, accuracy_level: int | None = None, symmetric: bool = True) -> None:
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
