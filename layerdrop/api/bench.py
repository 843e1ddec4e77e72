"""`layerdrop bench`: two model folders side by side (speed from ONNX Runtime, KV bytes and size from the files)."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import one_at_a_time
from layerdrop.errors import LayerdropError
from layerdrop.formats import FUSIONS_KEY
from layerdrop.passes.metadata import kv_bytes_per_token, removed_modules
from layerdrop.runtime.bench import compare
from layerdrop.runtime.session import RunOptions


def bench(base: Path, pruned: Path, *, seqs: tuple[int, ...] | None = None, runs: int = 5, decode_tokens: int = 32,
          options: RunOptions = RunOptions(), generation: tuple[int, int, int] | None = None,
          reference: Path | None = None, memory_limit: int | None = None) -> dict:
    """Prefill latency, decode speed, the profile-based ideal, memory, KV bytes per token and file bytes of two
    folders (see `runtime.bench.compare`), run as `options` says (`options.batch_size` sequences a prefill); default
    lengths 256,1024 on CPU and 512..4096 on CUDA. `generation`
    (batch, context, new tokens) adds the peak memory of generating with a cache that large. `reference` (a third
    folder, e.g. onnxruntime-genai's builder graph of the same model) is timed in the same alternating runs.

    The memory guard (`guard_memory`, `memory_limit`) counts a session on every folder at once, plus, for
    `generation`, the base's KV cache of that size twice (the cache and the step's copy of it). Where that is over
    the limit but each folder's session alone fits, the models are timed one at a time instead of in alternating
    runs (`result["one_at_a_time"]` says why; timings then spread more with the machine's load), so a model whose
    two sessions do not fit together can still be measured; where one alone does not fit either, it is refused.

    Raises:
        LayerdropError: either folder is not a readable model, the generation run is longer than its context, or
            memory over the limit.
    """
    folders = [base, pruned] + ([reference] if reference is not None else [])
    graphs = [model_folder.load(folder)[1] for folder in folders]  # all are checked before any timing
    if generation is not None:
        limit = model_folder.config(base).get("max_position_embeddings")
        if limit and generation[1] + generation[2] > limit:
            raise LayerdropError(f"--generation-memory asks for {generation[1]} + {generation[2]} tokens and the "
                                 f"model's context is {limit}; use a shorter context")
        if not all(kv_bytes_per_token(graph) for graph in graphs[:2]):
            raise LayerdropError("--generation-memory measures the KV cache; both models must be exported with "
                                 "one (layerdrop export without --no-kv-cache)")
    cache = 2 * generation[0] * (generation[1] + generation[2]) * kv_bytes_per_token(graphs[0]) if generation else 0
    seqs = seqs or ((512, 1024, 2048, 4096) if options.provider == "cuda" else (256, 1024))
    why = one_at_a_time("bench", folders, memory_limit, tokens=options.batch_size * max(seqs), extra=cache)
    fused = any(FUSIONS_KEY in graph.metadata_props for graph in graphs[:2])
    result = compare(base, pruned, seqs=seqs, runs=runs, decode_tokens=decode_tokens, options=options,
                     generation=generation, reference=reference, ideal=not fused, together=why is None)
    if why:
        result["one_at_a_time"] = f"timed one model at a time: {why}"
    result["kv_bytes_per_token"] = {name: kv_bytes_per_token(graph)
                                    for name, graph in zip(("base", "pruned", "reference"), graphs)}
    if fused:
        _structural_ideal(result, base, *graphs[:2], RunOptions(result["provider"], options.threads))
    return result


def _structural_ideal(result: dict, base: Path, base_graph, pruned_graph, options: RunOptions) -> None:
    """For fused graphs, whose fused nodes get new names on every rewrite, the ideal from the branches the pruned
    model's removal record names, found by structure in the base graph (`search.measure.module_ideal`); None
    where the record does not say (the base had removals of its own, or the pruned model has none)."""
    from layerdrop.search.measure import module_ideal

    removed = {(e["kind"], int(e["layer"])) for e in removed_modules(pruned_graph)}
    usable = bool(removed) and not removed_modules(base_graph)
    for entry in result["prefill"]:
        ideal = module_ideal(base, removed, entry["seq"], options) if usable else {
            "ideal": None, "removed_share": None}
        entry.update(ideal, ideal_from="regions")
