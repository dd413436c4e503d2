"""Predicted against compiled collectives where ``exact_search`` changes the plan:
the small programs of several axes (at most ``EXACT_MAX_COLUMNS`` columns) that the
verifier's suites do not have (their programs are over that rule, or their per-demand
plans are already the per-value optimum: bench_truth's 2-D rows plan the same either way).

For each case and mesh: the plan of each of ``--searches`` (default ``"one-axis"``, the
default before 2026-11-27, and ``"lp"``, the default since), its planning seconds
(``auto_shard_graph``, the graph traced already), each compiled on fake CPU devices and
compared with its prediction (:func:`autoshard.verify.check.verify_plan`: the same (kind,
axes) pairs, bytes within 2%; XLA's compile seconds).  With ``--memo-off`` the last
search's plan is also compiled with the runtime's reshard memo off (each reader of a value
constrained on its own, as before 2026-11-27), which is how ``auto``'s prediction missed
an all-gather on test_intra's MLP on 2x2. One JSON line per case on stdout, progress on
stderr; ``--out`` writes every row with the command and the load::

    python benchmarks/studies/bench_exact_verify.py [--meshes 2x2 2x4 4x2]
        [--searches one-axis lp] [--repeat 3] [--memo-off] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

CASES = {  # name: (model, overrides); "conv": Alpa's n-layer conv net (bench_exact_search)
    "conv2": ("conv", {"num_layers": 2}),
    "conv4": ("conv", {"num_layers": 4}),
    "mlp-16x256": ("mlp", {"batch_size": 16, "hidden": 256, "num_layers": 2}),
    "mlp-4096x128": ("mlp", {"batch_size": 4096, "hidden": 128, "num_layers": 2}),
    "mlp-64x1024": ("mlp", {"batch_size": 64, "hidden": 1024, "num_layers": 2}),
}


def _verified(program, plan, devices, memo: bool) -> dict:
    import autoshard.runtime.sharded as sharded
    from autoshard.verify.check import verify_plan

    hook = sharded.SpecConstraints.operands_hook
    if not memo:  # each reader's constraints on its own (the runtime before 2026-11-27)
        sharded.SpecConstraints.operands_hook = lambda self, i, v, memo=None: hook(self, i, v)
    try:
        report = verify_plan(program, plan, devices=devices)
    finally:
        sharded.SpecConstraints.operands_hook = hook
    return {
        "compile_s": round(report.compile_seconds, 2),
        "collectives_agree": report.collectives_agree,
        "disagreeing": [
            f"{r.kind}@{','.join(r.axes)}: {r.predicted_count} x {r.predicted_bytes:,} B "
            f"predicted, {r.compiled_count} x {r.compiled_bytes:,} B compiled"
            for r in report.comparison.rows
            if not r.agree
        ],
        "memory_error": round(
            (report.predicted_peak_bytes - report.compiled_peak_bytes) / report.compiled_peak_bytes,
            4,
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--meshes", nargs="+", default=["2x2", "2x4", "4x2"])
    ap.add_argument("--searches", nargs="+", default=["one-axis", "lp"])
    ap.add_argument("--repeat", type=int, default=1, help="plans per search; plan_s: the median")
    ap.add_argument("--memo-off", action="store_true", help="also the last plan, memo off")
    ap.add_argument("--out", default=None, help="also write every row here (JSON)")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_exact_search import conv_program

    from autoshard.api import trace_workload
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.ir.graph import build_graph

    rows, t_start, loads = [], time.time(), [os.getloadavg()[0]]
    for name in args.cases:
        model, kw = CASES[name]
        if model == "conv":
            program = conv_program(**kw)
            graph = build_graph(program.records)
        else:
            traced = trace_workload(model, optimizer="sgd", **kw)
            program, graph = traced.program, traced.graph
        for mesh_text in args.meshes:
            shape = tuple(int(n) for n in mesh_text.split("x"))
            print(f"{name} {mesh_text} ...", file=sys.stderr, flush=True)
            mesh = alpa_test_mesh(shape, ("data", "model"))
            devices = jax.devices()[: mesh.num_devices]
            row = {"case": name, "model": model, "overrides": kw, "mesh": mesh_text}
            times = {s: [] for s in args.searches}
            for _ in range(args.repeat):  # the searches alternate, so load shifts hit both
                for search in args.searches:
                    t0 = time.perf_counter()
                    plan = auto_shard_graph(
                        graph, mesh, IntraOptions(solver="highs", exact_search=search)
                    )
                    times[search].append(round(time.perf_counter() - t0, 2))
                    if search in row:  # the same plan every time (no time in the rules)
                        assert plan.objective == row[search]["objective"], (name, search)
                    row[search] = {"objective": plan.objective, "plan": plan}
            for search in args.searches:
                plan = row[search].pop("plan")
                row[search] = {
                    "objective": plan.objective,
                    "plan_s": statistics.median(times[search]),
                    "plan_s_runs": times[search],
                    "exact_stopped": plan.solver.get("exact_stopped"),
                    **_verified(program, plan, devices, memo=True),
                }
            if args.memo_off:
                row[search]["memo_off"] = _verified(program, plan, devices, memo=False)
            first, last = args.searches[0], args.searches[-1]
            row["plan_changed"] = row[last]["objective"] < row[first]["objective"] * (1 - 1e-9)
            rows.append(row)
            loads.append(os.getloadavg()[0])
            print(json.dumps(row), flush=True)
    first, last = args.searches[0], args.searches[-1]
    summary = {
        "cases": len(rows),
        f"{last}_changed_the_plan": sum(r["plan_changed"] for r in rows),
        **{f"agree_{s}": sum(r[s]["collectives_agree"] for r in rows) for s in args.searches},
        **{
            f"planning_over_compile_max_{s}": max(r[s]["plan_s"] / r[s]["compile_s"] for r in rows)
            for s in args.searches
        },
        "command": "python benchmarks/studies/bench_exact_verify.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "load_1min": [min(loads), max(loads)],
        "jax": jax.__version__,
    }
    if args.memo_off:
        summary[f"agree_{last}_memo_off"] = sum(
            r[last]["memo_off"]["collectives_agree"] for r in rows
        )
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
