#!/usr/bin/env bash
# Everything a GPU measurement needs, in one command on a machine without network access:
#   benchmarks/gpu_suite.sh OUT [SECTIONS]     e.g.  benchmarks/gpu_suite.sh $OUT bulk,formats,onechunk
# Installs the wheels placed in .whl/ (pyzmq, pydantic, blake3, redis, and rich where the image lacks them) into
# /tmp/site, runs the GPU tests, then `kvferry bench gpu-transfer` sections (default: all but the slow crossover),
# `kvferry bench cache-gpu` (the cache's one chunk) and the GPU timelines of a one-chunk and a 32-chunk request
# (benchmarks/experiments/trace_gpu_call.py). Results (tables, JSON) and logs land in OUT.
# About 5 minutes on the H200 machine, a third of it compiling kernels (shared .triton-cache).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUT [SECTIONS]}
sections=${2:-bulk,formats,formats-run,onechunk,bidir,gemm}
cd "$(dirname "$0")/.."
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >/dev/null 2>&1 || echo "gpu_suite: installing .whl/ failed; server and cache parts may not import" >&2
fi
export PYTHONPATH=src:/tmp/site TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/card.txt"
status=0
.ci/gpu-tests 8 2>&1 | tail -3 | tee "$out/gpu_tests.txt" || status=1
python3 -m kvferry.cli bench gpu-transfer --json "$out/gpu.json" --sections "$sections" --reps 15 2>&1 \
    | grep -Ev "serial|zero-copy kernel" | tee "$out/gpu.txt" || status=1
python3 -m kvferry.cli bench cache-gpu --json "$out/cache_gpu.json" 2>&1 | tee "$out/cache_gpu.txt" || status=1
python3 benchmarks/experiments/trace_gpu_call.py --out "$out/anatomy_1.json" --reps 20 2>&1 | grep -v "^   " \
    | tee "$out/anatomy_1.txt" || status=1
python3 benchmarks/experiments/trace_gpu_call.py --out "$out/anatomy_32.json" --chunks 32 --models qwen2.5-0.5b \
    --reps 15 2>&1 | grep -v "^   " | tee "$out/anatomy_32.txt" || status=1
exit "$status"
