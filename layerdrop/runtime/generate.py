"""Greedy decoding through ONNX Runtime, with the KV cache when the graph has one."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from layerdrop.runtime.feeds import is_kv_graph, prefill_feed


def _present_to_past(name: str) -> str:
    return "past_key_values." + name.removeprefix("present.")


def greedy_generate(
    session: ort.InferenceSession, prompt: np.ndarray, max_new_tokens: int, eos_token_id: int | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """Greedily extend `prompt` ([1, seq] token ids).

    Returns:
        The new tokens and the logits each was chosen from (float32, vocab-sized).
    """
    output_names = [o.name for o in session.get_outputs()]
    sequence = [int(t) for t in np.asarray(prompt).reshape(-1)]
    tokens: list[int] = []
    step_logits: list[np.ndarray] = []
    kv = is_kv_graph(session)
    feed = prefill_feed(session, np.array([sequence]))
    for _ in range(max_new_tokens):
        outputs = dict(zip(output_names, session.run(output_names, feed)))
        last = outputs["logits"][0, -1]
        token = int(np.argmax(last))
        tokens.append(token)
        step_logits.append(last)
        sequence.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
        if kv:
            feed = {_present_to_past(n): v for n, v in outputs.items() if n.startswith("present.")}
            ids = np.array([[token]], dtype=np.int64)
            feed["input_ids"] = ids
            feed["attention_mask"] = np.ones((1, len(sequence)), dtype=np.int64)
            names = {i.name for i in session.get_inputs()}
            if "position_ids" in names:
                feed["position_ids"] = np.array([[len(sequence) - 1]], dtype=np.int64)
        else:
            feed = prefill_feed(session, np.array([sequence]))
    return tokens, step_logits
