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
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from layerdrop.formats import is_carried, is_past, is_state_past, past_for
from layerdrop.runtime.feeds import is_kv_graph, prefill_feed, takes_padded_batches
from layerdrop.runtime.generate import greedy_batch, greedy_generate
from layerdrop.runtime.session import RunOptions, active_provider


def _ids(seq: int, batch: int, session: ort.InferenceSession | None = None, seed: int = 0) -> np.ndarray:
    """Random token ids below the model's vocabulary size (read from the logits shape when static)."""
    vocab = 1000
    if session is not None:
        width = next((o.shape[-1] for o in session.get_outputs() if o.name == "logits"), None)
        vocab = width if isinstance(width, int) else vocab
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq)).astype(np.int64)


def _runner(session: ort.InferenceSession, feed: dict[str, np.ndarray]):
    """A no-argument callable that runs one prefill; on CUDA inputs and outputs stay on the device (I/O binding)."""
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return lambda: session.run(["logits"], feed)
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda")

    def run() -> None:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return run


def _interleaved(runners: list, runs: int, warmup: int | list[int]) -> list[list[float]]:
    """Each runner's times (ms) over `runs` rounds that run them in turn, after `warmup` untimed runs of each (one
    count for all, or one per runner).

    A newly built session's first timed run after a single warm-up is still measurably slow on CPU (its arena and
    packed weights settle over the first runs); after two it is not."""
    counts = warmup if isinstance(warmup, list) else [warmup] * len(runners)
    for _ in range(max(counts, default=0)):
        for run, count in zip(runners, counts):
            if count > 0:
                run()
        counts = [count - 1 for count in counts]
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(runs):
        for i, run in enumerate(runners):
            start = time.perf_counter()
            run()
            times[i].append((time.perf_counter() - start) * 1000)
    return times


def prefill_latency(folders: list[Path], seq: int, *, runs: int = 5, warmup: int = 2,
                    options: RunOptions = RunOptions()) -> list[dict]:
    """Median and p90 prefill latency (ms) of each model at `seq` tokens (`options.batch_size` sequences a run),
    runs interleaved across models."""
    sessions = [options.session(Path(f) / "model.onnx") for f in folders]
    times = _interleaved([_runner(s, prefill_feed(s, _ids(seq, options.batch_size, s))) for s in sessions], runs,
                         warmup)
    return [{"median_ms": statistics.median(t), "p90_ms": float(np.percentile(t, 90)), "runs": t} for t in times]


def paired_speedup(base: ort.InferenceSession, other: ort.InferenceSession, seq: int, *, runs: int = 5,
                   warmup: int = 2, base_warmup: int | None = None) -> dict:
    """`other`'s measured prefill speedup over `base` at `seq` tokens: the ratio of their median latencies, runs
    alternating base, other after `warmup` untimed runs of each (`base_warmup` of the base, if given: fewer for a
    base already run), on the same random ids; with each run's time (`base_runs_ms`, `runs_ms`), to pool with
    other measurements of the same pair."""
    ids = _ids(seq, 1, base)
    counts = [warmup if base_warmup is None else base_warmup, warmup]
    times = _interleaved([_runner(s, prefill_feed(s, ids)) for s in (base, other)], runs, counts)
    base_ms, other_ms = (statistics.median(t) for t in times)
    return {"seq": seq, "base_ms": base_ms, "ms": other_ms, "speedup": base_ms / other_ms,
            "base_runs_ms": times[0], "runs_ms": times[1]}


def lone_prefill_ms(session: ort.InferenceSession, seq: int, runs: int, warmup: int = 2) -> list[float]:
    """`runs` prefill times (ms) of one session at `seq` tokens, after `warmup` untimed runs, on the same random ids
    as `paired_speedup`'s; for graphs timed one at a time."""
    return _interleaved([_runner(session, prefill_feed(session, _ids(seq, 1, session)))], runs, warmup)[0]


