"""One handler per subcommand: call the API with the parsed arguments, print what it returns."""

from __future__ import annotations

import sys

from layerdrop import api, model_folder
from layerdrop.cli.options import parse_modules
from layerdrop.cli.parser import sampling
from layerdrop.cli.tables import fidelity_line, harness_table, print_fusions, print_scores, removal_text
from layerdrop.errors import LayerdropError, OverBudget


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _options(args, batch_size: int = 1) -> api.RunOptions:
    """The command's provider and threads, with `batch_size` windows (or sequences) a run."""
    return api.RunOptions(args.provider, args.threads, batch_size)


def cmd_export(args) -> int:
    out = api.export(args.model, args.output, kv_cache=not args.no_kv_cache, dtype=args.dtype, force=args.force,
                     trust_remote_code=args.trust_remote_code, memory_limit=args.memory_limit)
    print(f"exported {'without' if args.no_kv_cache else 'with'} KV cache to {out}")
    return 0


def cmd_score(args) -> int:
    result = api.score(args.model, args.output, calib=args.calib, samples=args.samples, seq_len=args.seq_len,
                       sampling=sampling(args), options=_options(args, args.batch), force=args.force,
                       progress=_progress(args), compare=args.compare, top_n=args.top_n, memory_limit=args.memory_limit)
    print_scores(result["regions"])
    if "compare" in result:
        c = result["compare"]
        print(f"rank overlap: {c['shared']} of the {c['n']} lowest modules are shared with {args.compare.name}")
    if args.json:
        api.write_json(result, args.json)
    if args.output:
        print(f"scored model written to {args.output}")
    return 0


