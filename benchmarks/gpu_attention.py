"""The fused attention kernel's achieved throughput on this machine's first GPU, by shape.

Times autoshard's fused attention (:func:`autoshard.models.attention.fused_attention`,
causal, bf16; cuDNN flash attention on a GPU) forward alone and forward + backward, for a
grid of (batch x heads, sequence, head dim), and writes

* ``--out``: every measurement (seconds, TFLOP/s, the repeats) as JSON;
* ``--table-out``: the attention table the planner and the simulator read
  (``autoshard/hardware/attention_tables/<name>.json``, see
  :mod:`autoshard.hardware.attention`): rows ``[batch_heads, seq, head_dim, fwd_tflops,
  bwd_tflops]``.

FLOPs are counted as MFU conventions count them, the full square whether or not the
kernel skips the masked half: forward ``4 B H S^2 D`` (QK^T and PV), backward 2.5x the
forward (the flash backward recomputes the scores).  The backward's time is
(forward + backward) - forward, each the median of ``--repeats`` timed loops of
``--iters`` calls.

    python benchmarks/gpu_attention.py --out attention_measured.json \\
        --table-out autoshard/hardware/attention_tables/h100.json [--quick] [--total-s 120]

On a machine without a GPU it runs the XLA implementation (a check of the script, not a
measurement: ``--table-out`` is refused there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (batch x heads, sequence, head dim): the GPT suite's shapes per device (heads split by
# tensor parallelism, batch by data parallelism and micro-batches) -- seq 1024 first
GRID_BH = (8, 32, 128, 512)
GRID_S = (1024, 2048, 512, 4096)
GRID_D = (64, 128)
QUICK = ((4, 64, 16),)
BWD_FLOPS_RATIO = 2.5


def attention_flops(batch_heads: int, seq: int, head_dim: int) -> float:
    """Forward FLOPs of one attention, the full square: 4 B H S^2 D."""
    return 4.0 * batch_heads * seq * seq * head_dim


def _split(bh: int) -> tuple[int, int]:
    """(batch, heads) with at most 16 heads whose product is ``bh``."""
    heads = min(bh, 16)
    while bh % heads:
        heads -= 1
    return bh // heads, heads


def time_shape(bh: int, seq: int, head_dim: int, iters: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from autoshard.models.attention import default_implementation, fused_attention

    batch, heads = _split(bh)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(kk, (batch, seq, heads, head_dim), jnp.bfloat16) for kk in keys)
    fwd = jax.jit(lambda q, k, v: fused_attention(q, k, v, causal=True))

    def loss(q, k, v):
        return jnp.sum(fused_attention(q, k, v, causal=True).astype(jnp.float32) * g)

    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def timed(fn) -> list[float]:
        jax.block_until_ready(fn(q, k, v))  # compile
        jax.block_until_ready(fn(q, k, v))
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                r = fn(q, k, v)
            jax.block_until_ready(r)
            out.append((time.perf_counter() - t0) / iters)
        return out

    t_fwd, t_both = timed(fwd), timed(both)
    f_med, b_med = float(np.median(t_fwd)), float(np.median(t_both))
    flops = attention_flops(bh, seq, head_dim)
    bwd_s = max(b_med - f_med, 1e-9)
    return {
        "batch_heads": bh,
        "batch": batch,
        "heads": heads,
        "seq": seq,
        "head_dim": head_dim,
        "implementation": default_implementation(),
        "fwd_s": f_med,
        "fwd_bwd_s": b_med,
        "bwd_s": bwd_s,
        "fwd_tflops": flops / f_med / 1e12,
        "bwd_tflops": BWD_FLOPS_RATIO * flops / bwd_s / 1e12,
        "fwd_bwd_tflops": (1 + BWD_FLOPS_RATIO) * flops / b_med / 1e12,
        "fwd_repeats_s": t_fwd,
        "fwd_bwd_repeats_s": t_both,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON of every measurement")
    ap.add_argument("--table-out", help="the planner's attention table (GPU only)")
    ap.add_argument("--quick", action="store_true", help="one tiny shape (a CPU check)")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per shape (median)")
    ap.add_argument("--total-s", type=float, default=150.0, help="stop starting new shapes")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak")
    args = ap.parse_args(argv)

    import jax

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    if args.table_out and not on_gpu:
        ap.error("--table-out writes measured GPU rows; this machine has no GPU")
    shapes = QUICK if args.quick else [(bh, s, d) for s in GRID_S for d in GRID_D for bh in GRID_BH]
    result = {
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["benchmarks/gpu_attention.py", *(argv or sys.argv[1:])]),
        "flops_convention": "forward 4*B*H*S^2*D (full square, causal or not); backward "
        f"{BWD_FLOPS_RATIO}x forward",
        "rows": [],
        "skipped": [],
    }
    t_start = time.monotonic()
    for bh, s, d in shapes:
        if time.monotonic() - t_start > args.total_s:
            result["skipped"].append([bh, s, d])
            continue
        try:
            row = time_shape(bh, s, d, args.iters, args.repeats)
        except Exception as err:  # noqa: BLE001 - an unsupported shape is recorded, not fatal
            result["rows"].append(
                {"batch_heads": bh, "seq": s, "head_dim": d, "error": repr(err)[:500]}
            )
            print(f"BH {bh} S {s} D {d}: FAILED {err!r}"[:300], flush=True)
            continue
        result["rows"].append(row)
        print(
            f"BH {bh:4d} S {s:5d} D {d:3d}: fwd {row['fwd_s'] * 1e3:7.3f} ms "
            f"{row['fwd_tflops']:6.1f} TFLOP/s, bwd {row['bwd_s'] * 1e3:7.3f} ms "
            f"{row['bwd_tflops']:6.1f} TFLOP/s ({row['implementation']})",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.table_out:
        good = [r for r in result["rows"] if "error" not in r]
        table = {
            "device": dev.device_kind,
            "dtype": "bf16",
            "peak_tflops": args.peak_tflops,
            "causal": True,
            "source": (
                f"measured by benchmarks/gpu_attention.py on one {dev.device_kind}, jax "
                f"{jax.__version__}, {result['date']}: autoshard's fused attention "
                f"({good[0]['implementation'] if good else '?'}), bf16, causal; medians of "
                f"{args.repeats} loops of {args.iters} calls; FLOPs " + result["flops_convention"]
            ),
            "columns": ["batch_heads", "seq", "head_dim", "fwd_tflops", "bwd_tflops"],
            "rows": [
                [
                    r["batch_heads"],
                    r["seq"],
                    r["head_dim"],
                    round(r["fwd_tflops"], 2),
                    round(r["bwd_tflops"], 2),
                ]
                for r in good
            ],  # fmt: skip
        }
        Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_out).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
