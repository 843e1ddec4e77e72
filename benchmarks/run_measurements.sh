#!/usr/bin/env bash
# Every figure of the README's results, in one run (x86_64, 2 cores: about two hours). Outputs in bench-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
python benchmarks/model_table.py --model smollm2-135m --out "$out/smollm2"
python benchmarks/model_table.py --model gemma3-270m --out "$out/gemma3"
python benchmarks/big_text.py --model "$out/smollm2/pipeline/export" --json "$out/big_text.json"
python benchmarks/bench_scoring.py --model "$out/gemma3/pipeline/export" \
    --hf "${LAYERDROP_CACHE:-$HOME/.cache/layerdrop}/gemma-3-270m" --json "$out/scoring-gemma3.json"
python benchmarks/bench_scoring.py --model "$out/smollm2/pipeline/export" \
    --hf "${LAYERDROP_CACHE:-$HOME/.cache/layerdrop}/SmolLM2-135M-Instruct" --json "$out/scoring-smollm2.json"
