#!/usr/bin/env bash
# Issue 30's MFU check on one lent GPU (~5 min): autoshard's fused gpt-1.3b step (24 layers,
# batch 8, seq 1024, bf16, AdamW) compiled with XLA options autoshard could pass on GPUs
# (Lowered.compile(compiler_options=...)), interleaved with the shipped compile and the
# PyTorch peer in the same run, so that drift shows; then issue 36's gpu_truth rows in the
# time left of TOTAL_S (default 560 s). Variants (OPTS_<name>; a name's options in VARIANTS):
#   base      nothing (as shipped)
#   lt        xla_gpu_enable_cublaslt=true (cuBLASLt: bias and GELU epilogues into the GEMM)
#   notriton  xla_gpu_enable_triton_gemm=false (cuBLAS for the GEMMs Triton takes today)
#   lt_nt     both
# Writes under $OUT: xla_options.json (every run, with a summary), log.txt, and
# gpu_truth.json + hlo.tar.gz from benchmarks/gpu_truth.sh.
#     run(command="PYTHONUNBUFFERED=1 bash benchmarks/gpu_xla_options.sh", timeout_s=600)
#     OUT=/tmp/out QUICK=1 TOTAL_S=0 bash benchmarks/gpu_xla_options.sh   # gpt-tiny on CPU
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/parts"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
PY=${PY:-$(command -v python3 || command -v python)}
TOTAL_S=${TOTAL_S:-560}
CONFIG=gpt-1.3b:24:8:fused; PEER=(--configs gpt-1.3b:24:8); CAP=110
[ "${QUICK:-0}" = 1 ] && { CONFIG=gpt-tiny:2:8:fused; PEER=(--quick); CAP=60; }
declare -A VARIANTS=(
  [base]=""
  [lt]="xla_gpu_enable_cublaslt=true"
  [notriton]="xla_gpu_enable_triton_gemm=false"
  [lt_nt]="xla_gpu_enable_cublaslt=true xla_gpu_enable_triton_gemm=false"
)
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
log "start"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
i=0
for name in base lt notriton peer lt_nt base; do
  i=$((i + 1))
  if [ "$name" = peer ]; then
    log "$i. PyTorch peer"
    timeout --foreground 120 "$PY" benchmarks/gpu_peer_torch.py "${PEER[@]}" \
      --out "$OUT/parts/${i}_peer.json" 2>&1 | tail -5 | tee -a "$OUT/log.txt"
    continue
  fi
  opts=(); [ -n "${VARIANTS[$name]}" ] && opts=(--xla-options ${VARIANTS[$name]})
  log "$i. autoshard $CONFIG $name ${VARIANTS[$name]}"
  timeout --foreground $((CAP + 10)) "$PY" benchmarks/gpu_single.py measure \
    --out "$OUT/parts/${i}_${name}.json" --configs "$CONFIG" --timeout-s "$CAP" "${opts[@]}" \
    2>&1 | tail -3 | tee -a "$OUT/log.txt"
done
"$PY" - "$OUT" <<'PYEOF' 2>&1 | tee -a "$OUT/log.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); runs = []
for f in sorted(out.glob("parts/*.json"), key=lambda p: int(p.name.split("_")[0])):
    d = json.loads(f.read_text())
    variant = f.stem.split("_", 1)[1]
    for r in d.get("runs", d.get("rows", [])) if isinstance(d, dict) else d:
        r = dict(r, variant=variant, part=f.name)
        r.pop("losses", None) if variant != "peer" else None
        runs.append(r)
def mfu(r, t):
    B, s, L, h, V = r["batch"], r.get("seq_len", 1024), r["layers"], r["hidden"], r.get("vocab", 51200)
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)) / t / 989e12
summary = {}
for r in runs:
    t = r.get("step_time_s")
    if t is None or "hidden" not in r:
        continue
    summary.setdefault(r["variant"], []).append(
        {"step_ms": round(t * 1e3, 2), "mfu": round(mfu(r, t), 4),
         "compiled_peak_gib": round(r.get("memory_analysis", {}).get("compiled_peak_bytes", 0) / 2**30, 2)})
for k, v in summary.items():
    print(f"{k:9s} " + ", ".join(f"{x['step_ms']} ms MFU {x['mfu']:.1%} peak {x['compiled_peak_gib']} GiB" for x in v))
(out / "xla_options.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
PYEOF
rm -rf "$OUT/parts"
left=$((TOTAL_S - SECONDS))
log "options sweep took ${SECONDS} s; ${left} s left for gpu_truth"
if [ "$left" -gt 60 ]; then
  SUITE=${SUITE:-scale} BUDGET=$((left - 40)) TIMEOUT=$((left - 8)) bash benchmarks/gpu_truth.sh
fi
ls -la "$OUT"
