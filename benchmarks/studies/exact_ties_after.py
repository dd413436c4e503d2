"""Why the exact per-value program's solve on one axis was slow with the tie-break
preferences: its first solve on the lexicographic program (the reductions keep every
strategy that costs what another does but is preferred differently) against the same
solve on the program reduced on its costs alone (``solve(..., ties_after=True)``, what the
planner does since 2026-11-28), each followed by the tie-breaking solve.

For each bench_truth row ``LABEL/MESH/PLAN`` (one-axis meshes): the per-demand plan, then
the exact program solved from it as the planner solves it (200 nodes, presolve on, no time
cap) both ways, with every HiGHS run's columns, binary columns, branch-and-bound nodes,
LP iterations and seconds, and each way's objective and preference total. One JSON line
per row on stdout; ``--out`` writes them with the command, the UTC start, the load and the
jax version::

    python benchmarks/studies/exact_ties_after.py [--rows gpt-tiny/8/auto ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = (
    "gpt-tiny/8/auto",
    "gpt-tiny/1x8/auto",
    "gpt-tiny(num_layers=4)/8/auto",
    "gpt-tiny(num_layers=4)/1x8/auto",
    "gpt-tiny/8/zero2",
)


class _HighsRuns:
    """Records each ``Highs.run`` of the solves meanwhile: the model's size, HiGHS's
    nodes and LP iterations, and its seconds."""

    def __enter__(self):
        import highspy

        self.highs, self.runs = highspy.Highs, []
        self.run = self.highs.run
        runs, run = self.runs, self.run

        def recorded(highs):
            started = time.perf_counter()
            status = run(highs)
            info, lp = highs.getInfo(), highs.getLp()
            binary = sum(1 for k in lp.integrality_ if int(k) != 0) if lp.integrality_ else 0
            runs.append(
                {
                    "columns": lp.num_col_,
                    "binary": binary,
                    "nodes": int(info.mip_node_count),
                    "lp_iterations": int(info.simplex_iteration_count),
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
            return status

        self.highs.run = recorded
        return self

    def __exit__(self, *exc):
        self.highs.run = self.run
        return False


def run_row(text: str, traced: dict) -> dict:
    from bench_truth import plan_settings, truth_mesh
    from exact_truth_sample import find_row

    from autoshard.api import trace_workload
    from autoshard.intra.ilp import SolverTimeLimitWarning, objective_of, solve
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.exact_values import EXACT_MAX_NODES

    _suite, model, overrides, optimizer, mesh_text, which = find_row(text)
    key = (model, tuple(sorted(overrides.items())), optimizer)
    if key not in traced:
        traced[key] = trace_workload(model, optimizer=optimizer, **overrides)
    graph, mesh = traced[key].graph, truth_mesh(mesh_text)
    if sum(1 for n in mesh.mesh.shape if n > 1) > 1:
        raise ValueError(f"row {text!r}: this study solves one-axis meshes only")
    options, pinned = plan_settings(graph, mesh, which, 300.0)
    demand = build_problem(graph, mesh, options, pinned_inputs=pinned)
    exact = build_problem(graph, mesh, options, pinned_inputs=pinned, exact_values=True)
    row = {"row": text}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeLimitWarning)
        first = solve(demand.problem, solver="highs", time_limit_s=300.0)
        row["per_demand_seconds"] = round(first.seconds, 2)
        start = exact.values.complete(exact.strategies, first.strategy, mesh)
        row["start_objective"] = objective_of(exact.problem, start)
        for name, after in (("lexicographic", False), ("ties_after", True)):
            with _HighsRuns() as runs:
                sol = solve(exact.problem, solver="highs", time_limit_s=None, initial=start,
                            presolve=True, max_nodes=EXACT_MAX_NODES, ties_after=after)  # fmt: skip
            choice = exact.values.complete(exact.strategies, sol.strategy, mesh)
            prefs = exact.problem.preferences
            row[name] = {
                "objective": objective_of(exact.problem, choice),
                "preference": sum(prefs[v][p] for v, p in enumerate(sol.strategy)),
                "status": sol.status,
                "tie_break": sol.tie_break,
                "seconds": round(sol.seconds, 2),
                "highs_runs": runs.runs,  # the first solve, then the tie-break
            }
    row["same_plan"] = row["lexicographic"]["objective"] == row["ties_after"]["objective"]
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="LABEL/MESH/PLAN rows")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    start, rows, traced = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), [], {}
    for text in args.rows:
        row = run_row(text, traced)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        summary = {
            "command": "python "
            + " ".join(["benchmarks/studies/exact_ties_after.py"] + sys.argv[1:]),  # fmt: skip
            "started_utc": start,
            "jax": jax.__version__,
        }
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
