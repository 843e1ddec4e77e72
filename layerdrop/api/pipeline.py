"""`layerdrop pipeline`: export -> score -> drop or HARP -> eval -> bench, each stage's output kept in OUTDIR.

Each stage writes a stamp (`layerdrop-stage.json`) with a fingerprint of its inputs and options; with `resume`
a stage whose output exists and whose stamp matches is skipped.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from layerdrop import memory, model_folder
from layerdrop.api.common import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    fusion_passes,
    guard_memory,
    quantize_pass,
    save_model,
    task_items_available,
    write_json,
)
from layerdrop.api.drop import drop
from layerdrop.api.evaluate import evaluate, fidelity, standard_tasks
from layerdrop.api.harp import harp
from layerdrop.api.inspect import inspect
from layerdrop.api.reports import pipeline_summary, removed_by_kind, reproduce_command, run_snippet
from layerdrop.api.score import score
from layerdrop.errors import LayerdropError
from layerdrop.model_folder import write_atomically
from layerdrop.passes.quantize_int4 import DEFAULT_ACCURACY_LEVEL
from layerdrop.runtime.session import RunOptions
from layerdrop.windows import Sampling, TextSource, resolve_text

STAMP = "layerdrop-stage.json"


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(path: Path | None) -> str | None:
    return TextSource.open(resolve_text(path)).sha256()[:16] if path else None


def _stamp_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / STAMP).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None


def _stage(name: str, folder: Path, fingerprint: str, resume: bool, run) -> bool:
    """Run one stage unless resuming and its output matches; return True when it ran."""
    if resume and (folder / "model.onnx").is_file() and _stamp_of(folder) == fingerprint:
        print(f"[{name}] up to date, skipped ({folder})", file=sys.stderr)
        return False
    print(f"[{name}] ...", file=sys.stderr)
    start = time.perf_counter()
    run()
    write_atomically(folder / STAMP, json.dumps({"stage": name, "fingerprint": fingerprint}) + "\n")
    print(f"[{name}] done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return True


def pipeline(
    model: Path | None,
    out_dir: Path,
    *,
    calib: Path | None = None,
    eval_text: Path | None = None,
    attn: int | None = None,
    joint: int | None = None,
    harp_top: int | None = None,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    eval_samples: int = 32,
    bench_seq: tuple[int, ...] = (256, 1024),
    bench_runs: int = 5,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    fuse: bool = True,
    builder: bool = True,
    quantize: str | None = None,
    memory_limit: int | None = None,
    task_items: int = 0,
) -> dict:
    """Run the whole pipeline; returns the report (also written to OUTDIR/report.json, and as `pipeline_summary`
    to OUTDIR/report.md): the side-by-side figures, the layers removed (read back from the output model), the texts
    the figures come from, a snippet that runs the output, the command that reproduces the run, and `notes` for the
    user (e.g. why the bench has no builder column), and the output's fidelity to the base (KL divergence of its
    next-token distribution, top-1 agreement) on the held-out windows.

    With no selection, drops about a quarter of the attention layers by score. With `fuse` (the default) the
    rewritten model is written fused for ONNX Runtime, and the bench's base is the export fused the same way
    (OUTDIR/bench-base; quantized too with `quantize`), so the speedup and the perplexity ratio are the rewrite's
    alone. With `builder` and onnxruntime-genai installed, onnxruntime-genai's model builder graph of the same
    Hugging Face model (OUTDIR/builder; fp32, or int4 with `quantize`) is timed as a third column: what the user
    would have shipped without layerdrop. Every stage runs with `options`' provider and threads; its batch size is
    the search's and the evaluation's (the score stage and the bench run one sequence a run). With `task_items`,
    the base and the rewritten model also run the first `task_items` items of each of the papers' standard tasks
    (`api.evaluate.standard_tasks`, item by item: paired differences, % retained, chance-adjusted retained).

    Before anything is written, the pipeline's peak memory is estimated (`guard_pipeline`: one session's
    activations, as the bench and the fidelity hold one model at a time where two would not fit, and one copy of the
    float32 weights, two with the builder's conversion, the quantizer's with `quantize`) and refused over
    `memory_limit` (None: $LAYERDROP_MEMORY_LIMIT, else 16 GB); every stage also checks its own estimate.

    Raises:
        LayerdropError: conflicting selections, an OUTDIR that holds other files without --force/--resume, or an
            estimate over the memory limit.
    """
    if sum(x is not None for x in (attn, joint, harp_top)) > 1:
        raise LayerdropError("choose one of --attn, --joint, --harp")
    if task_items < 0:
        raise LayerdropError(f"--task-items counts items of each task: give 0 or more, not {task_items}")
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (resume or force):
        raise LayerdropError(f"{out_dir} is not empty; pass --resume to reuse its stages or --force to redo them")
    source = Path(model) if model else None
    onnx_input = source is not None and source.is_dir() and (source / "model.onnx").is_file()
    # Every stage holds one session on the model at a time where two would not fit (the bench and the fidelity say
    # so in a note), so one session's activations and a floor of one copy of the weights; onnxruntime-genai's builder
    # holds the Hugging Face weights and the graph it writes, and the quantizer its copies of the weights, with no
    # session running beside them.
    copies = max(1, 2 if builder and not onnx_input else 0, memory.QUANTIZE_COPIES if quantize else 0)
    guard_pipeline(source, memory_limit, copies=copies, tokens=max(max(bench_seq), options.batch_size * seq_len))
    task_items_available(task_items)
    out_dir.mkdir(parents=True, exist_ok=True)
    exported, scored, pruned = out_dir / "export", out_dir / "scored", out_dir / "pruned"
    redo = not resume
    one_a_run = RunOptions(options.provider, options.threads)

    key = _fingerprint("export", str(source.resolve()) if source else "default")
    if onnx_input:
        exported = source  # already an ONNX folder: start from it
    else:
        def export() -> None:
            from layerdrop.api.export import export as export_model
            export_model(source, exported, kv_cache=True, force=True, memory_limit=memory_limit)
        redo |= _stage("export", exported, key, resume, export)

    # stages written through the quantizer are redone when its settings change
    quantized = (quantize, DEFAULT_ACCURACY_LEVEL) if quantize else None
    key = _fingerprint("score", _stamp_of(exported) or str(exported), _file_digest(calib), samples, seq_len,
                       sampling)
    redo |= _stage("score", scored, key, resume and not redo, lambda: score(
        exported, scored, calib=calib, samples=samples, seq_len=seq_len, sampling=sampling,
        options=one_a_run, force=True, progress=progress, memory_limit=memory_limit))

    scored_info = inspect(scored)
    layers, scored_calibration = int(scored_info["regions"][-1]["layer"]) + 1, scored_info["calibration"]
    if harp_top is not None:
        method = f"harp-{harp_top}"
        key = _fingerprint("harp", _stamp_of(scored), harp_top, _file_digest(calib), sampling, fuse, quantized)
        _stage(method, pruned, key, resume and not redo, lambda: harp(
            scored, pruned, top=harp_top, search=True, search_text=calib, sampling=sampling, options=options,
            force=True, progress=progress, fuse=fuse, quantize=quantize, memory_limit=memory_limit))
    else:
        counts = {"joint": joint} if joint is not None else {"attn": attn if attn is not None else max(1, layers // 4)}
        method = "-".join(f"{k}-{v}" for k, v in counts.items())
        key = _fingerprint("drop", _stamp_of(scored), counts, fuse, quantized)
        _stage(method, pruned, key, resume and not redo,
               lambda: drop(scored, pruned, counts=counts, force=True, fuse=fuse, quantize=quantize,
                            memory_limit=memory_limit))

    bench_base = exported
    if fuse or quantize:  # the base written the way the output is, so the bench times the rewrite alone
        bench_base = out_dir / "bench-base"
        key = _fingerprint("bench-base", _stamp_of(exported) or str(exported), fuse, quantized)
        _stage("bench base", bench_base, key, resume and not redo,
               lambda: _written_like_the_output(exported, bench_base, fuse, quantize))
    precision = "int4" if quantize else "fp32"
    notes: list[str] = []  # for the user
    reference = _builder_stage(source, out_dir / "builder", resume, precision, notes) if builder else None

    print("[eval] ...", file=sys.stderr)
    quality = [evaluate(folder, text=eval_text, samples=eval_samples, seq_len=seq_len, sampling=sampling,
                        options=options, progress=progress, memory_limit=memory_limit)
               for folder in (bench_base, pruned)]
    closeness = fidelity(bench_base, pruned, text=eval_text, samples=eval_samples, seq_len=seq_len, sampling=sampling,
                         options=options, progress=progress, memory_limit=memory_limit)
    tasks = None
    if task_items:
        print(f"[tasks] the papers' standard tasks, {task_items} items each ...", file=sys.stderr)
        tasks = standard_tasks([bench_base, pruned], ["papers"], limit=task_items,
                               options=RunOptions(options.provider, options.threads, batch_size=8), progress=progress,
                               memory_limit=memory_limit)
    print("[bench] ...", file=sys.stderr)
    from layerdrop.api.bench import bench

    speed = bench(bench_base, pruned, seqs=bench_seq, runs=bench_runs, options=one_a_run,
                  reference=reference, memory_limit=memory_limit)
    notes += [part["one_at_a_time"] for part in (closeness, speed) if "one_at_a_time" in part]
    removed = inspect(pruned)["removed"]  # read back from the output, so the report says what the file holds
    runtime, snippet = run_snippet(pruned)
    command = reproduce_command("pipeline", [model], {
        "-o": out_dir, "--calib": calib, "--eval": eval_text, "--attn": attn, "--joint": joint, "--harp": harp_top,
        "--samples": _unless(samples, DEFAULT_SAMPLES), "--seq-len": _unless(seq_len, DEFAULT_SEQ_LEN),
        "--eval-samples": _unless(eval_samples, 32), "--seq": _unless(tuple(bench_seq), (256, 1024)),
        "--runs": _unless(bench_runs, 5), "--seed": _unless(sampling.seed, 0), "--from-start": sampling.from_start,
        "--text-field": _unless(sampling.text_field, "text"), "--batch-size": _unless(options.batch_size, 1),
        "--provider": _unless(options.provider, "cpu"), "--threads": options.threads, "--no-fuse": not fuse,
        "--no-builder": not builder, "--quantize": quantize, "--task-items": _unless(task_items, 0)})
    report = {"method": method, "base": str(exported), "bench_base": str(bench_base), "fused": fuse,
              "pruned": str(pruned), "reference": str(reference) if reference else None,
              "reference_label": f"builder {precision}", "quality": quality, "bench": speed,
              "removed": removed, "removed_by_kind": removed_by_kind(removed),
              "texts": {"calibration": scored_calibration, "eval": quality[0]["text"]},
              "run": {"runtime": runtime, "folder": str(pruned), "python": snippet}, "reproduce": command,
              "notes": notes, "tasks": tasks, "fidelity": closeness}
    write_json(report, out_dir / "report.json")
    noted = "".join(f"\n- {note}" for note in notes)
    write_atomically(out_dir / "report.md", pipeline_summary(report) + (f"\n\nNotes:{noted}" if notes else "") + "\n")
    return report


def guard_pipeline(source: Path | None, memory_limit: int | None, *, copies: int, tokens: int) -> None:
    """Refuse a pipeline on `source` (an ONNX folder, a Hugging Face folder, a GGUF file, a known model's name or
    None for the default) whose peak memory, `copies` copies of its float32 weights held at once and one session's
    activations after a run of `tokens` tokens, is over `memory_limit`. A model whose files state no parameter shapes
    is not estimated here (each stage still checks its own).

    Raises:
        LayerdropError: an estimate over the limit, naming the float16 export the pipeline can start from.
    """
    if source is not None and source.is_dir() and (source / "model.onnx").is_file():
        guard_memory("pipeline", [source], memory_limit, copies=copies, tokens=tokens, running=1)
        return
    from layerdrop.api.export import parameters_of, weights_of

    weights = weights_of(source)[0]
    parameters = parameters_of(weights) if weights is not None else None
    if not parameters:
        return
    limit = memory.memory_limit(memory_limit)
    vocabulary = model_folder.config(weights).get("vocab_size", 0) if weights.is_dir() else 0
    activations = memory.activation_peak(tokens, vocabulary if isinstance(vocabulary, int) else 0)
    estimate = memory.session_peak(4 * parameters, copies) + activations
    halved = memory.session_peak(2 * parameters, copies) + activations
    name = str(source) if source is not None else "MODEL"
    fits = (f"its float16 export would need about {memory.gigabytes(halved)} (layerdrop export {name} -o OUT "
            "--dtype float16, then layerdrop pipeline OUT)") if halved <= limit else (
            "a float16 export would not fit either; run it where more memory is free")
    memory.check_memory(estimate, limit, f"pipeline on {memory.gigabytes(4 * parameters)} of float32 weights", fits)


def _unless(value, default):
    """`value`, or None where it is the command's default (so the reproduce command names only what was chosen)."""
    return None if value == default else value


