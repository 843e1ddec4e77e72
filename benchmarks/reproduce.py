"""Reproduce the results tables of the README and docs/results/ in one command.

    python benchmarks/reproduce.py --model smollm2 [--quick] [--only pipeline,planner,criteria,deploy]
    python benchmarks/reproduce.py --model smollm2 --render-only

Each section runs the `layerdrop` commands a user would (printed as they run), keeps their outputs under
--work, and writes what it measured to OUT/<model>/<section>.json with the machine, date, commit, the versions
of layerdrop and ONNX Runtime, the commands, and the texts (file, hash, window starts) each figure used. The
Markdown is rendered from those JSON files only: OUT/<model>/README.md, and the README's headline table between
`<!-- results:<model> begin -->` and `<!-- results:<model> end -->`.

Sections:
  pipeline  `layerdrop pipeline` (a quarter of the attention layers dropped), HARP on as many top layers with
            searched alphas, and the planner at the same count, side by side: perplexity on the held-out prose and
            on texts of other kinds, accuracy on the planner's multiple-choice items, prefill, decode, KV cache bytes,
            file bytes (every output fused as the pipeline writes it), and peak memory while generating.
  planner   the planner's default plan at attn=N calibrated on the mixed text (held out on prose, docs, code and
            the dictionary), and the speedup plan (25% less prefill time, fitted maps and block moves allowed).
  criteria  the plan at attn=N calibrated on prose alone, held out on prose, docs, code and the dictionary: which
            row each pick criterion takes, against the best paper row (on the mix: the planner section).
  deploy    `layerdrop pipeline` fp32 and `--quantize int4` against onnxruntime-genai's model builder graph of the
            same model, with the deployment goals (the fused export within 1.1x of the builder graph's time;
            each pruned output at 0.95 of the drop's ideal speedup or more), and the builder's own int4 graph
            scored and with the same attention drop written by layerdrop (graphs in).

A section whose JSON holds the same commit (the last that changed the package) and arguments is skipped unless
--force, and a command already done at that commit is not run again, so a crash loses at most the running command
(with uncommitted changes under layerdrop/ nothing is skipped). --quick runs a small version (few windows, one timed
run) in minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("pipeline", "planner", "blocks", "speedup", "criteria", "deploy")
MODELS = {  # the known model each name stands for, the planner section's budget, and its extra plan options
    "smollm2": {"source": "smollm2-135m", "planner_attn": 8, "plan_args": []},
    "gemma3": {"source": "gemma3-270m", "planner_attn": 4,
               "plan_args": ["--extra", "2", "--search-samples", "4", "--fit-samples", "16"]},
    # 28 attention layers; its plans take hours on 2 cores, so sections span sessions (a stopped plan goes on)
    "qwen2.5-coder": {"source": "qwen2.5-coder-1.5b", "planner_attn": 7,
                      "plan_args": ["--extra", "2", "--search-samples", "4", "--fit-samples", "16"]},
}
OTHER_KINDS = {"docs": "technical writing", "code": "code"}  # held-out texts of other kinds than the calibration
SPEEDUP = "1.333"  # the speedup plan's budget: 25% less prefill time


def sizes(quick: bool) -> dict:
    """Windows, runs and lengths of every command: the README's (the commands' defaults) or a small version."""
    if not quick:
        return {"samples": 64, "seq_len": 256, "eval_samples": 32, "search_samples": 8, "seq": "256,1024",
                "runs": 5, "decode": 32, "generation": "8,2048,64", "speedup_tokens": 1024, "task_items": 300,
                "quick": []}
    return {"samples": 8, "seq_len": 128, "eval_samples": 8, "search_samples": 4, "seq": "256", "runs": 2,
            "decode": 8, "generation": "1,256,8", "speedup_tokens": 256, "task_items": 4,
            "quick": ["--search-samples", "4", "--fit-samples", "8", "--extra", "1", "--accuracy-items", "20",
                      "--validation-items", "10", "--speedup-runs", "1", "--samples", "8", "--eval-samples", "8",
                      "--seq-len", "128"]}


class Runner:
    """Runs `layerdrop` commands for one section and keeps their lines and times. A command that finished at this
    commit (recorded in WORK/steps.json) and whose outputs are there is not run again, so a rerun after a crash
    resumes within a section; a plan that started at this commit and did not finish goes on from its checkpoints
    (`plan --resume`), so a section of several hours can be stopped and continued; `fresh` runs every command."""

    def __init__(self, threads: str, work: Path, commit: str, fresh: bool):
        self.threads, self.commit, self.fresh = threads, commit, fresh
        self.record = work / "steps.json"
        self.commands: list[str] = []
        self.seconds: dict[str, float] = {}
        self.resumed: list[str] = []  # steps that went on from checkpoints (the time counted is the last part's)

    def __call__(self, name: str, *args: str) -> None:
        line = "layerdrop " + " ".join(args)
        self.commands.append(line)
        done = read(self.record) if self.record.exists() else {}
        outputs = [Path(args[i + 1]) for i, a in enumerate(args) if a in ("-o", "--json")]
        previous = done.get(line)
        same = not self.fresh and previous is not None and previous["commit"] == self.commit
        if same and "seconds" in previous and all(p.exists() for p in outputs):
            print(f"$ {line}  (done at this commit, skipped)", file=sys.stderr, flush=True)
            self.seconds[name] = previous["seconds"]
            return
        resume = ["--resume"] if args[0] == "plan" and same and "seconds" not in previous else []
        if resume:
            self.resumed.append(name)
        print(f"$ {line}" + ("  (going on from the checkpoints of its run at this commit)" if resume else ""),
              file=sys.stderr, flush=True)
        write_atomic(self.record, json.dumps({**done, line: {"commit": self.commit}}, indent=1) + "\n")
        started = time.perf_counter()
        common = [] if args[0] in ("export", "fuse") else ["--threads", self.threads, "--no-progress"]
        subprocess.run([sys.executable, "-m", "layerdrop.cli", *args, *common, *resume], check=True)
        self.seconds[name] = round(time.perf_counter() - started, 1)
        done = read(self.record) if self.record.exists() else {}
        write_atomic(self.record, json.dumps({**done, line: {"commit": self.commit, "seconds": self.seconds[name]}},
                                             indent=1) + "\n")


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def slim_plan(report: dict) -> dict:
    """plan.json without the multiple-choice items' text (kept as their count and hash)."""
    task = report.pop("accuracy_task", None)
    if task is not None:
        report["accuracy_task_sha256"] = hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()
    return report


