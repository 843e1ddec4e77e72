"""Side-by-side measurement of two model folders: prefill latency, decode speed, ideal speedup, memory, size.

Latency runs alternate A B A B after warm-up, so drift of the machine hits both models alike. The ideal speedup
comes from an ONNX Runtime profile of the base model: total node time over total node time minus the time of
the nodes the rewrite removed.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from layerdrop.runtime.feeds import is_kv_graph, prefill_feed
from layerdrop.runtime.generate import greedy_generate
from layerdrop.runtime.session import make_session


def _ids(seq: int, batch: int, vocab: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq)).astype(np.int64)


def prefill_latency(folders: list[Path], seq: int, *, batch: int = 1, runs: int = 5, warmup: int = 1,
                    provider: str = "cpu", threads: int | None = None) -> list[dict]:
    """Median and p90 prefill latency (ms) of each model at `seq` tokens, runs interleaved across models."""
    sessions = [make_session(Path(f) / "model.onnx", provider=provider, threads=threads) for f in folders]
    feeds = [prefill_feed(s, _ids(seq, batch)) for s in sessions]
    outputs = [["logits"] for _ in sessions]
    for _ in range(warmup):
        for session, feed, names in zip(sessions, feeds, outputs):
            session.run(names, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for i, (session, feed, names) in enumerate(zip(sessions, feeds, outputs)):
            start = time.perf_counter()
            session.run(names, feed)
            times[i].append((time.perf_counter() - start) * 1000)
    return [{"median_ms": statistics.median(t), "p90_ms": float(np.percentile(t, 90)), "runs": t} for t in times]


def decode_tokens_per_second(folder: Path, *, prompt_len: int = 64, new_tokens: int = 32, provider: str = "cpu",
                             threads: int | None = None) -> float | None:
    """Greedy decode speed with the KV cache (tokens/s after the prefill); None for a graph without cache."""
    session = make_session(Path(folder) / "model.onnx", provider=provider, threads=threads)
    if not is_kv_graph(session):
        return None
    prompt = _ids(prompt_len, 1)
    greedy_generate(session, prompt, 2)  # warm-up
    start = time.perf_counter()
    greedy_generate(session, prompt, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    greedy_generate(session, prompt, new_tokens + 1)
    total = time.perf_counter() - start
    return new_tokens / max(total - prefill, 1e-9)


def node_times(folder: Path, seq: int, *, runs: int = 3, provider: str = "cpu", threads: int | None = None
               ) -> dict[str, float]:
    """Mean time (µs) per graph node over `runs` profiled prefills, keyed by node name."""
    with tempfile.TemporaryDirectory() as tmp:
        session = make_session(Path(folder) / "model.onnx", provider=provider, threads=threads,
                               profile_prefix=os.path.join(tmp, "profile"))
        feed = prefill_feed(session, _ids(seq, 1))
        session.run(["logits"], feed)
        for _ in range(runs):
            session.run(["logits"], feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    totals: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            name = event["name"].removesuffix("_kernel_time")
            totals[name] = totals.get(name, 0.0) + event["dur"]
    return {name: value / (runs + 1) for name, value in totals.items()}


def graph_node_names(folder: Path) -> set[str]:
    return {n.name for n in onnx.load(Path(folder) / "model.onnx", load_external_data=False).graph.node}


def ideal_speedup(base: Path, pruned: Path, seq: int, **session_args) -> dict:
    """Profile-based ideal: base node time / (base node time - time of base nodes absent from `pruned`)."""
    times = node_times(base, seq, **session_args)
    removed = graph_node_names(base) - graph_node_names(pruned)
    total = sum(times.values())
    gone = sum(t for name, t in times.items() if name in removed)
    return {"ideal": total / max(total - gone, 1e-9), "removed_share": gone / total if total else 0.0}


def model_bytes(folder: Path) -> int:
    """Bytes of the graph file and its weight data."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.name.startswith("model.onnx"))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
