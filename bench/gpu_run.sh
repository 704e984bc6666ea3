#!/usr/bin/env bash
# What the device machine runs: kernel tests in bf16, a GPU test of the graph runner, the
# decode-step profile, then the engine benchmark.
# Needs nothing from the network. From the repo root: bash bench/gpu_run.sh OUT_DIR
set -uo pipefail
out="${1:-${OUT:-bench/results/tmp}}"
mkdir -p "$out"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
  SPECDEC_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_kernels.py tests/test_fused_ops.py 2>&1 | tail -15
  timeout 90 python3 -m pytest -q -x tests/test_cuda_graphs.py 2>&1 | tail -5
  timeout 200 python3 bench/gpu_step_profile.py --skip-linear --out "$out"
  timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu_engine.py --out "$out" --budget-s "${BENCH_BUDGET:-300}"
} 2>&1 | tee "$out/gpu_engine.log"
