#!/usr/bin/env bash
# One lent GPU, one call, each part capped; PARTS picks them and runs them in this order
# (default "ab peer offload truth"; the 2026-11-27 leases ran the A/B (answered), the
# offloaded gpt-6.7b (cut at its caps twice) and nine scale rows):
#   1. ab, issue 30: benchmarks/gpu_ab.py -- autoshard's fused gpt-1.3b step (24 layers,
#      batch 8), each round timed synchronised and back to back (AB_MODEL, AB_VARIANTS);
#   2. peer, issue 30: benchmarks/gpu_peer_torch.py -- the PyTorch peer of the same step,
#      timed both ways in the same run (PEER_CONFIGS);
#   3. offload, issue 34: benchmarks/gpu_offload.py measure -- the plans of
#      benchmarks/results/gpu_offload_plans named by OFFLOAD_ROWS (default the gpt-1.3b pair:
#      with and without the optimizer state in pinned_host; "all": every plan, gpt-6.7b
#      first), each row capped at OFFLOAD_ROW_S; OFFLOAD_XLA="xla_a=v xla_b=w" compiles
#      each step with those XLA options (xla_gpu_enable_host_memory_offloading=true: on
#      2026-11-27 the default flags held the whole offloaded state on the device);
#      OFFLOAD_STREAM="1 none" runs each offloaded row with each stream window (1: the
#      runtime's default, state streamed a parameter at a time; none: every fetch where
#      the step starts, the form of 2026-11-27); the compiled steps' HLO goes to
#      $OUT/offload_hlo;
#   4. truth, issue 36: benchmarks/gpu_truth.sh on the scale rows not yet compiled
#      (TRUTH_ROWS), in the time left of TOTAL_S.
# Writes under $OUT: ab.json, peer.json, offload.json, gpu_truth.json, hlo.tar.gz, log.txt.
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
  AB=(--quick --rounds 2 --steps 3); PEER=(--quick --no-compile --rounds 2 --steps 3)
  PLANS=${PLANS:-/tmp/lead-offq}; ROWS=(--rows gpt-tiny-L2-auto-2x4)
  TRUTH_ENV=(SUITE=h100-8 DRY=1)
else
  AB=(--model "${AB_MODEL:-gpt-1.3b}" --rounds 5 --steps 10)
  # shellcheck disable=SC2206
  PEER=(--configs ${PEER_CONFIGS:-gpt-1.3b:24:8} --steps 10 --rounds 5)
  PLANS=benchmarks/results/gpu_offload_plans
  # shellcheck disable=SC2206
  ROWS=(--rows ${TRUTH_ROWS:-gpt-6.7b-L32-zero2-2x8-B16 gpt-6.7b-L32-heuristic-2x8
        moe-1.3b-L16-megatron-2x4 moe-1.3b-L16-zero2-2x4 wresnet-1b-L50-dp-2x4-B128
        wresnet-1b-L50-heuristic-2x4-B128 wresnet-1b-L50-zero2-2x4-B128})
  TRUTH_ENV=()
fi
if [ "${QUICK:-0}" = 1 ]; then OFFLOAD_ROWS=${OFFLOAD_ROWS:-all}; fi
OFFLOAD_ROWS=${OFFLOAD_ROWS:-gpt-1.3b-none gpt-1.3b-optimizer}
if [ "$OFFLOAD_ROWS" = all ]; then OFF_ROWS=(); else read -r -a OFF_ROWS <<<"--rows $OFFLOAD_ROWS"; fi
OFF_XLA=()
for o in ${OFFLOAD_XLA:-}; do OFF_XLA+=(--xla-option "$o"); done
for w in ${OFFLOAD_STREAM:-}; do OFF_XLA+=(--stream-window "$w"); done
PARTS=${PARTS:-ab peer offload truth}
if [[ " $PARTS " == *" ab "* ]]; then
  log "1. gpu_ab (issue 30)"
  # shellcheck disable=SC2086
  timeout "${AB_S:-170}" "$PY" benchmarks/gpu_ab.py "${AB[@]}" --variant ${AB_VARIANTS:-base=} \
    --out "$OUT/ab.json" 2>&1 | tee -a "$OUT/log.txt" | tail -4
fi
if [[ " $PARTS " == *" peer "* ]]; then
  log "2. PyTorch peer (issue 30)"
  timeout "${PEER_S:-150}" "$PY" benchmarks/gpu_peer_torch.py "${PEER[@]}" --out "$OUT/peer.json" \
    2>&1 | tee -a "$OUT/log.txt" | grep "^torch"
fi
if [[ " $PARTS " == *" offload "* ]]; then
  log "3. gpu_offload measure (issue 34): ${OFFLOAD_ROWS}"
  timeout "${OFFLOAD_S:-200}" "$PY" benchmarks/gpu_offload.py measure --dir "$PLANS" \
    --out "$OUT/offload.json" --steps 4 --timeout-s "${OFFLOAD_ROW_S:-100}" "${OFF_ROWS[@]}" \
    "${OFF_XLA[@]}" --hlo-dir "$OUT/offload_hlo" 2>&1 \
    | tee -a "$OUT/log.txt" | grep "\[measure\]\|\[one\]"
fi
left=$((TOTAL_S - SECONDS))
log "4. gpu_truth (issue 36): ${left} s left"
if [[ " $PARTS " == *" truth "* ]] && [ "$left" -gt 60 ]; then
  env "${TRUTH_ENV[@]}" BUDGET=$((left - 40)) TIMEOUT=$((left - 5)) bash benchmarks/gpu_truth.sh "${ROWS[@]}" >/dev/null 2>&1
  tail -5 "$OUT/log.txt"
fi
log "done"
ls -la "$OUT"
