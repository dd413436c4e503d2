"""Intra-operator planning cost vs XLA's own compile time (abstract shapes, fake devices).

For each model and mesh: nodes before and after merging (followers, shared layers),
ILP variables and constraints, solve time (both programs of the default exact pricing:
the per-demand one and the per-value one started from its plan), total planning time
(trace + graph + ILP + plan, ``auto_shard_graph``'s whole path), and, in the same run, XLA's compile time of the planned step on as many fake CPU
devices as the mesh has.  Writes benchmarks/results/bench_intra.json.

    python benchmarks/bench_intra.py [--models gpt-350m gpt-1.3b ...] [--meshes 2x4 8x8]
        [--solver cbc] [--merge-elementwise] [--layer-period 1] [--[no-]layer-ends]
        [--per-demand-pricing]
        [--no-compile] [--repeat 3] [--tie-break-columns 0]

Without ``--solver``, ``--merge-elementwise``, ``--layer-period`` or ``--layer-ends`` it
plans with the planner's defaults (:class:`~autoshard.intra.problem.options.IntraOptions`).

``--tie-break-columns N`` sets the largest program that gets the second, tie-breaking
solve (:data:`autoshard.intra.ilp.solve.TIE_MAX_COLUMNS`; 0: none does), to measure what
that solve costs; each row says how it went (``tie_break``).

With ``--repeat N`` every (mesh, model) is planned and compiled N times in the same
process; each row reports the median of every timing and keeps the N runs under ``runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

TIMINGS = ("trace_s", "build_s", "solve_s", "auto_shard_s", "xla_compile_s")


def _one_run(args, jax, model: str, mesh_text: str, dmesh) -> dict:
    """Trace, plan and (unless ``--no-compile``) compile one model on one mesh, timed."""
    from autoshard.api import trace_workload
    from autoshard.intra.cost.resharding import CostOptions
    from autoshard.intra.ilp import resolve_ties
    from autoshard.intra.problem.build import auto_shard_graph, build_problem
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.runtime.sharded import abstract_args, build_sharded_step, make_mesh

    n = dmesh.num_devices
    batch = args.batch or 2 * n
    t0 = time.perf_counter()
    traced = trace_workload(model, batch_size=batch)
    t1 = time.perf_counter()
    defaults = IntraOptions()  # unless a flag says otherwise, the planner's defaults
    options = defaults.replace(
        solver=args.solver or defaults.solver,
        merge_elementwise=defaults.merge_elementwise or args.merge_elementwise,
        layer_period=args.layer_period or defaults.layer_period,
        layer_ends=defaults.layer_ends if args.layer_ends is None else args.layer_ends,
        cost=CostOptions(tie_breakers=args.cluster is None),
    )
    options = options.replace(time_limit_s=args.time_limit)
    if args.per_demand_pricing:
        options = options.replace(exact_values=False)
    if args.exact_search is not None:
        options = options.replace(exact_search=args.exact_search)
    plan = auto_shard_graph(traced.graph, dmesh, options)  # the planner's whole path
    t4 = time.perf_counter()
    sol = plan.solver
    ip = build_problem(traced.graph, dmesh, options)  # its size, untimed
    roots = len(set(resolve_ties(ip.problem)[0]))
    row = {
        "model": model,
        "mesh": mesh_text,
        "batch": batch,
        "nodes": len(ip.problem.num_strategies),
        "roots_after_merging": roots,
        "variables": sol["num_variables"],
        "constraints": sol["num_constraints"],
        "trace_s": t1 - t0,
        "build_s": sol["build_seconds"],
        "solve_s": sol["seconds"],
        "auto_shard_s": t4 - t0,
        "solver": options.solver,
        "merge_elementwise": options.merge_elementwise,
        "layer_period": options.layer_period,
        "layer_ends": options.layer_ends,
        "exact_values": options.exact_values,
        "exact_search": options.exact_search,
        "solver_status": sol["status"],
        "exact_stopped": sol.get("exact_stopped"),
        "objective": plan.objective,
        "tie_break": sol.get("tie_break"),
    }
    if not args.no_compile:
        jmesh = make_mesh(plan.mesh, jax.devices()[:n])
        step = build_sharded_step(traced.program, plan, jmesh)
        c0 = time.perf_counter()
        step.lower(*abstract_args(traced.program, plan, jmesh)).compile()
        row["xla_compile_s"] = time.perf_counter() - c0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["gpt-350m", "gpt-1.3b", "gpt-2.6b", "gpt-39b"])
    ap.add_argument("--meshes", nargs="+", default=["2x4", "8x8"])
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: mesh size x 2)")
    ap.add_argument("--solver", default=None, help="cbc or highs (default: the planner's)")
    ap.add_argument(
        "--layer-period", type=int, default=None, help="identical layers tied p at a time"
    )
    ap.add_argument(
        "--layer-ends",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first and last layer of each run untied (default: the planner's)",
    )
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--per-demand-pricing",
        action="store_true",
        help="the ILP without the exact per-value program (the planner's default has it)",
    )
    ap.add_argument(
        "--exact-search",
        choices=("lp", "auto", "one-axis", "always", "never"),
        default=None,
        help="where the exact per-value program is solved (default: the planner's)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; timings are medians")
    ap.add_argument("--cluster", default=None, help="cluster preset for costs in seconds")
    ap.add_argument(
        "--merge-elementwise",
        action="store_true",
        help="Alpa's follower rule for binary elementwise ops (smaller ILP)",
    )
    ap.add_argument(
        "--tie-break-columns",
        type=int,
        default=None,
        help="largest program (columns) solved a second time to break ties (0: none)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_intra.json"))
    args = ap.parse_args()

    import jax

    if args.tie_break_columns is not None:
        if args.tie_break_columns < 0:
            ap.error(f"--tie-break-columns {args.tie_break_columns}: give a number >= 0")
        import autoshard.intra.ilp.solve  # noqa: F401 - the module; the package's name is a function

        sys.modules["autoshard.intra.ilp.solve"].TIE_MAX_COLUMNS = args.tie_break_columns
    max_devices = max(eval(m.replace("x", "*")) for m in args.meshes)  # noqa: S307
    jax.config.update("jax_num_cpu_devices", max_devices)

    from autoshard.api import device_mesh_for

    rows = []
    for mesh_text in args.meshes:
        dmesh = device_mesh_for(mesh_text, cluster=args.cluster)
        for model in args.models:
            runs = [_one_run(args, jax, model, mesh_text, dmesh) for _ in range(args.repeat)]
            row = dict(runs[0])
            for key in TIMINGS:
                if key in row:
                    row[key] = statistics.median(r[key] for r in runs)
            if "xla_compile_s" in row:
                row["planning_over_compile"] = row["auto_shard_s"] / row["xla_compile_s"]
            if args.repeat > 1:
                row["runs"] = [{k: r[k] for k in TIMINGS if k in r} for r in runs]
            rows.append(row)
            print(
                json.dumps(
                    {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
                ),
                flush=True,
            )
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "command": " ".join(["python"] + sys.argv),
                        "cpu_count": os.cpu_count(),
                        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "rows": rows,
                    },
                    f,
                    indent=2,
                )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
