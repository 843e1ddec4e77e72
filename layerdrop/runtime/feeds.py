"""Build ONNX Runtime inputs for a decoder graph: token ids, mask, positions, and an empty or given KV cache (and
previous-token states, zero before the first token)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from layerdrop.errors import LayerdropError
from layerdrop.formats import is_past, is_state_past

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                "tensor(bfloat16)": np.float32}


def numpy_type(ort_type: str):
    """The numpy dtype to feed for an ONNX Runtime tensor type (float32 when unknown)."""
    return _NUMPY_TYPES.get(ort_type, np.float32)


def takes_padded_batches(model: onnx.ModelProto | ir.Model) -> bool:
    """Whether a batch may be padded and prefilled through the cache in pieces: not for a graph with
    GroupQueryAttention (the builder's, or a fused one), which takes its positions from position_ids or the mask's
    row sums, treats padding as lying on the right, and takes several new tokens over a past for one row only."""
    nodes = model.graph.node if isinstance(model, onnx.ModelProto) else model.graph
    return not any(node.op_type == "GroupQueryAttention" for node in nodes)


def is_kv_graph(session: ort.InferenceSession) -> bool:
    """Whether the session takes KV-cache inputs."""
    return any(is_past(i.name) for i in session.get_inputs())


def empty_past(session: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """Zero-length past tensors [batch, kv_heads, 0, head_dim] for every cache input."""
    feed = {}
    for info in session.get_inputs():
        if is_past(info.name):
            _, heads, _, head_dim = info.shape
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise LayerdropError(f"cache input {info.name} has no static head count/size; re-export the model")
            feed[info.name] = np.zeros((batch, heads, 0, head_dim), dtype=numpy_type(info.type))
    return feed


def prefill_feed(
    session: ort.InferenceSession,
    ids: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Inputs for a full-sequence forward of `ids` [batch, seq] (past length 0 in a KV graph).

    Padding (mask 0) is allowed; positions count real tokens only, as Hugging Face does. `extra` inputs (a cached
    hidden state, an alpha during a search) are passed as they are.

    Raises:
        LayerdropError: the graph has an input layerdrop cannot fill.
    """
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.ones_like(ids) if mask is None else np.asarray(mask, dtype=np.int64)
    feed: dict[str, np.ndarray] = dict(extra or {})
    for info in session.get_inputs():
        if info.name in feed:
            continue
        if info.name == "input_ids":
            feed[info.name] = ids
        elif info.name == "attention_mask":
            feed[info.name] = mask
        elif info.name == "position_ids":
            feed[info.name] = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        elif is_state_past(info.name):  # a map's previous-token state: none before the first token
            shape = info.shape[1:]
            if not all(isinstance(size, int) for size in shape):
                raise LayerdropError(f"state input {info.name} has no static shape; rewrite the model again")
            feed[info.name] = np.zeros((ids.shape[0], *shape), dtype=numpy_type(info.type))
        elif not is_past(info.name):
            raise LayerdropError(f"the graph has an input layerdrop cannot fill: {info.name!r}")
    feed.update(empty_past(session, ids.shape[0]))
    return feed