def export_folder(work: Path, source: str, run: Runner) -> Path:
    """The pipeline section's export when it is there, else a new one."""
    for folder in (work / "pipeline" / "pipeline" / "export", work / "export"):
        if (folder / "model.onnx").exists():
            return folder
    run("export", "export", source, "-o", str(work / "export"), "--force")
    return work / "export"


def section_pipeline(work: Path, source: str, config: dict, s: dict, run: Runner) -> dict:
    out = work / "pipeline"
    pipeline = out / "pipeline"
    windows = ["--samples", str(s["samples"]), "--seq-len", str(s["seq_len"])]
    run("pipeline", "pipeline", source, "-o", str(pipeline), "--resume", "--calib", "prose", *windows,
        "--eval-samples", str(s["eval_samples"]), "--seq", s["seq"], "--runs", str(s["runs"]), "--no-builder")
    report = read(pipeline / "report.json")
    count = report["method"].split("-")[-1]  # "attn-N"
    scored = str(pipeline / "scored")
    run("harp", "harp", scored, "-o", str(out / "harp"), "--top", count, "--search", "--search-text", "prose",
        "--samples", str(s["search_samples"]), "--seq-len", str(s["seq_len"]), "--fuse", "--force",
        "--json", str(out / "harp.json"))
    run("plan", "plan", scored, "-o", str(out / "plan"), "--budget", f"attn={count}", "--calib", "prose",
        *config["plan_args"], *s["quick"], "--force", "--json", str(out / "plan.json"))
    run("fuse plan", "fuse", str(out / "plan"), "-o", str(out / "plan-fused"), "--force")
    folders = {"base": pipeline / "bench-base", "drop": pipeline / "pruned", "harp": out / "harp",
               "plan": out / "plan-fused"}
    evals = {}
    for kind in ("eval", *OTHER_KINDS):  # every output on the same windows of each held-out text
        for first, second in (("base", "drop"), ("harp", "plan")):
            path = out / f"eval-{kind}-{first}.json"
            run(f"eval {kind} {first}", "eval", str(folders[first]), "--vs", str(folders[second]), "--text", kind,
                "--samples", str(s["eval_samples"]), "--seq-len", str(s["seq_len"]), "--json", str(path))
            models = read(path)["models"]
            evals.setdefault(kind, {}).update({first: models[0], second: models[1]})
    benches = {}
    for name in ("drop", "harp", "plan"):
        path = out / f"bench-{name}.json"
        run(f"bench {name}", "bench", str(folders["base"]), str(folders[name]), "--seq", s["seq"], "--runs",
            str(s["runs"]), "--decode", str(s["decode"]), "--json", str(path))
        benches[name] = read(path)
    path = out / "generation-drop.json"
    run("generation memory", "bench", str(folders["base"]), str(folders["drop"]), "--seq", s["seq"].split(",")[0],
        "--runs", "1", "--decode", "4", "--generation-memory", s["generation"], "--json", str(path))
    return {"count": int(count), "pipeline": report, "eval": evals, "bench": benches,
            "harp": read(out / "harp.json"), "plan": slim_plan(read(out / "plan.json")),
            "generation_memory": read(path)["generation_memory"]}


def scored_model(work: Path, source: str, s: dict, run: Runner) -> Path:
    """The planner sections' scored export (scores on the mix), made once."""
    out = work / "planner"
    export = export_folder(work, source, run)
    run("score", "score", str(export), "-o", str(out / "scored"), "--calib", "calib", "--samples", str(s["samples"]),
        "--seq-len", str(s["seq_len"]), "--force", "--json", str(out / "score.json"))
    return out / "scored"


def held_out_plan(step: str, name: str, scored: Path, calib: str, config: dict, s: dict, run: Runner,
                  budget: str) -> dict:
    """`plan --budget BUDGET --calib CALIB -o NAME`, held out on prose, docs, code and the dictionary and on the
    first items of each of the papers' tasks; its plan.json."""
    out = scored.parent
    run(step, "plan", str(scored), "-o", str(out / name), "--budget", budget, "--calib", calib,
        *config["plan_args"], *s["quick"], "--also-eval", "docs", "--also-eval", "code", "--also-eval", "dictionary",
        "--task-items", str(s["task_items"]), "--force", "--json", str(out / f"{name}.json"))
    return slim_plan(read(out / f"{name}.json"))


