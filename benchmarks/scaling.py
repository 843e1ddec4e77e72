"""What each stage costs as models grow: wall time, CPU time and peak memory of export, score, drop, plan (and each
of its phases), eval and bench, one fresh process each, for one or more models.

    python benchmarks/scaling.py smollm2-135m gemma3-270m qwen2.5-coder-1.5b [--quick] [--out docs/results]
    python benchmarks/scaling.py --render-only

MODEL is anything `layerdrop export` takes (a known model's name, a Hugging Face folder, a GGUF file). Each stage runs
as `python -m layerdrop.cli ...` in its own process, so its peak resident memory (`os.wait4`'s ru_maxrss) is its
own; CPU time is user + system of that process. The plan's phases are timed from its progress lines. The table
gives, beside each figure, the model's parameters, layers and hidden size, so the cost per parameter and token can
be read off and carried to larger models. Every stage's outputs are kept under --work (default
bench-out/scaling/<model>); a stage whose output is there is run again only with --force.

The figures go to OUT/scaling.json (one entry per model, with the machine, date, commit and versions; a run on one
model keeps the others' entries when sizes, commit and machine match), and OUT/scaling.md is rendered from it alone:
the measured table, and the same stages carried on paper to 8B parameters (time and memory in proportion to
parameters, from the largest model measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from reproduce import provenance, write_atomic

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"layerdrop plan: \[(\d+)/\d+\] (.*) \((\d+) s in\)")


def sizes(quick: bool) -> dict:
    """Windows and runs of each stage: the commands' defaults, or a small version for a quick look."""
    if quick:
        return {"samples": "8", "seq_len": "128", "eval_samples": "8", "seq": "128", "runs": "2",
                "plan": ["--search-samples", "4", "--fit-samples", "8", "--extra", "1", "--accuracy-items", "0",
                         "--validation-items", "0", "--validation-samples", "4", "--eval-samples", "8"]}
    return {"samples": "64", "seq_len": "256", "eval_samples": "32", "seq": "256,1024", "runs": "5", "plan": []}


def run_stage(args: list[str], threads: str | None) -> dict:
    """One `layerdrop` command in a fresh process: its wall and CPU seconds, peak RSS in bytes, and the plan's
    phases (from its progress lines on stderr) where it printed them.

    Raises:
        RuntimeError: the command failed (its last lines of stderr in the message).
    """
    extra = ["--threads", threads] if threads and args[0] not in ("export", "fuse") else []
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "layerdrop.cli", *args, *extra], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    for line in process.stderr:  # read as it comes, so a chatty command never blocks on a full pipe
        lines.append(line.rstrip("\n"))
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"layerdrop {' '.join(args)} failed:\n" + "\n".join(lines[-15:]))
    phases, previous = [], None
    for line in lines:
        found = PHASE.search(line)
        if found:
            at = int(found.group(3))
            if previous is not None:
                phases[-1]["seconds"] = at - previous
            phases.append({"phase": found.group(2), "started_s": at})
            previous = at
    if phases:
        phases[-1]["seconds"] = round(wall) - previous
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024, **({"phases": phases} if phases else {})}


