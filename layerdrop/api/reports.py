"""Markdown tables that commands print and write (the pipeline's report.md, the planner's comparison)."""

from __future__ import annotations


def side_by_side(bench: dict, method: str, quality: list[dict] | None = None, reference: str = "reference") -> str:
    """The closing table (markdown) of `pipeline` and `bench`: base vs rewritten model, with ratios; where the
    bench timed a reference graph too (`bench["reference"]`), its column and the rewritten model's ratio to it."""
    has_ref = "reference" in bench
    rows = []
    if quality:
        base_q, pruned_q = quality
        rows.append(("perplexity", f"{base_q['perplexity']:.2f}", "-", f"{pruned_q['perplexity']:.2f}",
                     f"{pruned_q['perplexity'] / base_q['perplexity']:.2f}x", "-"))
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
    others = [text["file"] for text in result.get("also_eval_texts", [])]
    accuracy = bool(result.get("accuracy_items"))
    speed = result.get("speedup_tokens")
    searched = result.get("search_text") or {}
    search = f"search ppl ({searched['file']})" if searched.get("file") else "search ppl"
    held = result.get("eval_text") or {}
    held_out = f"held-out ppl ({held['file']})" if held.get("file") else "held-out ppl"
    head = (["KV kept"] + ([f"prefill speedup at {speed} tokens"] if speed else []) + [search, held_out]
            + [f"held-out ppl ({name})" for name in others]
            + ([f"accuracy, {result['accuracy_items']} items (retained)",
                "accuracy against the baseline, points (± paired SE)"] if accuracy else []))
    fit = "fitted map of the token and the previous one" if result.get("fit_previous") else "fitted map"
    lines = [f"| method (budget {result['budget']}) | moves: layer:alpha (0 = drop, or the mean with the shift; fit = "
             f"{fit}), blocks removed | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]

    def cells(row: dict, measured: bool) -> str:
        values = [f"{row['kv_kept']:.3f}" if measured else "1.000"]
        values += [f"{row['speedup']:.2f}x" if measured and "speedup" in row else "1.00x"] if speed else []
        values += [f"{row['search_ppl']:.2f}", f"{row['eval_ppl']:.2f}"]
        values += [f"{row['also_eval_ppl'][name]:.2f}" for name in others]
        if accuracy:
            share = f" ({row['accuracy_retained']:.1f}%)" if measured and row.get("accuracy_retained") else ""
            values.append(f"{100 * row['accuracy']:.1f}{share}")
            paired = measured and row.get("accuracy_difference_se") is not None
            values.append(f"{row['accuracy_difference']:+.1f} ± {row['accuracy_difference_se']:.1f}" if paired else "-")
        return " | ".join(values)

    lines.append(f"| baseline | - | {cells(result['baseline'], False)} |")
    for row in result["methods"]:
        name = f"**{row['method']}**" if row == result["pick"] else row["method"]
        if set(row.get("moves", [])) - set(result.get("moves", row.get("moves", []))):
            name += " (outside --moves)"
        lines.append(f"| {name} | {_moves_cell(row)} | {cells(row, True)} |")
    return "\n".join(lines)


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
