"""The Python API: each function reads model folders and writes one, as the matching CLI command does."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerdrop import model_folder
from layerdrop.errors import LayerdropError
from layerdrop.passes.attach_scores import AttachScoresPass, read_scores
from layerdrop.passes.cleanup import cleanup_passes, run_passes
from layerdrop.passes.drop_branches import DropBranchesPass, removed_modules
from layerdrop.passes.find_residuals import FindResidualsPass, annotated_regions
from layerdrop.passes.fold_alpha import fold_alpha_rules
from layerdrop.passes.harp_bypass import HarpBypassPass
from layerdrop.passes.prune_kv_cache import PruneKvCachePass, kv_layer_map
from layerdrop.runtime.alpha_search import greedy_alpha_search
from layerdrop.runtime.scoring import compute_scores
from layerdrop.windows import Sampling, Windows, draw_windows

DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 256
KINDS = ("attn", "mlp", "block")


def windows_for(folder: Path, text: Path | None, *, role: str, samples: int | None, seq_len: int,
                sampling: Sampling = Sampling(), calibration_sha256: str | None = None) -> Windows:
    """Windows of `text` (default: the bundled text of the role) for `role`, with the folder's tokenizer and
    context length (see `layerdrop.windows.draw_windows`)."""
    limit = model_folder.config(folder).get("max_position_embeddings")
    return draw_windows(folder, text, role=role, samples=samples, seq_len=seq_len, sampling=sampling,
                        max_positions=limit, calibration_sha256=calibration_sha256)


def calibration_sha256(model: ir.Model) -> str | None:
    """The SHA-256 of the text the model's scores came from (None for an unscored model)."""
    from layerdrop.passes.attach_scores import CALIBRATION_KEY

    try:
        return json.loads(model.metadata_props.get(CALIBRATION_KEY, "null") or "null").get("sha256")
    except (AttributeError, json.JSONDecodeError):
        return None


