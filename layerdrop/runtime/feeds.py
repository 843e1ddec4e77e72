"""Build ONNX Runtime inputs for a decoder graph: token ids, mask, positions, and an empty or given KV cache."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort

from layerdrop.errors import LayerdropError

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def is_kv_graph(session: ort.InferenceSession) -> bool:
    return any(_PAST.match(i.name) for i in session.get_inputs())


def empty_past(session: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """Zero-length past tensors [batch, kv_heads, 0, head_dim] for every cache input."""
    feed = {}
    for info in session.get_inputs():
        if _PAST.match(info.name):
            _, heads, _, head_dim = info.shape
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise LayerdropError(f"cache input {info.name} has no static head count/size; re-export the model")
            feed[info.name] = np.zeros((batch, heads, 0, head_dim), dtype=_NUMPY_TYPES.get(info.type, np.float32))
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
        elif not _PAST.match(info.name):
            raise LayerdropError(f"the graph has an input layerdrop cannot fill: {info.name!r}")
    feed.update(empty_past(session, ids.shape[0]))
    return feed
