"""One results table per real model: the pipeline's attention drop, HARP and the planner side by side.

    python benchmarks/model_table.py --model smollm2-135m --out bench-out/smollm2
    python benchmarks/model_table.py --model gemma3-270m --out bench-out/gemma3

Every row runs the `layerdrop` command a user would (each one's line is printed first), with the same count of
attention layers for every method: a quarter of them (the pipeline's default). Texts: the bundled calibration
text (*Persuasion*) for scores and searches, the bundled evaluation text (*Northanger Abbey*) for perplexity;
spread windows, seed 0; a BOS first where the tokenizer adds one (Gemma). Each model is also evaluated on the
bundled texts of other kinds (technical writing, code), and the attention drop's peak memory is measured while
generating 64 tokens after 2048 x 8 (where the KV cache shows). `--speed-only` reruns only the benches (for a
quiet machine); `--resume` skips the steps whose JSON is already in OUT. Results: OUT/table.json and a Markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

OTHER_KINDS = {"docs": "technical writing", "code": "code"}  # bundled texts of other kinds than the calibration
GENERATION = "8,2048,64"  # batch, context, new tokens of the memory run where the KV cache shows


def run(*args: str) -> float:
    command = [sys.executable, "-m", "layerdrop.cli", *args]
    print("$ layerdrop " + " ".join(args), file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a known model name, a HF folder or a .gguf file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", default="2")
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--resume", action="store_true", help="skip the steps whose JSON is already in --out")
    parser.add_argument("--calib", default="prose", help="calibration and search text of every step (default: "
                        "prose, the text the README's tables were measured with; `calib` is the mixed default)")
    parser.add_argument("--plan-args", default="", help="extra `layerdrop plan` options, e.g. '--extra 2'")
    args = parser.parse_args()
    out, threads = args.out, ["--threads", args.threads, "--no-progress"]
    out.mkdir(parents=True, exist_ok=True)
    pipeline, export, scored = out / "pipeline", out / "pipeline" / "export", out / "pipeline" / "scored"
    old = json.loads((out / "seconds.json").read_text()) if args.resume and (out / "seconds.json").exists() else {}
    seconds: dict[str, float] = {}

    def step(name: str, result: Path, *command: str) -> None:
        if args.speed_only or (args.resume and result.exists()):
            if name in old:
                seconds[name] = old[name]
            return
        seconds[name] = run(*command)
        (out / "seconds.json").write_text(json.dumps({**old, **seconds}, indent=2) + "\n")

    step("pipeline", pipeline / "report.json", "pipeline", args.model, "-o", str(pipeline), "--force", "--calib",
         args.calib, *threads)
    layers = json.loads((pipeline / "report.json").read_text())["method"]  # "attn-N"
    count = layers.split("-")[-1]
    step("harp", out / "harp.json", "harp", str(scored), "-o", str(out / "harp"), "--top", count, "--search",
         "--calib", args.calib, "--force", "--json", str(out / "harp.json"), *threads)
    step("plan", out / "plan.json", "plan", str(scored), "-o", str(out / "plan"), "--budget", f"attn={count}",
         "--calib", args.calib, "--force", "--json", str(out / "plan.json"), *args.plan_args.split(), *threads)
    for name in ("harp", "plan"):
        step(f"eval-{name}", out / f"eval-{name}.json", "eval", str(out / name), "--json",
             str(out / f"eval-{name}.json"), *threads)
    for kind in OTHER_KINDS:  # calibrated on prose, evaluated on a text of another kind
        for first, second in ((export, pipeline / "pruned"), (out / "harp", out / "plan")):
            step(f"eval-{kind}-{first.name}", out / f"eval-{kind}-{first.name}.json", "eval", str(first), "--vs",
                 str(second), "--text", kind, "--json", str(out / f"eval-{kind}-{first.name}.json"), *threads)
    for name, folder in (("drop", pipeline / "pruned"), ("harp", out / "harp"), ("plan", out / "plan")):
        if args.speed_only or not (args.resume and (out / f"bench-{name}.json").exists()):
            run("bench", str(export), str(folder), "--seq", "256,1024", "--json", str(out / f"bench-{name}.json"),
                *threads)
    step("generation-memory", out / "generation-drop.json", "bench", str(export), str(pipeline / "pruned"),
         "--seq", "256", "--runs", "1", "--decode", "4", "--generation-memory", GENERATION,
         "--json", str(out / "generation-drop.json"), *threads)

    report = json.loads((pipeline / "report.json").read_text())
    quality = {"base": report["quality"][0], "drop": report["quality"][1]}
    for name in ("harp", "plan"):
        quality[name] = json.loads((out / f"eval-{name}.json").read_text())["models"][0]
    benches = {name: json.loads((out / f"bench-{name}.json").read_text()) for name in ("drop", "harp", "plan")}
    plan = json.loads((out / "plan.json").read_text())
    harp = json.loads((out / "harp.json").read_text())
    other = {}
    for kind in OTHER_KINDS:
        pairs = [json.loads((out / f"eval-{kind}-{f}.json").read_text())["models"] for f in ("export", "harp")]
        other[kind] = dict(zip(("base", "drop", "harp", "plan"), [m for pair in pairs for m in pair]))
    generation = json.loads((out / "generation-drop.json").read_text())["generation_memory"]
    table = {"model": args.model, "count": int(count), "seconds": seconds, "quality": quality, "bench": benches,
             "harp_alphas": harp["alphas"], "plan_pick": plan["pick"], "other_kinds": other,
             "generation_memory": generation, "plan_skipped": plan.get("skipped", []), "plan_args": args.plan_args}
    (out / "table.json").write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(markdown(table))


def markdown(table: dict) -> str:
    names = {"drop": f"attn-{table['count']} drop", "harp": f"HARP top-{table['count']}",
             "plan": f"planner attn={table['count']}"}
    bench = table["bench"]
    bos = " (BOS first)" if table["quality"]["base"]["text"].get("bos") else ""
    lines = [f"| {bench['drop']['machine']} | base | " + " | ".join(names.values()) + " |",
             "|---|---|---|---|---|"]
    base_ppl = table["quality"]["base"]["perplexity"]
    cells = [f"{table['quality'][k]['perplexity']:.2f} ({table['quality'][k]['perplexity'] / base_ppl:.2f}x)"
             for k in names]
    lines.append(f"| perplexity{bos} | {base_ppl:.2f} | " + " | ".join(cells) + " |")
    for kind, label in OTHER_KINDS.items():
        row = {k: v["perplexity"] for k, v in table["other_kinds"][kind].items()}
        lines.append(f"| perplexity on {label} (another kind) | {row['base']:.2f} | "
                     + " | ".join(f"{row[k]:.2f} ({row[k] / row['base']:.2f}x)" for k in names) + " |")
    for index, entry in enumerate(bench["drop"]["prefill"]):
        row = [f"{bench[k]['prefill'][index]['pruned']['median_ms']:.0f} "
               f"({bench[k]['prefill'][index]['speedup']:.2f}x)" for k in names]
        lines.append(f"| prefill {entry['seq']} tokens, median ms | {entry['base']['median_ms']:.0f} | "
                     + " | ".join(row) + " |")
    decode = [bench[k]["decode_tokens_per_s"] for k in names]
    lines.append(f"| decode tokens/s | {decode[0]['base']:.1f} | "
                 + " | ".join(f"{d['pruned']:.1f} ({d['pruned'] / d['base']:.2f}x)" for d in decode) + " |")
    kv = [bench[k]["kv_bytes_per_token"] for k in names]
    lines.append(f"| KV cache bytes/token | {kv[0]['base']} | "
                 + " | ".join(f"{v['pruned']} ({v['pruned'] / v['base']:.3f})" for v in kv) + " |")
    size = [bench[k]["model_bytes"] for k in names]
    lines.append(f"| model file bytes | {size[0]['base']:,} | "
                 + " | ".join(f"{v['pruned']:,} ({v['pruned'] / v['base']:.3f})" for v in size) + " |")
    memory = table["generation_memory"]
    lines.append(f"| peak memory generating {memory['new_tokens']} tokens after {memory['context']} x "
                 f"{memory['batch']} (MiB) | {memory['base'] / 2**20:.0f} | {memory['pruned'] / 2**20:.0f} "
                 f"({memory['pruned'] / memory['base']:.3f}) | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