def model_facts(folder: Path) -> dict:
    """Parameters (the exported initializers' elements), layers, hidden size and vocabulary of an export."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    parameters = sum(int(_count(t.dims)) for t in model.graph.initializer)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    return {"parameters": parameters, "layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}


def _count(dims) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def measure(model: str, work: Path, quick: bool, threads: str | None, force: bool) -> dict:
    """Every stage on one model, in order; each stage's figures (kept in WORK/stages.json as they finish, so a
    rerun measures only what is missing)."""
    s = sizes(quick)
    record = work / "stages.json"
    done = json.loads(record.read_text()) if record.is_file() and not force else {}
    export, scored = work / "export", work / "scored"
    stages = {
        "export": ["export", model, "-o", str(export), "--force"],
        "score": ["score", str(export), "-o", str(scored), "--samples", s["samples"], "--seq-len", s["seq_len"],
                  "--force", "--no-progress"],
        "drop": ["drop", str(scored), "-o", str(work / "drop"), "--attn", "{quarter}", "--force"],
        "plan": ["plan", str(scored), "-o", str(work / "plan"), "--budget", "attn={quarter}", "--samples",
                 s["samples"], "--seq-len", s["seq_len"], *s["plan"], "--force"],
        "eval": ["eval", str(export), "--vs", str(work / "drop"), "--samples", s["eval_samples"], "--seq-len",
                 s["seq_len"], "--no-progress"],
        "bench": ["bench", str(export), str(work / "drop"), "--seq", s["seq"], "--runs", s["runs"]],
    }
    facts = None
    for name, args in stages.items():
        if facts is None and (export / "model.onnx").is_file():
            facts = model_facts(export)
        quarter = str(max(1, (facts or {}).get("layers") or 4) // 4) if facts else "1"
        if name in done:
            print(f"[{name}] measured before, kept ({record})", file=sys.stderr)
            continue
        print(f"[{name}] layerdrop {' '.join(a.replace('{quarter}', quarter) for a in args)}", file=sys.stderr,
              flush=True)
        done[name] = run_stage([a.replace("{quarter}", quarter) for a in args], threads)
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_name(record.name + ".partial")
        partial.write_text(json.dumps(done, indent=1) + "\n")
        os.replace(partial, record)
    return {"model": model, **(facts or model_facts(export)), "stages": done}


def table(results: list[dict]) -> str:
    """Markdown: one row per model and stage (the plan's phases below it), with the model's size beside."""
    lines = ["| model | parameters | layers | hidden | stage | wall s | CPU s | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['model']} | {r['parameters'] / 1e9:.2f}B | {r['layers']} | {r['hidden_size']} |"
        for name, stage in r["stages"].items():
            lines.append(f"{head} {name} | {stage['wall_s']:.0f} | {stage['cpu_s']:.0f} | "
                         f"{stage['peak_rss_bytes'] / 1e9:.2f} |")
            for phase in stage.get("phases", []):
                lines.append(f"| | | | | plan: {phase['phase']} | {phase['seconds']} | | |")
    return "\n".join(lines)


READS_NO_WEIGHTS = {"drop"}  # rewrites the graph without loading its weights: its cost does not grow with them


def on_paper(largest: dict, parameters: float = 8e9, memory_gb: float = 24.0) -> str:
    """Markdown: each stage of the largest model measured carried to PARAMETERS in proportion to parameters (the
    same windows and tokens; a forward's multiply-adds and a float32 session's bytes both grow with them), and
    whether its peak memory would fit MEMORY_GB. A stage that reads no weights is carried as measured."""
    factor = parameters / largest["parameters"]
    lines = [f"| stage | {largest['model']} wall s | {parameters / 1e9:.0f}B wall s (on paper) | "
             f"{largest['model']} peak RSS GB | {parameters / 1e9:.0f}B peak RSS GB (on paper) | "
             f"fits {memory_gb:.0f} GB |", "|---|---|---|---|---|---|"]
    for name, stage in largest["stages"].items():
        grows = 1.0 if name in READS_NO_WEIGHTS else factor
        rss = stage["peak_rss_bytes"] / 1e9
        lines.append(f"| {name} | {stage['wall_s']:.0f} | {stage['wall_s'] * grows:.0f} | {rss:.2f} | "
                     f"{rss * grows:.1f} | {'yes' if rss * grows <= memory_gb else 'no'} |")
    return "\n".join(lines)


def render(report: dict) -> str:
    """OUT/scaling.md: where and how it was measured, the table, and the stages carried to 8B."""
    results = report["results"]
    s = sizes(report["quick"])
    sizes_note = (f"{'quick' if report['quick'] else 'default'} sizes ({s['samples']} windows of {s['seq_len']} "
                  f"tokens to score, {s['eval_samples']} to evaluate, a plan with {' '.join(s['plan']) or 'defaults'}, "
                  f"{s['runs']} timed runs at {s['seq']} tokens)")
    largest = max(results, key=lambda r: r["parameters"])
    return "\n".join([
        "# What each stage costs as models grow", "",
        f"Measured on {report['machine']['cpu']} ({report['machine']['summary']}), {report['date'][:10]}, commit "
        f"{report['commit'][:10]}, layerdrop {report['versions']['layerdrop']}, ONNX Runtime "
        f"{report['versions']['onnxruntime']}, at {sizes_note}; each stage a fresh process (`python "
        f"benchmarks/scaling.py {' '.join(r['model'] for r in results)}{' --quick' if report['quick'] else ''}`). "
        "Peak RSS is the process's own (ru_maxrss); a budget of a quarter of the layers for drop and plan.", "",
        table(results), "",
        "## Carried to 8B on paper", "",
        f"From {largest['model']}, in proportion to parameters at the same windows: a forward's multiply-adds and a "
        "float32 session's bytes both grow about linearly with them; a drop reads no weights and stays as measured "
        "(a large vocabulary's head and the tokenizer's "
        "fixed costs make the smaller models cost more per parameter, so this is a bound for models with a "
        "smaller share of head). Stages over the machine's memory need `--dtype float16` or a builder int4 graph, "
        "or a larger machine; on one GPU a forward takes milliseconds and session builds dominate.", "",
        on_paper(largest), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="known model names, Hugging Face folders or GGUF files")
    parser.add_argument("--quick", action="store_true", help="few windows and runs: a quick look, not the table")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "scaling")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results",
                        help="where scaling.json and scaling.md go")
    parser.add_argument("--threads")
    parser.add_argument("--force", action="store_true", help="measure every stage again")
    parser.add_argument("--render-only", action="store_true", help="no measurement: render OUT/scaling.json")
    args = parser.parse_args(argv)
    record = args.out / "scaling.json"
    if args.render_only:
        if not record.is_file():
            parser.error(f"{record} does not exist: run the measurement first")
        report = json.loads(record.read_text())
    else:
        if not args.models:
            parser.error("name at least one model (or --render-only)")
        results = [measure(m, args.work / Path(m).name, args.quick, args.threads, args.force) for m in args.models]
        report = {**provenance(), "quick": args.quick}
        old = json.loads(record.read_text()) if record.is_file() else {}
        # the others' figures stay only where the page's one stamp holds for them too
        same = all(old.get(k) == report[k] for k in ("quick", "commit", "machine"))
        kept = [r for r in old.get("results", []) if same and r["model"] not in {n["model"] for n in results}]
        report["results"] = kept + results
        write_atomic(record, json.dumps(report, indent=1) + "\n")
    report["results"].sort(key=lambda r: r["parameters"])
    write_atomic(args.out / "scaling.md", render(report))
    print(f"*{report['machine']['summary']}; {report['date'][:10]}{'; quick sizes' if report['quick'] else ''}*\n")
    print(table(report["results"]))
    print(f"scaling: wrote {record} and {args.out / 'scaling.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