def section_planner(work: Path, source: str, config: dict, s: dict, run: Runner, attn: int) -> dict:
    """The default plan: a quarter of the attention layers (attn=N), calibrated on the mix."""
    scored = scored_model(work, source, s, run)
    return {"default": held_out_plan("plan default", "plan", scored, "calib", config, s, run, f"attn={attn}")}


def section_blocks(work: Path, source: str, config: dict, s: dict, run: Runner, count: int) -> dict:
    """The block plan: a quarter of the blocks (as many as the attention plans' layers), ShortGPT's drop against
    ReplaceMe's fitted run, calibrated on the mix, with the same held-out texts and tasks."""
    scored = scored_model(work, source, s, run)
    return {"blocks": held_out_plan("plan blocks", "blocks", scored, "calib", config, s, run, f"blocks={count}")}


def section_speedup(work: Path, source: str, config: dict, s: dict, run: Runner) -> dict:
    """The speedup plan: 25% less prefill time, block moves and fitted maps allowed."""
    scored = scored_model(work, source, s, run)
    run("plan speedup", "plan", str(scored), "-o", str(scored.parent / "speedup"), "--budget",
        f"speedup={SPEEDUP}@{s['speedup_tokens']}", "--moves", "blocks,fit", *s["quick"], "--also-eval", "docs",
        "--also-eval", "code", "--task-items", str(s["task_items"]), "--force", "--json",
        str(scored.parent / "speedup.json"))
    return {"speedup": slim_plan(read(scored.parent / "speedup.json"))}


def section_criteria(work: Path, source: str, config: dict, s: dict, run: Runner, attn: int) -> dict:
    """The plan at attn=N calibrated on one kind (prose), held out on prose, docs, code and the dictionary: every
    row's validation evidence and which row each pick criterion takes (calibrated on the mix: the planner
    section's default plan)."""
    scored = scored_model(work, source, s, run)
    return {"prose": held_out_plan("plan prose", "plan-prose", scored, "prose", config, s, run, f"attn={attn}")}


def held_out_files(plan: dict) -> list[str]:
    """The file names of the plan's held-out texts: the eval text, then the --also-eval texts."""
    return [plan["eval_text"]["file"], *(t["file"] for t in plan.get("also_eval_texts", []))]


DROPPED_KINDS = ("model's own text",)  # validation kinds plans measured before and no longer do


def current_picks(plan: dict) -> dict[str, str]:
    """The row each pick criterion of this layerdrop takes among the plan's measured rows (those its moves allow):
    plan.json's own `picks` are those of the version that measured it."""
    from layerdrop.api.plan import PlanRow, choose_pick

    names = {f.name for f in dataclasses.fields(PlanRow)}
    empty = {"method": "baseline", "alphas": {}, "fits": [], "shift": False, "ridges": {}, "blocks": [],
             "replaced_into": None, "run_ridge": None, "moves": [], "kv_kept": 1.0}

    def as_row(entry: dict) -> PlanRow:
        row = PlanRow(**{**empty, **{k: v for k, v in entry.items() if k in names}})
        if row.validation_ppl:  # a kind this version no longer measures (see docs/design.md) is not evidence
            row.validation_ppl = {k: v for k, v in row.validation_ppl.items() if k not in DROPPED_KINDS} or None
        return row

    rows = [as_row(m) for m in plan["methods"] if set(m["moves"]) <= set(plan["moves"])]
    return choose_pick(rows, as_row(plan["baseline"]), plan.get("criterion", "guarded"))[2]


