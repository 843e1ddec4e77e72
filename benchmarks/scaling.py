"""What each stage costs as models grow: wall time, CPU time and peak memory of export, score, drop, plan (and each
of its phases), eval and bench, one fresh process each, for one or more models.

    python benchmarks/scaling.py smollm2-135m gemma3-270m qwen2.5-coder-1.5b [--quick] [--out docs/results]
    python benchmarks/scaling.py qwen2.5-coder-1.5b --builder int4 --quick
    python benchmarks/scaling.py --render-only

MODEL is anything `layerdrop export` takes (a known model's name, a Hugging Face folder, a GGUF file). Each stage runs
as `python -m layerdrop.cli ...` in its own process, so its peak resident memory (`os.wait4`'s ru_maxrss) is its
own; CPU time is user + system of that process. The plan's phases are timed from its progress lines. The table
gives, beside each figure, the model's parameters, layers and hidden size, so the cost per parameter and token can
be read off and carried to larger models. Every stage's outputs are kept under --work (default
bench-out/scaling/<model>); a stage whose output is there is run again only with --force.

With --builder int4 (or fp32) the graph is onnxruntime-genai's model builder's of the model's Hugging Face folder
instead of layerdrop's export (the first stage times the builder), the same commands run on it, and a last stage,
genai, serves the plan's output with onnxruntime-genai: greedy generation of 64 tokens after a short prompt, in its own
process, with the decode rate and the text it wrote.

The figures go to OUT/scaling.json (one entry per model and graph, each with the commit and date it was measured at;
a run on one model keeps the others' entries when sizes and machine match, and the page names each entry's commit),
and OUT/scaling.md is rendered from it alone:
the measured table, and the same stages carried on paper to 8B parameters (time and memory in proportion to
parameters, from the largest model measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


def layerdrop(args: list[str], threads: str | None) -> list[str]:
    """The command line of `layerdrop ARGS` in a fresh Python process (with --threads where the command takes it)."""
    extra = ["--threads", threads] if threads and args[0] not in ("export", "fuse") else []
    return [sys.executable, "-m", "layerdrop.cli", *args, *extra]


def run_stage(command: list[str]) -> dict:
    """One command in a fresh process: its wall and CPU seconds, peak RSS in bytes, and the plan's phases (from its
    progress lines on stderr) where it printed them.

    Raises:
        RuntimeError: the command failed (its last lines of stderr in the message).
    """
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    for line in process.stderr:  # read as it comes, so a chatty command never blocks on a full pipe
        lines.append(line.rstrip("\n"))
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{shown(command)} failed:\n" + "\n".join(lines[-15:]))
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


# the genai stage: onnxruntime-genai's own generation loop on a folder, greedy, its figures to a JSON file
SERVE = """
import json, sys, time
import onnxruntime_genai as og
folder, new, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = og.Model(folder); tokenizer = og.Tokenizer(model); params = og.GeneratorParams(model)
prompt = tokenizer.encode("def fibonacci(n):")
params.set_search_options(max_length=len(prompt) + new, do_sample=False)
generator = og.Generator(model, params)
started = time.perf_counter(); generator.append_tokens(prompt); prefill = time.perf_counter() - started
count = 0
while not generator.is_done():
    generator.generate_next_token(); count += 1
decode = time.perf_counter() - started - prefill
text = tokenizer.decode(generator.get_sequence(0)[len(prompt):])
json.dump({"prompt_tokens": len(prompt), "new_tokens": count, "prefill_s": prefill, "decode_s": decode,
           "text": text}, open(out, "w"))
"""
NEW_TOKENS = 64


def shown(command: list[str]) -> str:
    """A stage's command as a person would type it (the serving script by name)."""
    if command[1] == "-c":
        return f"onnxruntime-genai generate {' '.join(command[3:])}"
    return " ".join(["layerdrop" if a == "layerdrop.cli" else a for a in command[2:]])