def cmd_inspect(args) -> int:
    info = api.inspect(args.model)
    print(f"family: {info['family'] or 'unknown'}   nodes: {info['nodes']}   regions: {len(info['regions'])}")
    kv = info["kv_bytes_per_token"]
    kv_text = f"{kv} bytes/token ({len(info['kv_layers'])} cached layers)" if kv else "none (no KV-cache inputs)"
    print(f"KV cache: {kv_text}")
    if info["state_layers"]:
        size = info["state_bytes_per_sequence"]
        print(f"previous-token states (not KV; {'unknown' if size is None else size} bytes per sequence, whatever its "
              f"length): layers {' '.join(map(str, info['state_layers']))}")
    rows = info["regions"] + [{**b, "kind": "block"} for b in info["blocks"]]
    print_scores(rows)
    if info["calibration"]:
        c = info["calibration"]
        bos = ", each after a BOS" if c.get("bos") else ""
        print(f"scores from {c['file']} ({c['samples']} x {c['seq_len']} tokens{bos}, sha256 {c['sha256'][:12]})")
    if info["removed"]:
        print("removed or bypassed: " + ", ".join(removal_text(entry) for entry in info["removed"]))
    if args.plot:
        scored = [r for r in rows if "score" in r]
        if not scored:
            raise LayerdropError(f"{args.model} has no scores to plot; run `layerdrop score` first")
        api.plot_scores(scored, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        api.write_json(info, args.json)
    return 0


def cmd_drop(args) -> int:
    targets = parse_modules(args.drop) if args.drop else None
    counts = {k: getattr(args, k) for k in ("attn", "mlp", "block", "joint")}
    result = api.drop(args.model, args.output, targets=targets, counts=counts, iterative=args.iterative,
                      calib=args.calib, samples=args.samples, seq_len=args.seq_len, sampling=sampling(args),
                      options=_options(args), force=args.force, progress=_progress(args), fuse=args.fuse,
                      quantize=args.quantize, memory_limit=args.memory_limit)
    names = ", ".join(f"{e['kind']}:{e['layer']}" for e in result["dropped"])
    print(f"dropped {names}; nodes {result['nodes']['before']} -> {result['nodes']['after']}; written to {args.output}")
    print_fusions(result["fusions"], args.fuse, result.get("fusion_note"))
    if args.json:
        api.write_json(result, args.json)
    return 0


def cmd_harp(args) -> int:
    result = api.harp(args.model, args.output, alphas=args.alpha, top=args.top, search=args.search,
                      search_text=args.search_text, samples=args.samples, seq_len=args.seq_len,
                      sampling=sampling(args), options=_options(args, args.batch_size), force=args.force,
                      progress=_progress(args), fuse=args.fuse, quantize=args.quantize, keep_float=args.keep_float,
                      memory_limit=args.memory_limit)
    print_fusions(result["fusions"], args.fuse, result.get("fusion_note"))
    alphas = ", ".join(f"{layer}={alpha:g}" for layer, alpha in sorted(result["alphas"].items(), reverse=True))
    searched = f" (searched in {result['search_seconds']:.0f} s)" if result["trials"] else ""
    print(f"HARP alphas {alphas}{searched}; written to {args.output}")
    if args.json:
        api.write_json(result, args.json)
    return 0


def _note_one_at_a_time(result: dict) -> None:
    """The note of a measurement that held one model's session at a time for want of memory, if it did."""
    if "one_at_a_time" in result:
        print(f"layerdrop: note: {result['one_at_a_time']}", file=sys.stderr)


def cmd_eval(args) -> int:
    folders = [args.model] + ([args.vs] if args.vs else [])
    tokens = 0 if args.tasks else (args.batch or 1) * args.seq_len  # a task's prompt lengths are its own
    for folder in folders:  # one model's session at a time; every one is checked before any is evaluated
        api.guard_memory("eval", [folder], args.memory_limit, tokens=tokens)
    if args.tasks:
        return _eval_tasks(args)
    results = [api.evaluate(f, text=args.text, samples=args.samples, seq_len=args.seq_len, sampling=sampling(args),
                            options=_options(args, args.batch or 1), progress=_progress(args),
                            memory_limit=args.memory_limit)
               for f in folders]
    for folder, result in zip(folders, results):
        bos = ", each window after a BOS" if result["text"].get("bos") else ""
        print(f"{str(folder):<40} perplexity {result['perplexity']:9.3f}   ({result['tokens']} predicted tokens "
              f"of {result['text']['file']}{bos})")
    report = {"models": [{"path": str(f), **r} for f, r in zip(folders, results)]}
    if len(results) == 2:
        print(f"ratio {results[1]['perplexity'] / results[0]['perplexity']:.3f}")
        from layerdrop.api.evaluate import fidelity

        report["fidelity"] = fidelity(args.model, args.vs, text=args.text, samples=args.samples,
                                      seq_len=args.seq_len, sampling=sampling(args), options=_options(args),
                                      progress=_progress(args), memory_limit=args.memory_limit)
        _note_one_at_a_time(report["fidelity"])
        print(fidelity_line(report["fidelity"]))
    if args.prompt:
        report["generations"] = []
        for folder in folders:
            text = api.generate_text(folder, args.prompt, args.max_new_tokens, options=_options(args))
            report["generations"].append({"path": str(folder), "text": text})
            print(f"--- {folder}\n{args.prompt}{text}")
    if args.json:
        api.write_json(report, args.json)
    return 0


def _eval_tasks(args) -> int:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise LayerdropError("--tasks is empty; name lm-eval tasks, e.g. --tasks hellaswag,arc_easy")
    if args.limit is not None and args.limit <= 0:
        raise LayerdropError(f"--limit must be above 0 (items per task), not {args.limit:g}")
    folders = [args.model] + ([args.vs] if args.vs else [])
    if _standard(tasks, args):
        return _eval_standard_tasks(args, tasks, folders)
    for folder in folders:
        model_folder.load(folder)  # both folders are checked before minutes of evaluation
    results = [api.harness(f, tasks, limit=args.limit, include_path=args.include_path, num_fewshot=args.num_fewshot,
                           options=_options(args, args.batch or 8), progress=_progress(args),
                           memory_limit=args.memory_limit)
               for f in folders]
    text, rows = harness_table([str(f) for f in folders], results)
    print(text)
    if args.json:
        api.write_json({"models": [str(f) for f in folders], "tasks": rows,
                        "generations": [r["generations"] for r in results]}, args.json)
    return 0


def _standard(tasks: list[str], args) -> bool:
    """Whether `tasks` are the offline standard tasks (all of them), not lm-eval tasks of the user's own."""
    from layerdrop.runtime.standard_tasks import STANDARD_TASKS

    known = [t in STANDARD_TASKS or t == "papers" for t in tasks]
    if any(known) and not all(known):
        raise LayerdropError("give either the standard tasks (" + ", ".join(STANDARD_TASKS) + ", papers) or lm-eval "
                             "tasks of your own, not both in one --tasks")
    return all(known) and args.include_path is None and args.num_fewshot is None


def _eval_standard_tasks(args, tasks: list[str], folders: list) -> int:
    from layerdrop.api.evaluate import fidelity, standard_tasks
    from layerdrop.cli.tables import standard_tasks_table

    for folder in folders:  # the fidelity's sessions, one at a time where both do not fit: checked before the tasks
        api.guard_memory("eval", [folder], args.memory_limit, tokens=args.seq_len)
    report = standard_tasks(folders, tasks, limit=args.limit, options=_options(args, args.batch or 8),
                            progress=_progress(args), memory_limit=args.memory_limit)
    if args.vs:
        report["fidelity"] = fidelity(args.model, args.vs, text=args.text, samples=args.samples,
                                      seq_len=args.seq_len, sampling=sampling(args), options=_options(args),
                                      progress=_progress(args), memory_limit=args.memory_limit)
        _note_one_at_a_time(report["fidelity"])
    print(standard_tasks_table(report))
    if args.json:
        api.write_json(report, args.json)
    return 0


def cmd_bench(args) -> int:
    from layerdrop.api.reports import side_by_side
    from layerdrop.runtime.bench import plot_prefill

    result = api.bench(args.base, args.pruned, seqs=args.seq, runs=args.runs, decode_tokens=args.decode,
                       options=_options(args, args.batch), generation=args.generation_memory,
                       reference=args.reference, memory_limit=args.memory_limit)
    _note_one_at_a_time(result)
    print(side_by_side(result, "pruned"))
    if args.json:
        api.write_json(result, args.json)
    if args.plot:
        plot_prefill(result, args.plot)
    return 0


def cmd_check(args) -> int:
    verdict = api.check(args.model, max_bytes=args.max_bytes, max_kv_bytes_per_token=args.max_kv_bytes_per_token,
                        max_attention_layers=args.max_attention_layers)
    if args.json:
        api.write_json({k: v for k, v in verdict.items() if k != "over"}, args.json)
    if verdict["over"]:
        raise OverBudget("over budget: " + "; ".join(verdict["over"]))
    print("within budget: " + ", ".join(f"{k} {verdict['measured'][k]:,}" for k, v in verdict["limits"].items()
                                        if v is not None))
    return 0


def cmd_pipeline(args) -> int:
    from layerdrop.api.reports import pipeline_summary

    report = api.pipeline(args.model, args.output, calib=args.calib, eval_text=args.eval, attn=args.attn,
                          joint=args.joint, harp_top=args.harp, samples=args.samples, seq_len=args.seq_len,
                          eval_samples=args.eval_samples, bench_seq=args.seq, bench_runs=args.runs,
                          sampling=sampling(args), options=_options(args, args.batch_size), resume=args.resume,
                          force=args.force, progress=_progress(args), fuse=args.fuse, builder=args.builder,
                          quantize=args.quantize, memory_limit=args.memory_limit,
                          task_items=args.task_items)
    for note in report["notes"]:
        print(f"layerdrop: note: {note}", file=sys.stderr)
    print(pipeline_summary(report))
    print(f"\nall stages, report.md and report.json are in {args.output}")
    return 0


def cmd_plan(args) -> int:
    from layerdrop.api.reports import plan_summary

    texts = api.PlanTexts(
        calib=args.calib, eval_text=args.eval, search_text=args.search_text, also_eval=tuple(args.also_eval or ()),
        samples=args.samples, search_samples=args.search_samples, eval_samples=args.eval_samples,
        fit_samples=args.fit_samples, seq_len=args.seq_len, sampling=sampling(args), accuracy_items=args.accuracy_items,
        self_samples=args.self_samples, validation_samples=args.validation_samples,
        validation_items=args.validation_items, task_items=args.task_items)
    result = api.plan(args.model, args.output, budget=args.budget, texts=texts, extra=args.extra, moves=args.moves,
                      shift=args.shift, per_layer_moves=args.per_layer_moves, fit_previous=args.fit_previous,
                      pick=args.pick, force=args.force, progress=_progress(args), quantize=args.quantize,
                      keep_float=args.keep_float, speedup_tokens=args.speedup_tokens, speedup_runs=args.speedup_runs,
                      resume=args.resume, memory_limit=args.memory_limit, options=_options(args, args.batch_size))
    for note in result.notes:
        print(f"layerdrop: note: {note}", file=sys.stderr)
    report = result.to_dict()
    print(plan_summary(report))
    print(f"\nsearch took {result.search_seconds:.0f} s; written to {args.output} (this report: "
          f"{args.output / 'plan-report.md'})")
    if args.json:
        api.write_json(report, args.json)
    return 0


def cmd_fuse(args) -> int:
    result = api.fuse(args.model, args.output, force=args.force, memory_limit=args.memory_limit)
    print_fusions(result["fusions"], True, result.get("fusion_note"))
    print(f"nodes {result['nodes']['before']} -> {result['nodes']['after']}; written to {args.output}")
    if args.json:
        api.write_json(result, args.json)
    return 0


def cmd_quantize(args) -> int:
    result = api.quantize(args.model, args.output, block_size=args.block_size, accuracy_level=args.accuracy_level,
                          force=args.force, memory_limit=args.memory_limit)
    sizes = result["bytes"]
    print(f"int4: {result['matmul_nbits']} MatMulNBits, {sizes['before']:,} -> {sizes['after']:,} bytes; written to "
          f"{args.output}")
    if args.json:
        api.write_json(result, args.json)
    return 0


COMMANDS = {"export": cmd_export, "score": cmd_score, "inspect": cmd_inspect, "drop": cmd_drop, "harp": cmd_harp,
            "eval": cmd_eval, "bench": cmd_bench, "check": cmd_check, "pipeline": cmd_pipeline, "plan": cmd_plan,
            "quantize": cmd_quantize, "fuse": cmd_fuse}