def render_criteria_table(plan: dict) -> str:
    """Each criterion's pick and the best paper row on every held-out text, as a ratio to the baseline's
    perplexity, with the accuracy column and the papers' tasks."""
    from layerdrop.api.reports import tasks_cell

    texts = held_out_files(plan)
    base = plan["baseline"]
    rows = {m["method"]: m for m in plan["methods"]}

    def held(row: dict) -> list[float]:
        also = row.get("also_eval_ppl", {})
        return [row["eval_ppl"], *(also[t] for t in texts[1:])]

    def spread(row: dict) -> float:  # the mean log ratio to the baseline over the held-out texts
        pairs = list(zip(held(row), held(base)))
        return sum(math.log(mine / theirs) for mine, theirs in pairs) / len(pairs)

    def cells(row: dict) -> list[str]:
        ratios = [f"{mine / theirs:.3f}" for mine, theirs in zip(held(row), held(base))]
        accuracy = [f"{100 * row['accuracy']:.1f}"] if plan.get("accuracy_items") else []
        tasks = [tasks_cell(row, base, True)] if plan.get("task_items") else []
        return ratios + [f"{math.exp(spread(row)):.3f}"] + accuracy + tasks

    head = ["row", "chosen by", *(f"held-out ppl / baseline ({t})" for t in texts), "geometric mean"]
    head += [f"accuracy, {plan['accuracy_items']} items, %"] if plan.get("accuracy_items") else []
    head += ([f"papers' tasks, {plan['task_items']} items each: average % (retained, chance-adjusted)"]
             if plan.get("task_items") else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    papers = [m for m in plan["methods"] if m.get("paper")]
    best = min(papers, key=spread, default=None)
    if best is not None:
        lines.append(f"| {best['method']} | best paper row on the held-out texts (hindsight) | "
                     + " | ".join(cells(best)) + " |")
    picks = current_picks(plan)
    for method in dict.fromkeys(picks.values()):
        chooser = ", ".join(f"**{n}**" if n == plan.get("criterion") else n for n, m in picks.items() if m == method)
        lines.append(f"| {method} | {chooser} | " + " | ".join(cells(rows[method])) + " |")
    return "\n".join(lines)


def render_criteria(data: dict) -> str:
    from layerdrop.api.reports import validation_count, validation_items_text

    plan = data["results"]["prose"]
    kinds = ", ".join(plan.get("validation_texts", {})) or "none"
    return "\n\n".join([
        f"Calibrated on prose alone ({plan['budget']}; scores on the mix); validation kinds: {kinds}; validation task "
        f"items: {validation_count(plan)}, {validation_items_text(plan)}. Held out: "
        f"{plan['eval_text'].get('samples')} windows of {plan['eval_text'].get('seq_len')} tokens of each text; "
        f"accuracy: {plan.get('accuracy_items', 0)} multiple-choice next-token items built from "
        f"{plan['eval_text']['file']}. Each criterion's pick, and the paper row that did best on the held-out texts "
        "(known only in hindsight):",
        render_criteria_table(plan), *written_note(plan), "Every row:", render_plan(plan), *render_tasks(plan)])


def written_note(plan: dict) -> list[str]:
    """A line where the plan that measured the rows wrote another pick than this version's criterion takes."""
    now = current_picks(plan).get(plan.get("criterion", "guarded"))
    if now is None or now == plan["pick"]["method"]:
        return []
    return [f"The plan that measured these rows ran an earlier form of the `{plan.get('criterion')}` criterion and "
            f"wrote {plan['pick']['method']}; the criteria above are this version's, applied to the same rows."]


def section_deploy(work: Path, source: str, config: dict, s: dict, run: Runner) -> dict:
    out = work / "deploy"
    reports = {}
    for name, extra in (("fp32", []), ("int4", ["--quantize", "int4"])):
        folder = out / name
        for stage in ("export", "scored"):  # the pipeline section's stages, when there: their stamps say what
            earlier = work / "pipeline" / "pipeline" / stage
            if earlier.exists() and not (folder / stage).exists():
                shutil.copytree(earlier, folder / stage)
        run(f"pipeline {name}", "pipeline", source, "-o", str(folder), "--resume", "--calib", "prose",
            "--samples", str(s["samples"]), "--seq-len", str(s["seq_len"]), "--eval-samples", str(s["eval_samples"]),
            "--seq", s["seq"], "--runs", str(s["runs"]), *extra)
        reports[name] = read(folder / "report.json")
    builder = reports["int4"].get("reference")
    if builder:  # graphs in: the builder's own int4 graph scored and rewritten by layerdrop
        count = reports["int4"]["method"].split("-")[-1]
        run("score builder int4", "score", builder, "-o", str(out / "builder-scored"), "--calib", "prose",
            "--samples", str(s["samples"]), "--seq-len", str(s["seq_len"]), "--force")
        run("drop builder int4", "drop", str(out / "builder-scored"), "-o", str(out / "builder-dropped"), "--attn",
            count, "--force")
        run("eval builder int4", "eval", builder, "--vs", str(out / "builder-dropped"), "--samples",
            str(s["eval_samples"]), "--seq-len", str(s["seq_len"]), "--json", str(out / "eval-builder.json"))
        run("bench builder int4", "bench", builder, str(out / "builder-dropped"), "--seq", s["seq"], "--runs",
            str(s["runs"]), "--decode", str(s["decode"]), "--json", str(out / "bench-builder.json"))
        reports["builder int4 in"] = {"method": f"attn-{count}", "eval": read(out / "eval-builder.json")["models"],
                                      "bench": read(out / "bench-builder.json")}
    return reports


# Rendering: Markdown from the sections' JSON only.

def _ratio(value: float, base: float, digits: int = 2) -> str:
    return f"({value / base:.{digits}f}x)"


def render_pipeline(data: dict) -> str:
    r = data["results"]
    count = r["count"]
    names = {"drop": f"attn-{count} drop", "harp": f"HARP top-{count}", "plan": f"planner attn={count}"}
    bench, evals = r["bench"], r["eval"]
    lines = [f"| {bench['drop']['machine']} | base | " + " | ".join(names.values()) + " |", "|---|---|---|---|---|"]
    for kind, label in (("eval", "held-out prose"), *OTHER_KINDS.items()):
        row = {k: v["perplexity"] for k, v in evals[kind].items()}
        lines.append(f"| perplexity, {label} ({evals[kind]['base']['text']['file']}) | {row['base']:.2f} | "
                     + " | ".join(f"{row[k]:.2f} {_ratio(row[k], row['base'])}" for k in names) + " |")
    plan = r["plan"]
    rows = {m["method"]: m for m in plan["methods"]}
    accuracy = {"drop": next((m for n, m in rows.items() if "one-shot drop" in n), None),
                "harp": next((m for n, m in rows.items() if n.startswith("HARP")), None), "plan": plan["pick"]}
    if plan.get("accuracy_items"):
        cells = ["-" if accuracy[k] is None else f"{100 * accuracy[k]['accuracy']:.1f}" for k in names]
        lines.append(f"| accuracy, {plan['accuracy_items']} items (the planner's rows), % | "
                     f"{100 * plan['baseline']['accuracy']:.1f} | " + " | ".join(cells) + " |")
    for index, entry in enumerate(bench["drop"]["prefill"]):
        cells = [f"{bench[k]['prefill'][index]['pruned']['median_ms']:.1f} "
                 f"({bench[k]['prefill'][index]['speedup']:.2f}x)" for k in names]
        lines.append(f"| prefill {entry['seq']} tokens, median ms | {entry['base']['median_ms']:.1f} | "
                     + " | ".join(cells) + " |")
    decode = {k: bench[k]["decode_tokens_per_s"] for k in names}
    lines.append(f"| decode tokens/s | {decode['drop']['base']:.1f} | "
                 + " | ".join(f"{d['pruned']:.1f} {_ratio(d['pruned'], d['base'])}" for d in decode.values()) + " |")
    kv = {k: bench[k]["kv_bytes_per_token"] for k in names}
    lines.append(f"| KV cache bytes/token | {kv['drop']['base']} | "
                 + " | ".join(f"{v['pruned']} {_ratio(v['pruned'], v['base'], 3)}" for v in kv.values()) + " |")
    size = {k: bench[k]["model_bytes"] for k in names}
    lines.append(f"| model file bytes | {size['drop']['base']} | "
                 + " | ".join(f"{v['pruned']} {_ratio(v['pruned'], v['base'], 3)}" for v in size.values()) + " |")
    memory = r["generation_memory"]
    lines.append(f"| peak memory generating {memory['new_tokens']} tokens after {memory['context']} x "
                 f"{memory['batch']}, MiB | {memory['base'] / 2**20:.0f} | {memory['pruned'] / 2**20:.0f} "
                 f"{_ratio(memory['pruned'], memory['base'], 3)} | - | - |")
    calib = r["pipeline"]["quality"][0]["text"]
    lines += ["", f"Calibrated on prose (scores, HARP's search and the planner's choices); perplexity on "
              f"{calib['samples']} windows of {calib['seq_len']} tokens spread across each held-out text (seed "
              f"{calib['seed']}); HARP alphas "
              + ", ".join(f"{k}={v:g}" for k, v in sorted(r["harp"]["alphas"].items(), key=lambda kv: -int(kv[0])))
              + f"; planner pick: {plan['pick']['method']}. Timings: the base column is the drop's bench; each "
              "ratio is against its own bench's base, timed alternating with it."]
    return "\n".join(lines)


def render_plan(plan: dict) -> str:
    from layerdrop.api.reports import fidelity_cell, tasks_cell, validation_count

    texts = held_out_files(plan)
    head = ["method", "KV kept", f"prefill speedup at {plan['speedup_tokens']} tokens",
            f"search ppl ({plan['search_text']['file']})", *(f"held-out ppl ({t})" for t in texts)]
    if plan.get("accuracy_items"):
        head.append(f"accuracy, {plan['accuracy_items']} items, %")
    kinds = list(plan.get("validation_texts") or {})
    base_validation = plan["baseline"].get("validation_ppl") or {}
    if kinds:
        head.append(f"validation ppl / baseline's (geometric mean, {len(kinds)} kinds)")
    if plan.get("validation_items"):
        head.append(f"validation tasks, {validation_count(plan)} items, %")
    if plan.get("task_items"):
        head.append(f"papers' tasks, {plan['task_items']} items each: average % (retained, chance-adjusted)")
    if plan.get("fidelity_text"):
        head.append(f"KL from the baseline, nats/token (top-1 agreement), {plan['fidelity_text']['tokens']} tokens")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in [{"method": "baseline", "kv_kept": 1.0, "speedup": 1.0, **plan["baseline"]}, *plan["methods"]]:
        also = row.get("also_eval_ppl", {})
        cells = [row["method"], f"{row['kv_kept']:.3f}",
                 "-" if row.get("speedup") is None else f"{row['speedup']:.2f}x", f"{row['search_ppl']:.2f}",
                 f"{row['eval_ppl']:.2f}", *(f"{also[t]:.2f}" if t in also else "-" for t in texts[1:])]
        if plan.get("accuracy_items"):
            cells.append("-" if row.get("accuracy") is None else f"{100 * row['accuracy']:.1f}")
        if kinds:
            logs = [math.log(row["validation_ppl"][k] / base_validation[k]) for k in kinds]
            cells.append(f"{math.exp(sum(logs) / len(logs)):.3f}")
        if plan.get("validation_items"):
            cells.append(f"{100 * row['validation_accuracy']:.1f}")
        measured = row["method"] != "baseline"
        if plan.get("task_items"):
            cells.append(tasks_cell(row, plan["baseline"], measured))
        if plan.get("fidelity_text"):
            cells.append(fidelity_cell(row, measured))
        if row["method"] == plan["pick"]["method"]:
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Budget {plan['budget']}; moves {', '.join(plan['moves'])}; pick: {plan['pick']['method']}; "
              f"search {plan['search_seconds'] / 60:.1f} minutes."]
    return "\n".join(lines)


