"""How closely a rewritten model follows the original: the KL divergence of its next-token distribution from the
original's and how often the two agree on the most likely next token, on the same windows (no labels needed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from layerdrop.runtime.feeds import prefill_feed


@dataclass(frozen=True)
class Fidelity:
    """Mean KL(base || other) in nats per predicted token, the share of tokens whose top-1 next token agrees, and
    the token count both are over."""

    kl: float
    top1: float
    tokens: int

    def as_dict(self) -> dict:
        return {"kl": self.kl, "top1_agreement": self.top1, "tokens": self.tokens}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    values -= values.max(axis=-1, keepdims=True)
    return values - np.log(np.exp(values).sum(axis=-1, keepdims=True))


def logit_divergence(base: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position of logits [..., vocab] from two models: KL(softmax(base) || softmax(other)) in nats (float64)
    and whether their arg-max tokens agree."""
    log_p, log_q = _log_softmax(base), _log_softmax(other)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    return kl, base.argmax(axis=-1) == other.argmax(axis=-1)


def next_token_fidelity(base: ort.InferenceSession, other: ort.InferenceSession, windows: np.ndarray, *,
                        batch_size: int = 1, progress: bool = False) -> Fidelity:
    """KL divergence of `other`'s next-token distribution from `base`'s, and their top-1 agreement, over every
    position of token windows [n, seq] (real tokens, no padding) run through both sessions (their `logits`).

    Use it for any pair of model folders that share a tokenizer: `make_session` each, draw held-out windows
    (`api.common.windows_for(folder, None, role="eval", ...)`), and pass `windows.ids`.
    """
    total, agree, count = 0.0, 0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc="fidelity", unit="batch", disable=not progress,
                      leave=False):
        ids = windows[start:start + batch_size]
        logits = [s.run(["logits"], prefill_feed(s, ids))[0] for s in (base, other)]
        kl, same = logit_divergence(*logits)
        total += float(kl.sum())
        agree += int(same.sum())
        count += kl.size
    return Fidelity(total / count, agree / count, count)


def log_probs(session: ort.InferenceSession, windows: np.ndarray, *, batch_size: int = 1,
              store: Callable[[tuple[int, ...]], np.ndarray] | None = None) -> np.ndarray:
    """The next-token log-probabilities (float32 [n, seq, vocab]) of a session (its `logits`) at every position of
    token windows [n, seq]: a reference to measure other models' fidelity against (`fidelity_to`). With `store`
    (given the whole shape, it returns the array to fill: a memory-mapped file, say, for a reference larger than
    memory should hold), they are written into that array one batch at a time, and it is returned."""
    found, out = [], None
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size]
        values = _log_softmax(session.run(["logits"], prefill_feed(session, ids))[0]).astype(np.float32)
        if store is None:
            found.append(values)
            continue
        if out is None:
            out = store((len(windows), *values.shape[1:]))
        out[start:start + len(ids)] = values
    return np.concatenate(found) if store is None else out


def fidelity_to(reference: np.ndarray, session: ort.InferenceSession, windows: np.ndarray, *,
                batch_size: int = 1) -> Fidelity:
    """`next_token_fidelity` of a session against `reference`, the base's `log_probs` on the same windows, one
    batch at a time (the reference is kept, the base's session is not)."""
    total, agree, count = 0.0, 0, 0
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size]
        log_p = reference[start:start + batch_size].astype(np.float64)
        log_q = _log_softmax(session.run(["logits"], prefill_feed(session, ids))[0])
        total += float((np.exp(log_p) * (log_p - log_q)).sum())
        agree += int((log_p.argmax(axis=-1) == log_q.argmax(axis=-1)).sum())
        count += ids.size
    return Fidelity(total / count, agree / count, count)
