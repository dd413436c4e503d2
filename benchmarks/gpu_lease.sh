#!/usr/bin/env bash
# One lent GPU, one call (device time is 15 minutes a session, the start included): issue
# 30's fused-step check first, then issue 36's XLA:GPU plan check in whatever time is left.
#   1. benchmarks/gpu_fused_check.sh: the fused attention on this GPU; autoshard's fused
#      GPT step (gpt-1.3b then gpt-350m, 24 layers, batch 8, profiled, HLO dumped) each
#      beside the PyTorch peer; then step 6's configurations, by default the simulator's
#      H100 validation rows with the fused step (gpt-1.3b 24 layers batch 4, 8 layers
#      batch 8; BASELINE_CONFIGS overrides);
#   2. the part files merged (benchmarks/gpu_merge_out.py), also when 1 was cut short;
#   3. benchmarks/gpu_truth.sh with a time budget of what is left of TOTAL_S (default 540 s):
#      the rows of SUITE (default scale: GPT 1.3b/6.7b/39b, GPT-MoE, Wide-ResNet on 8 to 512
#      GPUs, most informative first; ~100 s left after the fused check compiles its first
#      two rows). The whole scale suite wants a lease of its own (~9 min):
#          run(command="BUDGET=470 TIMEOUT=560 bash benchmarks/gpu_truth.sh", timeout_s=600)
# At most 8 files come back: check.json, measured.json, peer.json, log.txt, hlo/ (two
# dumps), gpu_truth.json, hlo.tar.gz.
#     run(command="bash benchmarks/gpu_lease.sh", timeout_s=600)
#     OUT=/tmp/out QUICK=1 DRY=1 bash benchmarks/gpu_lease.sh     # the same on CPU, gpt-tiny
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PY:-$(command -v python3 || command -v python)}
TOTAL_S=${TOTAL_S:-540}
export BASELINE_CONFIGS=${BASELINE_CONFIGS:-gpt-1.3b:24:4 gpt-1.3b:8:8}
[ "${QUICK:-0}" = 1 ] && BASELINE_CONFIGS=${QUICK_BASELINES:-gpt-tiny:2:8:unfused}
timeout "${FUSED_S:-430}" bash benchmarks/gpu_fused_check.sh
"$PY" benchmarks/gpu_merge_out.py "$OUT"
left=$((TOTAL_S - SECONDS))
echo "[gpu_lease] fused check took ${SECONDS} s; ${left} s left for gpu_truth" | tee -a "$OUT/log.txt"
if [ "$left" -gt 45 ]; then
  SUITE=${SUITE:-scale} BUDGET=$((left - 35)) TIMEOUT=$((left - 5)) bash benchmarks/gpu_truth.sh
fi
ls -la "$OUT" "$OUT/hlo" 2>/dev/null
