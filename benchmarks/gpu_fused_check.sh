#!/usr/bin/env bash
# Issue 30's GPU check, one run on one lent GPU (~8 min on an H100; every part capped):
#   0. the fused attention on this GPU: its jaxpr (one forward and one backward operator,
#      the forward's results) and its gradients against the XLA implementation;
#   1-4. autoshard's fused GPT step and the PyTorch peer (benchmarks/gpu_peer_torch.py),
#      gpt-1.3b then gpt-350m (24 layers, batch 8, seq 1024, bf16, AdamW), alternating;
#   5. with TABLE=1 only (h100.json is committed): the attention kernel's TFLOP/s by
#      shape (benchmarks/gpu_attention.py), the planner's table
#      autoshard/hardware/attention_tables/h100.json;
#   6. autoshard's unfused step (the einsum attention) for gpt-1.3b, the same-run baseline,
#      and the fused step with q, k, v from three GEMMs (fused-qkv3, GPTConfig.qkv_gemms=3:
#      the default since 2026-11-27 is one GEMM, split) for both models.
# Writes under $OUT (at most 8 files come back from a lent machine): measured.json,
# peer.json, attention_measured.json, attention_h100.json, check.json, hlo/*.gz, log.
#     OUT=/tmp/out bash benchmarks/gpu_fused_check.sh          # QUICK=1: gpt-tiny on CPU
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/hlo"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
PY=${PY:-$(command -v python3 || command -v python)}
exec > >(tee -a "$OUT/log.txt") 2>&1
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
if [ "${QUICK:-0}" = 1 ]; then
  FUSED=(gpt-tiny:2:8); PEER=(gpt-tiny:2:8); ATT=(--quick)
  BASELINES=(gpt-tiny:2:8:unfused gpt-tiny:2:8:fused-qkv3)
else
  FUSED=(gpt-1.3b:24:8 gpt-350m:24:8); PEER=(gpt-1.3b:24:8 gpt-350m:24:8)
  ATT=(--table-out "$OUT/attention_h100.json" --total-s 70)
  BASELINES=(gpt-1.3b:24:8:unfused gpt-1.3b:24:8:fused-qkv3 gpt-350m:24:8:fused-qkv3)
fi
# BASELINE_CONFIGS="a b" replaces step 6's configurations (benchmarks/gpu_lease.sh)
[ -n "${BASELINE_CONFIGS:-}" ] && read -r -a BASELINES <<<"$BASELINE_CONFIGS"
log "start"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null

log "0. the fused attention on this device"
timeout --foreground 90 "$PY" - "$OUT/check.json" <<'EOF'
import json, sys
import jax, jax.numpy as jnp
from autoshard.models.attention import default_implementation, fused_attention
impl = default_implementation()
out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "implementation": impl}
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, g = (jax.random.normal(x, (2, 256, 4, 64), jnp.bfloat16) for x in ks)
def loss(impl):
    return lambda q, k, v: jnp.sum(fused_attention(q, k, v, implementation=impl).astype(jnp.float32) * g)
jp = jax.make_jaxpr(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
out["jits"] = [{"name": e.params.get("name"), "in": [str(x.aval) for x in e.invars],
                "out": [str(x.aval) for x in e.outvars]}
               for e in jp.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
a = jax.jit(jax.value_and_grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
b = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
out["loss"] = [float(a[0]), float(b[0])]
out["grad_max_abs_diff"] = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                            for x, y in zip(a[1], b[1])]
out["grad_max_abs"] = [float(jnp.max(jnp.abs(y.astype(jnp.float32)))) for y in b[1]]
print(json.dumps(out, indent=1))
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
EOF

for i in 0 1; do
  log "$((2 * i + 1)). autoshard fused ${FUSED[$i]:-}"
  [ -n "${FUSED[$i]:-}" ] && timeout --foreground 150 "$PY" benchmarks/gpu_single.py measure \
    --out "$OUT/measured_$i.json" --configs "${FUSED[$i]}" --profile --dump-hlo "$OUT/hlo" \
    --timeout-s 140
  log "$((2 * i + 2)). PyTorch peer ${PEER[$i]:-}"
  [ -n "${PEER[$i]:-}" ] && timeout --foreground 130 "$PY" benchmarks/gpu_peer_torch.py \
    --configs "${PEER[$i]}" --out "$OUT/peer_$i.json"
done
if [ "${TABLE:-0}" = 1 ]; then
  log "5. attention kernel table"
  timeout --foreground 140 "$PY" benchmarks/gpu_attention.py --out "$OUT/attention_measured.json" "${ATT[@]}"
fi
log "6. autoshard ${BASELINES[*]}"
timeout --foreground 330 "$PY" benchmarks/gpu_single.py measure --out "$OUT/measured_u.json" \
  --configs "${BASELINES[@]}" --timeout-s 110

log "merge"
"$PY" benchmarks/gpu_merge_out.py "$OUT"
ls -la "$OUT" "$OUT/hlo"
log "done"
