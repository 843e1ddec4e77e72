#!/usr/bin/env bash
# int4 at the builder's accuracy level (4: int8 activations in MatMulNBits on CPU) against layerdrop's default
# (float activations), after deploy_table.py: the fused fp32 base and the fused attn-7 output quantized both ways,
# perplexity on the bundled held-out text (32 x 256), then each level's pair benched beside the builder's int4
# graph (2 threads, 5 alternating runs, 1024 tokens, 32 decode tokens).
#     bash benchmarks/int4_levels.sh bench-out/deploy bench-out/int4-levels
set -euo pipefail
cd "$(dirname "$0")/.."
deploy=${1:-bench-out/deploy}
out=${2:-bench-out/int4-levels}
mkdir -p "$out"
for level in 0 4; do
    for model in bench-base pruned; do
        layerdrop quantize "$deploy/fp32/$model" -o "$out/level$level/$model" --accuracy-level "$level" --force
    done
    layerdrop eval "$out/level$level/bench-base" --vs "$out/level$level/pruned" --threads 2 --no-progress \
        --json "$out/level$level/eval.json" | tee "$out/level$level/eval.md"
    layerdrop bench "$out/level$level/bench-base" "$out/level$level/pruned" --reference "$deploy/int4/builder" \
        --seq 1024 --runs 5 --threads 2 --json "$out/level$level/bench.json" | tee "$out/level$level/bench.md"
done