def model_facts(folder: Path) -> dict:
    """Parameters (the graph's initializers' elements, a MatMulNBits weight counted as its K x N, GroupQueryAttention's
    rotary tables left out), layers, hidden size and vocabulary of an exported or built folder."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    packed, parameters = set(), 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            parameters += attrs["K"] * attrs["N"]
            packed.update(node.input[1:])  # the packed weight, its scales and zero points
        elif node.op_type == "GroupQueryAttention":
            packed.update(node.input[7:9])  # the rotary cos/sin tables: computed, not weights
    parameters += sum(int(_count(t.dims)) for t in model.graph.initializer if t.name not in packed)
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
    else:  # a builder folder: onnxruntime-genai's config holds the shape
        genai = json.loads((folder / "genai_config.json").read_text())["model"]
        config = {"num_hidden_layers": genai["decoder"].get("num_hidden_layers"),
                  "hidden_size": genai["decoder"].get("hidden_size"), "vocab_size": genai.get("vocab_size")}
    return {"parameters": parameters, "layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}


def _count(dims) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def entry_name(model: str, builder: str | None) -> str:
    """How a model's entry is named: its name, and the builder's graph where that is what was measured."""
    return f"{Path(model).name} (builder {builder})" if builder else Path(model).name


def measure(model: str, work: Path, quick: bool, threads: str | None, force: bool, builder: str | None = None) -> dict:
    """Every stage on one model, in order; each stage's figures (kept in WORK/stages.json as they finish, so a
    rerun measures only what is missing). BUILDER ("int4", "fp32"): the model builder's graph of the model's Hugging
    Face folder instead of layerdrop's export, and onnxruntime-genai serving the plan's output last."""
    s = sizes(quick)
    record = work / "stages.json"
    done = json.loads(record.read_text()) if record.is_file() and not force else {}
    export, scored = work / "export", work / "scored"
    stages = {
        "export": layerdrop(["export", model, "-o", str(export), "--force"], threads),
        "score": layerdrop(["score", str(export), "-o", str(scored), "--samples", s["samples"], "--seq-len",
                            s["seq_len"], "--force", "--no-progress"], threads),
        "drop": layerdrop(["drop", str(scored), "-o", str(work / "drop"), "--attn", "{quarter}", "--force"], threads),
        "plan": layerdrop(["plan", str(scored), "-o", str(work / "plan"), "--budget", "attn={quarter}", "--samples",
                           s["samples"], "--seq-len", s["seq_len"], *s["plan"], "--force"], threads),
        "eval": layerdrop(["eval", str(export), "--vs", str(work / "drop"), "--samples", s["eval_samples"],
                           "--seq-len", s["seq_len"], "--no-progress"], threads),
        "bench": layerdrop(["bench", str(export), str(work / "drop"), "--seq", s["seq"], "--runs", s["runs"]],
                           threads),
    }
    if builder:
        if "export" not in done:
            shutil.rmtree(export, ignore_errors=True)  # the builder adds to a folder; start from nothing
        hf = hf_folder(model)
        stages["export"] = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                            str(export), "-p", builder, "-e", "cpu", "-c", str(work / "builder-cache")]
        stages["genai"] = [sys.executable, "-c", SERVE, str(work / "plan"), str(NEW_TOKENS), str(work / "genai.json")]
    facts = None
    for name, command in stages.items():
        if facts is None and (export / "model.onnx").is_file():
            facts = model_facts(export)
        quarter = str(max(1, (facts or {}).get("layers") or 4) // 4) if facts else "1"
        if name in done:
            print(f"[{name}] measured before, kept ({record})", file=sys.stderr)
            continue
        command = [a.replace("{quarter}", quarter) for a in command]
        print(f"[{name}] {shown(command)}", file=sys.stderr, flush=True)
        done[name] = run_stage(command)
        if name == "genai":
            served = json.loads((work / "genai.json").read_text())
            done[name]["served"] = {**served, "tokens_per_s": round(served["new_tokens"] / served["decode_s"], 2)}
        if name == "export" and builder:
            shutil.rmtree(work / "builder-cache", ignore_errors=True)  # the builder's working cache: nothing to keep
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_name(record.name + ".partial")
        partial.write_text(json.dumps(done, indent=1) + "\n")
        os.replace(partial, record)
    return {"model": entry_name(model, builder), "graph": f"builder {builder}" if builder else "export",
            **(facts or model_facts(export)), "stages": done}


def hf_folder(model: str) -> Path:
    """The Hugging Face folder the model builder reads: a known model's cached folder (converted from its GGUF file
    on first use), or the folder given.

    Raises:
        RuntimeError: no Hugging Face folder for MODEL (the model is then left out, like one whose stage fails).
    """
    from layerdrop.errors import LayerdropError
    from layerdrop.export.default_model import resolve_source

    try:
        folder = resolve_source(Path(model))
    except LayerdropError as error:
        raise RuntimeError(str(error)) from None
    if not (folder / "config.json").is_file():
        raise RuntimeError(f"--builder needs a Hugging Face folder or a known model's name, not {model}")
    return folder


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


def served(results: list[dict]) -> list[str]:
    """Markdown lines: what onnxruntime-genai did with each plan's output it served (the genai stage)."""
    lines = []
    for r in results:
        serve = r["stages"].get("genai", {}).get("served")
        if serve:
            text = " ".join(serve["text"].split())[:160].replace("|", "\\|").replace("`", "'")
            lines += [f"onnxruntime-genai served the plan's output of {r['model']}: {serve['new_tokens']} tokens "
                      f"greedy after a {serve['prompt_tokens']}-token prompt at {serve['tokens_per_s']:.1f} tokens/s "
                      f"(prefill {serve['prefill_s']:.2f} s); it wrote: \"{text}\"", ""]
    return lines


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
    results = [{"commit": report["commit"], "date": report["date"], **r} for r in report["results"]]
    s = sizes(report["quick"])
    sizes_note = (f"{'quick' if report['quick'] else 'default'} sizes ({s['samples']} windows of {s['seq_len']} "
                  f"tokens to score, {s['eval_samples']} to evaluate, a plan with {' '.join(s['plan']) or 'defaults'}, "
                  f"{s['runs']} timed runs at {s['seq']} tokens)")
    commits = sorted({(r["commit"], r["date"][:10]) for r in results})
    stamp = (f"commit {commits[0][0][:10]}, {commits[0][1]}" if len(commits) == 1 else
             "; ".join(f"{', '.join(r['model'] for r in results if (r['commit'], r['date'][:10]) == c)} at commit "
                       f"{c[0][:10]}, {c[1]}" for c in commits))
    commands = []
    for graph in graphs(results):
        names = " ".join(r["model"].split(" (builder ")[0] for r in results if graph_of(r) == graph)
        option = "" if graph == "export" else f" --builder {graph.split()[1]}"
        commands.append(f"`python benchmarks/scaling.py {names}{option}{' --quick' if report['quick'] else ''}`")
    return "\n".join([
        "# What each stage costs as models grow", "",
        f"Measured on {report['machine']['cpu']} ({report['machine']['summary']}), {stamp}, layerdrop "
        f"{report['versions']['layerdrop']}, ONNX Runtime {report['versions']['onnxruntime']}, at {sizes_note}; "
        f"each stage a fresh process ({' and '.join(commands)}). Peak RSS is the process's own (ru_maxrss); a budget "
        "of a quarter of the layers for drop and plan. A builder row is onnxruntime-genai's model builder's graph of "
        "the same Hugging Face folder (its export stage is the builder), rewritten by the same commands, and its "
        "genai stage serves the plan's output with onnxruntime-genai.", "",
        table(results), "", *served(results), *carried(results)])