def score(
    model_path: Path,
    out_dir: Path | None = None,
    *,
    calib: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    batch_size: int = 1,
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Score every module of a model on calibration text; write the scored folder if `out_dir` is given.

    Returns:
        {"calibration": {...}, "regions": [{"layer", "kind", "score", "norm_ratio"}, ...]}

    Raises:
        LayerdropError: bad model or text, or an output that would overwrite something.
    """
    folder, model = model_folder.load(model_path)
    if out_dir is not None:
        model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    annotated_regions(model)
    windows = windows_for(folder.path, calib, role="calib", samples=samples, seq_len=seq_len, sampling=sampling)
    scores = compute_scores(model, folder.path, windows, batch_size=batch_size, provider=provider,
                            threads=threads, progress=progress)
    run_passes(model, [AttachScoresPass(scores, windows.source)])
    if out_dir is not None:
        model_folder.save(model, out_dir, source=folder, force=force)
    return {"calibration": windows.source, "regions": [asdict(s) for s in scores]}


def rank_overlap(first: list[dict], second: list[dict], n: int, kinds: Iterable[str] = ("attn", "mlp")) -> dict:
    """How many of the n lowest-scored modules two rankings share (over the given kinds)."""
    def lowest(rows: list[dict]) -> list[tuple[str, int]]:
        chosen = sorted((r for r in rows if r["kind"] in kinds), key=lambda r: (r["score"], r["layer"]))[:n]
        return [(r["kind"], r["layer"]) for r in chosen]

    a, b = lowest(first), lowest(second)
    return {"n": n, "shared": len(set(a) & set(b)), "first": a, "second": b}


def select_lowest(rows: list[dict], kinds: tuple[str, ...], count: int) -> list[tuple[str, int]]:
    """The `count` lowest-scored modules among `kinds` (ties broken by layer, then kind).

    Raises:
        LayerdropError: count is not positive or larger than the modules there are.
    """
    pool = [r for r in rows if r["kind"] in kinds]
    label = "+".join(kinds)
    if count < 1:
        raise LayerdropError(f"the {label} count must be at least 1 (got {count})")
    if count > len(pool):
        raise LayerdropError(f"asked to drop {count} {label} modules but the model has {len(pool)}")
    chosen = sorted(pool, key=lambda r: (r["score"], r["layer"], r["kind"]))[:count]
    return [(r["kind"], r["layer"]) for r in chosen]


def _selection_kinds(counts: dict[str, int]) -> list[tuple[tuple[str, ...], int]]:
    plan = []
    for key, kinds in (("attn", ("attn",)), ("mlp", ("mlp",)), ("block", ("block",)), ("joint", ("attn", "mlp"))):
        if counts.get(key) is not None:
            plan.append((kinds, counts[key]))
    return plan


def drop(
    model_path: Path,
    out_dir: Path,
    *,
    targets: list[tuple[str, int]] | None = None,
    counts: dict[str, int] | None = None,
    iterative: bool = False,
    calib: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
    fuse: bool = False,
) -> dict:
    """Drop modules and write the pruned folder (with `fuse`, ONNX Runtime fusions applied after the drop).

    Args:
        targets: explicit (kind, layer) pairs, kind in attn/mlp/block.
        counts: score-based selection: {"attn": n, "mlp": n, "block": n, "joint": n} (joint: the n lowest of
            attention and MLP together). Uses the scores `score` attached, unless `iterative`, which re-scores
            the pruned graph on `calib` after each single drop.

    Returns:
        {"dropped": [...], "kv_layers": [...], "nodes": {"before", "after"}}

    Raises:
        LayerdropError: no or conflicting selection, unknown modules, an unscored model for score-based selection.
    """
    counts = {k: v for k, v in (counts or {}).items() if v is not None}
    if bool(targets) == bool(counts):
        raise LayerdropError("say what to drop: either --drop KIND:LAYERS or one of --attn/--mlp/--block/--joint")
    if counts.get("joint") is not None and len(counts) > 1:
        raise LayerdropError("--joint already chooses among attention and MLP; do not combine it with other counts")
    if counts.get("block") is not None and len(counts) > 1:
        raise LayerdropError("--block cannot be combined with --attn/--mlp/--joint; drop blocks in a separate run")
    if iterative and not counts:
        raise LayerdropError("--iterative goes with a score-based count (--attn/--mlp/--block/--joint)")
    folder, model = model_folder.load(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    nodes_before = len(model.graph)
    regions = annotated_regions(model)
    _check_kinds_exist(regions, targets or [], counts)
    passes: list[ir.passes.PassBase] = []
    if targets:
        passes.append(DropBranchesPass(targets, reason="explicit"))
    elif not iterative:
        rows = read_scores(model, regions)
        if not rows:
            raise LayerdropError(f"{model_path} has no scores; run `layerdrop score` on it first")
        for kinds, count in _selection_kinds(counts):
            label = "joint" if len(kinds) > 1 else kinds[0]
            passes.append(DropBranchesPass(select_lowest(rows, kinds, count), reason=f"{label}-{count} one-shot"))
    else:
        windows = windows_for(folder.path, calib, role="calib", samples=samples, seq_len=seq_len, sampling=sampling)
        for kinds, count in _selection_kinds(counts):
            drop_iteratively(model, folder.path, windows, kinds, count, provider, threads, progress)
    run_passes(model, [*passes, *rewrite_passes([], {}, "", fuse=fuse)])
    model_folder.save(model, out_dir, source=folder, force=force)
    return {
        "fusions": json.loads(model.metadata_props.get("layerdrop.ort_fusions", "{}")),
        "dropped": removed_modules(model),
        "kv_layers": kv_layer_map(model),
        "nodes": {"before": nodes_before, "after": len(model.graph)},
    }


HARP_SEARCH_KEY = "layerdrop.harp_search"


def rewrite_passes(drops: list[tuple[str, int]], alphas: dict[int, float], reason: str, fuse: bool = False,
                   means: dict | None = None) -> list[ir.passes.PassBase]:
    """The passes that apply drops and HARP bypasses (mean-shifted for the layers in `means`), fold alphas, prune
    the KV cache and clean up; with `fuse`, ONNX Runtime fusions last of all (which also restores a builder
    graph's skip-norms)."""
    from onnxscript.rewriter import RewritePass

    passes: list[ir.passes.PassBase] = []
    if drops:
        passes.append(DropBranchesPass(drops, reason=reason))
    if alphas:
        passes += [HarpBypassPass(alphas, means), RewritePass(fold_alpha_rules())]
    passes += [PruneKvCachePass(), *cleanup_passes(), FindResidualsPass()]
    if fuse:
        from layerdrop.passes.ort_fusions import OrtFusionPass

        passes += [OrtFusionPass(), *cleanup_passes()]
    return passes


def harp(
    model_path: Path,
    out_dir: Path,
    *,
    alphas: dict[int, float] | None = None,
    top: int | None = None,
    search: bool = False,
    search_text: Path | None = None,
    samples: int = 8,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
    fuse: bool = False,
) -> dict:
    """Replace attention by the rescaled V·O map (SPEC §4) in chosen layers, and write the folder.

    Either explicit `alphas` (layer -> alpha), or `top` K layers with `search` (greedy, top-down, over
    {0, 0.1, ..., 1}, by perplexity on search windows of `search_text`, default the bundled calibration text), or
    `top` K with alpha = 1.

    Returns:
        {"alphas": {...}, "trials": [...], "search_seconds": s, "kv_layers": [...]}

    Raises:
        LayerdropError: no or conflicting selection, bad layers or alphas.
    """
    import time

    if bool(alphas) == (top is not None):
        raise LayerdropError("say which layers: either --alpha LAYER=A,... or --top K (with --search)")
    if search and top is None:
        raise LayerdropError("--search goes with --top K")
    folder, model = model_folder.load(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    attention = sorted(r.layer for r in annotated_regions(model) if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions to bypass")
    trials: list[dict] = []
    seconds = 0.0
    if top is not None:
        if not 1 <= top <= len(attention):
            raise LayerdropError(f"--top {top} is out of range: the model has {len(attention)} attention layers")
        layers = attention[::-1][:top]
        if search:
            windows = windows_for(folder.path, search_text, role="search", samples=samples, seq_len=seq_len,
                                  sampling=sampling, calibration_sha256=calibration_sha256(model))
            start = time.perf_counter()
            found = greedy_alpha_search(model, folder.path, windows.ids, layers, progress=progress,
                                        provider=provider, threads=threads)
            seconds = time.perf_counter() - start
            alphas, trials = found.alphas, found.trials
            model.metadata_props[HARP_SEARCH_KEY] = json.dumps(
                {"text": windows.source, "trials": trials, "seconds": round(seconds, 1)}, sort_keys=True)
        else:
            alphas = {layer: 1.0 for layer in layers}
    run_passes(model, rewrite_passes([], alphas, "harp", fuse=fuse))
    model_folder.save(model, out_dir, source=folder, force=force)
    return {"alphas": {int(k): v for k, v in alphas.items()}, "trials": trials, "search_seconds": seconds,
            "kv_layers": kv_layer_map(model),
            "fusions": json.loads(model.metadata_props.get("layerdrop.ort_fusions", "{}"))}


def _check_kinds_exist(regions, targets: list[tuple[str, int]], counts: dict[str, int]) -> None:
    present = {r.kind for r in regions}
    wanted = {k for k, _ in targets} | {k for k in counts if k in ("attn", "mlp")}
    if "joint" in counts and "attn" not in present:
        wanted.add("attn")
    for kind in wanted - {"block"}:
        if kind not in present:
            raise LayerdropError(f"this graph has no {kind} regions; nothing of that kind can be dropped")


def drop_iteratively(model: ir.Model, folder: Path, windows: Windows, kinds: tuple[str, ...], count: int,
                     provider: str = "cpu", threads: int | None = None, progress: bool = True) -> None:
    """Drop the lowest-scored module, re-score the pruned graph, repeat `count` times (SPEC §3, iterative)."""
    label = "joint" if len(kinds) > 1 else kinds[0]
    for step in range(count):
        scores = compute_scores(model, folder, windows, provider=provider, threads=threads, progress=progress)
        rows = [asdict(s) for s in scores]
        target = select_lowest(rows, kinds, count - step)[:1]
        run_passes(model, [AttachScoresPass(scores, windows.source),
                           DropBranchesPass(target, reason=f"{label}-{count} iterative step {step + 1}"),
                           PruneKvCachePass(), *cleanup_passes()])


def evaluate(
    model_path: Path,
    *,
    text: Path | None = None,
    samples: int | None = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    batch_size: int = 1,
    provider: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Perplexity of a model folder on evaluation windows of `text` (default: the bundled evaluation text); when
    `text` is the model's calibration text, the windows come from its evaluation part.

    Returns:
        {"perplexity", "nll", "tokens", "text": {...}}
    """
    from layerdrop.runtime.evaluate import perplexity
    from layerdrop.runtime.session import make_session

    folder, model = model_folder.load(model_path)  # validates the folder and its external data before ORT reads it
    windows = windows_for(folder.path, text, role="eval", samples=samples, seq_len=seq_len, sampling=sampling,
                          calibration_sha256=calibration_sha256(model))
    session = make_session(folder.onnx_path, provider=provider, threads=threads)
    result = perplexity(session, windows.ids, batch_size=batch_size, progress=progress)
    return {"perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "text": windows.source}


def harness(
    model_path: Path,
    tasks: list[str],
    *,
    limit: float | None = None,
    include_path: Path | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    provider: str = "cpu",
    show: int = 3,
    progress: bool = True,
) -> dict:
    """lm-evaluation-harness tasks on a model folder through ONNX Runtime (needs the `eval` extra).

    Returns:
        {"scores": {task: {metric: (value, stderr)}}, "generations": {task: [{"prompt", "target", "output"}]}}
        with the first `show` generation samples of each generate_until task.

    Raises:
        LayerdropError: lm-eval is missing, a task name is unknown, or a task's data cannot be loaded.
    """
    try:
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LayerdropError("--tasks needs lm-eval; install the eval extra: pip install -e '.[eval]'") from None
    from layerdrop.runtime.harness import LayerdropLM

    if include_path is not None and not Path(include_path).is_dir():
        raise LayerdropError(f"--include-path {include_path} is not a folder of task YAML files")
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LayerdropError(f"unknown lm-eval task(s): {', '.join(unknown)}; `lm_eval ls tasks` lists them, and "
                             "--include-path adds a folder of your own task YAML files")
    model = LayerdropLM(path=str(model_path), provider=provider, batch_size=batch_size, progress=progress)
    try:
        raw = evaluator.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                        num_fewshot=num_fewshot, log_samples=show > 0, verbosity="ERROR")
    except (ConnectionError, OSError) as exc:
        raise LayerdropError(f"task data could not be loaded ({type(exc).__name__}: {str(exc)[:200]}); the "
                             "standard tasks download their datasets from the Hugging Face Hub, so this needs a "
                             "network") from None
    scores: dict[str, dict[str, tuple[float, float | None]]] = {}
    for task, metrics in raw["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            scores.setdefault(task, {})[metric] = (float(value), float(stderr) if isinstance(stderr, (int, float))
                                                   else None)
    generations: dict[str, list[dict]] = {}
    for task, samples in (raw.get("samples") or {}).items():
        if raw["configs"].get(task, {}).get("output_type") != "generate_until":
            continue
        first = sorted(samples, key=lambda s: s["doc_id"])[:show]
        generations[task] = [{"prompt": s["arguments"][0][0], "target": str(s["target"]),
                              "output": s["filtered_resps"][0]} for s in first]
    return {"scores": scores, "generations": generations}


def harness_table(names: list[str], results: list[dict]) -> tuple[str, list[dict]]:
    """Task scores of one or two models side by side (with the difference), as text and as rows."""
    rows = []
    for task in sorted(results[0]["scores"]):
        for metric, _ in sorted(results[0]["scores"][task].items()):
            values = [r["scores"].get(task, {}).get(metric, (float("nan"), None)) for r in results]
            row = {"task": task, "metric": metric, "scores": [v for v, _ in values],
                   "stderr": [e for _, e in values]}
            if len(results) == 2:
                row["difference"] = values[1][0] - values[0][0]
            rows.append(row)

    def number(value: float) -> str:
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4e}"

    def cell(value: float, stderr: float | None) -> str:
        return f"{number(value)} ± {number(stderr)}" if stderr is not None else number(value)

    labels = ["base", "vs"][: len(names)] if len(names) == 2 else ["score"]
    lines = [f"{label}: {name}" for label, name in zip(labels, names)] + [""]
    header = f"{'task':<20} {'metric':<16} " + " ".join(f"{label:>24}" for label in labels)
    header += f" {'difference (vs - base)':>23}" if len(results) == 2 else ""
    lines.append(header)
    for row in rows:
        line = f"{row['task']:<20} {row['metric']:<16} " + " ".join(
            f"{cell(v, e):>24}" for v, e in zip(row["scores"], row["stderr"]))
        lines.append(line + (f" {row['difference']:>+23.4f}" if "difference" in row else ""))
    for task in sorted(results[0]["generations"]):
        lines.append(f"\ngenerations, {task} (first {len(results[0]['generations'][task])}):")
        for index, sample in enumerate(results[0]["generations"][task]):
            lines.append(f"  [{index}] prompt: ...{sample['prompt'][-60:]!r}   target: {sample['target'][:40]!r}")
            for label, result in zip(labels, results):
                output = result["generations"][task][index]["output"]
                lines.append(f"      {label:>6}: {output[:100]!r}")
    return "\n".join(lines), rows


def generate_text(model_path: Path, prompt: str, max_new_tokens: int, *, provider: str = "cpu") -> str:
    """Greedy continuation of `prompt` (tokenized with the folder's tokenizer), decoded back to text."""
    from layerdrop.runtime.generate import greedy_generate
    from layerdrop.runtime.session import make_session
    from layerdrop.windows import load_tokenizer

    folder = model_folder.resolve(model_path)
    tokenizer = load_tokenizer(folder.path)
    ids = tokenizer.encode(prompt, special=True)  # as the model is used: with its BOS where the tokenizer adds one
    if not ids:
        raise LayerdropError("--prompt is empty after tokenization; give some text")
    eos = model_folder.config(folder.path).get("eos_token_id")
    tokens, _ = greedy_generate(make_session(folder.onnx_path, provider=provider), np.array([ids]), max_new_tokens,
                                eos_token_id=eos if isinstance(eos, int) else None)
    return tokenizer.decode(tokens)


def kv_bytes_per_token(model: ir.Model) -> int | None:
    """KV-cache bytes one token costs (keys and values of every cached layer, batch 1); None without a cache."""
    total = 0
    for value in model.graph.inputs:
        if (value.name or "").startswith("past_key_values.") and value.shape is not None:
            dims = list(value.shape)
            heads, head_dim = dims[1], dims[3]
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                return None
            total += heads * head_dim * int(value.dtype.itemsize)
    return total or None


def _genai_family(folder: Path) -> str | None:
    path = Path(folder) / model_folder.GENAI_CONFIG
    if not path.is_file():
        return None
    kind = model_folder.config_json(path).get("model", {}).get("type")
    return f"{kind} (onnxruntime-genai builder)" if kind else None


def inspect(model_path: Path) -> dict:
    """Describe a model folder: regions with their scores, KV bytes per token, what was removed."""
    folder, model = model_folder.load(model_path)
    regions = annotated_regions(model)
    scores = {(r["kind"], r["layer"]): r for r in read_scores(model, regions)}
    rows = []
    for region in regions:
        row = {"layer": region.layer, "kind": region.kind, "branch_nodes": len(region.branch),
               "kv_inputs": region.kv_inputs}
        scored = scores.get((region.kind, region.layer), {})
        row.update({k: v for k, v in scored.items() if k in ("score", "norm_ratio")})
        rows.append(row)
    blocks = [r for r in scores.values() if r["kind"] == "block"]
    return {
        "family": model.metadata_props.get("layerdrop.family") or _genai_family(folder.path),
        "nodes": len(model.graph),
        "regions": rows,
        "blocks": sorted(blocks, key=lambda r: r["layer"]),
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "kv_layers": kv_layer_map(model),
        "removed": removed_modules(model),
        "calibration": json.loads(model.metadata_props.get("layerdrop.calibration", "null")),
    }


def plot_scores(rows: list[dict], path: Path) -> None:
    """Draw per-layer attention, MLP and block scores to a PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for kind, marker in (("attn", "o"), ("mlp", "s"), ("block", "^")):
        points = sorted((r["layer"], r["score"]) for r in rows if r["kind"] == kind)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, label=kind)
    ax.set_xlabel("layer")
    ax.set_ylabel("S = 1 - cos(X, Y)  (low: candidate to drop)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("layerdrop importance scores")
    fig.tight_layout()
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    fig.savefig(partial, format="png")
    plt.close(fig)
    partial.replace(path)


def write_json(data: dict, path: Path) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n", encoding="utf-8")
    partial.replace(path)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(type(value).__name__)


def parse_budget(text: str, attention_layers: int) -> tuple[str, float, int | None]:
    """'attn=8' | 'kv=0.75' | 'speedup=1.2' or 'speedup=1.2@1024' -> (kind, value, seq for speedup).

    Raises:
        LayerdropError: an unknown or out-of-range budget.
    """
    kind, sep, value = text.partition("=")
    if not sep or kind not in ("attn", "kv", "speedup"):
        raise LayerdropError(f"bad --budget {text!r}: use attn=N, kv=FRACTION or speedup=X[@TOKENS]")
    value, _, seq = value.partition("@")
    try:
        number = float(value)
        seq_len = int(seq) if seq else None
    except ValueError:
        raise LayerdropError(f"bad --budget {text!r}: {value!r} is not a number") from None
    if kind == "attn" and not (number.is_integer() and 1 <= number <= attention_layers):
        raise LayerdropError(f"--budget attn={value} must be a whole number from 1 to {attention_layers}")
    if kind == "kv" and not 0 <= number < 1:
        raise LayerdropError(f"--budget kv={value} must be a fraction in [0, 1) of the KV cache to keep")
    if kind == "speedup" and not number > 1:
        raise LayerdropError(f"--budget speedup={value} must be above 1")
    return kind, number, seq_len


def attention_count_for(kind: str, value: float, seq: int | None, folder: Path, scores: dict[int, float],
                        threads: int | None) -> int:
    """How many attention layers a budget asks to remove or bypass."""
    import math

    layers = len(scores)
    if kind == "attn":
        return int(value)
    if kind == "kv":
        return max(1, math.ceil(layers * (1 - value) - 1e-9))
    # speedup: remove the lowest-scored attention layers until the profile-based ideal speedup reaches the target
    from layerdrop.runtime.bench import node_times

    times = node_times(folder, seq or 1024, runs=2, threads=threads)
    _, model = model_folder.load(folder)
    branch_time = {r.layer: sum(times.get(n.name, 0.0) for n in r.branch)
                   for r in annotated_regions(model) if r.kind == "attn"}
    total = sum(times.values())
    saved = 0.0
    for count, layer in enumerate(sorted(scores, key=scores.get), start=1):
        saved += branch_time.get(layer, 0.0)
        if total / max(total - saved, 1e-9) >= value:
            return count
    raise LayerdropError(f"--budget speedup={value} is out of reach by removing attention alone "
                         f"(all {layers} layers give {total / max(total - saved, 1e-9):.2f}x)")


def _check_disjoint_from_start(folder: Path, calib: Path | None, samples: int, search_samples: int, seq_len: int,
                               sampling: Sampling) -> None:
    """With --from-start, the first `samples` windows calibrate and the last `search_samples` search: refuse a text
    too short for both."""
    try:
        windows_for(folder, calib, role="calib", samples=samples + search_samples, seq_len=seq_len, sampling=sampling)
    except LayerdropError:
        raise LayerdropError(f"with --from-start the calibration text must hold {samples} calibration and "
                             f"{search_samples} search windows of {seq_len} tokens apart; use a longer text, fewer "
                             "--samples, or leave out --from-start") from None


def plan(
    model_path: Path,
    out_dir: Path,
    *,
    budget: str,
    calib: Path | None = None,
    eval_text: Path | None = None,
    samples: int = DEFAULT_SAMPLES,
    search_samples: int = 8,
    eval_samples: int = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    extra: int = 4,
    shift: bool = True,
    provider: str = "cpu",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Plan the best set of attention drops/bypasses for a budget and write the chosen model (see planner).

    The search windows come from the search part of `calib` (disjoint from its calibration windows); the comparison
    table is measured on `eval_text`, which the search never sees (its evaluation part, if it is `calib` itself).
    With `shift`, the planner's moves carry the mean shift, whose means come from calibration windows of `calib`
    (`branch_means`); the other methods are the papers' own.

    Returns:
        {"budget", "attention_layers", "pick": {...}, "methods": [{"method", "alphas", "shift", "search_ppl",
         "eval_ppl"}], "baseline": {...}, "search_seconds"}
    """
    import time

    from layerdrop.runtime.alpha_search import branch_means
    from layerdrop.runtime.evaluate import perplexity
    from layerdrop.runtime.planner import bypass_search, candidate_pool, plan_attention
    from layerdrop.runtime.session import make_session

    folder, model = model_folder.load(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    regions = annotated_regions(model)
    attention = sorted(r.layer for r in regions if r.kind == "attn")
    if not attention:
        raise LayerdropError("this graph has no attention regions; nothing to plan")
    kind, value, seq = parse_budget(budget, len(attention))
    started = time.perf_counter()
    rows = read_scores(model, regions)
    if not rows:
        rows = score(folder.path, None, calib=calib, samples=samples, seq_len=seq_len, sampling=sampling,
                     provider=provider, threads=threads, progress=progress)["regions"]
    scores = {r["layer"]: r["score"] for r in rows if r["kind"] == "attn"}
    count = attention_count_for(kind, value, seq, folder.path, scores, threads)
    session_args = {"provider": provider, "threads": threads}
    calib_windows = windows_for(folder.path, calib, role="calib", samples=min(samples, 16), seq_len=seq_len,
                                sampling=sampling)
    calib_sha = calib_windows.source["sha256"]
    search = windows_for(folder.path, calib, role="search", samples=search_samples, seq_len=seq_len,
                         sampling=sampling, calibration_sha256=calib_sha)
    if sampling.from_start:  # the search windows are the text's last ones: they must not reach the first ones
        _check_disjoint_from_start(folder.path, calib, samples, search_samples, seq_len, sampling)
    held_out = windows_for(folder.path, eval_text, role="eval", samples=eval_samples, seq_len=seq_len,
                           sampling=sampling, calibration_sha256=calib_sha)

    def measure(alphas: dict[int, float], means: dict | None) -> tuple[float, float]:
        candidate = model_folder.copy_model(model)
        run_passes(candidate, rewrite_passes([], alphas, "plan", means=means))
        session = make_session(candidate, folder=folder.path, **session_args)
        return (perplexity(session, search.ids).perplexity, perplexity(session, held_out.ids).perplexity)

    lowest = sorted(scores, key=lambda layer: (scores[layer], layer))[:count]
    top = attention[::-1][:count]
    methods: dict[str, dict[int, float]] = {
        "paper 1: one-shot drop of the lowest scores": dict.fromkeys(lowest, 0.0)}
    scratch = model_folder.copy_model(model)
    drop_iteratively(scratch, folder.path, calib_windows, ("attn",), count, provider, threads, progress)
    methods["paper 1: iterative drop"] = {e["layer"]: 0.0 for e in removed_modules(scratch)}
    methods["HARP: top layers, searched alphas"] = bypass_search(model, folder.path, search.ids, top,
                                                                  progress=progress, **session_args)
    methods["score-selected bypass, searched alphas"] = bypass_search(model, folder.path, search.ids, lowest,
                                                                       progress=progress, **session_args)
    means = None
    if shift:
        means = branch_means(model, folder.path, calib_windows, candidate_pool(scores, count, extra),
                             **session_args)
    planned = plan_attention(model, folder.path, search.ids, scores, count, extra=extra, means=means,
                             progress=progress, **session_args)
    rows = [(name, alphas, None) for name, alphas in methods.items()]
    if shift:
        rows += [("planner (moves with the mean shift)", planned.alphas, means),
                 ("planner's layers and alphas without the shift", planned.alphas, None)]
    else:
        rows.append(("planner", planned.alphas, None))
    table = []
    for name, alphas, row_means in rows:
        search_ppl, eval_ppl = measure(alphas, row_means)
        table.append({"method": name, "alphas": {int(k): v for k, v in sorted(alphas.items())},
                      "shift": row_means is not None, "search_ppl": search_ppl, "eval_ppl": eval_ppl})
    pick = min(table, key=lambda row: row["search_ppl"])
    pick_means = {k: means[k] for k in pick["alphas"]} if pick["shift"] else None
    seconds = time.perf_counter() - started
    baseline = make_session(model, folder=folder.path, **session_args)  # still unmodified here
    base = {"search_ppl": perplexity(baseline, search.ids).perplexity,
            "eval_ppl": perplexity(baseline, held_out.ids).perplexity}
    kept = (len(attention) - count) / len(attention)
    result = {"budget": budget, "attention_layers": count, "kv_fraction_kept": kept,
              "baseline": base, "methods": table, "pick": pick, "search_seconds": seconds,
              "search_text": search.source, "eval_text": held_out.source, "planner_log": planned.log}
    model.metadata_props["layerdrop.plan"] = json.dumps({k: v for k, v in result.items() if k != "planner_log"},
                                                        sort_keys=True, default=_json_default)
    run_passes(model, rewrite_passes([], pick["alphas"], "plan", means=pick_means))
    model_folder.save(model, out_dir, source=folder, force=force)
    return result

