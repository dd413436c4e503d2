"""A/B of XLA compile options on autoshard's GPT step, in one process on one GPU.

Issue 30: autoshard's fused gpt-1.3b step (24 layers, batch 8, seq 1024, bf16 compute with
f32 master weights, AdamW; the step ``benchmarks/gpu_single.py measure`` times) compiled
once per variant, the state made once, then ``--rounds`` rounds in which every variant runs
``--steps`` steps in turn on the same state (the executables take the same arguments), so
clock and thermal drift fall on all variants alike. Each round times a variant two ways:
``--steps`` steps each synchronised (the loss read back before the next step is
dispatched: host dispatch and the read-back are in every step), then ``--steps`` steps
dispatched back to back with one synchronisation at the end (what a training loop does:
JAX dispatches step n+1 while step n runs), the time over the count. Prints and writes,
per variant and way, the median step time over all its timed steps (back to back: the
median over rounds), the median of its per-round medians, MFU (72 B s L h^2 (1 + s/6h +
V/12Lh) per step over 989 TFLOP/s) and the compiled peak.

    python benchmarks/gpu_ab.py --out ab.json                       # base vs cuBLASLt
    python benchmarks/gpu_ab.py --variant base= --variant lt=xla_gpu_enable_cublaslt=true
    python benchmarks/gpu_ab.py --quick --out /tmp/ab.json          # gpt-tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK_FLOPS = 989e12  # H100 SXM dense bf16
DEFAULT_VARIANTS = ("base=", "lt=xla_gpu_enable_cublaslt=true")


def model_flops(cfg, batch: int) -> float:
    s, L, h, V = cfg.seq_len, cfg.num_layers, cfg.hidden, cfg.vocab_size
    return 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--variant",
        action="append",
        help="name=opt1=v1,opt2=v2 (empty after the first '=': the shipped compile); "
        f"default: {' '.join(DEFAULT_VARIANTS)}",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, 2 layers (CPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import jax
    from gpu_single import make_state, parse_xla_options

    from autoshard.models import get_workload, make_optimizer, make_train_step
    from autoshard.verify.memory import memory_stats

    if args.quick:
        args.model, args.layers = "gpt-tiny", 2
    variants = {}
    for text in args.variant or DEFAULT_VARIANTS:
        name, _, opts = text.partition("=")
        variants[name] = parse_xla_options([o for o in opts.split(",") if o])
    work = get_workload(
        args.model,
        batch_size=args.batch,
        num_layers=args.layers,
        dtype="bfloat16",
        attention="fused",
    )
    opt = make_optimizer("adamw")
    step = jax.jit(make_train_step(work.loss_fn, opt), donate_argnums=(0, 1))
    lowered = step.lower(*work.abstract_train_args(opt))
    result = {
        "what": "issue 30: XLA compile options on autoshard's fused GPT step, interleaved A/B",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "layers": args.layers,
        "batch": args.batch,
        "model_flops_per_step": model_flops(work.config, args.batch),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "variants": {},
    }
    compiled = {}
    for name, opts in variants.items():
        t0 = time.perf_counter()
        compiled[name] = lowered.compile(compiler_options=opts or None)
        mem = memory_stats(compiled[name])
        result["variants"][name] = {
            "xla_options": opts,
            "compile_s": time.perf_counter() - t0,
            "compiled_peak_bytes": mem.argument_bytes
            + mem.output_bytes
            - mem.alias_bytes
            + mem.temp_bytes,
            "times_s": [],
            "round_medians_s": [],
            "back_to_back_round_s": [],
        }
        print(
            f"[ab] compiled {name} {opts} in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    params, opt_state, data = make_state(work, opt)
    result["init_s"] = time.perf_counter() - t0
    for name in compiled:  # warm-up: 3 steps each
        for _ in range(3):
            params, opt_state, loss = compiled[name](params, opt_state, data)
        float(loss)
    for r in range(args.rounds):
        order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
        for name in order:
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                params, opt_state, loss = compiled[name](params, opt_state, data)
                float(loss)
                times.append(time.perf_counter() - t)
            v = result["variants"][name]
            v["times_s"] += times
            v["round_medians_s"].append(statistics.median(times))
            t = time.perf_counter()
            for _ in range(args.steps):  # back to back: one synchronisation at the end
                params, opt_state, loss = compiled[name](params, opt_state, data)
            jax.block_until_ready((params, opt_state, loss))
            v["back_to_back_round_s"].append((time.perf_counter() - t) / args.steps)
        print(
            f"[ab] round {r + 1}/{args.rounds}, loss {float(loss):.4f}", file=sys.stderr, flush=True
        )
    flops = result["model_flops_per_step"]
    base = None
    for name, v in result["variants"].items():
        v["median_s"] = statistics.median(v["times_s"])
        v["median_of_rounds_s"] = statistics.median(v["round_medians_s"])
        v["mfu"] = flops / v["median_s"] / PEAK_FLOPS
        b2b = v["back_to_back_round_s"]
        v["back_to_back_s"] = statistics.median(b2b)
        v["back_to_back_mfu"] = flops / v["back_to_back_s"] / PEAK_FLOPS
        base = base or name
        print(
            f"{name:10s} synchronised: step {v['median_s'] * 1e3:7.2f} ms (rounds "
            f"{v['median_of_rounds_s'] * 1e3:.2f} ms, "
            f"{min(v['round_medians_s']) * 1e3:.2f}-{max(v['round_medians_s']) * 1e3:.2f}), "
            f"MFU {v['mfu'] * 100:.2f}%; back to back: step {v['back_to_back_s'] * 1e3:.2f} ms "
            f"({min(b2b) * 1e3:.2f}-{max(b2b) * 1e3:.2f}), MFU {v['back_to_back_mfu'] * 100:.2f}%; "
            f"peak {v['compiled_peak_bytes'] / 2**30:.2f} GiB"
        )
    ref = result["variants"][base]["round_medians_s"]
    for v in result["variants"].values():
        v["rounds_faster_than_" + base] = sum(
            a < b for a, b in zip(v["round_medians_s"], ref, strict=True)
        )
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