def render_planner(data: dict) -> str:
    r = data["results"]
    parts = [f"Default plan ({r['default']['budget']}, calibrated on the mixed text):", render_plan(r["default"]),
             *render_tasks(r["default"])]
    if r["default"].get("picks"):
        parts += ["Each criterion's pick:", render_criteria_table(r["default"])]
    return "\n\n".join(parts)


HELD_OUT_KINDS = {"eval.txt": "prose", "docs.txt": "docs", "code.txt": "code", "dictionary.txt": "dictionary"}


def render_headline(data: dict) -> str:
    """The README's table for a model: the default plan's baseline, the papers' rows, the pick and the row the
    validation perplexity alone picks (the planner's own best, where the guard fell back to a paper row), on every
    held-out text, the papers' tasks and the fidelity, with the prefill speedup."""
    from layerdrop.api.reports import fidelity_cell, tasks_cell

    plan = data["results"]["default"]
    texts = held_out_files(plan)
    head = [f"method (budget {plan['budget']}, KV kept {plan['kv_fraction_kept']:.3f})",
            *(f"held-out ppl ({HELD_OUT_KINDS.get(t, t)})" for t in texts)]
    if plan.get("accuracy_items"):
        head.append(f"next-words accuracy, {plan['accuracy_items']} items of held-out "
                    f"{HELD_OUT_KINDS.get(texts[0], texts[0])}, %")
    if plan.get("task_items"):
        head.append(f"papers' tasks, {plan['task_items']} items each: average % (retained, chance-adjusted)")
    if plan.get("fidelity_text"):
        head.append("KL from the baseline, nats/token (top-1 agreement)")
    head.append(f"prefill speedup at {plan['speedup_tokens']} tokens")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown = {plan["pick"]["method"], plan.get("picks", {}).get("validation")}
    rows = [m for m in plan["methods"] if m.get("paper") or m["method"] in shown]
    for row in [{"method": "baseline", "speedup": 1.0, **plan["baseline"]}, *rows]:
        measured = row["method"] != "baseline"
        also = row.get("also_eval_ppl", {})
        cells = [row["method"], *(f"{row['eval_ppl'] if t == texts[0] else also[t]:.2f}" for t in texts)]
        if plan.get("accuracy_items"):
            cells.append(f"{100 * row['accuracy']:.1f}")
        if plan.get("task_items"):
            cells.append(tasks_cell(row, plan["baseline"], measured))
        if plan.get("fidelity_text"):
            cells.append(fidelity_cell(row, measured))
        cells.append("-" if row.get("speedup") is None else f"{row['speedup']:.2f}x")
        if row["method"] == plan["pick"]["method"]:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_one_plan(key: str, what: str):
    """The renderer of a section that holds one plan under `key`: its table and its per-task table."""
    def render_section(data: dict) -> str:
        plan = data["results"][key]
        return "\n\n".join([f"{what} ({plan['budget']}, calibrated on the mixed text):", render_plan(plan),
                            *render_tasks(plan)])
    return render_section


