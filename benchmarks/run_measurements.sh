#!/usr/bin/env bash
# Every figure of the README's results, in one run (x86_64, 2 cores: about four hours). Outputs in bench-out/.
# Gemma's plan searches a smaller pool on fewer windows (--plan-args) to fit the same time as SmolLM2's.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
cache=${LAYERDROP_CACHE:-$HOME/.cache/layerdrop}
python benchmarks/model_table.py --model smollm2-135m --out "$out/smollm2"
python benchmarks/model_table.py --model gemma3-270m --out "$out/gemma3" \
    --plan-args "--extra 2 --search-samples 4 --fit-samples 16"
bash benchmarks/plan_mixed.sh "$out/smollm2/pipeline/export" "$out/plan-mixed"        # the mixed default text
bash benchmarks/plan_speedup.sh "$out/plan-mixed/scored" "$out/plan-speedup"  # a 25% speedup, blocks allowed
python benchmarks/bench_scoring.py --model "$out/gemma3/pipeline/export" --hf "$cache/gemma-3-270m" \
    --json "$out/scoring-gemma3.json"
python benchmarks/big_text.py --model "$out/smollm2/pipeline/export" --json "$out/big_text.json"
python benchmarks/bench_scoring.py --model "$out/smollm2/pipeline/export" --hf "$cache/SmolLM2-135M-Instruct" \
    --json "$out/scoring-smollm2.json"
python benchmarks/int4_workflow.py --out "$out/int4" --json "$out/int4.json" --export "$out/smollm2/pipeline/export"
python benchmarks/deploy_table.py --out "$out/deploy"
bash benchmarks/int4_levels.sh "$out/deploy" "$out/int4-levels"
python benchmarks/op_profile.py "$out/deploy/fp32/bench-base" "$out/deploy/fp32/builder" --seq 1024 \
    --json "$out/op-profile-fp32.json"