def decode_tokens_per_second(folders: list[Path], *, prompt_len: int = 64, new_tokens: int = 32, rounds: int = 3,
                             options: RunOptions = RunOptions(), device_resident: bool | None = None
                             ) -> list[float | None]:
    """Greedy decode speed with the KV cache (tokens/s after the prefill, `prompt_len` tokens of context, one
    sequence), median of `rounds` interleaved runs; None for a graph without cache.

    With `device_resident` (the default on CUDA) the cache stays where the session computes it, bound from one
    step's outputs to the next step's inputs (`device_greedy`); otherwise each step goes through numpy.
    """
    sessions = [options.session(Path(f) / "model.onnx") for f in folders]
    speeds: list[list[float]] = [[] for _ in sessions]
    for _ in range(rounds):
        for i, session in enumerate(sessions):
            if not is_kv_graph(session):
                continue
            resident = device_resident if device_resident is not None else (
                session.get_providers()[0] == "CUDAExecutionProvider")
            generate = device_greedy if resident else (lambda s, p, n: greedy_generate(s, p, n)[0])
            prompt = _ids(prompt_len, 1, session)
            generate(session, prompt, 1)  # warm-up and prefill time
            start = time.perf_counter()
            generate(session, prompt, 1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            generate(session, prompt, new_tokens + 1)
            speeds[i].append(new_tokens / max(time.perf_counter() - start - prefill, 1e-9))
    return [statistics.median(s) if s else None for s in speeds]


def device_greedy(session: ort.InferenceSession, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """Greedy decoding of one prompt ([1, seq]) with the KV cache kept on the session's device: each step binds the
    previous step's `present.*` outputs as its `past_key_values.*` inputs, and only the last logits come back."""
    device = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    names = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    feed = prefill_feed(session, prompt)
    past: dict[str, ort.OrtValue] = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feed.items()
                                     if is_past(k) or is_state_past(k)}
    tokens: list[int] = []
    length = prompt.shape[1]
    step_ids = np.asarray(prompt, dtype=np.int64)
    for _ in range(new_tokens):
        binding = session.io_binding()
        small = {"input_ids": step_ids, "attention_mask": np.ones((1, length), dtype=np.int64),
                 "position_ids": np.arange(length - step_ids.shape[1], length, dtype=np.int64)[None]}
        for name, array in small.items():
            if name in inputs:
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
        for name, value in past.items():
            binding.bind_ortvalue_input(name, value)
        for name in names:
            binding.bind_output(name, device)
        session.run_with_iobinding(binding)
        outputs = dict(zip(names, binding.get_outputs()))
        token = int(np.argmax(outputs["logits"].numpy()[0, -1]))
        tokens.append(token)
        past = {past_for(name): value for name, value in outputs.items() if is_carried(name)}
        step_ids = np.array([[token]], dtype=np.int64)
        length += 1
    return tokens


def node_times(folder: Path, seq: int, *, runs: int = 3, options: RunOptions = RunOptions()) -> dict[str, float]:
    """Mean time (µs) per graph node over `runs` profiled prefills of one sequence, keyed by node name.

    Graph optimizations are off for the profile so every name is a node of the ONNX graph; ONNX Runtime fuses
    little on these graphs, so the shares of time match the optimized run closely.
    """
    with tempfile.TemporaryDirectory() as tmp:
        session = options.session(Path(folder) / "model.onnx", profile_prefix=os.path.join(tmp, "profile"),
                                  optimize=False)
        feed = prefill_feed(session, _ids(seq, 1, session))
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


def ideal_speedup(base: Path, pruned: Path, seq: int, options: RunOptions = RunOptions()) -> dict:
    """Profile-based ideal: base node time / (base node time - time of base nodes absent from `pruned`)."""
    times = node_times(base, seq, options=options)
    removed = graph_node_names(base) - graph_node_names(pruned)
    total = sum(times.values())
    gone = sum(t for name, t in times.items() if name in removed)
    return {"ideal": total / max(total - gone, 1e-9), "removed_share": gone / total if total else 0.0}


def model_bytes(folder: Path) -> int:
    """Bytes of the graph file and its weight data."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.name.startswith("model.onnx"))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process image so far.

    On Linux this is VmHWM of /proc/self/status: `ru_maxrss` would not do, because it keeps the peak of the process
    before `exec`, and a spawned child starts as a fork of its parent, so it would report the parent's resident
    size whenever that is larger than its own peak. Elsewhere `ru_maxrss` (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _measure_peak(folder: str, seq: int, options: RunOptions) -> int | None:
    """Run one prefill in this (fresh) process and report its peak memory: RSS on CPU, device memory on CUDA."""
    session = options.session(Path(folder) / "model.onnx", arena=False)
    session.run(["logits"], prefill_feed(session, _ids(seq, 1, session)))
    if active_provider(session) == "cuda":
        return _cuda_memory_of_this_process()
    return peak_rss_bytes()


def _cuda_memory_of_this_process() -> int | None:
    import subprocess

    try:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        listing = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 1024 * 1024
    return None


GENERATION_CHUNK = 256  # prompt tokens per prefill step of the generation-memory run: logits stay small


def _measure_generation_peak(folder: str, batch: int, context: int, new_tokens: int, options: RunOptions
                             ) -> int | None:
    """Generate in this (fresh) process with a large cache and report its peak memory (None: no KV cache)."""
    session = options.session(Path(folder) / "model.onnx", arena=False)
    if not is_kv_graph(session):
        return None
    ids = _ids(context, batch, session)
    padded = takes_padded_batches(onnx.load(Path(folder) / "model.onnx", load_external_data=False))
    greedy_batch(session, ids, np.ones_like(ids), new_tokens, prefill_chunk=GENERATION_CHUNK, rows_alone=not padded)
    if active_provider(session) == "cuda":
        return _cuda_memory_of_this_process()
    return peak_rss_bytes()


def generation_memory(folder: Path, batch: int, context: int, new_tokens: int, *,
                      options: RunOptions = RunOptions()) -> int | None:
    """Peak memory of generating `new_tokens` after `context` tokens for `batch` sequences, in a fresh child
    process; the prompt is prefilled `GENERATION_CHUNK` tokens at a time, so the cache, not the logits, is what
    grows. None for a graph without KV cache."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure_generation_peak, (str(folder), batch, context, new_tokens, options))


def peak_memory(folder: Path, seq: int, *, options: RunOptions = RunOptions()) -> int | None:
    """Peak memory of one prefill of `folder` at `seq` tokens (one sequence), measured in a fresh child process."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure_peak, (str(folder), seq, options))


def compare(base: Path, pruned: Path, *, seqs: tuple[int, ...] = (256, 1024), runs: int = 5, decode_tokens: int = 32,
            options: RunOptions = RunOptions(), generation: tuple[int, int, int] | None = None,
            reference: Path | None = None, ideal: bool = True, together: bool = True) -> dict:
    """Measure two model folders side by side (see module docstring); every ratio comes from these runs, the
    prefills with `options.batch_size` sequences a run.

    `ideal=False` leaves out the name-based ideal (meaningless for fused graphs, whose node names change).

    `generation` (batch, context, new tokens) adds the peak memory of generating with that large a cache.
    `reference` (another graph of the same model, e.g. onnxruntime-genai's builder graph) is timed in the same
    alternating runs, so `vs_reference` (its time over the pruned model's) is measured under the same conditions.
    With `together=False` each model is timed alone, its session released before the next is made (for models
    whose sessions do not fit in memory together; the runs no longer alternate).
    """
    import platform

    probe = options.session(Path(base) / "model.onnx")
    used = replace(options, provider=active_provider(probe))
    del probe
    folders = [base, pruned] + ([reference] if reference is not None else [])
    prefill = []
    def each(measure, **kwargs) -> list:
        if together:
            return measure(folders, **kwargs)
        return [measure([folder], **kwargs)[0] for folder in folders]

    for seq in seqs:
        times = each(prefill_latency, seq=seq, runs=runs, options=used)
        entry = {"seq": seq, "batch": used.batch_size, "base": times[0], "pruned": times[1],
                 "speedup": times[0]["median_ms"] / times[1]["median_ms"], "ideal": None, "removed_share": None}
        if ideal:
            entry |= ideal_speedup(base, pruned, seq, used) | {"ideal_from": "names"}
        if reference is not None:
            entry |= {"reference": times[2], "vs_reference": times[2]["median_ms"] / times[1]["median_ms"],
                      "base_vs_reference": times[2]["median_ms"] / times[0]["median_ms"]}
        prefill.append(entry)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {used.threads or 'default'} threads, {used.provider}"
    names = ("base", "pruned", "reference")
    result = {
        "machine": machine,
        "provider": used.provider,
        "prefill": prefill,
        "decode_tokens_per_s": dict(zip(names, each(decode_tokens_per_second, new_tokens=decode_tokens,
                                                     options=used))),
        "model_bytes": {name: model_bytes(folder) for name, folder in zip(names, folders)},
        "peak_memory_bytes": {name: peak_memory(folder, max(seqs), options=used)
                              for name, folder in (("base", base), ("pruned", pruned))},
    }
    if reference is not None:
        result["reference"] = str(reference)
    if generation is not None:
        batch_size, context, new_tokens = generation
        result["generation_memory"] = {
            "batch": batch_size, "context": context, "new_tokens": new_tokens,
            **{name: generation_memory(folder, batch_size, context, new_tokens, options=used)
               for name, folder in (("base", base), ("pruned", pruned))}}
    return result


def plot_prefill(result: dict, path: Path) -> None:
    """Bar chart of median prefill latency per sequence length, base vs pruned (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [entry["seq"] for entry in result["prefill"]]
    xs = np.arange(len(seqs))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.bar(xs - 0.2, [e["base"]["median_ms"] for e in result["prefill"]], 0.4, label="base")
    ax.bar(xs + 0.2, [e["pruned"]["median_ms"] for e in result["prefill"]], 0.4, label="pruned")
    for x, entry in zip(xs, result["prefill"]):
        ax.annotate(f"{entry['speedup']:.2f}x", (x + 0.2, entry["pruned"]["median_ms"]), ha="center", va="bottom")
    ax.set_xticks(xs, [str(s) for s in seqs])
    ax.set_xlabel("prefill tokens")
    ax.set_ylabel("median latency (ms)")
    ax.set_title(f"layerdrop bench ({result['machine']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    partial = Path(path).with_name(f".{Path(path).name}.partial")
    fig.savefig(partial, format="png")
    plt.close(fig)
    partial.replace(path)
