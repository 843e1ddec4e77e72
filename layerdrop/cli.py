"""The `layerdrop` command: a thin layer over layerdrop.api. Errors become one line and an exit code."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

from layerdrop import model_folder
from layerdrop.errors import LayerdropError
from layerdrop.options import parse_alphas, parse_bytes, parse_count, parse_modules


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        print(f"layerdrop: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    parser.add_argument("--provider", choices=("cpu", "cuda", "auto"), default="cpu")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _output(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("-o", "--output", type=Path, required=required, help="output model folder")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output folder")


def _text_options(parser: argparse.ArgumentParser, flag: str | None, what: str, samples: int | None = None) -> None:
    """A text flag with its window count and length (when `flag`), and how windows are taken from texts."""
    from layerdrop.api import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN

    if flag:
        parser.add_argument(flag, type=Path, default=None, help=f"{what} text: a UTF-8 file, a .jsonl file or a "
                            "folder of them (default: the bundled text)")
        parser.add_argument("--samples", type=parse_count, default=samples or DEFAULT_SAMPLES, help="windows to use")
        parser.add_argument("--seq-len", type=parse_count, default=DEFAULT_SEQ_LEN,
                            help="text tokens per window (a BOS comes first where the tokenizer adds one)")
    _sampling_options(parser)


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="which windows are drawn across the text (default 0)")
    parser.add_argument("--from-start", action="store_true",
                        help="consecutive windows from the start of each text instead of windows spread across it")
    parser.add_argument("--text-field", default="text", help="the field that holds the text in JSON Lines files")


def _sampling(args):
    from layerdrop.windows import Sampling

    return Sampling(seed=args.seed, from_start=args.from_start, text_field=args.text_field)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerdrop", description="Drop or bypass redundant layers of exported LLMs (ONNX).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("export", help="export a HF model folder or GGUF file (default: SmolLM2-135M) to ONNX")
    p.add_argument("model", nargs="?", type=Path, help="HF model folder, .gguf file, or a known model: "
                   "smollm2-135m (the default), gemma3-270m")
    _output(p)
    p.add_argument("--no-kv-cache", action="store_true", help="export without KV-cache inputs/outputs")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--trust-remote-code", action="store_true", help="allow models with custom code (auto_map)")
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("score", help="attach calibration scores S = 1 - cos(X, Y) to every region")
    p.add_argument("model", type=Path, help="model folder or model.onnx")
    _output(p, required=False)
    _text_options(p, "--calib", "calibration")
    p.add_argument("--batch", type=parse_count, default=1, help="windows per ONNX Runtime call")
    p.add_argument("--json", type=Path, help="write the scores as JSON")
    p.add_argument("--compare", type=Path, help="second calibration text: report the overlap of the rankings")
    p.add_argument("--top-n", type=parse_count, default=8, help="n for --compare (default 8)")
    _common(p)

    p = sub.add_parser("inspect", help="show regions, scores, KV bytes per token and what was removed")
    p.add_argument("model", type=Path)
    p.add_argument("--plot", type=Path, help="draw the scores to a PNG")
    p.add_argument("--json", type=Path, help="write the table as JSON")
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("drop", help="delete attention/MLP branches or whole blocks")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--drop", action="append", default=[], metavar="KIND:LAYERS", help="e.g. attn:3,6 mlp:12")
    for kind in ("attn", "mlp", "block", "joint"):
        p.add_argument(f"--{kind}", type=parse_count, metavar="N", help=f"drop the N lowest-scored {kind} modules")
    p.add_argument("--iterative", action="store_true", help="re-score after each single drop (needs text)")
    _text_options(p, "--calib", "calibration")
    p.add_argument("--json", type=Path, help="write what was dropped as JSON")
    p.add_argument("--fuse", action="store_true", help="apply ONNX Runtime fusions after the drop")
    _common(p)

    p = sub.add_parser("harp", help="replace top-layer attention by a rescaled V·O projection (HARP)")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--alpha", type=parse_alphas, metavar="LAYER=A,...", help="explicit alphas, e.g. 29=0.8,28=0.2")
    p.add_argument("--top", type=parse_count, metavar="K", help="bypass the top K attention layers")
    p.add_argument("--search", action="store_true", help="search alphas greedily top-down (needs --top)")
    _text_options(p, "--search-text", "search (its search part, if it is the calibration text)", samples=8)
    p.add_argument("--json", type=Path, help="write the alphas and every perplexity tried as JSON")
    p.add_argument("--fuse", action="store_true", help="apply ONNX Runtime fusions after the rewrite")
    _common(p)

    p = sub.add_parser("eval", help="perplexity (and greedy generations) of one model or two side by side")
    p.add_argument("model", type=Path)
    p.add_argument("--vs", type=Path, help="a second model evaluated on the same windows")
    _text_options(p, "--text", "evaluation", samples=32)
    p.add_argument("--batch", type=parse_count, default=None, help="sequences per run (default 1; 8 with --tasks)")
    p.add_argument("--prompt", help="also show greedy generations for this prompt (uses the KV cache)")
    p.add_argument("--max-new-tokens", type=parse_count, default=32)
    p.add_argument("--tasks", help="lm-evaluation-harness tasks instead of perplexity, e.g. hellaswag,arc_easy "
                   "(needs the eval extra)")
    p.add_argument("--limit", type=float, help="with --tasks: at most this many examples per task (or a fraction)")
    p.add_argument("--num-fewshot", type=int, help="with --tasks: few-shot examples per prompt")
    p.add_argument("--include-path", type=Path, help="with --tasks: a folder of your own task YAML files")
    p.add_argument("--json", type=Path)
    _common(p)

    p = sub.add_parser("bench", help="prefill/decode speed, memory and size of two models side by side")
    p.add_argument("base", type=Path)
    p.add_argument("pruned", type=Path)
    p.add_argument("--seq", type=_seq_list, default=None, help="prefill lengths (default CPU 256,1024; CUDA "
                   "512,1024,2048,4096)")
    p.add_argument("--batch", type=parse_count, default=1)
    p.add_argument("--runs", type=parse_count, default=5)
    p.add_argument("--decode", type=parse_count, default=32, help="tokens for the decode measurement")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    _common(p)

    p = sub.add_parser("check", help="CI gate: exit 0 within budget, 1 over budget, 2 on bad input")
    p.add_argument("model", type=Path)
    p.add_argument("--max-bytes", type=parse_bytes, help="model file bytes, e.g. 500MB or 1.5GiB")
    p.add_argument("--max-kv-bytes-per-token", type=parse_bytes)
    p.add_argument("--max-attention-layers", type=int)
    p.add_argument("--json", type=Path)
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("pipeline", help="export -> score -> drop -> eval -> bench on one model (default SmolLM2)")
    p.add_argument("model", nargs="?", type=Path, help="HF folder, .gguf, ONNX folder, or a known model: "
                   "smollm2-135m (the default), gemma3-270m")
    p.add_argument("-o", "--output", type=Path, default=Path("out/pipeline"))
    p.add_argument("--calib", type=Path)
    p.add_argument("--eval", type=Path)
    p.add_argument("--attn", type=parse_count, help="drop the N lowest-scored attention layers (default L/4)")
    p.add_argument("--joint", type=parse_count, help="drop the N lowest of attention and MLP together")
    p.add_argument("--harp", type=parse_count, metavar="K", help="HARP on the top K layers with searched alphas")
    p.add_argument("--samples", type=parse_count, default=64, help="calibration windows")
    p.add_argument("--seq-len", type=parse_count, default=256)
    p.add_argument("--eval-samples", type=parse_count, default=32)
    p.add_argument("--seq", type=_seq_list, default=(256, 1024), help="bench prefill lengths")
    p.add_argument("--runs", type=parse_count, default=5)
    p.add_argument("--resume", action="store_true", help="skip stages whose output matches their inputs")
    p.add_argument("--force", action="store_true", help="redo every stage in a non-empty OUTDIR")
    p.add_argument("--fuse", action="store_true", help="apply ONNX Runtime fusions to the rewritten model")
    _sampling_options(p)
    _common(p)

    p = sub.add_parser("plan", help="for a budget, choose which attention layers go and how (drop or bypass)")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--budget", required=True, help="attn=N | kv=FRACTION_KEPT | speedup=X[@TOKENS]")
    p.add_argument("--calib", type=Path, help="text for scores and the search (default: bundled calibration text)")
    p.add_argument("--eval", type=Path, help="held-out text for the comparison table (default: bundled eval text)")
    p.add_argument("--samples", type=parse_count, default=64, help="scoring windows (if the model is unscored)")
    p.add_argument("--search-samples", type=parse_count, default=8, help="windows of search text per evaluation")
    p.add_argument("--eval-samples", type=parse_count, default=32)
    p.add_argument("--seq-len", type=parse_count, default=256)
    p.add_argument("--extra", type=int, default=4, help="candidates beyond the budget in the search pool")
    p.add_argument("--no-shift", dest="shift", action="store_false",
                   help="search the papers' moves only (keep, drop, V·O bypass), without the mean shift")
    p.add_argument("--json", type=Path)
    _sampling_options(p)
    _common(p)
    return parser


def _seq_list(text: str) -> tuple[int, ...]:
    return tuple(parse_count(part) for part in text.split(","))


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def cmd_export(args) -> int:
    from layerdrop.export.onnx_export import export_folder

    out = export_folder(args.model, args.output, kv_cache=not args.no_kv_cache, dtype=args.dtype, force=args.force,
                        trust_remote_code=args.trust_remote_code)
    print(f"exported {'without' if args.no_kv_cache else 'with'} KV cache to {out}")
    return 0


def cmd_score(args) -> int:
    from layerdrop import api

    result = api.score(args.model, args.output, calib=args.calib, samples=args.samples, seq_len=args.seq_len,
                       sampling=_sampling(args), batch_size=args.batch, provider=args.provider, threads=args.threads,
                       force=args.force, progress=_progress(args))
    if args.compare:
        other = api.score(args.model, None, calib=args.compare, samples=args.samples, seq_len=args.seq_len,
                          sampling=_sampling(args), batch_size=args.batch, provider=args.provider,
                          threads=args.threads, progress=_progress(args))
        result["compare"] = {"calibration": other["calibration"],
                             **api.rank_overlap(result["regions"], other["regions"], args.top_n)}
    _print_scores(result["regions"])
    if "compare" in result:
        c = result["compare"]
        print(f"rank overlap: {c['shared']} of the {c['n']} lowest modules are shared with {args.compare.name}")
    if args.json:
        api.write_json(result, args.json)
    if args.output:
        print(f"scored model written to {args.output}")
    return 0


def _print_scores(rows: list[dict]) -> None:
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


def _removal_text(entry: dict) -> str:
    """attn:29, or attn:29(alpha 0.5) for a HARP bypass, with ", mean shift" when the planner shifted it."""
    if "alpha" not in entry:
        return f"{entry['kind']}:{entry['layer']}"
    return f"{entry['kind']}:{entry['layer']}(alpha {entry['alpha']}{', mean shift' if entry.get('shift') else ''})"


def cmd_inspect(args) -> int:
    from layerdrop import api

    info = api.inspect(args.model)
    print(f"family: {info['family'] or 'unknown'}   nodes: {info['nodes']}   regions: {len(info['regions'])}")
    kv = info["kv_bytes_per_token"]
    kv_text = f"{kv} bytes/token ({len(info['kv_layers'])} cached layers)" if kv else "none (no KV-cache inputs)"
    print(f"KV cache: {kv_text}")
    rows = info["regions"] + [{**b, "kind": "block"} for b in info["blocks"]]
    _print_scores(rows)
    if info["calibration"]:
        c = info["calibration"]
        print(f"scores from {c['file']} ({c['samples']} x {c['seq_len']} tokens, sha256 {c['sha256'][:12]})")
    if info["removed"]:
        removed = ", ".join(_removal_text(entry) for entry in info["removed"])
        print(f"removed or bypassed: {removed}")
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
    from layerdrop import api

    targets = parse_modules(args.drop) if args.drop else None
    counts = {k: getattr(args, k) for k in ("attn", "mlp", "block", "joint")}
    result = api.drop(args.model, args.output, targets=targets, counts=counts, iterative=args.iterative,
                      calib=args.calib, samples=args.samples, seq_len=args.seq_len, sampling=_sampling(args),
                      provider=args.provider, threads=args.threads, force=args.force, progress=_progress(args),
                      fuse=args.fuse)
    names = ", ".join(f"{e['kind']}:{e['layer']}" for e in result["dropped"])
    print(f"dropped {names}; nodes {result['nodes']['before']} -> {result['nodes']['after']}; written to {args.output}")
    _print_fusions(result["fusions"], args.fuse)
    if args.json:
        api.write_json(result, args.json)
    return 0


def cmd_harp(args) -> int:
    from layerdrop import api

    result = api.harp(args.model, args.output, alphas=args.alpha, top=args.top, search=args.search,
                      search_text=args.search_text, samples=args.samples, seq_len=args.seq_len,
                      sampling=_sampling(args), provider=args.provider, threads=args.threads, force=args.force,
                      progress=_progress(args), fuse=args.fuse)
    _print_fusions(result["fusions"], args.fuse)
    alphas = ", ".join(f"{layer}={alpha:g}" for layer, alpha in sorted(result["alphas"].items(), reverse=True))
    searched = f" (searched in {result['search_seconds']:.0f} s)" if result["trials"] else ""
    print(f"HARP alphas {alphas}{searched}; written to {args.output}")
    if args.json:
        api.write_json(result, args.json)
    return 0


def _print_fusions(counts: dict[str, int], asked: bool) -> None:
    if asked:
        fused = ", ".join(f"{name} x{count}" for name, count in counts.items()) or "nothing matched"
        print(f"ONNX Runtime fusions: {fused}")


def cmd_eval(args) -> int:
    from layerdrop import api

    if args.tasks:
        return _eval_tasks(args)
    folders = [args.model] + ([args.vs] if args.vs else [])
    results = [api.evaluate(f, text=args.text, samples=args.samples, seq_len=args.seq_len,
                            sampling=_sampling(args), batch_size=args.batch or 1, provider=args.provider,
                            threads=args.threads, progress=_progress(args)) for f in folders]
    for folder, result in zip(folders, results):
        bos = ", each window after a BOS" if result["text"].get("bos") else ""
        print(f"{str(folder):<40} perplexity {result['perplexity']:9.3f}   ({result['tokens']} predicted tokens "
              f"of {result['text']['file']}{bos})")
    if len(results) == 2:
        print(f"ratio {results[1]['perplexity'] / results[0]['perplexity']:.3f}")
    report = {"models": [{"path": str(f), **r} for f, r in zip(folders, results)]}
    if args.prompt:
        report["generations"] = []
        for folder in folders:
            text = api.generate_text(folder, args.prompt, args.max_new_tokens, provider=args.provider)
            report["generations"].append({"path": str(folder), "text": text})
            print(f"--- {folder}\n{args.prompt}{text}")
    if args.json:
        api.write_json(report, args.json)
    return 0


def _eval_tasks(args) -> int:
    from layerdrop import api

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise LayerdropError("--tasks is empty; name lm-eval tasks, e.g. --tasks hellaswag,arc_easy")
    folders = [args.model] + ([args.vs] if args.vs else [])
    for folder in folders:
        model_folder.load(folder)  # both folders are checked before minutes of evaluation
    results = [api.harness(f, tasks, limit=args.limit, include_path=args.include_path, num_fewshot=args.num_fewshot,
                           batch_size=args.batch or 8, provider=args.provider,
                           progress=_progress(args)) for f in folders]
    text, rows = api.harness_table([str(f) for f in folders], results)
    print(text)
    if args.json:
        api.write_json({"models": [str(f) for f in folders], "tasks": rows,
                        "generations": [r["generations"] for r in results]}, args.json)
    return 0


def cmd_bench(args) -> int:
    from layerdrop import api
    from layerdrop.runtime.bench import compare, plot_prefill

    for folder in (args.base, args.pruned):
        model_folder.load(folder)  # validates both folders first, with clear errors
    seqs = args.seq or ((512, 1024, 2048, 4096) if args.provider == "cuda" else (256, 1024))
    result = compare(args.base, args.pruned, seqs=seqs, batch=args.batch, runs=args.runs, decode_tokens=args.decode,
                     provider=args.provider, threads=args.threads)
    from layerdrop.pipeline import side_by_side

    print(side_by_side(result, "pruned"))
    if args.json:
        api.write_json(result, args.json)
    if args.plot:
        plot_prefill(result, args.plot)
    return 0


def cmd_check(args) -> int:
    from layerdrop import api
    from layerdrop.errors import OverBudget
    from layerdrop.runtime.bench import model_bytes

    info = api.inspect(args.model)
    folder = model_folder.resolve(args.model).path
    measured = {"bytes": model_bytes(folder), "kv_bytes_per_token": info["kv_bytes_per_token"] or 0,
                "attention_layers": sum(r["kind"] == "attn" for r in info["regions"])}
    limits = {"bytes": args.max_bytes, "kv_bytes_per_token": args.max_kv_bytes_per_token,
              "attention_layers": args.max_attention_layers}
    if all(v is None for v in limits.values()):
        raise LayerdropError("give at least one budget: --max-bytes, --max-kv-bytes-per-token, --max-attention-layers")
    over = [f"{k} {measured[k]:,} > {v:,}" for k, v in limits.items() if v is not None and measured[k] > v]
    if args.json:
        api.write_json({"measured": measured, "limits": limits, "within_budget": not over}, args.json)
    if over:
        raise OverBudget("over budget: " + "; ".join(over))
    print("within budget: " + ", ".join(f"{k} {measured[k]:,}" for k, v in limits.items() if v is not None))
    return 0


def cmd_pipeline(args) -> int:
    from layerdrop.pipeline import run_pipeline, side_by_side

    report = run_pipeline(args.model, args.output, calib=args.calib, eval_text=args.eval, attn=args.attn,
                          joint=args.joint, harp_top=args.harp, samples=args.samples, seq_len=args.seq_len,
                          eval_samples=args.eval_samples, bench_seq=args.seq, bench_runs=args.runs,
                          sampling=_sampling(args), provider=args.provider, threads=args.threads,
                          resume=args.resume, force=args.force, progress=_progress(args), fuse=args.fuse)
    print(side_by_side(report["bench"], report["method"], report["quality"]))
    print(f"all stages and report.json are in {args.output}")
    return 0


def cmd_plan(args) -> int:
    from layerdrop import api

    result = api.plan(args.model, args.output, budget=args.budget, calib=args.calib, eval_text=args.eval,
                      samples=args.samples, search_samples=args.search_samples, eval_samples=args.eval_samples,
                      seq_len=args.seq_len, sampling=_sampling(args), extra=args.extra, shift=args.shift,
                      provider=args.provider,
                      threads=args.threads, force=args.force, progress=_progress(args))
    print(plan_table(result))
    print(f"pick: {result['pick']['method']}; search took {result['search_seconds']:.0f} s; written to {args.output}")
    if args.json:
        api.write_json(result, args.json)
    return 0


def plan_table(result: dict) -> str:
    """The planner's comparison (markdown): every method at the same budget, search and held-out perplexity."""
    count = result["attention_layers"]
    lines = [f"| method ({count} attention layers, KV kept {result['kv_fraction_kept']:.3f}) | layers: alpha "
             "(0 = drop, or the mean with the shift) | search ppl | held-out ppl |", "|---|---|---|---|",
             f"| baseline | - | {result['baseline']['search_ppl']:.2f} | {result['baseline']['eval_ppl']:.2f} |"]
    for row in result["methods"]:
        alphas = " ".join(f"{k}:{v:g}" for k, v in sorted(row["alphas"].items(), key=lambda kv: -int(kv[0])))
        name = f"**{row['method']}**" if row == result["pick"] else row["method"]
        lines.append(f"| {name} | {alphas} | {row['search_ppl']:.2f} | {row['eval_ppl']:.2f} |")
    return "\n".join(lines)


