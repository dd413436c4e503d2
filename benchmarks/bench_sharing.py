"""Layer sharing against no sharing: objective, problem size and solve time (issue #14).

For each case (model, layers, mesh) plans four ways -- identical layers tied one at a
time (``layer_period=1``), two at a time (``layer_period=2``), two at a time between the
untied first and last layer of each run (``layer_ends=True``) and not at all
(``share_layers=False``) -- on Alpa's test mesh, and records each plan's objective
(relative units), its ILP roots and variables and the solve time.  The unshared solve
starts from the ends-untied plan (so it is never dearer than that plan).  Sharing is exact on a case when the
shared objective equals the unshared one.  Writes benchmarks/results/bench_sharing.json.

    python benchmarks/bench_sharing.py [--cases mlp:6:1x4 gpt-tiny:4:2x4 ...]
        [--solver highs] [--merge-elementwise] [--time-limit 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_CASES = (
    "mlp:6:1x4",
    "mlp:6:4x1",
    "gpt-tiny:2:2x4",
    "gpt-tiny:4:2x4",
    "gpt-tiny:6:2x4",
    "gpt-tiny:4:1x8",
)
WAYS = {
    "period 1": {"layer_period": 1, "layer_ends": False},
    "period 2": {"layer_period": 2, "layer_ends": False},
    "ends, period 2": {"layer_period": 2, "layer_ends": True},
    "unshared": {"share_layers": False},
}


def _case(args, text: str) -> dict:
    from autoshard.api import trace_workload
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.ilp import resolve_ties, solve
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.options import IntraOptions

    model, layers, mesh_text = text.split(":")
    sizes = {"batch_size": 16, "hidden": 2048} if model == "mlp" else {}
    traced = trace_workload(model, optimizer="sgd", num_layers=int(layers), **sizes)
    shape = tuple(int(s) for s in mesh_text.split("x"))
    mesh = alpa_test_mesh(shape, ("data", "model"))
    row: dict = {"case": text, **sizes}
    start = None
    for way, changes in WAYS.items():
        options = IntraOptions(solver=args.solver, merge_elementwise=args.merge_elementwise)
        ip = build_problem(traced.graph, mesh, options.replace(**changes))
        t0 = time.perf_counter()
        sol = solve(ip.problem, solver=args.solver, time_limit_s=args.time_limit, initial=start)
        row[way] = {
            "objective": sol.objective,
            "status": sol.status,
            "gap": sol.gap,
            "roots": len(set(resolve_ties(ip.problem)[0])),
            "variables": sol.num_variables,
            "solve_s": time.perf_counter() - t0,
        }
        if way == "ends, period 2":
            start = sol.strategy
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="model:layers:mesh")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--merge-elementwise", action="store_true")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_sharing.json"))
    args = ap.parse_args()
    rows = []
    for text in args.cases:
        rows.append(_case(args, text))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            doc = {"command": " ".join(["python"] + sys.argv), "time": time.strftime("%F %T")}
            json.dump({**doc, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