def _written_like_the_output(exported: Path, folder: Path, fuse: bool, quantize: str | None) -> None:
    """The unpruned export fused and/or quantized by the same passes as the pipeline's output."""
    from layerdrop.passes.cleanup import run_passes

    source, model = model_folder.load(exported)
    passes = fusion_passes() if fuse else []
    model = run_passes(model, passes + ([quantize_pass(quantize)] if quantize else []))
    save_model(model, folder, source, force=True)


def _builder_stage(source: Path | None, folder: Path, resume: bool, precision: str, notes: list[str]) -> Path | None:
    """onnxruntime-genai's builder graph (`-p precision -e cpu`, the builder's other defaults) of the source's
    Hugging Face folder; None where onnxruntime-genai is not installed, or (with a line appended to `notes`) where
    the source has no Hugging Face folder or the builder's graph cannot be built or run."""
    from layerdrop.export.builder import builder_available, run_builder
    from layerdrop.export.default_model import resolve_source

    if not builder_available():
        return None
    hf_folder = resolve_source(source)
    if not (hf_folder.is_dir() and (hf_folder / "config.json").is_file()) or (hf_folder / "model.onnx").exists():
        notes.append(f"no Hugging Face folder for {hf_folder}; the bench has no builder column")
        return None
    key = _fingerprint("builder", str(hf_folder.resolve()), precision)
    try:
        _stage("builder", folder, key, resume, lambda: run_builder(hf_folder, folder, precision=precision))
        _runs_a_prefill(folder)
    except LayerdropError as error:
        notes.append(f"{error}; the bench has no builder column")
        return None
    return folder


def _runs_a_prefill(folder: Path) -> None:
    """Raise LayerdropError where ONNX Runtime cannot run a short prefill of the folder's graph (the builder writes
    graphs whose kernels refuse some shapes, e.g. GroupQueryAttention with a head size not a multiple of 16)."""
    import numpy as np

    from layerdrop.runtime.feeds import prefill_feed
    from layerdrop.runtime.session import make_session

    try:
        session = make_session(folder / "model.onnx")
        session.run(["logits"], prefill_feed(session, np.zeros((1, 4), dtype=np.int64)))
    except Exception as error:  # noqa: BLE001 - ONNX Runtime's own message names the kernel that refused
        raise LayerdropError(
            f"ONNX Runtime cannot run the builder's graph ({str(error).splitlines()[0][:200]})") from None
