"""The lm-eval adapter on the default model: `layerdrop` (ONNX Runtime) against lm-eval's `hf` model.

    python benchmarks/harness_check.py --base out/pipeline/export --pruned out/attn8 --json bench-out/harness.json

Builds an offline task from the bundled evaluation text (Northanger Abbey): 40 passages, each with its true next
words and three next-word runs taken from other passages (multiple choice), and the same passages as a
generation task (greedy, stop at "."). Runs it through
  1. lm-eval's own `hf` model on the PyTorch model the export came from (the reference),
  2. the `layerdrop` model on the exported folder,
  3. the `layerdrop` model on a pruned folder,
and prints the largest log-likelihood difference between 1 and 2, whether the generations agree, and the task
scores of all three. The PyTorch model is the converted Hugging Face folder `layerdrop export` caches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the tests' helpers

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_tasks(folder: Path, items: int, seed: int = 0) -> None:
    from layerdrop.windows import bundled_text
    from tests.lm_eval_tasks import write_local_task

    text = bundled_text("eval").read_text(encoding="utf-8")
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in text.split("\n\n")]
    paragraphs = [p for p in paragraphs if len(p.split()) > 45 and not p.isupper()]
    rng = random.Random(seed)
    picked = rng.sample(paragraphs, items + 3)
    mc, gen = [], []
    for index, paragraph in enumerate(picked[:items]):
        words = paragraph.split()
        context, answer = " ".join(words[:30]), " " + " ".join(words[30:36])
        others = [p.split() for j, p in enumerate(picked) if j != index]
        wrong = [" " + " ".join(w[30:36]) for w in rng.sample(others, 3)]
        choices = [answer, *wrong]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "answer": choices.index(answer)})
        gen.append({"context": context, "answer": answer})
    write_local_task(folder, "austen_next_words", mc, output_type="multiple_choice", doc_to_text="{{context}}",
                     doc_to_choice="{{choices}}", doc_to_target="{{answer}}", metrics=["acc", "acc_norm"])
    write_local_task(folder, "austen_continue", gen, output_type="generate_until", doc_to_text="{{context}}",
                     doc_to_target="{{answer}}", metrics=["exact_match"],
                     generation_kwargs={"until": [".", "\n"], "max_gen_toks": 16, "do_sample": False})


def evaluate(model, tasks: Path) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    return evaluator.simple_evaluate(model=model, tasks=["austen_next_words", "austen_continue"], log_samples=True,
                                     task_manager=TaskManager(include_path=str(tasks)), bootstrap_iters=0)


def loglikelihoods(results: dict) -> np.ndarray:
    samples = sorted(results["samples"]["austen_next_words"], key=lambda s: s["doc_id"])
    return np.array([resp[0][0] for s in samples for resp in s["resps"]], dtype=np.float64)


def generations(results: dict) -> list[str]:
    return [s["resps"][0][0] for s in sorted(results["samples"]["austen_continue"], key=lambda s: s["doc_id"])]


def scores(results: dict) -> dict:
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," in key and "stderr" not in key and isinstance(value, float):
                out[f"{task} {key.split(',')[0]}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, default=Path("out/pipeline/export"))
    parser.add_argument("--pruned", type=Path, default=None)
    parser.add_argument("--hf", type=Path, default=Path.home() / ".cache/layerdrop/SmolLM2-135M-Instruct")
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--reference-dtype", choices=["float32", "float64"], default="float64",
                        help="PyTorch precision of the reference (float32 torch and float32 ORT differ by ~1e-4)")
    parser.add_argument("--json", type=Path, default=Path("bench-out/harness.json"))
    args = parser.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerdrop.runtime.harness import LayerdropLM

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp)
        write_tasks(tasks, args.items)
        dtype = torch.float64 if args.reference_dtype == "float64" else torch.float32
        reference = evaluate(HFLM(pretrained=AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype),
                                  tokenizer=AutoTokenizer.from_pretrained(args.hf), batch_size=8, device="cpu"),
                             tasks)
        ours = evaluate(LayerdropLM(path=str(args.base), batch_size=8, threads=2), tasks)
        pruned = evaluate(LayerdropLM(path=str(args.pruned), batch_size=8, threads=2), tasks) if args.pruned else None
    difference = np.abs(loglikelihoods(ours) - loglikelihoods(reference))
    report = {
        "requests": int(difference.size),
        "max_abs_loglikelihood_difference": float(difference.max()),
        "generations_equal": sum(a == b for a, b in zip(generations(ours), generations(reference))),
        "generations": len(generations(ours)),
        "scores": {"hf (PyTorch)": scores(reference), "layerdrop": scores(ours)},
    }
    if pruned:
        report["scores"][f"layerdrop {args.pruned}"] = scores(pruned)
        report["examples"] = [{"base": a, "pruned": b} for a, b in
                              zip(generations(ours)[:3], generations(pruned)[:3])]
    print(json.dumps(report, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
