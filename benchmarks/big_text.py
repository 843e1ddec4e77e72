"""Reading a calibration text costs what the windows need, not what the file holds.

Writes a text of about 1 GB (the bundled texts repeated, each copy numbered so no two are alike) and the same
content as JSON Lines (one paragraph a record), then times `layerdrop score MODEL --calib X --samples 64` on the
bundled text, on the big text and on the JSON Lines file, each in a fresh process whose peak memory (the kernel's
maxrss of that child) is read with os.wait4.

    python benchmarks/big_text.py --model out/pipeline/export [--gigabytes 1] [--workdir /tmp/layerdrop-big]

Results go to bench-out/big_text.json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from layerdrop.windows import bundled_text


def write_texts(workdir: Path, gigabytes: float) -> tuple[Path, Path]:
    """big.txt and big.jsonl of about `gigabytes` each (kept between runs)."""
    workdir.mkdir(parents=True, exist_ok=True)
    text_path, jsonl_path = workdir / "big.txt", workdir / "big.jsonl"
    target = int(gigabytes * 1e9)
    if text_path.is_file() and abs(text_path.stat().st_size - target) < 5e6 and jsonl_path.is_file():
        return text_path, jsonl_path
    base = bundled_text("prose").read_text(encoding="utf-8") + "\n\n" + bundled_text("eval").read_text(encoding="utf-8")
    paragraphs = [p for p in base.split("\n\n") if p.strip()]
    with open(text_path, "w", encoding="utf-8") as text_out, open(jsonl_path, "w", encoding="utf-8") as jsonl_out:
        copy = 0
        while text_out.tell() < target:
            header = f"Copy {copy} of the bundled texts.\n\n"
            text_out.write(header + base + "\n\n")
            jsonl_out.write(json.dumps({"text": header.strip(), "copy": copy}) + "\n")
            for paragraph in paragraphs:
                jsonl_out.write(json.dumps({"text": paragraph, "copy": copy}) + "\n")
            copy += 1
    return text_path, jsonl_path


def measure(command: list[str]) -> dict:
    """Wall time and peak resident memory of one command in its own process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    error = process.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{error[-2000:]}")
    return {"seconds": round(seconds, 2), "peak_mib": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an exported model folder")
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/layerdrop-big"))
    parser.add_argument("--json", type=Path, default=Path("bench-out/big_text.json"))
    args = parser.parse_args()

    big, jsonl = write_texts(args.workdir, args.gigabytes)
    score = [sys.executable, "-m", "layerdrop.cli", "score", str(args.model), "--samples", str(args.samples),
             "--threads", str(args.threads), "--no-progress"]
    rows = {}
    for name, path in (("bundled text", bundled_text("prose")), ("big text", big), ("big JSON Lines", jsonl)):
        rows[name] = {"bytes": path.stat().st_size, **measure([*score, "--calib", str(path)])}
    base = rows["bundled text"]
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
              "samples": args.samples, "model": str(args.model), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| `layerdrop score --samples {args.samples}` ({result['machine']}) | file bytes | wall s | vs bundled | "
          "peak MiB | vs bundled |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['bytes']:,} | {row['seconds']:.1f} | {row['seconds'] / base['seconds']:.2f}x | "
              f"{row['peak_mib']:.0f} | {row['peak_mib'] - base['peak_mib']:+.0f} MiB |")


if __name__ == "__main__":
    main()
