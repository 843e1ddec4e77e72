#!/usr/bin/env bash
# Issue 16: the planner at attn=8 on SmolLM2, calibrated on the bundled mixed-kind text (the default), every row
# also evaluated on texts of other kinds (docs, code, and the dictionary, a kind the mix does not hold) and on the
# next-tokens multiple-choice task from the held-out prose.
#
#   bash benchmarks/plan_mixed.sh [EXPORT] [OUT] [TEXT] [SEARCH]
#
# EXPORT: a SmolLM2 export (default: bench-out/smollm2/pipeline/export, from benchmarks/model_table.py);
# TEXT: the calibration text (default calib, the mixed one; `prose` gives the cross-kind run of the README);
# SEARCH: the text every choice is made on (default: TEXT's search part; `calib` with TEXT=prose gives the
# cross-kind run with prose estimates and choices on the bundled mix of kinds).
# BUDGET (environment, default attn=8) and PLAN_ARGS (more `layerdrop plan` options) serve other models, e.g.
#   BUDGET=attn=4 PLAN_ARGS="--extra 2 --search-samples 4 --fit-samples 16" bash benchmarks/plan_mixed.sh \
#       bench-out/gemma3-kv bench-out/gemma3-plan-mixed
set -euo pipefail
cd "$(dirname "$0")/.."
export_dir=${1:-bench-out/smollm2/pipeline/export}
out=${2:-bench-out/plan-mixed}
text=${3:-calib}
search=()
if [ -n "${4:-}" ]; then search=(--search-text "$4"); fi
mkdir -p "$out"
layerdrop score "$export_dir" -o "$out/scored" --calib "$text" --threads 2 --no-progress --force \
    --json "$out/score.json"
/usr/bin/time -v layerdrop plan "$out/scored" -o "$out/plan" --budget "${BUDGET:-attn=8}" --calib "$text" \
    "${search[@]}" ${PLAN_ARGS:-} --also-eval docs --also-eval code --also-eval dictionary --threads 2 --force \
    --json "$out/plan.json" \
    2> "$out/plan.log" | tee "$out/plan.md"
grep -E "Elapsed|Maximum resident" "$out/plan.log"
