"""What XLA holds at its live peak, for one plan of bench_truth's suites.

Plans ``--model`` (a preset; SGD, as bench_truth's intra and moe suites) on ``--mesh``
with ``--plan`` (auto or a baseline) under Alpa's test-mesh costs, compiles it with XLA's
dumps (``verify_plan(..., live_peak="always")``) and prints the predicted peak, XLA's
allocation and live peak (bytes per device), the instruction at the live peak and the
largest values live there with the bytes each holds::

    python benchmarks/studies/live_peak_values.py --model moe-tiny --mesh 4x2 --plan megatron [--top 25]

``--layers``, ``--batch``, ``--dtype`` and ``--attention`` override the preset as bench_truth's memory suite
does (``--model gpt-350m --layers 2 --batch 8 --dtype bfloat16 --optimizer adamw``).
"""

from __future__ import annotations

import argparse
import shutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--mesh", default="8", help="e.g. 8, 2x4, 4x2")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    ap.add_argument("--plan", default="auto", choices=("auto", "dp", "zero2", "zero3", "megatron"))
    ap.add_argument("--top", type=int, default=25, help="how many live values to print")
    ap.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit (s)")
    ap.add_argument("--layers", type=int, default=None, help="num_layers override")
    ap.add_argument("--batch", type=int, default=None, help="batch_size override")
    ap.add_argument("--dtype", default=None, help="dtype override, e.g. bfloat16")
    ap.add_argument("--attention", default=None, choices=("fused", "unfused"))
    ap.add_argument("--dump", default=None, help="keep XLA's dump (HLO, live ranges) here")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import autoshard.verify.check as check
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    peaks = []
    read = check.dump_live_peak

    def keep(folder):  # the LivePeak verify_plan reads, values included
        if args.dump:
            shutil.copytree(folder, args.dump, dirs_exist_ok=True)
        peaks.append(read(folder))
        return peaks[-1]

    check.dump_live_peak = keep
    overrides = {
        k: v
        for k, v in (
            ("num_layers", args.layers),
            ("batch_size", args.batch),
            ("dtype", args.dtype),
            ("attention", args.attention),
        )
        if v is not None
    }
    traced = trace_workload(args.model, optimizer=args.optimizer, **overrides)
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = device_mesh_for(shape, ("data", "model")[: len(shape)])
    options = IntraOptions(solver="highs", time_limit_s=args.time_limit)
    pinned = None
    if args.plan != "auto":
        pinned = baseline_inputs(traced.graph, mesh.mesh, args.plan)
        options = baseline_options(options, mesh.mesh, args.plan)
    plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name=args.plan)
    report = check.verify_plan(traced.program, plan, live_peak="always")
    print(f"predicted peak {report.predicted_peak_bytes:,.0f} B, XLA allocates "
          f"{report.compiled_peak_bytes:,.0f} B, live peak {report.compiled_live_peak_bytes:,.0f} B")  # fmt: skip
    live = peaks[-1] if peaks else None
    if live is None:
        print(report.live_peak_note)
        return
    print(f"at {live.instruction} (schedule position {live.position}):")
    for name, nbytes in live.values[: args.top]:
        print(f"{nbytes:>12,} B  {name}")


if __name__ == "__main__":
    main()
