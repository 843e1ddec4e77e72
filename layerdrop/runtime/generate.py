"""Greedy decoding through ONNX Runtime, with the KV cache when the graph has one, one prompt or a left-padded batch
(or, for graphs that take no padded batch, rows of one length prefilled one at a time)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from layerdrop.errors import LayerdropError
from layerdrop.formats import is_carried, past_for
from layerdrop.runtime.feeds import is_kv_graph, prefill_feed


def right_pad(sequences: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, longest] padded on the right with `pad_id`, and the mask that excludes the padding: every
    row's tokens keep positions 0, 1, ..., so a causal graph scores them as if alone, whatever its attention op."""
    return _pad(sequences, pad_id, left=False)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, longest] padded on the left with `pad_id`, and the mask that excludes the padding."""
    return _pad(sequences, pad_id, left=True)


def _pad(sequences: list[list[int]], pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    longest = max(len(s) for s in sequences)
    ids = np.full((len(sequences), longest), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        if sequence:
            cells = slice(longest - len(sequence), None) if left else slice(0, len(sequence))
            ids[row, cells] = sequence
            mask[row, cells] = 1
    return ids, mask


def greedy_batch(
    session: ort.InferenceSession,
    ids: np.ndarray,
    mask: np.ndarray,
    max_new_tokens: int,
    *,
    finished: Callable[[int, list[int]], bool] | None = None,
    keep_logits: bool = False,
    prefill_chunk: int | None = None,
    rows_alone: bool = False,
) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Greedily extend a left-padded batch (`ids`, `mask` [batch, seq]); padding is excluded by the mask.

    With `prefill_chunk` (a KV graph only) the prompt goes in `prefill_chunk` tokens at a time through the cache,
    so the prefill never holds more than that many positions of logits (a long prompt at a large vocabulary).
    With `rows_alone` (a graph that takes no padded batch, see `feeds.takes_padded_batches`) each row of an unpadded
    batch is prefilled by itself and the batch decodes together from the joined caches.

    `finished(row, new_tokens)` says when a row may stop (an end token, a stop string); decoding ends when every row
    has stopped or after `max_new_tokens`. A stopped row keeps being fed (its tokens are ignored) so the batch stays
    rectangular.

    Returns:
        Each row's new tokens and, with `keep_logits`, the float32 logits each token was chosen from.

    Raises:
        LayerdropError: `rows_alone` with a padded batch.
    """
    output_names = [o.name for o in session.get_outputs()]
    input_names = {i.name for i in session.get_inputs()}
    kv = is_kv_graph(session)
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask, dtype=np.int64)
    batch = ids.shape[0]
    new: list[list[int]] = [[] for _ in range(batch)]
    chosen_logits: list[list[np.ndarray]] = [[] for _ in range(batch)]
    done = [False] * batch
    if max_new_tokens < 1:
        return new, chosen_logits
    if rows_alone and kv and batch > 1 and not mask.all():
        raise LayerdropError("this graph takes no padded batch (GroupQueryAttention); give rows of one length")
    outputs = _prefill(session, ids, mask, prefill_chunk if kv else None, output_names, rows_alone and kv)
    for step in range(max_new_tokens):
        last = outputs["logits"][:, -1]
        tokens = np.argmax(last, axis=-1).astype(np.int64)
        for row in range(batch):
            if done[row]:
                continue
            new[row].append(int(tokens[row]))
            if keep_logits:
                chosen_logits[row].append(last[row])
            done[row] = finished(row, new[row]) if finished else False
        if all(done) or step == max_new_tokens - 1:
            break
        ids = np.concatenate([ids, tokens[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        if kv:
            feed = cached_feed(outputs, tokens[:, None], mask, mask.sum(axis=1, keepdims=True) - 1, input_names)
        else:
            feed = prefill_feed(session, ids, mask)
        outputs = dict(zip(output_names, session.run(output_names, feed)))
    return new, chosen_logits


def greedy_generate(
    session: ort.InferenceSession, prompt: np.ndarray, max_new_tokens: int, eos_token_id: int | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """Greedily extend `prompt` ([1, seq] token ids).

    Returns:
        The new tokens and the logits each was chosen from (float32, vocab-sized).
    """
    ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)

    def finished(_row: int, tokens: list[int]) -> bool:
        return eos_token_id is not None and tokens[-1] == eos_token_id

    tokens, logits = greedy_batch(session, ids, np.ones_like(ids), max_new_tokens, finished=finished,
                                  keep_logits=True)
    return tokens[0], logits[0]


def _prefill(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray, chunk: int | None,
             output_names: list[str], rows_alone: bool) -> dict[str, np.ndarray]:
    """The outputs (logits of the last piece, the cache) after the whole prompt, in pieces of `chunk` tokens
    through the cache when given, one row at a time with `rows_alone`."""
    if rows_alone and ids.shape[0] > 1:
        rows = [_prefill(session, ids[r:r + 1], mask[r:r + 1], chunk, output_names, False) for r in range(len(ids))]
        return {name: np.concatenate([row[name] for row in rows]) for name in output_names}
    if chunk and ids.shape[1] > chunk:
        feed = _cache_after(session, ids, mask, chunk, output_names)
    else:
        feed = prefill_feed(session, ids, mask)
    return dict(zip(output_names, session.run(output_names, feed)))


def _cache_after(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray, chunk: int,
                 output_names: list[str]) -> dict[str, np.ndarray]:
    """Run the prompt but its last `chunk`-sized piece through the cache; return the feed of that last piece."""
    input_names = {i.name for i in session.get_inputs()}
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    feed = prefill_feed(session, ids[:, :chunk], mask[:, :chunk])
    for start in range(chunk, ids.shape[1], chunk):
        outputs = dict(zip(output_names, session.run(output_names, feed)))
        end = min(start + chunk, ids.shape[1])
        feed = cached_feed(outputs, ids[:, start:end], mask[:, :end], positions[:, start:end], input_names)
    return feed


def cached_feed(outputs: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                 input_names: set[str]) -> dict[str, np.ndarray]:
    """The next step's inputs: the cache (and previous-token states) the last run presented, the new `ids`, the mask
    over past and new tokens, and the new tokens' positions (where the graph takes them)."""
    feed = {past_for(n): v for n, v in outputs.items() if is_carried(n)}
    feed["input_ids"] = ids
    feed["attention_mask"] = mask
    if "position_ids" in input_names:
        feed["position_ids"] = positions
    return feed


def sample_windows(
    session: ort.InferenceSession,
    count: int,
    width: int,
    first_tokens: np.ndarray,
    *,
    bos_id: int | None = None,
    seed: int = 0,
    batch_size: int = 16,
    bar=None,
) -> np.ndarray:
    """`count` windows [count, width] that the model writes itself: each starts with `bos_id` (when given) and a
    token drawn uniformly from `first_tokens`, and goes on with tokens sampled from the model's next-token
    distribution (temperature 1, no truncation), through the KV cache.

    Draws, from `numpy.random.default_rng(seed)`, for each batch of up to `batch_size` windows in turn: the first
    tokens (`rng.choice(first_tokens, rows)`), then at each step one uniform number per row (`rng.random(rows)`),
    and the token is the first whose cumulative probability (float64 softmax of the logits) exceeds it, so a reference
    can replay the same draws. `bar` (a tqdm bar) advances by one per window.

    Raises:
        LayerdropError: a graph without a KV cache (sampling would run the whole prefix again for every token).
    """
    if not is_kv_graph(session):
        raise LayerdropError("sampling windows from the model needs a graph with a KV cache; export the model "
                             "without --no-kv-cache")
    output_names = [o.name for o in session.get_outputs()]
    input_names = {i.name for i in session.get_inputs()}
    rng = np.random.default_rng(seed)
    prefix = 1 + (bos_id is not None)
    if width <= prefix:
        raise LayerdropError(f"sampled windows need more than {prefix} tokens; give a longer --seq-len")
    windows = []
    for start in range(0, count, batch_size):
        rows = min(batch_size, count - start)
        firsts = rng.choice(np.asarray(first_tokens, dtype=np.int64), rows)[:, None]
        ids = firsts if bos_id is None else np.concatenate([np.full((rows, 1), bos_id, np.int64), firsts], axis=1)
        mask = np.ones_like(ids)
        outputs = dict(zip(output_names, session.run(output_names, prefill_feed(session, ids, mask))))
        for _ in range(width - prefix):
            logits = outputs["logits"][:, -1].astype(np.float64)
            weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
            cumulative = np.cumsum(weights, axis=-1)
            drawn = rng.random(rows)[:, None] * cumulative[:, -1:]
            tokens = np.minimum((cumulative <= drawn).sum(axis=-1), logits.shape[-1] - 1).astype(np.int64)[:, None]
            ids = np.concatenate([ids, tokens], axis=1)
            if ids.shape[1] == width:
                break
            mask = np.ones_like(ids)
            feed = cached_feed(outputs, tokens, mask, np.full((rows, 1), ids.shape[1] - 1, np.int64), input_names)
            outputs = dict(zip(output_names, session.run(output_names, feed)))
        windows.append(ids)
        if bar is not None:
            bar.update(rows)
    return np.concatenate(windows)
