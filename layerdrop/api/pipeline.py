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

from layerdrop.api.common import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, write_json
from layerdrop.api.drop import drop
from layerdrop.api.evaluate import evaluate
from layerdrop.api.harp import harp
from layerdrop.api.inspect import inspect
from layerdrop.api.reports import side_by_side
from layerdrop.api.score import score
from layerdrop.errors import LayerdropError
from layerdrop.model_folder import write_atomically
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
    batch_size: int = 1,
    provider: str = "cpu",
    threads: int | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    fuse: bool = False,
    quantize: str | None = None,
) -> dict:
    """Run the whole pipeline; returns the side-by-side report (also written to OUTDIR/report.json and .md).

    With no selection, drops about a quarter of the attention layers by score.

    Raises:
        LayerdropError: conflicting selections, or an OUTDIR that holds other files without --force/--resume.
    """
    if sum(x is not None for x in (attn, joint, harp_top)) > 1:
        raise LayerdropError("choose one of --attn, --joint, --harp")
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (resume or force):
        raise LayerdropError(f"{out_dir} is not empty; pass --resume to reuse its stages or --force to redo them")
    out_dir.mkdir(parents=True, exist_ok=True)
    exported, scored, pruned = out_dir / "export", out_dir / "scored", out_dir / "pruned"
    redo = not resume

    source = Path(model) if model else None
    key = _fingerprint("export", str(source.resolve()) if source else "default")
    if source is not None and source.is_dir() and (source / "model.onnx").is_file():
        exported = source  # already an ONNX folder: start from it
    else:
        def export() -> None:
            from layerdrop.api.export import export as export_model
            export_model(source, exported, kv_cache=True, force=True)
        redo |= _stage("export", exported, key, resume, export)

    key = _fingerprint("score", _stamp_of(exported) or str(exported), _file_digest(calib), samples, seq_len,
                       sampling)
    redo |= _stage("score", scored, key, resume and not redo, lambda: score(
        exported, scored, calib=calib, samples=samples, seq_len=seq_len, sampling=sampling, provider=provider,
        threads=threads, force=True, progress=progress))

    layers = int(inspect(scored)["regions"][-1]["layer"]) + 1
    if harp_top is not None:
        method = f"harp-{harp_top}"
        key = _fingerprint("harp", _stamp_of(scored), harp_top, _file_digest(calib), sampling, fuse, quantize)
        _stage(method, pruned, key, resume and not redo, lambda: harp(
            scored, pruned, top=harp_top, search=True, search_text=calib, sampling=sampling, batch_size=batch_size,
            provider=provider,
            threads=threads, force=True, progress=progress, fuse=fuse, quantize=quantize))
    else:
        counts = {"joint": joint} if joint is not None else {"attn": attn if attn is not None else max(1, layers // 4)}
        method = "-".join(f"{k}-{v}" for k, v in counts.items())
        key = _fingerprint("drop", _stamp_of(scored), counts, fuse, quantize)
        _stage(method, pruned, key, resume and not redo,
               lambda: drop(scored, pruned, counts=counts, force=True, fuse=fuse, quantize=quantize))

    print("[eval] ...", file=sys.stderr)
    quality = [evaluate(folder, text=eval_text, samples=eval_samples, seq_len=seq_len, sampling=sampling,
                        batch_size=batch_size, provider=provider, threads=threads, progress=progress)
               for folder in (exported, pruned)]
    print("[bench] ...", file=sys.stderr)
    from layerdrop.api.bench import bench

    speed = bench(exported, pruned, seqs=bench_seq, runs=bench_runs, provider=provider, threads=threads)
    report = {"method": method, "base": str(exported), "pruned": str(pruned), "quality": quality, "bench": speed}
    write_json(report, out_dir / "report.json")
    write_atomically(out_dir / "report.md", side_by_side(speed, method, quality) + "\n")
    return report
