"""The tables and lines the commands print."""

from __future__ import annotations


def print_scores(rows: list[dict]) -> None:
    by_layer: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_layer.setdefault(row["layer"], {})[row["kind"]] = row
    print(f"{'layer':>5}  {'attn S':>9} {'|Y|/|X|':>7}  {'mlp S':>9} {'|Y|/|X|':>7}  {'block S':>9} {'|Y|/|X|':>7}")
    for layer in sorted(by_layer):
        cells = []
        for kind in ("attn", "mlp", "block"):
            row = by_layer[layer].get(kind)
            scored = row and "score" in row
            cells.append(f"{row['score']:9.5f} {row['norm_ratio']:7.3f}" if scored else f"{'-':>9} {'':>7}")
        print(f"{layer:>5}  " + "  ".join(cells))


def removal_text(entry: dict) -> str:
    """attn:29, or attn:29(alpha 0.5) for a HARP bypass, with ", mean shift" when the planner shifted it."""
    if "alpha" not in entry:
        return f"{entry['kind']}:{entry['layer']}"
    return f"{entry['kind']}:{entry['layer']}(alpha {entry['alpha']}{', mean shift' if entry.get('shift') else ''})"


def print_fusions(counts: dict[str, int], asked: bool, note: str | None = None) -> None:
    if asked:
        fused = ", ".join(f"{name} x{count}" for name, count in counts.items()) or "nothing matched"
        print(f"ONNX Runtime fusions: {fused}" + (f" ({note})" if note else ""))


def harness_table(names: list[str], results: list[dict]) -> tuple[str, list[dict]]:
    """Task scores of one or two models side by side (with the difference), as text and as rows."""
    rows = []
    for task in sorted(results[0]["scores"]):
        for metric, _ in sorted(results[0]["scores"][task].items()):
            values = [r["scores"].get(task, {}).get(metric, (float("nan"), None)) for r in results]
            row = {"task": task, "metric": metric, "scores": [v for v, _ in values],
                   "stderr": [e for _, e in values]}
            if len(results) == 2:
                row["difference"] = values[1][0] - values[0][0]
            rows.append(row)

    def number(value: float) -> str:
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4e}"

    def cell(value: float, stderr: float | None) -> str:
        return f"{number(value)} ± {number(stderr)}" if stderr is not None else number(value)

    labels = ["base", "vs"][: len(names)] if len(names) == 2 else ["score"]
    lines = [f"{label}: {name}" for label, name in zip(labels, names)] + [""]
    header = f"{'task':<20} {'metric':<16} " + " ".join(f"{label:>24}" for label in labels)
    header += f" {'difference (vs - base)':>23}" if len(results) == 2 else ""
    lines.append(header)
    for row in rows:
        line = f"{row['task']:<20} {row['metric']:<16} " + " ".join(
            f"{cell(v, e):>24}" for v, e in zip(row["scores"], row["stderr"]))
        lines.append(line + (f" {row['difference']:>+23.4f}" if "difference" in row else ""))
    for task in sorted(results[0]["generations"]):
        lines.append(f"\ngenerations, {task} (first {len(results[0]['generations'][task])}):")
        for index, sample in enumerate(results[0]["generations"][task]):
            lines.append(f"  [{index}] prompt: ...{sample['prompt'][-60:]!r}   target: {sample['target'][:40]!r}")
            for label, result in zip(labels, results):
                output = result["generations"][task][index]["output"]
                lines.append(f"      {label:>6}: {output[:100]!r}")
    return "\n".join(lines), rows


def standard_tasks_table(report: dict) -> str:
    """The standard tasks' table (`api.evaluate.standard_tasks`): per task and on average, each model's score ±
    its standard error, and with two models the paired difference, % retained and chance-adjusted % retained;
    then the fidelity line where the report has one."""
    two = len(report["models"]) == 2
    labels = ["base", "other"] if two else ["score"]
    lines = [f"{label}: {name}" for label, name in zip(labels, report["models"])] + [""]
    header = f"{'task':<15} {'metric':<9} {'split':<10} {'items':>6} {'chance':>6} "
    header += " ".join(f"{label:>13}" for label in labels)
    if two:
        header += f" {'difference':>14} {'retained':>9} {'chance-adj.':>11}"
    lines.append(header)
    for row in [*report["tasks"], report["average"]]:
        if row["task"] == "average":
            lines.append("-" * len(header))
        line = (f"{row['task']:<15} {row['metric']:<9} {row['split']:<10} {row['items']:>6} {row['chance']:>6.1f} "
                + " ".join(f"{f'{s:.1f} ± {e:.1f}':>13}" for s, e in zip(row["scores"], row["stderrs"])))
        if two:
            difference = f"{row['difference']:+.1f} ± {row['difference_se']:.1f}"
            line += f" {difference:>14} {_percent(row['retained']):>9} {_percent(row['chance_adjusted_retained']):>11}"
        lines.append(line)
    lines.append("scores in %; metric: acc_norm for ARC, HellaSwag, OpenBookQA, PIQA, acc otherwise; the average "
                 "is the mean over tasks")
    if "fidelity" in report:
        lines.append(fidelity_line(report["fidelity"]))
    return "\n".join(lines)


def fidelity_line(found: dict) -> str:
    """'fidelity on N held-out tokens of FILE: KL(base || other) ... nats/token, top-1 agreement ...%'."""
    return (f"fidelity on {found['tokens']} held-out tokens of {found['text'].get('file', 'the eval text')}: "
            f"KL(base || other) {found['kl']:.4f} nats/token, top-1 agreement {100 * found['top1_agreement']:.1f}%")


def _percent(value: float | None) -> str:
    """A retained figure, or n/a where the base leaves nothing to retain."""
    return "n/a" if value is None else f"{value:.1f}%"
