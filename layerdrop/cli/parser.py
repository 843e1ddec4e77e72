"""The command line: one subcommand per API function; values are checked while parsing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerdrop import __version__
from layerdrop.cli.options import (
    parse_alphas,
    parse_bytes,
    parse_count,
    parse_generation,
    parse_items,
    parse_provider,
    parse_runs,
    parse_self_samples,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        print(f"layerdrop: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    parser.add_argument("--provider", type=parse_provider, default="cpu",
                        help="cpu, cuda or auto, or ONNX Runtime's names (CPUExecutionProvider, CUDAExecutionProvider)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _output(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("-o", "--output", type=Path, required=required, help="output model folder")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output folder")


def text_path(value: str) -> Path:
    """A text argument: a bundled text's bare name (calib, prose, eval, docs, code, dictionary) means that text even
    where a file or folder of the same name exists here (write `./docs` for the folder), else the path given."""
    from layerdrop.windows import BUNDLED, bundled_text

    return bundled_text(value) if value in BUNDLED else Path(value)


def _text_options(parser: argparse.ArgumentParser, flag: str | None, what: str, samples: int | None = None) -> None:
    """A text flag with its window count and length (when `flag`), and how windows are taken from texts."""
    from layerdrop.api import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN

    if flag:
        parser.add_argument(flag, type=text_path, default=None, help=f"{what} text: a UTF-8 file, a .jsonl file, a "
                            "folder of them, or a bundled text (calib, prose, eval, docs, code; default: the bundled "
                            "text)")
        parser.add_argument("--samples", type=parse_count, default=samples or DEFAULT_SAMPLES, help="windows to use")
        parser.add_argument("--seq-len", type=parse_count, default=DEFAULT_SEQ_LEN,
                            help="text tokens per window (a BOS comes first where the tokenizer adds one)")
    _sampling_options(parser)


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="which windows are drawn across the text (default 0)")
    parser.add_argument("--from-start", action="store_true",
                        help="consecutive windows from the start of each text instead of windows spread across it")
    parser.add_argument("--text-field", default="text", help="the field that holds the text in JSON Lines files")


def sampling(args):
    """The parsed sampling options as a `Sampling`."""
    from layerdrop.windows import Sampling

    return Sampling(seed=args.seed, from_start=args.from_start, text_field=args.text_field)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerdrop", description="Drop or bypass redundant layers of exported LLMs (ONNX).")
    parser.add_argument("--version", action="version", version=f"layerdrop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("export", help="export a HF model folder or GGUF file (default: SmolLM2-135M) to ONNX")
    p.add_argument("model", nargs="?", type=Path, help="HF model folder, .gguf file, or a known model: "
                   "smollm2-135m (the default), gemma3-270m, qwen2.5-coder-1.5b")
    _output(p)
    p.add_argument("--no-kv-cache", action="store_true", help="export without KV-cache inputs/outputs")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--trust-remote-code", action="store_true", help="allow models with custom code (auto_map)")
    _memory_option(p)
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("score", help="attach calibration scores S = 1 - cos(X, Y) to every region")
    p.add_argument("model", type=Path, help="model folder or model.onnx")
    _output(p, required=False)
    _text_options(p, "--calib", "calibration")
    p.add_argument("--batch-size", "--batch", dest="batch", type=parse_count, default=1,
                   help="windows per ONNX Runtime call")
    p.add_argument("--json", type=Path, help="write the scores as JSON")
    p.add_argument("--compare", type=text_path, help="second calibration text: report the overlap of the rankings")
    p.add_argument("--top-n", type=parse_count, default=8, help="n for --compare (default 8)")
    _memory_option(p)
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
    _quantize_option(p)
    _memory_option(p)
    _common(p)

    p = sub.add_parser("harp", help="replace top-layer attention by a rescaled V·O projection (HARP)")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--alpha", type=parse_alphas, metavar="LAYER=A,...", help="explicit alphas, e.g. 29=0.8,28=0.2")
    p.add_argument("--top", type=parse_count, metavar="K", help="bypass the top K attention layers")
    p.add_argument("--search", action="store_true", help="search alphas greedily top-down (needs --top)")
    _text_options(p, "--search-text", "search (its search part, if it is the calibration text)", samples=8)
    p.add_argument("--batch-size", type=parse_count, default=1, help="windows per ONNX Runtime run in the search")
    p.add_argument("--json", type=Path, help="write the alphas and every perplexity tried as JSON")
    p.add_argument("--fuse", action="store_true", help="apply ONNX Runtime fusions after the rewrite")
    _quantize_option(p)
    _memory_option(p)
    _common(p)

    p = sub.add_parser("eval", help="perplexity (and greedy generations) of one model or two side by side")
    p.add_argument("model", type=Path)
    p.add_argument("--vs", type=Path, help="a second model evaluated on the same windows")
    _text_options(p, "--text", "evaluation", samples=32)
    p.add_argument("--batch-size", "--batch", dest="batch", type=parse_count, default=None,
                   help="sequences per run (default 1; 8 with --tasks)")
    p.add_argument("--prompt", help="also show greedy generations for this prompt (uses the KV cache)")
    p.add_argument("--max-new-tokens", type=parse_count, default=32)
    p.add_argument("--tasks", help="lm-evaluation-harness tasks instead of perplexity, e.g. hellaswag,arc_easy "
                   "(needs the eval extra)")
    p.add_argument("--limit", type=float, help="with --tasks: at most this many examples per task (or a fraction)")
    p.add_argument("--num-fewshot", type=int, help="with --tasks: few-shot examples per prompt")
    p.add_argument("--include-path", type=Path, help="with --tasks: a folder of your own task YAML files")
    p.add_argument("--json", type=Path)
    _memory_option(p)
    _common(p)

    p = sub.add_parser("bench", help="prefill/decode speed, memory and size of two models side by side")
    p.add_argument("base", type=Path)
    p.add_argument("pruned", type=Path)
    p.add_argument("--seq", type=_seq_list, default=None, help="prefill lengths (default CPU 256,1024; CUDA "
                   "512,1024,2048,4096)")
    p.add_argument("--batch-size", "--batch", dest="batch", type=parse_count, default=1, help="sequences per run")
    p.add_argument("--runs", type=parse_count, default=5)
    p.add_argument("--decode", type=parse_count, default=32, help="tokens for the decode measurement")
    p.add_argument("--reference", type=Path, help="a third folder timed alongside, e.g. onnxruntime-genai's model "
                   "builder graph of the same model (prefill and decode)")
    p.add_argument("--generation-memory", type=parse_generation, metavar="BATCH,CONTEXT,NEW",
                   help="also the peak memory of generating NEW tokens after CONTEXT for BATCH sequences, where the "
                   "KV cache shows (e.g. 8,2048,64)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    _memory_option(p)
    _common(p)

    p = sub.add_parser("quantize", help="int4 weights (MatMulNBits) through ONNX Runtime's quantizer")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--block-size", type=parse_count, default=32, help="weights per scale (16, 32, 64, 128, ...)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None,
                   help="MatMulNBits accuracy level (default 4, as the model builder writes for CPU: int8 "
                   "activations; 0: float activations)")
    p.add_argument("--json", type=Path)
    _memory_option(p)
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("fuse", help="ONNX Runtime's transformer fusions on a model folder (fuse last)")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--json", type=Path)
    _memory_option(p)
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("check", help="CI gate: exit 0 within budget, 1 over budget, 2 on bad input")
    p.add_argument("model", type=Path)
    p.add_argument("--max-bytes", type=parse_bytes, help="model file bytes, e.g. 500MB or 1.5GiB")
    p.add_argument("--max-kv-bytes-per-token", type=parse_bytes)
    p.add_argument("--max-attention-layers", type=int)
    p.add_argument("--json", type=Path)
    p.add_argument("--debug", action="store_true")

    p = sub.add_parser("pipeline", help="export -> score -> drop -> eval -> bench on one model (default SmolLM2)")
    p.add_argument("model", nargs="?", type=Path, help="HF folder, .gguf, ONNX folder, or a known model: "
                   "smollm2-135m (the default), gemma3-270m, qwen2.5-coder-1.5b")
    p.add_argument("-o", "--output", type=Path, default=Path("out/pipeline"))
    p.add_argument("--calib", type=text_path)
    p.add_argument("--eval", type=text_path)
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
    p.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="write the rewritten model unfused (default: ONNX Runtime fusions, and the bench's base "
                   "fused the same way)")
    p.add_argument("--fuse", dest="fuse", action="store_true", help=argparse.SUPPRESS)  # the default; kept for scripts
    p.add_argument("--no-builder", dest="builder", action="store_false",
                   help="no bench column for onnxruntime-genai's model builder graph (default: one when "
                   "onnxruntime-genai is installed and the model has a Hugging Face folder)")
    _quantize_option(p)
    p.add_argument("--task-items", type=int, default=0, metavar="N",
                   help="also the papers' standard tasks (arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, "
                   "openbookqa, lambada_openai; offline, from the task data), the first N items of each, base against "
                   "the output (default 0: none; 100 take about 15 minutes on SmolLM2)")
    p.add_argument("--batch-size", type=parse_count, default=1, help="windows per ONNX Runtime run")
    _sampling_options(p)
    _memory_option(p)
    _common(p)

    p = sub.add_parser("plan", help="for a budget, choose which attention layers or blocks go and "
                       "how (drop, bypass, fit, fitted run)")
    p.add_argument("model", type=Path)
    _output(p)
    p.add_argument("--budget", required=True, help="attn=N | kv=FRACTION_KEPT | speedup=X[@TOKENS] | blocks=N")
    p.add_argument("--calib", type=text_path, help="text for scores and the search: a file, a folder or a bundled text "
                   "(calib, prose, eval, docs, code; default: calib, the mixed one)")
    p.add_argument("--eval", type=text_path, help="held-out text for the comparison table (default: the bundled eval)")
    p.add_argument("--search-text", type=text_path, help="text every choice is made on (alphas, layers, ridges, the "
                   "pick; default: the search part of --calib); e.g. --calib mine.txt --search-text calib keeps "
                   "estimates on your text and choices on the bundled mix of kinds")
    p.add_argument("--also-eval", type=text_path, action="append", default=[], metavar="TEXT",
                   help="another held-out text for a column of its own (repeatable; e.g. --also-eval docs)")
    p.add_argument("--accuracy-items", type=parse_items, default=200, help="multiple-choice items built from the "
                   "held-out text for the accuracy column, run through lm-eval (0: no column; needs the eval extra)")
    p.add_argument("--samples", type=parse_count, default=64, help="scoring windows (if the model is unscored)")
    p.add_argument("--search-samples", type=parse_count, default=16, help="windows of search text per evaluation")
    p.add_argument("--eval-samples", type=parse_count, default=32)
    p.add_argument("--seq-len", type=parse_count, default=256)
    p.add_argument("--extra", type=int, default=4, help="candidates beyond the budget in the search pool")
    p.add_argument("--batch-size", type=parse_count, default=1, help="windows per ONNX Runtime run")
    p.add_argument("--no-shift", dest="shift", action="store_false",
                   help="without the mean shift (the same as leaving shift out of --moves)")
    p.add_argument("--moves", help="the moves allowed: drop, bypass, shift, fit (the default for attn and kv "
                   "budgets; with fit the planner searches fitted maps, without it drops and bypasses; --moves "
                   "drop,bypass searches the papers' moves only), blocks (the default for blocks=N); a speedup "
                   "budget takes any of them (default all)")
    p.add_argument("--per-layer-moves", action="store_true",
                   help="after the fit search, choose each chosen layer's move again among its fit, a drop and its "
                   "bypass alphas (needs fit and drop or bypass allowed; costs a few minutes on SmolLM2)")
    p.add_argument("--speedup-tokens", type=parse_count, help="prefill length of the measured speedup column "
                   "(default: a speedup budget's, else --seq-len)")
    p.add_argument("--speedup-runs", type=parse_runs, default=5, help="timed prefill runs per row for that column, "
                   "alternating with the baseline's; rows with the same ops on the same weight shapes share their "
                   "runs, and a speedup budget's sizing confirms its counts with this many (0: no column)")
    p.add_argument("--fit-samples", type=parse_count, default=64, help="calibration windows the fits are estimated on")
    p.add_argument("--self-samples", type=parse_self_samples, default=0,
                   help="windows the model writes itself (random first token, temperature 1) added to the fits' "
                   "calibration windows: a prior toward the model's own text where --calib is of one kind (default 0;"
                   " 64 take about 2 minutes for SmolLM2 on 2 cores)")
    p.add_argument("--fit-per-token", dest="fit_previous", action="store_false", default=None,
                   help="fitted attention maps read the current token alone (default: they also read the previous "
                   "token's normalized input, better on kinds of text the calibration lacks; the layer's KV cache "
                   "becomes a one-token state, past_key_values.N.conv_state, that layerdrop's runtime and "
                   "onnxruntime-genai carry in greedy and sampling search, not beam search)")
    p.add_argument("--fit-previous", dest="fit_previous", action="store_true",
                   help="maps that also read the previous token (the default where fit is allowed; named, it "
                   "requires fit in --moves)")
    p.add_argument("--pick", default="guarded", metavar="CRITERION",
                   help="how the pick is chosen among the rows, on validation evidence no fit or search saw: guarded "
                   "(default: the best row by the validation measure that the best paper row by it does not beat on a "
                   "validation kind, nor the paper row best on the validation tasks on them beyond noise; else that "
                   "paper row), validation "
                   "(geometric mean of perplexity ratios over the validation kinds), "
                   "worst-kind, tasks (the validation task items), search (the search perplexity)")
    p.add_argument("--validation-samples", type=int, default=16, help="windows of each validation kind (the "
                   "calibration text's held-out part, and the bundled mix where it is not the calibration text; 0: "
                   "none)")
    p.add_argument("--validation-items", type=int, default=150, help="validation items of each "
                   "validation task: the first of ARC-Easy's, ARC-Challenge's and OpenBookQA's validation splits, the "
                   "last of HellaSwag, PIQA and LAMBADA (never the first ones reported; 0: none)")
    p.add_argument("--task-items", type=int, default=0, metavar="N",
                   help="a column of the papers' standard tasks (lm-eval's arc_easy, arc_challenge, hellaswag, piqa, "
                   "winogrande, boolq, openbookqa, lambada_openai; offline, from the task data): the first N items of "
                   "each, held out (nothing is chosen on them); about 100 take a few minutes a row on SmolLM2 "
                   "(default 0: no column)")
    p.add_argument("--resume", action="store_true", help="go on from the finished measurements of an interrupted "
                   "plan of the same -o, kept in .NAME.plan-work beside it (removed once the plan is written); a "
                   "changed input recomputes what depends on it")
    _quantize_option(p)
    p.add_argument("--json", type=Path)
    _memory_option(p)
    _sampling_options(p)
    _common(p)
    return parser


def _memory_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-limit", type=parse_bytes, default=None, help="refuse, before starting, a run whose "
                        "estimated peak memory is over this (e.g. 24GB; default $LAYERDROP_MEMORY_LIMIT, else 16GB)")


def _quantize_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=("int4",), help="write int4 weights (MatMulNBits, ONNX Runtime's "
                        "quantizer) after the rewrite")
    parser.add_argument("--keep-float", action="store_true", help="on an int4 graph, keep the matrices a rewrite "
                        "computes (V·O, fits) in float instead of writing them back as MatMulNBits")


def _seq_list(text: str) -> tuple[int, ...]:
    return tuple(parse_count(part) for part in text.split(","))
