"""Does solving the exact per-value program pay on meshes of two axes? (IntraOptions.exact_search)

For each plan of the verifier's small suites (gpt-tiny with 2 and 4 blocks, moe-tiny,
wresnet-tiny with 2 blocks; SGD; meshes 2x4 and 4x2; the ILP and every baseline), this
solves the per-demand program, prices its plan per value (the objective the default
reports on such meshes), then solves the exact program from that plan as
``exact_search="always"`` does, and reports both objectives and the seconds each step
took.  One JSON line per plan on stdout, progress on stderr; ``--out`` also writes them
as one JSON document.

    python benchmarks/studies/bench_exact_search.py [--meshes 2x4 4x2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CASES = [
    ("gpt-tiny", {}),
    ("gpt-tiny", {"num_layers": 4}),
    ("moe-tiny", {}),
    ("wresnet-tiny", {"num_layers": 8}),
]
PLANS = ("auto", "dp", "zero2", "zero3", "megatron")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", nargs="+", default=["2x4", "4x2"])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--out", default=None, help="also write every row here (JSON)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.ilp import objective_of, solve
    from autoshard.intra.problem.build import _common, _finish, _solve_exact
    from autoshard.intra.problem.options import IntraOptions

    rows = []
    for model, overrides in CASES:
        traced = trace_workload(model, optimizer="sgd", **overrides)
        for mesh_text in args.meshes:
            shape = tuple(int(s) for s in mesh_text.split("x"))
            mesh = device_mesh_for(shape, ("data", "model")[: len(shape)])
            for which in PLANS:
                print(f"{model} {overrides} {mesh_text} {which} ...", file=sys.stderr, flush=True)
                pinned = (
                    baseline_inputs(traced.graph, mesh.mesh, which) if which != "auto" else None
                )
                options = IntraOptions(solver="highs", time_limit_s=args.time_limit)
                if which != "auto":
                    options = baseline_options(options, mesh.mesh, which)
                settings = dict(solver="highs", time_limit_s=args.time_limit, mip_gap=0.0, seed=0)
                t0 = time.perf_counter()
                common = _common(traced.graph, mesh, options, pinned, True, None)
                exact, demand = _finish(common, True), _finish(common, False)
                t1 = time.perf_counter()
                first = solve(demand.problem, **settings)
                t2 = time.perf_counter()
                priced = objective_of(
                    exact.problem, exact.values.complete(exact.strategies, first.strategy, mesh)
                )
                t3 = time.perf_counter()
                # what exact_search="always" does (it solves the per-demand program again)
                solved = _solve_exact(exact, demand, mesh, settings)
                t4 = time.perf_counter()
                row = dict(
                    model=model, overrides=overrides, mesh=mesh_text, plan=which,
                    per_demand_objective=first.objective, priced_per_value=priced,
                    exact_objective=solved.objective,
                    exact_gain_pct=100 * (priced - solved.objective) / priced,
                    build_s=round(t1 - t0, 3), per_demand_solve_s=round(t2 - t1, 3),
                    exact_solve_extra_s=round((t4 - t3) - (t2 - t1), 3),
                    exact_stopped=solved.exact_stopped, status=solved.status,
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    over = [r for r in rows if r["per_demand_objective"] > r["priced_per_value"] * (1 + 1e-9)]
    print(
        f"{len(rows)} plans, {len(over)} over-charged by the per-demand program; the exact "
        f"solve improved {sum(r['exact_gain_pct'] > 1e-9 for r in rows)} of them "
        f"(best {max((r['exact_gain_pct'] for r in rows), default=0):.3f}%)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
