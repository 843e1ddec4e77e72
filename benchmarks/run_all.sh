#!/usr/bin/env bash
# The README's earlier figures (windows from the start of each text, as layerdrop read texts until 2026-12-01).
# Calibration text: prose (Persuasion), the default until 2026-12-02. About 45 minutes on 2 cores. Outputs go to out/ and bench-out/. The current figures: run_measurements.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench-out
layerdrop pipeline -o out/pipeline --force --from-start --calib prose                        # export, score, attn-7 drop, eval, bench
python benchmarks/bench_scoring.py --model out/pipeline/export --hf "${LAYERDROP_CACHE:-$HOME/.cache/layerdrop}/SmolLM2-135M-Instruct"
python benchmarks/bench_edit.py --model out/pipeline/scored
python benchmarks/quality.py --model out/pipeline/scored --from-start --json bench-out/quality.json
layerdrop drop out/pipeline/scored -o out/attn8 --attn 8 --force
layerdrop bench out/pipeline/export out/attn8 --seq 512,1024 --runs 5 --threads 2 --json bench-out/attn8.json
layerdrop harp out/pipeline/export -o out/harp8 --force \
  --alpha 29=0.4,28=0.4,27=0.7,26=0,25=0.3,24=0.6,23=0,22=0.1       # the alphas quality.py's search chose
layerdrop bench out/pipeline/export out/harp8 --seq 512,1024,2048,4096 --runs 3 --threads 2 --json bench-out/harp8.json
layerdrop plan out/pipeline/scored -o out/plan8 --budget attn=8 --threads 2 --json bench-out/plan8.json --force \
  --from-start --moves drop,bypass,shift --calib prose --accuracy-items 0
