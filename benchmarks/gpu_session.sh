#!/usr/bin/env bash
# One lent GPU, one call, each part capped; PARTS picks them (default "offload truth": the
# 2026-11-27 lease ran all three, the A/B answered and the offloaded gpt-6.7b ran out of
# its 150 s cap, so it now gets OFFLOAD_ROW_S, default 330 s, and runs first):
#   1. issue 30: benchmarks/gpu_ab.py -- autoshard's fused gpt-1.3b step (24 layers, batch 8),
#      the shipped compile against cuBLASLt (bias/GELU epilogues), interleaved in one process;
#   2. issue 34: benchmarks/gpu_offload.py measure -- the plans of
#      benchmarks/results/gpu_offload_plans (gpt-6.7b with the planner's --offload auto on one
#      80 GB GPU; gpt-1.3b with and without the optimizer state in pinned_host);
#   3. issue 36: benchmarks/gpu_truth.sh on the scale rows not yet compiled, in the time left
#      of TOTAL_S.
# Writes under $OUT: ab.json, offload.json, gpu_truth.json, hlo.tar.gz, log.txt.
#     run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
#     OUT=/tmp/out QUICK=1 bash benchmarks/gpu_session.sh     # the same on CPU, small
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PY:-$(command -v python3 || command -v python)}
TOTAL_S=${TOTAL_S:-555}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
log "start"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/log.txt"
if [ "${QUICK:-0}" = 1 ]; then
  AB=(--quick --rounds 2 --steps 3); PLANS=${PLANS:-/tmp/lead-offq}; ROWS=(--rows gpt-tiny-L2-auto-2x4)
  TRUTH_ENV=(SUITE=h100-8 DRY=1)
else
  AB=(--rounds 5 --steps 10); PLANS=benchmarks/results/gpu_offload_plans
  ROWS=(--rows moe-1.3b-L16-auto-2x4 wresnet-1b-L50-auto-2x4-B128 gpt-39b-L48-megatron-8x8
        wresnet-1b-L50-zero3-2x4-B128 moe-1.3b-L16-zero3-2x4 gpt-6.7b-L32-zero2-2x8-B16)
  TRUTH_ENV=()
fi
PARTS=${PARTS:-offload truth}
if [[ " $PARTS " == *" ab "* ]]; then
  log "1. gpu_ab (issue 30)"
  timeout "${AB_S:-150}" "$PY" benchmarks/gpu_ab.py "${AB[@]}" --out "$OUT/ab.json" 2>&1 | tee -a "$OUT/log.txt" | tail -4
fi
if [[ " $PARTS " == *" offload "* ]]; then
  log "2. gpu_offload measure (issue 34)"
  timeout "${OFFLOAD_S:-480}" "$PY" benchmarks/gpu_offload.py measure --dir "$PLANS" \
    --out "$OUT/offload.json" --steps 4 --timeout-s "${OFFLOAD_ROW_S:-330}" 2>&1 | tee -a "$OUT/log.txt" | grep "\[measure\]\|\[one\]"
fi
left=$((TOTAL_S - SECONDS))
log "3. gpu_truth (issue 36): ${left} s left"
if [[ " $PARTS " == *" truth "* ]] && [ "$left" -gt 60 ]; then
  env "${TRUTH_ENV[@]}" BUDGET=$((left - 40)) TIMEOUT=$((left - 5)) bash benchmarks/gpu_truth.sh "${ROWS[@]}" >/dev/null 2>&1
  tail -5 "$OUT/log.txt"
fi
log "done"
ls -la "$OUT"
