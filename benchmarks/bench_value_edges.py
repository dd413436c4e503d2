"""Problem size and solve of the intra-op ILP, per-demand against exact per-value pricing.

For one model (SGD), mesh and pricing mode, builds the problem and solves it with HiGHS
under a time limit; prints one JSON document: real and extra nodes, edges, the solver's
columns, rows and roots after the exact reductions, solve seconds, status, gap, objective::

    python benchmarks/bench_value_edges.py --model gpt-tiny --layers 2 --mesh 2x4 \\
        [--exact-values] [--time-limit 90]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mesh", default="2x4", help="e.g. 8 or 2x4 (axes data, model)")
    ap.add_argument("--exact-values", action="store_true")
    ap.add_argument("--time-limit", type=float, default=90.0, help="seconds")
    args = ap.parse_args()

    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.ilp import solve
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.options import IntraOptions

    traced = trace_workload(args.model, optimizer="sgd", num_layers=args.layers)
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = device_mesh_for(shape, ("data", "model")[: len(shape)])
    t0 = time.perf_counter()
    ip = build_problem(traced.graph, mesh, IntraOptions(), exact_values=args.exact_values)
    build_s = time.perf_counter() - t0
    sol = solve(ip.problem, solver="highs", time_limit_s=args.time_limit)
    print(
        json.dumps(
            {
                "model": args.model,
                "layers": args.layers,
                "mesh": args.mesh,
                "exact_values": args.exact_values,
                "real_nodes": len(ip.strategies),
                "extra_nodes": ip.problem.num_nodes - len(ip.strategies),
                "edges": len(ip.problem.edges),
                "build_s": round(build_s, 2),
                "columns": sol.num_variables,
                "rows": sol.num_constraints,
                "roots": sol.num_roots,
                "solve_s": round(sol.seconds, 2),
                "status": sol.status,
                "gap": sol.gap,
                "objective": sol.objective,
            }
        )
    )


if __name__ == "__main__":
    main()