def render_tasks(plan: dict) -> list[str]:
    """Every row's score on each of the papers' tasks (the first `task_items` items of each; each task's metric, in
    percent), with the chance level; none where the plan measured no task items."""
    from layerdrop.runtime.standard_tasks import STANDARD_TASKS

    if not plan.get("task_items"):
        return []
    tasks = list(plan["baseline"]["tasks_correct"])
    lines = ["| method | " + " | ".join(f"{t} ({STANDARD_TASKS[t].metric})" for t in tasks) + " | average |",
             "|---|" + "---|" * (len(tasks) + 1)]
    chance = plan["baseline"]["tasks_chance"]
    lines.append("| chance | " + " | ".join(f"{100 * chance[t]:.1f}" for t in tasks)
                 + f" | {100 * sum(chance.values()) / len(chance):.1f} |")
    for row in [{"method": "baseline", **plan["baseline"]}, *plan["methods"]]:
        if not row.get("tasks_correct"):
            continue
        scores = [100 * sum(row["tasks_correct"][t]) / len(row["tasks_correct"][t]) for t in tasks]
        lines.append(f"| {row['method']} | " + " | ".join(f"{v:.1f}" for v in scores)
                     + f" | {sum(scores) / len(scores):.1f} |")
    return [f"The papers' tasks, the first {plan['task_items']} items of each (lm-eval's definitions, offline), "
            "per task:", "\n".join(lines)]


