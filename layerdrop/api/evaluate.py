"""`layerdrop eval`: perplexity on held-out text, greedy generations, and lm-evaluation-harness tasks."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import DEFAULT_SEQ_LEN, calibration_sha256, windows_for
from layerdrop.errors import LayerdropError
from layerdrop.passes.token_logprobs import with_token_logprobs
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.generate import greedy_generate
from layerdrop.runtime.session import make_session
from layerdrop.windows import Sampling, load_tokenizer


def evaluate(
    model_path: Path,
    *,
    text: Path | None = None,
    samples: int | None = 32,
    seq_len: int = DEFAULT_SEQ_LEN,
    sampling: Sampling = Sampling(),
    batch_size: int = 1,
    provider: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Perplexity of a model folder on evaluation windows of `text` (default: the bundled evaluation text); when
    `text` is the model's calibration text, the windows come from its evaluation part.

    Returns:
        {"perplexity", "nll", "tokens", "text": {...}}
    """
    folder, model = model_folder.load(model_path)  # validates the folder and its external data before ORT reads it
    windows = windows_for(folder.path, text, role="eval", samples=samples, seq_len=seq_len, sampling=sampling,
                          calibration_sha256=calibration_sha256(model))
    session = make_session(with_token_logprobs(model), folder=folder.path, provider=provider, threads=threads)
    result = perplexity(session, windows.ids, batch_size=batch_size, progress=progress)
    return {"perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "text": windows.source}


def generate_text(model_path: Path, prompt: str, max_new_tokens: int, *, provider: str = "cpu") -> str:
    """Greedy continuation of `prompt` (tokenized as the model is used: with its BOS where the tokenizer adds one),
    decoded back to text."""
    folder = model_folder.resolve(model_path)
    tokenizer = load_tokenizer(folder.path)
    ids = tokenizer.encode(prompt, special=True)
    if not ids:
        raise LayerdropError("--prompt is empty after tokenization; give some text")
    eos = model_folder.config(folder.path).get("eos_token_id")
    session = make_session(folder.onnx_path, provider=provider)
    tokens, _ = greedy_generate(session, [ids], max_new_tokens, eos_token_id=eos if isinstance(eos, int) else None)
    return tokenizer.decode(tokens)


def harness(
    model_path: Path,
    tasks: list[str],
    *,
    limit: float | None = None,
    include_path: Path | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    provider: str = "cpu",
    show: int = 3,
    progress: bool = True,
) -> dict:
    """lm-evaluation-harness tasks on a model folder through ONNX Runtime (needs the `eval` extra).

    Returns:
        {"scores": {task: {metric: (value, stderr)}}, "generations": {task: [{"prompt", "target", "output"}]}}
        with the first `show` generation samples of each generate_until task.

    Raises:
        LayerdropError: lm-eval is missing, a task name is unknown, or a task's data cannot be loaded.
    """
    try:
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LayerdropError("--tasks needs lm-eval; install the eval extra: pip install -e '.[eval]'") from None
    from layerdrop.runtime.harness import LayerdropLM

    if include_path is not None and not Path(include_path).is_dir():
        raise LayerdropError(f"--include-path {include_path} is not a folder of task YAML files")
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LayerdropError(f"unknown lm-eval task(s): {', '.join(unknown)}; `lm_eval ls tasks` lists them, and "
                             "--include-path adds a folder of your own task YAML files")
    model = LayerdropLM(path=str(model_path), provider=provider, batch_size=batch_size, progress=progress)
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