def graph_of(result: dict) -> str:
    """What an entry measured: "export" (layerdrop's) or "builder int4" / "builder fp32"."""
    return result.get("graph", "export")


def graphs(results: list[dict]) -> list[str]:
    """The kinds of graph measured, layerdrop's export first."""
    return sorted({graph_of(r) for r in results}, key=lambda g: (g != "export", g))


CARRIED = {
    "export": "a forward's multiply-adds and a float32 session's bytes both grow about linearly with them; a drop "
              "reads no weights and stays as measured (a large vocabulary's head and the tokenizer's fixed costs make "
              "the smaller models cost more per parameter, so this is a bound for models with a smaller share of "
              "head). Stages over the machine's memory need `--dtype float16` or a builder int4 graph, or a larger "
              "machine; on one GPU a forward takes milliseconds and session builds dominate.",
    "builder": "its weights take about a quarter of the float32 bytes (the embedding stays float), so more stages "
               "fit; the builder's conversion itself reads the float32 folder (its export row).",
}


def carried(results: list[dict]) -> list[str]:
    """Markdown lines: for each kind of graph, its largest model's stages carried to 8B parameters (`on_paper`)."""
    lines = ["## Carried to 8B on paper", ""]
    for graph in graphs(results):
        largest = max((r for r in results if graph_of(r) == graph), key=lambda r: r["parameters"])
        lines += [f"From {largest['model']}, in proportion to parameters at the same windows: "
                  f"{CARRIED[graph.split()[0]]}", "", on_paper(largest), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="known model names, Hugging Face folders or GGUF files")
    parser.add_argument("--quick", action="store_true", help="few windows and runs: a quick look, not the table")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "scaling")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results",
                        help="where scaling.json and scaling.md go")
    parser.add_argument("--threads")
    parser.add_argument("--force", action="store_true", help="measure every stage again")
    parser.add_argument("--builder", choices=("int4", "fp32"),
                        help="onnxruntime-genai's model builder graph of each model instead of layerdrop's export")
    parser.add_argument("--render-only", action="store_true", help="no measurement: render OUT/scaling.json")
    args = parser.parse_args(argv)
    record = args.out / "scaling.json"
    failed: list[str] = []
    if args.render_only:
        if not record.is_file():
            parser.error(f"{record} does not exist: run the measurement first")
        report = json.loads(record.read_text())
    else:
        if not args.models:
            parser.error("name at least one model (or --render-only)")
        report = {**provenance(), "quick": args.quick}
        results = []
        for m in args.models:  # a model that fails is reported and left out; the others are still written
            work = args.work / (Path(m).name + (f"-builder-{args.builder}" if args.builder else ""))
            try:
                results.append({**measure(m, work, args.quick, args.threads, args.force, args.builder),
                                "commit": report["commit"], "date": report["date"]})
            except RuntimeError as error:
                failed.append(m)
                print(f"scaling: {m} left out: {error}", file=sys.stderr)
        old = json.loads(record.read_text()) if record.is_file() else {}
        # the others' figures stay where measured at the same sizes on the same machine (the page names each commit)
        same = all(old.get(k) == report[k] for k in ("quick", "machine"))
        kept = [{"commit": old["commit"], "date": old["date"], **r} for r in old.get("results", [])
                if same and r["model"] not in {n["model"] for n in results}]
        report["results"] = kept + results
        if not report["results"]:
            print("scaling: nothing measured, nothing written", file=sys.stderr)
            return 1
        write_atomic(record, json.dumps(report, indent=1) + "\n")
    # by size, and a model's own export before the builder's graph of it
    report["results"].sort(key=lambda r: (round(r["parameters"], -7), graph_of(r) != "export"))
    write_atomic(args.out / "scaling.md", render(report))
    print(f"*{report['machine']['summary']}; {report['date'][:10]}{'; quick sizes' if report['quick'] else ''}*\n")
    print(table(report["results"]))
    print(f"scaling: wrote {record} and {args.out / 'scaling.md'}", file=sys.stderr)
    if failed:
        print(f"scaling: not measured: {', '.join(failed)} (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
