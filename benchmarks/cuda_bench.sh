#!/usr/bin/env bash
# The GPU benchmark as one command, for a machine with PyTorch (CUDA 13) but no onnxruntime-gpu and no
# network. Bring the onnxruntime-gpu 1.31.1 wheel (CUDA 13, 255 MB) in parts first, one device call each:
#   here:   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#               -d .whl onnxruntime-gpu==1.31.1 && split -b 60M .whl/onnxruntime_gpu-*.whl .whl/ort-gpu.part-
#   there:  mkdir -p /tmp/ort-gpu && cp .whl/ort-gpu.part-aa /tmp/ort-gpu/   (then -ab, -ac, ... in later calls)
# Then, in the last call:  bash benchmarks/cuda_bench.sh [cuda_bench.py options]
# It joins the parts, installs the wheel into /tmp/site (ahead of the CPU build), and runs the benchmark with
# results in $OUT (the device tool's folder) or bench-out/cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=${WHEEL_PARTS:-/tmp/ort-gpu}
if compgen -G "$parts/ort-gpu.part-*" > /dev/null; then
    wheel=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
    cat "$parts"/ort-gpu.part-* > "$wheel"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel"
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
python3 benchmarks/cuda_bench.py --provider cuda --out "${OUT:-bench-out/cuda}" "$@"
