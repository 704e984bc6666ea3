#!/usr/bin/env bash
# What the device machine runs, in two parts that each fit a 10-minute call:
#   kernels: kernel tests in bf16, the graph runner's GPU tests, the decode-step profile;
#   engine:  the engine benchmark (both model shapes; cold kernel caches make its graph
#            captures slow, hence the budget);
#   attn:    decode attention fused vs two launches, PDL on/off, and a GPU timeline
#            (bench/gpu_decode_attn.py);
#   verify:  the attention kernels' bf16 tests, then tree attention fused vs two launches and
#            the cost curve with it off and on (bench/gpu_verify_attn.py), then the decode
#            kernel's tile and warp choices (bench/gpu_decode_attn.py --kernels-only);
#   runner:  the attention tests and the few-row matmul's in bf16, then the runner's
#            batch-1 cost curve under alternated settings (bench/gpu_verify_attn.py
#            --skip-kernels);
#   tiles:   the few-row matmul's tile candidates per layer role and the attention kernels'
#            split, tile and warp choices, per layer in 32-layer graphs
#            (bench/investigations/gpu_tiles.py);
#   timeline: the engine's steady batch-1 GPU timeline per kernel on both shapes, Qwen's in
#            OUT/qwen2 and Llama's in OUT/llama (bench/gpu_decode_attn.py --timeline-only).
#   probe:   the open leads of the verification cost at 8 rows, per layer in 32-layer graphs
#            (bench/investigations/gpu_tiles.py): tree attention with its rows in 2 row blocks
#            (OUT/attn), and the Qwen shape's matmuls at 2 and 8 rows with the 2-column FMA
#            tiles (OUT/qwen).
#   parts:   the tree attention tests in bf16, what each part of a tree attention layer costs
#            (bench/investigations/gpu_attn_parts.py), and the attention variants per layer at
#            1-16 rows on both head shapes, fused against the two launches (OUT/attn,
#            OUT/attn_qwen).
# probe, parts and tiles run scripts of bench/investigations/ (questions since answered, kept to
# ask them again of a changed kernel).
# Needs nothing from the network. From the repo root:
#   bash bench/gpu_run.sh OUT_DIR [kernels|engine|attn|verify|runner|tiles|timeline|probe|parts|all]
set -uo pipefail
out="${1:-${OUT:-bench/results/tmp}}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers as tf
print(torch.__version__, triton.__version__, tf.__version__)'
  if [ "$part" = kernels ] || [ "$part" = all ]; then
    # SPECDEC_SKINNY_TUNE=0: the few-row matmul tests take the first tile candidate untimed
    # (timing every candidate of every test shape ran past 230 s on 2026-12-01).
    SPECDEC_TEST_DEVICE=cuda SPECDEC_SKINNY_TUNE=0 timeout 450 python3 -m pytest -q \
      --noconftest -p no:cacheprovider tests/test_kernels.py tests/test_fused_ops.py \
      tests/test_decode_attention.py tests/test_argmax.py 2>&1 | tail -15
    # Nothing timed (the first tile candidate, no in-graph tuning): timing the tiny test model's
    # tiles took the graph tests past 100-120 s on 2026-12-01 (bench/results/HISTORY.md); these
    # tests check replays against the eager path, and the benchmarks exercise the tuning.
    SPECDEC_SKINNY_TUNE=0 SPECDEC_TUNE_GRAPHS=0 timeout 200 python3 -m pytest -q -x \
      -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -5
    # Overlapped speculative steps on the device (the module's other tests are the CPU path).
    SPECDEC_SKINNY_TUNE=0 SPECDEC_TUNE_GRAPHS=0 timeout 200 python3 -m pytest -q -x \
      -p no:cacheprovider tests/test_spec_overlap.py -k cuda 2>&1 | tail -5
    timeout 180 python3 bench/gpu_step_profile.py --skip-linear --out "$out"
  fi
  if [ "$part" = engine ] || [ "$part" = all ]; then
    timeout "${BENCH_TIMEOUT:-560}" python3 bench/gpu_engine.py --out "$out" \
      --budget-s "${BENCH_BUDGET:-540}"
  fi
  if [ "$part" = attn ] || [ "$part" = all ]; then
    timeout 450 python3 bench/gpu_decode_attn.py --out "$out"
  fi
  if [ "$part" = verify ]; then
    SPECDEC_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q --noconftest -p no:cacheprovider \
      tests/test_decode_attention.py 2>&1 | tail -5
    timeout 330 python3 bench/gpu_verify_attn.py --out "$out"
    timeout 100 python3 bench/gpu_decode_attn.py --out "$out" --kernels-only
  fi
  if [ "$part" = runner ]; then
    SPECDEC_TEST_DEVICE=cuda SPECDEC_SKINNY_TUNE=0 timeout 200 python3 -m pytest -q \
      --noconftest -p no:cacheprovider tests/test_decode_attention.py tests/test_fused_ops.py \
      -k "decode or tree or fuses or residual_linear or candidates" 2>&1 | tail -5
    timeout 400 python3 bench/gpu_verify_attn.py --out "$out" --skip-kernels
  fi
  if [ "$part" = timeline ]; then
    for m in qwen2.5-7b-shape llama-3.1-8b-shape; do
      timeout 240 python3 bench/gpu_decode_attn.py --out "$out/${m%%[.-]*}" --timeline-only \
        --model "$m"
    done
  fi
  if [ "$part" = probe ]; then
    SPECDEC_TEST_DEVICE=cuda SPECDEC_SKINNY_TUNE=0 timeout 120 python3 -m pytest -q \
      --noconftest -p no:cacheprovider tests/test_decode_attention.py -k tree 2>&1 | tail -3
    SPECDEC_SKINNY_TUNE=0 timeout 170 python3 bench/investigations/gpu_tiles.py --out "$out/attn" \
      --part attention
    SPECDEC_SKINNY_TUNE=0 timeout 120 python3 bench/investigations/gpu_tiles.py \
      --out "$out/attn_qwen" --part attention --shape qwen2.5-7b-shape
    SPECDEC_SKINNY_TUNE=0 timeout 250 python3 bench/investigations/gpu_tiles.py --out "$out/qwen" \
      --part matmuls --shape qwen2.5-7b-shape --rows 2,8
  fi
  if [ "$part" = parts ]; then
    SPECDEC_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q --noconftest -p no:cacheprovider \
      tests/test_decode_attention.py -k tree 2>&1 | tail -3
    timeout 100 python3 bench/investigations/gpu_attn_parts.py --out "$out"
    SPECDEC_SKINNY_TUNE=0 timeout 250 python3 bench/investigations/gpu_tiles.py --out "$out/attn" \
      --part attention
    SPECDEC_SKINNY_TUNE=0 timeout 150 python3 bench/investigations/gpu_tiles.py \
      --out "$out/attn_qwen" --part attention --shape qwen2.5-7b-shape
  fi
  if [ "$part" = tiles ]; then
    SPECDEC_SKINNY_TUNE=0 timeout 560 python3 bench/investigations/gpu_tiles.py --out "$out"
  fi
} 2>&1 | tee "$out/gpu_run_${part}.log"
