"""com.microsoft MatMulNBits weights read exactly: the float matrix that ONNX Runtime multiplies by.

B is [N, n_blocks, block_size * bits / 8] bytes, 4-bit values packed low nibble first; scales are one per block
([N * n_blocks] or [N, n_blocks]); zero points, when given, are 4-bit packed per block too (else 8, the symmetric
middle of 0..15). Each column n of the [K, N] weight is (q - zero) * scale, block by block along K. A 2-bit or 8-bit
layout, or a g_idx input (act-order), is refused with a message.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes._ir_utils import constant_array


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., m] -> uint8 [..., 2m]: low nibble first."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def dequantized_weight(node: ir.Node) -> np.ndarray:
    """The float [K, N] weight of a MatMulNBits node, in float64.

    Raises:
        LayerdropError: a layout layerdrop cannot read back (bits other than 4, act-order g_idx, non-constant).
    """
    bits = node.attributes.get_int("bits", 4)
    k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
    block = node.attributes.get_int("block_size")
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    if bits != 4 or inputs[4] is not None:
        raise LayerdropError(f"{node.name}: a MatMulNBits with {bits} bits{' and g_idx' if inputs[4] else ''} "
                             "cannot be read back; layerdrop reads 4-bit blocks (the model builder's int4)")
    tensors = [constant_array(v) for v in inputs[1:4]]
    if tensors[0] is None or tensors[1] is None or (inputs[3] is not None and tensors[2] is None):
        raise LayerdropError(f"{node.name}: the MatMulNBits weights are not constants; layerdrop cannot read them")
    blocks = (k + block - 1) // block
    values = _unpack_nibbles(tensors[0].reshape(n, blocks, block // 2)).astype(np.float64)
    scales = tensors[1].astype(np.float64).reshape(n, blocks, 1)
    if tensors[2] is not None:
        zero = tensors[2]
        zero = (_unpack_nibbles(zero.reshape(n, -1))[:, :blocks] if zero.dtype == np.uint8
                else zero.reshape(n, blocks)).astype(np.float64).reshape(n, blocks, 1)
    else:
        zero = 8.0
    columns = ((values - zero) * scales).reshape(n, blocks * block)[:, :k]
    return columns.T


def nbits_layout(model: ir.Model) -> dict | None:
    """{"block_size", "accuracy_level"} of the model's MatMulNBits weights (the first one's), or None."""
    for node in model.graph:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            level = node.attributes.get_int("accuracy_level", 0)
            return {"block_size": node.attributes.get_int("block_size"), "accuracy_level": level or None}
    return None
