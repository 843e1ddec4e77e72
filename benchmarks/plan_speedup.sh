#!/usr/bin/env bash
# Issue 16: a speedup budget of about 25% less prefill time at 1024 tokens (1.333x) on SmolLM2, with fitted
# attention layers and block moves allowed: attention rows, ShortGPT's and ReplaceMe's rows and the planner's mixes
# of a fitted run with fitted attention, each with its measured prefill speedup (runs alternating with the
# baseline's), calibrated on the mixed default text, held out on Northanger Abbey, docs and code.
#
#   bash benchmarks/plan_speedup.sh [SCORED] [OUT]
#
# SCORED: a SmolLM2 export scored on the mixed text (default: bench-out/plan-mixed/scored, from plan_mixed.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scored=${1:-bench-out/plan-mixed/scored}
out=${2:-bench-out/plan-speedup}
mkdir -p "$out"
/usr/bin/time -v layerdrop plan "$scored" -o "$out/plan" --budget speedup=1.333@1024 --moves blocks,fit \
    --also-eval docs --also-eval code --threads 2 --force --json "$out/plan.json" 2> "$out/plan.log" \
    | tee "$out/plan.md"
grep -E "Elapsed|Maximum resident" "$out/plan.log"