def render_deploy(data: dict) -> str:
    parts = []
    for name in ("fp32", "int4", "builder int4 in"):
        report = data["results"].get(name)
        if report is None:
            continue
        if name == "builder int4 in":
            parts.append(render_builder_in(report))
            continue
        bench = report["bench"]
        label = report.get("reference_label") or "-"
        lines = [f"| {name}, {bench['machine']} | base | {label} | {report['method']} | speedup (ideal) | vs {label} |",
                 "|---|---|---|---|---|---|"]
        for entry in bench["prefill"]:
            reference = entry.get("reference", {}).get("median_ms")
            lines.append(f"| prefill {entry['seq']} tokens, median ms | {entry['base']['median_ms']:.1f} | "
                         + ("-" if reference is None else f"{reference:.1f}")
                         + f" | {entry['pruned']['median_ms']:.1f} | {entry['speedup']:.2f}x "
                         f"({entry['ideal']:.2f}x) | "
                         + ("-" if "vs_reference" not in entry else f"{entry['vs_reference']:.2f}x") + " |")
        decode = bench["decode_tokens_per_s"]
        lines.append(f"| decode tokens/s | {decode['base']:.1f} | "
                     + ("-" if "reference" not in decode else f"{decode['reference']:.1f}")
                     + f" | {decode['pruned']:.1f} | {decode['pruned'] / decode['base']:.2f}x | "
                     + ("-" if "reference" not in decode else f"{decode['pruned'] / decode['reference']:.2f}x")
                     + " |")
        size = bench["model_bytes"]
        lines.append(f"| model file bytes | {size['base']} | {size.get('reference', '-')} | {size['pruned']} | "
                     f"{size['pruned'] / size['base']:.3f} | - |")
        quality = report["quality"]
        lines.append(f"| perplexity ({quality[0]['text']['file']}) | {quality[0]['perplexity']:.2f} | - | "
                     f"{quality[1]['perplexity']:.2f} | {quality[1]['perplexity'] / quality[0]['perplexity']:.2f}x "
                     "| - |")
        parts.append("\n".join(lines))
    parts.append(render_goals(data["results"]))
    return "\n\n".join(parts)


def render_builder_in(report: dict) -> str:
    """onnxruntime-genai's int4 graph as it was built and with layerdrop's attention drop."""
    bench, (base, pruned) = report["bench"], report["eval"]
    lines = [f"| builder int4 in, {bench['machine']} | as built | {report['method']} dropped by layerdrop | ratio |",
             "|---|---|---|---|",
             f"| perplexity ({base['text']['file']}) | {base['perplexity']:.2f} | {pruned['perplexity']:.2f} | "
             f"{pruned['perplexity'] / base['perplexity']:.2f}x |"]
    for entry in bench["prefill"]:
        lines.append(f"| prefill {entry['seq']} tokens, median ms | {entry['base']['median_ms']:.1f} | "
                     f"{entry['pruned']['median_ms']:.1f} | {entry['speedup']:.2f}x (ideal {entry['ideal']:.2f}x) |")
    decode = bench["decode_tokens_per_s"]
    lines.append(f"| decode tokens/s | {decode['base']:.1f} | {decode['pruned']:.1f} | "
                 f"{decode['pruned'] / decode['base']:.2f}x |")
    for label, key in (("KV cache bytes/token", "kv_bytes_per_token"), ("model file bytes", "model_bytes")):
        value = bench[key]
        lines.append(f"| {label} | {value['base']} | {value['pruned']} | {value['pruned'] / value['base']:.3f} |")
    return "\n".join(lines)


def render_goals(reports: dict) -> str:
    """The deployment goals at the longest prefill measured: the fused export within 1.1x of the builder graph's
    time, and each pruned output reaching 0.95 of the drop's ideal speedup (against the builder's unpruned graph for
    fp32, against the int4 base for int4)."""
    lines = ["| goal | measured | target | met |", "|---|---|---|---|"]
    fp32, int4 = (reports[name]["bench"]["prefill"][-1] for name in ("fp32", "int4"))
    if "reference" in fp32:
        ratio = fp32["base"]["median_ms"] / fp32["reference"]["median_ms"]
        lines.append(f"| unpruned fused export / builder fp32, prefill {fp32['seq']} | {ratio:.2f}x the builder's "
                     f"time | <= 1.10x | {'yes' if ratio <= 1.10 else 'no'} |")
        share = fp32["vs_reference"] / fp32["ideal"]
        lines.append(f"| pruned fused output vs builder fp32 (unpruned), prefill {fp32['seq']} | "
                     f"{fp32['vs_reference']:.2f}x = {share:.2f} of the ideal {fp32['ideal']:.2f}x | >= 0.95 of the "
                     f"ideal | {'yes' if share >= 0.95 else 'no'} |")
    share = int4["speedup"] / int4["ideal"]
    lines.append(f"| int4 pruned vs int4 base, prefill {int4['seq']} | {int4['speedup']:.2f}x = {share:.2f} of the "
                 f"ideal {int4['ideal']:.2f}x | >= 0.95 of the ideal | {'yes' if share >= 0.95 else 'no'} |")
    return "\n".join(lines)


RENDER = {"pipeline": render_pipeline, "planner": render_planner, "blocks": render_one_plan("blocks", "Block plan"),
          "speedup": render_one_plan("speedup", "Speedup plan"), "criteria": render_criteria, "deploy": render_deploy}
TITLES = {"pipeline": "The pipeline, HARP and the planner at the same count",
          "planner": "The planner at a quarter of the attention layers",
          "blocks": "Block moves at a quarter of the blocks: ShortGPT and ReplaceMe",
          "speedup": "The planner at a speedup budget, block moves allowed",
          "criteria": "How the pick is chosen: criteria on data the choice never saw",
          "deploy": "Deployment: fused, int4 and the model builder's graph"}


def stamp(data: dict, model: str, section: str) -> str:
    return (f"Measured on {data['machine']['cpu']} ({data['machine']['summary']}), {data['date'][:10]}, commit "
            f"{data['commit'][:10]}{' (with changes)' if data['dirty'] else ''}, layerdrop "
            f"{data['versions']['layerdrop']}, ONNX Runtime {data['versions']['onnxruntime']}; "
            f"`python benchmarks/reproduce.py --model {model} --only {section}"
            f"{' --quick' if data['args']['quick'] else ''}` ({_minutes(data):.1f} minutes"
            + (f"; {', '.join(data['resumed'])} went on from an interrupted run, whose time before the "
               "interruption is not counted" if data.get("resumed") else "") + ").")