COMMANDS = {"export": cmd_export, "score": cmd_score, "inspect": cmd_inspect, "drop": cmd_drop, "harp": cmd_harp,
            "eval": cmd_eval, "bench": cmd_bench, "check": cmd_check, "pipeline": cmd_pipeline, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `layerdrop` console command; returns the exit code."""
    parser = build_parser()
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "tasks", None):  # lm-eval's standard tasks download their data; nothing else may
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return COMMANDS[args.command](args)
    except LayerdropError as exc:
        if debug:
            traceback.print_exc()
        print(f"layerdrop: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("layerdrop: interrupted; no partial output was left", file=sys.stderr)
        return 130
    except MemoryError:
        print("layerdrop: error: out of memory; use fewer --samples, a shorter --seq-len or --batch 1",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        if debug:
            traceback.print_exc()
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        print(f"layerdrop: error: {type(exc).__name__}: {reason} (rerun with --debug for details)", file=sys.stderr)
        return 1


def run() -> None:
    """The console command: `main`, then exit with its code.

    After Ctrl-C the process leaves through os._exit: CI saw CPython 3.11 kill itself with SIGINT at shutdown
    (exit -2) after `main` had handled the interrupt during torch.export; CPython keeps a flag for a
    KeyboardInterrupt seen in C-API code, which handling it in Python does not clear. Outputs are already
    cleaned up by the time `main` returns.
    """
    code = main()
    if code == 130:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
