#!/usr/bin/env bash
# Issue 36's GPU check, one run on one lent GPU (every part capped): the plan files of one
# suite of benchmarks/gpu_truth.py (SUITE, default scale), planned on CPU with jax 0.11.2 (no
# solver needed here), compiled by XLA:GPU ahead of time for as many GPUs as each plan's mesh
# (jax.experimental.topologies: compile-only H100s), predicted vs compiled per row, rows in
# the suite's order until BUDGET seconds (the rest are written as skipped):
#   SUITE=scale   benchmarks/results/gpu_truth_plans_scale: GPT 1.3b/6.7b/39b at full depth,
#                 GPT-MoE (moe-1.3b), Wide-ResNet (wresnet-1b, batch 128), auto and the
#                 baselines, on 8, 16, 64 and 512 GPUs (~9 min of an H100 for the first ~10
#                 rows; `python benchmarks/gpu_truth.py --list --suite scale` prints them)
#   SUITE=h100-8  benchmarks/results/gpu_truth_plans: gpt-tiny and gpt-1.3b on 8 GPUs (run
#                 2026-11-27, benchmarks/results/gpu_truth_h100_2026-11-27.json)
# Writes under $OUT (3 files): gpu_truth.json, hlo.tar.gz (each row's compiled HLO, less
# its metadata), log.txt.
#     run(command="BUDGET=470 TIMEOUT=560 bash benchmarks/gpu_truth.sh", timeout_s=600)
#     OUT=/tmp/out SUITE=h100-8 DRY=1 bash benchmarks/gpu_truth.sh --rows gpt-tiny-L2-auto-2x4
#       (DRY=1: the same on fake CPU devices)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # nothing runs: compile only
PY=${PY:-$(command -v python3 || command -v python)}
exec > >(tee -a "$OUT/log.txt") 2>&1
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
log "start"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
"$PY" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
if [ "${DRY:-0}" = 1 ]; then
  MODE=(--dry-run); BUDGET=${BUDGET:-0}
else
  MODE=(--target "${TARGET:-gpu-aot}"); BUDGET=${BUDGET:-420}
fi
timeout "${TIMEOUT:-540}" "$PY" benchmarks/gpu_truth.py --suite "${SUITE:-scale}" "${MODE[@]}" \
  --budget-s "$BUDGET" \
  --out "$OUT/gpu_truth.json" --hlo-tar "$OUT/hlo.tar.gz" "$@"
log "done (exit $?)"
ls -la "$OUT"
