"""The deployable output against onnxruntime-genai's model builder graph (issue 17's goals), on SmolLM2.

    python benchmarks/deploy_table.py --out bench-out/deploy [--reuse bench-out/smollm2/pipeline]

Runs `layerdrop pipeline smollm2-135m` twice, as a user would: fp32 (fused by default) and `--quantize int4`.
Each bench times three graphs in the same alternating runs (2 threads, 5 runs, 256 and 1024 tokens): the
unpruned export written like the output (fused; int4 for the second run), onnxruntime-genai's builder graph of
the same model (`-p fp32` / `-p int4`, the builder's defaults otherwise), and the pruned output (the 7
lowest-scored attention layers dropped). `--reuse` copies the export and scored stages of an earlier pipeline
run (their stamps say what they came from), so only the new stages run. Prints the goals table and writes
OUT/deploy.json.

Goals (issue 17): the unpruned fused export within 1.1x of the builder graph's prefill at 1024 tokens; the pruned
fused output faster than the builder's unpruned graph by at least 0.95 of the drop's ideal; int4 pruned faster
than int4 base by at least 0.95 of the ideal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def pipeline(out: Path, reuse: Path | None, *extra: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for stage in ("export", "scored"):
        if reuse is not None and not (out / stage).exists():
            shutil.copytree(reuse / stage, out / stage)
    command = [sys.executable, "-m", "layerdrop.cli", "pipeline", "smollm2-135m", "-o", str(out), "--resume",
               "--calib", "prose", "--threads", "2", "--no-progress", *extra]
    print("$ layerdrop " + " ".join(command[3:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / "report.json").read_text())


def goals(fp32: dict, int4: dict) -> list[tuple[str, str, str, bool]]:
    at = {name: next(e for e in report["bench"]["prefill"] if e["seq"] == 1024)
          for name, report in (("fp32", fp32), ("int4", int4))}
    e = at["fp32"]
    ratio = e["base"]["median_ms"] / e["reference"]["median_ms"]
    rows = [("unpruned fused export / builder fp32, prefill 1024", f"{ratio:.2f}x the builder's time", "<= 1.10x",
             ratio <= 1.10)]
    share = e["vs_reference"] / e["ideal"]
    rows.append(("pruned fused output vs builder fp32 (unpruned), prefill 1024",
                 f"{e['vs_reference']:.2f}x faster = {share:.2f} of the ideal {e['ideal']:.2f}x", ">= 0.95 of ideal",
                 share >= 0.95))
    i = at["int4"]
    share = i["speedup"] / i["ideal"]
    rows.append(("int4 pruned vs int4 base, prefill 1024", f"{i['speedup']:.2f}x = {share:.2f} of the ideal "
                 f"{i['ideal']:.2f}x", ">= 0.95 of ideal", share >= 0.95))
    if "vs_reference" in i:
        rows.append(("int4 pruned vs builder int4 (unpruned), prefill 1024", f"{i['vs_reference']:.2f}x faster",
                     "(no goal)", True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/deploy"))
    parser.add_argument("--reuse", type=Path, help="an earlier pipeline OUTDIR of smollm2-135m (export, scored)")
    args = parser.parse_args()
    fp32 = pipeline(args.out / "fp32", args.reuse)
    int4 = pipeline(args.out / "int4", args.reuse, "--quantize", "int4")
    rows = goals(fp32, int4)
    (args.out / "deploy.json").write_text(json.dumps({"fp32": fp32, "int4": int4, "goals": rows}, indent=2) + "\n")
    for name, report in (("fp32", fp32), ("int4", int4)):
        print(f"\n{name}:\n" + (Path(report["pruned"]).parent / "report.md").read_text())
    print("| goal | measured | target | met |\n|---|---|---|---|")
    for name, measured, target, met in rows:
        print(f"| {name} | {measured} | {target} | {'yes' if met else 'no'} |")


if __name__ == "__main__":
    main()