def _minutes(data: dict) -> float:
    """The section's time: its own run's, or where it resumed, the sum of its commands' recorded times."""
    return max(data["seconds_total"], sum(data.get("seconds", {}).values())) / 60


def render(out: Path, model: str, readme: Path) -> None:
    """OUT/<model>/README.md from every section's JSON (beside it, so hand-kept pages under OUT are never
    overwritten), and between the README's markers the model's headline table: the default plan's
    (`render_headline`)."""
    found = {s: read(out / model / f"{s}.json") for s in SECTIONS if (out / model / f"{s}.json").exists()}
    if not found:
        print(f"reproduce: no JSON under {out / model}; nothing to render", file=sys.stderr)
        return
    parts = [f"# Results: {model}", ""]
    for section, data in found.items():
        parts += [f"## {TITLES[section]}", "", RENDER[section](data), "", stamp(data, model, section), ""]
    page = out / model / "README.md"
    write_atomic(page, "\n".join(parts))
    print(f"reproduce: wrote {page}", file=sys.stderr)
    begin, end = f"<!-- results:{model} begin -->", f"<!-- results:{model} end -->"
    text = readme.read_text() if readme.exists() else ""
    if "planner" not in found or begin not in text or end not in text.split(begin, 1)[1]:
        print(f"reproduce: {readme} has no {begin} ... {end} markers (or no planner JSON); its table is not "
              "rendered", file=sys.stderr)
        return
    table = stamp(found["planner"], model, "planner") + "\n\n" + render_headline(found["planner"])
    before, rest = text.split(begin, 1)
    after = rest.split(end, 1)[1]
    write_atomic(readme, f"{before}{begin}\n{table}\n{end}{after}")
    print(f"reproduce: rendered the {model} table into {readme}", file=sys.stderr)


# Provenance

def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def provenance() -> dict:
    import onnxruntime

    import layerdrop

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        cpu = names[0].strip() if names else cpu
    # the last commit that changed the package: committing results, docs or tests does not make figures stale
    return {"commit": _git("log", "-1", "--format=%H", "--", "layerdrop", "pyproject.toml") or "unknown",
            "head": _git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "layerdrop")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu, "summary": f"{platform.machine()}, {os.cpu_count()} cores",
                        "platform": platform.platform()},
            "versions": {"layerdrop": layerdrop.__version__, "onnxruntime": onnxruntime.__version__,
                         "python": platform.python_version()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--quick", action="store_true", help="a small version (few windows, one timed run)")
    parser.add_argument("--only", help="sections to run, comma-separated (default: all): " + ", ".join(SECTIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="where the JSON and Markdown go")
    parser.add_argument("--work", type=Path, help="the commands' outputs (default: bench-out/reproduce/<model>)")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--force", action="store_true", help="rerun sections whose JSON is up to date")
    parser.add_argument("--render-only", action="store_true", help="no measurement: render the existing JSON")
    parser.add_argument("--model-folder", help=argparse.SUPPRESS)  # a Hugging Face folder instead (the tests' tiny)
    parser.add_argument("--planner-attn", type=int, help=argparse.SUPPRESS)  # the planner section's attn budget
    args = parser.parse_args(argv)
    only = SECTIONS if not args.only else tuple(args.only.split(","))
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    if not args.render_only:
        config = MODELS[args.model]
        source = str(Path(args.model_folder).resolve()) if args.model_folder else config["source"]
        work = (args.work or ROOT / "bench-out" / "reproduce" / args.model).resolve()
        s = sizes(args.quick)
        facts = provenance()
        for section in only:
            key = {"source": source, "quick": args.quick, "threads": args.threads,
                   "planner_attn": args.planner_attn or config["planner_attn"], "sizes": s,
                   "plan_args": config["plan_args"]}
            path = args.out / args.model / f"{section}.json"
            if path.exists() and not args.force:
                old = read(path)
                if not facts["dirty"] and old.get("commit") == facts["commit"] and old.get("args") == key:
                    print(f"reproduce: {section} is up to date in {path}, skipped (--force reruns it)",
                          file=sys.stderr)
                    continue
            run = Runner(args.threads, work, facts["commit"], args.force or facts["dirty"])
            started = time.perf_counter()
            if section == "pipeline":
                results = section_pipeline(work, source, config, s, run)
            elif section == "planner":
                results = section_planner(work, source, config, s, run, key["planner_attn"])
            elif section == "blocks":
                results = section_blocks(work, source, config, s, run, key["planner_attn"])
            elif section == "speedup":
                results = section_speedup(work, source, config, s, run)
            elif section == "criteria":
                results = section_criteria(work, source, config, s, run, key["planner_attn"])
            else:
                results = section_deploy(work, source, config, s, run)
            data = {"section": section, "model": args.model, "args": key, **facts,
                    "seconds_total": round(time.perf_counter() - started, 1), "seconds": run.seconds,
                    "commands": run.commands, "resumed": run.resumed, "results": results}
            write_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
            print(f"reproduce: {section} took {data['seconds_total'] / 60:.1f} minutes; wrote {path}",
                  file=sys.stderr)
    render(args.out, args.model, args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
