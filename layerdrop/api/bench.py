"""`layerdrop bench`: two model folders side by side (speed from ONNX Runtime, KV bytes and size from the files)."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.passes.metadata import kv_bytes_per_token
from layerdrop.runtime.bench import compare


def bench(base: Path, pruned: Path, *, seqs: tuple[int, ...] | None = None, batch: int = 1, runs: int = 5,
          decode_tokens: int = 32, provider: str = "cpu", threads: int | None = None) -> dict:
    """Prefill latency, decode speed, the profile-based ideal, memory, KV bytes per token and file bytes of two
    folders (see `runtime.bench.compare`); default lengths 256,1024 on CPU and 512..4096 on CUDA.

    Raises:
        LayerdropError: either folder is not a readable model.
    """
    graphs = [model_folder.load(folder)[1] for folder in (base, pruned)]  # both are checked before any timing
    seqs = seqs or ((512, 1024, 2048, 4096) if provider == "cuda" else (256, 1024))
    result = compare(base, pruned, seqs=seqs, batch=batch, runs=runs, decode_tokens=decode_tokens,
                     provider=provider, threads=threads)
    kv = [kv_bytes_per_token(graph) for graph in graphs]
    result["kv_bytes_per_token"] = {"base": kv[0], "pruned": kv[1]}
    return result
