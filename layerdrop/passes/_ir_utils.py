"""The two graph helpers every pass shares: the constant a value holds, and a new initializer."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The array `value` holds if it is a constant (an initializer or a Constant node's output), else None.

    A graph input is never a constant here, even with an initializer behind it: the caller of the model may
    feed another value, so no rewrite may bake the initializer in.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register `array` as an initializer of `graph` under `name` (type and shape from the array); return its value.

    Raises:
        ValueError: another initializer of `graph` has that name.
    """
    value = ir.val(name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value
