#!/usr/bin/env bash
# Issue 36's GPU check, one run on one lent GPU (~6 min of an H100; every part capped):
# the plan files under benchmarks/results/gpu_truth_plans (gpt-1.3b, 24 layers: auto, zero2,
# zero3, megatron on 2x4 and 8 GPUs, auto on 8x8; planned on CPU with jax 0.11.2, no solver
# needed here) compiled by XLA:GPU ahead of time for as many GPUs as each plan's mesh
# (jax.experimental.topologies: compile-only H100s), predicted vs compiled per row; gpt-tiny
# auto and zero3 on 2x4 first (seconds; their HLO is the first real XLA:GPU fixture to commit).
# Writes under $OUT (3 files): gpu_truth.json, hlo.tar.gz (each row's compiled HLO, less
# its metadata), log.txt.
#     OUT=/tmp/out bash benchmarks/gpu_truth.sh          # DRY=1: the same on fake CPU devices
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
timeout "${TIMEOUT:-540}" "$PY" benchmarks/gpu_truth.py "${MODE[@]}" --budget-s "$BUDGET" \
  --out "$OUT/gpu_truth.json" --hlo-tar "$OUT/hlo.tar.gz" "$@"
log "done (exit $?)"
ls -la "$OUT"
