"""Simulate Alpa's GPT weak-scaling suite: the best Megatron grid and Alpa's search per point.

Points (REFERENCE.md): gpt-350m on 1 GPU, 760m on 2, 1.3b on 4, 2.6b on 8, 6.7b on 16,
15b on 32, 39b on 64; cluster preset ``alpa-v100`` (8 x V100-16GB per node, 25 Gbps
between nodes), global batch 1024, sequence 1024, fp16, full activation recompute.
For every point: ``plan="megatron"`` (every TP x PP x DP grid and micro-batch size,
best that fits, on Megatron-LM's program), ``plan="auto"`` (intra-op ILPs with HiGHS +
stage DP, on the traced JAX step) and ``megatron-traced`` (every grid on the traced step,
the program ``auto`` is priced on, at auto's number of micro-batches: one program, so the
comparison with ``auto`` compares plans). Records the reports and the wall time of each,
and the suite's totals; writes ``benchmarks/results/bench_simulate.json``.

    python benchmarks/bench_simulate.py [--plans megatron auto megatron-traced]
        [--time-limit 20] [--auto-microbatches M] [--auto-budget-s 600]
        [--models gpt-350m gpt-2.6b]

``--auto-microbatches``: fix the micro-batch count of ``auto`` (and ``megatron-traced``);
by default ``simulate`` chooses it (64, or more where no Megatron layout fits at that
micro-batch size). ``--attention fused`` prices ``auto`` and ``megatron-traced`` on the
fused-attention step; ``megatron-flash`` is the Megatron grid on Megatron-LM's
flash-attention program (presets with an attention table: dgx-a100, dgx-h100)::

    python benchmarks/bench_simulate.py --cluster dgx-h100 --dtype bf16 --attention fused \
        --plans megatron-flash auto megatron-traced --out benchmarks/results/bench_simulate_h100_fused.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# model -> GPUs (Alpa's weak scaling)
SUITE = {
    "gpt-350m": 1,
    "gpt-760m": 2,
    "gpt-1.3b": 4,
    "gpt-2.6b": 8,
    "gpt-6.7b": 16,
    "gpt-15b": 32,
    "gpt-39b": 64,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SUITE), choices=list(SUITE))
    ap.add_argument(
        "--plans",
        nargs="+",
        default=["megatron", "auto", "megatron-traced"],
        choices=["megatron", "megatron-flash", "auto", "megatron-traced", "dp", "zero2", "zero3"],
    )
    ap.add_argument(
        "--attention",
        choices=["unfused", "fused"],
        default="unfused",
        help="the traced step's attention (auto, megatron-traced); docs/fused.md",
    )
    ap.add_argument("--cluster", default="alpa-v100")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--recompute", default="full")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--time-limit", type=float, default=20.0, help="per-ILP limit (s), auto")
    ap.add_argument("--auto-microbatches", type=int, default=None)
    ap.add_argument(
        "--auto-budget-s", type=float, default=600.0, help="skip remaining auto points after"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_simulate.json"))
    args = ap.parse_args()

    from autoshard.hardware.clusters import load_cluster
    from autoshard.sim.auto import _default_microbatches
    from autoshard.sim.simulate import gpt_shape, simulate

    rows, totals = [], {plan: 0.0 for plan in args.plans}
    t_suite = time.perf_counter()
    for plan in args.plans:
        for model in args.models:
            gpus = SUITE[model]
            if plan == "auto" and totals[plan] > args.auto_budget_s:
                rows.append({"model": model, "gpus": gpus, "plan": plan, "skipped": True})
                print(f"{plan:9s} {model:9s} on {gpus:2d}: skipped (auto budget spent)")
                continue
            kw = {}
            if plan in ("auto", "megatron-traced"):
                kw = dict(
                    num_microbatches=args.auto_microbatches,
                    ilp_time_limit_s=args.time_limit,
                    attention=args.attention,
                )
            if plan == "megatron-flash":
                kw["program"] = "megatron-lm-flash"
            if plan == "megatron-traced":
                if args.auto_microbatches is None:  # auto's own default
                    shape, _ = gpt_shape(model)
                    cluster = load_cluster(args.cluster, gpus)
                    kw["num_microbatches"] = _default_microbatches(
                        args.global_batch, shape, cluster, args.dtype
                    )
                kw["program"] = "traced"
            t0 = time.perf_counter()
            report = simulate(
                model,
                args.cluster,
                gpus,
                "megatron" if plan in ("megatron-traced", "megatron-flash") else plan,
                global_batch=args.global_batch,
                recompute=args.recompute,
                dtype=args.dtype,
                **kw,
            )
            wall = time.perf_counter() - t0
            totals[plan] += wall
            rows.append(
                {"model": model, "gpus": gpus, "method": plan, "wall_seconds": wall}
                | report.to_json()  # its "plan" is the report's plan dict
            )
            p = report.plan
            grid = (
                f"{p['pp']} stages"
                if plan == "auto"
                else f"TP{p['tp']} PP{p['pp']} DP{p['dp']} b={p['microbatch_size']}"
            )
            print(
                f"{plan:9s} {model:9s} on {gpus:2d}: {report.tflops_per_device:6.1f} TFLOP/s/GPU, "
                f"MFU {report.mfu:6.1%}, step {report.step_time_s:8.3f} s, "
                f"{report.peak_bytes_per_device / 2**30:6.2f} GiB{' OOM' if report.oom else ''}, "
                f"{grid}; {wall:.1f} s",
                flush=True,
            )
            out = {
                "suite": "alpa gpt weak scaling",
                "cluster": args.cluster,
                "global_batch": args.global_batch,
                "recompute": args.recompute,
                "dtype": args.dtype,
                "attention": args.attention,
                "command": "python benchmarks/bench_simulate.py " + " ".join(sys.argv[1:]),
                "ilp_time_limit_s": args.time_limit,
                "auto_microbatches": args.auto_microbatches,
                "total_seconds_by_plan": totals,
                "suite_wall_seconds": time.perf_counter() - t_suite,
                "rows": rows,
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=2))
    print(
        "totals: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in totals.items())
        + f"; suite {time.perf_counter() - t_suite:.1f} s"
    )


if __name__ == "__main__":
    main()
