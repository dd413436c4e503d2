"""Does any plan the planner returns by default cost more than one the same ILP holds?
Issue #31's last acceptance check, on bench_truth's own problems.

For each sampled bench_truth row (its model, mesh and plan built by bench_truth's own
functions), three solves of the same problem:

1. the default plan, as bench_truth makes it (``auto_shard_graph`` under bench_truth's
   settings), its objective priced per value (``plan.objective``: on meshes of several axes
   over ``EXACT_MAX_COLUMNS`` the per-demand plan priced by ``price_per_value``);
2. the same plan made with the tie-break preferences off (every strategy's preference 0,
   as tests/test_tie_breaks.py switches them off): both plans' per-demand objective (what
   the per-demand ILP minimises) must be equal; a cheaper one would be a tie-break that
   bought cost;
3. the exact per-value program (what ``exact_search="always"`` solves: no column rule),
   warm-started from the default plan, under ``--time-limit`` seconds and without the
   planner's 200-node budget (the LP relaxation first on meshes of several axes, as the
   planner does, then the integer program), solved without preferences: its best
   objective, its bound and gap, status, seconds, nodes and columns.

Where the exact program finds a cheaper plan than the default, that plan is compiled
(``verify_plan``) and its collectives and peak memory compared with the prediction.
One JSON line per row on stdout, progress on stderr; ``--out`` writes every row with the
command, the UTC start, the load and the jax version::

    python benchmarks/studies/exact_truth_sample.py [--rows LABEL/MESH/PLAN ...] \\
        [--time-limit 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

# bench_truth's rows: its model label (bench_truth._label), mesh and plan
SAMPLE = (
    "gpt-tiny/2x4/auto",
    "gpt-tiny/4x2/auto",
    "gpt-tiny/2x4/zero3",
    "gpt-tiny(num_layers=4)/2x4/auto",
    "moe-tiny/2x4/auto",
    "wresnet-tiny(num_layers=8)/2x4/auto",
    "gpt-tiny/8/auto",  # one axis: the default solves the exact program there (control)
)
# bench_truth's ILP time limit (its --time-limit default) for the default and no-preference plans
PLAN_TIME_LIMIT = 300.0
# relative difference below which two objectives count as equal (the solvers' tolerances)
SAME = 1e-9


def find_row(text: str):
    """(suite, model, overrides, optimizer, mesh text, plan) of a row ``LABEL/MESH/PLAN``
    of bench_truth's suites, or ValueError naming what is not there."""
    from bench_truth import PLANS, SUITES, _label

    parts = text.split("/")
    if len(parts) != 3:
        raise ValueError(f"row {text!r}: give LABEL/MESH/PLAN, e.g. gpt-tiny/2x4/auto")
    label, mesh_text, which = parts
    if which not in PLANS:
        raise ValueError(f"row {text!r}: plan {which!r} is not one of {', '.join(PLANS)}")
    for suite, entries in SUITES.items():
        for model, overrides, optimizer, meshes in entries:
            if _label(model, overrides) == label:
                if mesh_text not in meshes:
                    raise ValueError(
                        f"row {text!r}: bench_truth plans {label} on {', '.join(meshes)}"
                    )
                return suite, model, overrides, optimizer, mesh_text, which
    raise ValueError(f"row {text!r}: no bench_truth model is labelled {label!r}")


@contextlib.contextmanager
def preferences_off():
    """Plan with every strategy's preference 0: no tie-break solve, no lexicographic
    reductions (the switch tests/test_tie_breaks.py uses)."""
    import autoshard.intra.problem.build as build

    def none(graph, strategies, n_in, mesh):
        return tuple((0.0,) * len(s) for s in strategies)

    original = build.preferences
    build.preferences = none
    try:
        yield
    finally:
        build.preferences = original


def plan_record(plan, demand, seconds: float) -> dict:
    """What a plan's solver record says, with its per-demand objective (``demand``: the
    per-demand program; a plan of the exact program is read on its real nodes, the
    per-demand program's few extra nodes set as XLA's behaviour implies)."""
    from autoshard.intra.ilp import objective_of

    choice = tuple(plan.solver["strategy"])
    if len(choice) != demand.problem.num_nodes:
        choice = demand.values.complete(demand.strategies, choice, demand.mesh)
    per_demand = objective_of(demand.problem, choice)
    # the plan is the per-demand program's where the planner does not solve the exact
    # program or stops it (exact_stopped says why), or where the per-demand program charged
    # it its per-value price (kept unsearched on one-axis meshes until 2026-11-28; since,
    # a start the exact program proved optimal); else it is the exact program's
    kept = plan.solver.get("exact_stopped") is not None or per_demand <= plan.objective * (1 + SAME)
    return {
        "objective": plan.objective,
        "per_demand_objective": per_demand,
        "from": "per-demand program" if kept else "exact program",
        "status": plan.solver.get("status"),
        "gap": plan.solver.get("gap"),
        "columns": plan.solver.get("num_variables"),
        "tie_break": plan.solver.get("tie_break"),
        "exact_stopped": plan.solver.get("exact_stopped"),
        "seconds": round(seconds, 2),
    }


class _LpRecorder:
    """Records the LP relaxation the solver runs first (meshes of several axes): its
    status, objective in the program's units, simplex iterations and seconds."""

    def __init__(self):
        from autoshard.intra.ilp import solvers

        self.solvers, self.solve_module = solvers, sys.modules["autoshard.intra.ilp.solve"]
        self.relaxation, self.build = solvers._relaxation, self.solve_module._build
        self.lp: dict | None = None
        self.constant = 0.0

    def __enter__(self):
        def relaxation(highs, lp, model):
            started = time.perf_counter()
            outcome = self.relaxation(highs, lp, model)
            info = highs.getInfo()
            self.lp = {
                "status": {"no_incumbent": "stopped"}.get(outcome.status, outcome.status),
                "objective": None
                if outcome.bound is None
                else outcome.bound * model.scale + self.constant,
                "iterations": int(info.simplex_iteration_count),
                "seconds": round(time.perf_counter() - started, 2),
            }
            return outcome

        def build(red, **kw):  # the reductions' constant: what the model leaves out
            self.constant = float(red.constant.real)
            return self.build(red, **kw)

        self.solvers._relaxation, self.solve_module._build = relaxation, build
        return self

    def __exit__(self, *exc):
        self.solvers._relaxation, self.solve_module._build = self.relaxation, self.build
        return False


def solve_exact_long(ip, mesh, start, time_limit: float):
    """The exact program ``ip`` warm-started from ``start`` (a plan of its real nodes),
    without preferences or a node budget, under ``time_limit`` seconds: (the solver's
    Solution, the completed assignment, its objective, the start's objective)."""
    from autoshard.intra.ilp import SolverTimeLimitWarning, objective_of, solve
    from autoshard.intra.problem.value_edges import hub_max_sets

    initial = ip.values.complete(ip.strategies, start, mesh)
    start_price = objective_of(ip.problem, initial)
    plain = dataclasses.replace(ip.problem, preferences=None)
    with warnings.catch_warnings(), _LpRecorder() as recorder:
        warnings.simplefilter("ignore", SolverTimeLimitWarning)  # recorded in the row
        solution = solve(
            plain,
            solver="highs",
            time_limit_s=time_limit,
            initial=initial,
            presolve=True,
            lp_first=hub_max_sets(mesh) > 0,
        )
    choice = ip.values.complete(ip.strategies, solution.strategy, mesh)
    return solution, choice, objective_of(ip.problem, choice), start_price, recorder.lp


def exact_record(solution, objective, start_price, default, lp) -> dict:
    """The exact program's outcome; its bound the best of the integer program's and its LP
    relaxation's (solved first on meshes of several axes)."""
    bound = None
    if solution.gap is not None:  # the solver's gap is relative to its own objective
        bound = solution.objective - solution.gap * abs(solution.objective)
    if lp is not None and lp["objective"] is not None:
        bound = lp["objective"] if bound is None else max(bound, lp["objective"])
    if bound is not None:
        bound = min(bound, objective)  # a bound past the plan is the solver's tolerance
    return {
        "objective": objective,
        "start_objective": start_price,
        "bound": bound,
        "gap": solution.gap,
        "status": solution.status,
        "limit": solution.limit,
        "nodes": solution.nodes,
        "columns": solution.num_variables,
        "seconds": round(solution.seconds, 2),
        "cheaper_than_default": objective < default * (1 - SAME),
        "change_vs_default": objective / default - 1 if default else 0.0,
        "bound_vs_default": None if bound is None else bound / default - 1,
        "gap_to_bound": None if bound is None else (objective - bound) / abs(objective),
        "lp": lp,
    }


@contextlib.contextmanager
def rules_lifted():
    """The default's exact search (``exact_search="lp"``) with its size rules lifted: no
    column rule (``EXACT_MAX_COLUMNS``) and no LP iteration cap (``EXACT_LP_MAX_ITERATIONS``),
    so its LP, and the integer program around the per-demand plan where the LP is
    fractional, run on bench_truth's 2-D programs too."""
    import autoshard.intra.problem.exact_values as exact_values

    saved = exact_values.EXACT_MAX_COLUMNS, exact_values.EXACT_LP_MAX_ITERATIONS
    exact_values.EXACT_MAX_COLUMNS = exact_values.EXACT_LP_MAX_ITERATIONS = 10**12
    try:
        yield
    finally:
        exact_values.EXACT_MAX_COLUMNS, exact_values.EXACT_LP_MAX_ITERATIONS = saved


def run_row(text: str, time_limit: float, traced_cache: dict, lifted: bool = False) -> dict:
    from bench_truth import _label, plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.baselines.tables import BaselineRefusedError
    from autoshard.intra.ilp import InfeasibleProblemError
    from autoshard.intra.problem.build import auto_shard_graph, build_problem
    from autoshard.intra.problem.predict import plan_from_solution
    from autoshard.verify.check import verify_plan

    suite, model, overrides, optimizer, mesh_text, which = find_row(text)
    key = (model, tuple(sorted(overrides.items())), optimizer)
    if key not in traced_cache:
        traced_cache[key] = trace_workload(model, optimizer=optimizer, **overrides)
    traced = traced_cache[key]
    graph, mesh = traced.graph, truth_mesh(mesh_text)
    row = {"suite": suite, "model": _label(model, overrides), "mesh": mesh_text, "plan": which}
    try:
        options, pinned = plan_settings(graph, mesh, which, PLAN_TIME_LIMIT)
    except BaselineRefusedError as err:  # as bench_truth counts it: refused, not planned
        return {**row, "refused": str(err)[:500]}

    def progress(what):
        print(f"{text}: {what} ...", file=sys.stderr, flush=True)

    demand = build_problem(graph, mesh, options, pinned_inputs=pinned)
    progress("default plan")
    t0 = time.perf_counter()
    try:
        plan = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
    except InfeasibleProblemError as err:
        if which == "auto":
            raise
        return {**row, "refused": str(err)[:500]}  # a baseline's layout rules (bench_truth)
    row["default"] = plan_record(plan, demand, time.perf_counter() - t0)
    progress("no preferences")
    t0 = time.perf_counter()
    with preferences_off():
        plain = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
    row["no_preferences"] = plan_record(plain, demand, time.perf_counter() - t0)
    d, p = row["default"], row["no_preferences"]
    # the per-demand objectives compare where both plans are that program's optimum
    both = d["from"] == p["from"] == "per-demand program"
    row["no_preferences_cheaper_per_demand"] = (
        p["per_demand_objective"] < d["per_demand_objective"] * (1 - SAME) if both else None
    )
    row["no_preferences_cheaper"] = p["objective"] < d["objective"] * (1 - SAME)
    row["same_plan"] = (
        plan.input_specs == plain.input_specs and plan.tensor_specs == plain.tensor_specs
    )
    if lifted:
        progress("the default's search, its size rules lifted")
        t0 = time.perf_counter()
        with rules_lifted():
            wide = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
        row["default_rules_lifted"] = plan_record(wide, demand, time.perf_counter() - t0)

    progress(f"exact program, {time_limit:g} s")
    t0 = time.perf_counter()
    exact = build_problem(graph, mesh, options, pinned_inputs=pinned, exact_values=True)
    build_s = time.perf_counter() - t0
    solution, choice, objective, start_price, lp = solve_exact_long(
        exact, mesh, plan.solver["strategy"], time_limit
    )
    row["exact"] = exact_record(solution, objective, start_price, plan.objective, lp)
    row["exact"]["build_seconds"] = round(build_s, 2)
    if row["exact"]["cheaper_than_default"]:
        progress("compiling the exact program's cheaper plan")
        found = dataclasses.replace(solution, strategy=choice, objective=objective)
        cheaper = plan_from_solution(exact, found, which, forbidden=options.forbidden_collectives())
        report = verify_plan(traced.program, cheaper)
        default_report = verify_plan(traced.program, plan)
        row["exact"]["verify"] = {
            "collectives_agree": report.collectives_agree,
            "disagreeing_rows": [
                f"{r.kind}@{','.join(r.axes) or '?'}" for r in report.comparison.rows if not r.agree
            ],
            "predicted_collective_bytes": sum(r.predicted_bytes for r in report.comparison.rows),
            "compiled_collective_bytes": sum(r.compiled_bytes for r in report.comparison.rows),
            "predicted_peak_bytes": report.predicted_peak_bytes,
            "compiled_peak_bytes": report.compiled_peak_bytes,
            "memory_agree": report.memory_agree,
            "default_compiled_collective_bytes": sum(
                r.compiled_bytes for r in default_report.comparison.rows
            ),
            "default_collectives_agree": default_report.collectives_agree,
        }
    return row


def _summary(rows, args, t_start, loads, jax_version) -> dict:
    done = [r for r in rows if "error" not in r and "refused" not in r]
    return {
        "rows": len(rows),
        "errors": [r["row"] for r in rows if "error" in r],
        "refused": [r["row"] for r in rows if "refused" in r],
        "no_preferences_cheaper": [r["row"] for r in done if r["no_preferences_cheaper"]],
        "no_preferences_cheaper_per_demand": [
            r["row"] for r in done if r["no_preferences_cheaper_per_demand"]
        ],
        "exact_proved_default_optimal": [
            r["row"]
            for r in done
            if r["exact"]["status"] == "optimal" and not r["exact"]["cheaper_than_default"]
        ],
        "exact_cheaper": {
            r["row"]: r["exact"]["change_vs_default"]
            for r in done
            if r["exact"]["cheaper_than_default"]
        },
        "time_limit_s": args.time_limit,
        "plan_time_limit_s": PLAN_TIME_LIMIT,
        "command": "python benchmarks/studies/exact_truth_sample.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "load_1min": [min(loads), max(loads)],
        "jax": jax_version,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(SAMPLE), help="LABEL/MESH/PLAN rows")
    ap.add_argument(
        "--time-limit", type=float, default=300.0, help="the exact program's seconds per row"
    )
    ap.add_argument(
        "--rules-lifted",
        action="store_true",
        help="also plan each row by default with the exact search's size rules lifted",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        ap.error(f"--time-limit {args.time_limit}: give seconds > 0")
    sys.path.insert(0, str(Path(__file__).parent.parent))
    for text in args.rows:  # every row checked before the first solve
        try:
            find_row(text)
        except ValueError as err:
            ap.error(str(err))

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    rows, traced, t_start, loads = [], {}, time.time(), [os.getloadavg()[0]]
    for text in args.rows:
        t0 = time.perf_counter()
        try:
            row = {"row": text, **run_row(text, args.time_limit, traced, args.rules_lifted)}
        except Exception as err:  # noqa: BLE001 -- one row's failure is a row of the study
            row = {"row": text, "error": f"{type(err).__name__}: {err}"[:500]}
        row["row_seconds"] = round(time.perf_counter() - t0, 1)
        loads.append(os.getloadavg()[0])
        row["load"] = loads[-1]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # every row so far, so a stopped run keeps what it did
            summary = _summary(rows, args, t_start, loads, jax.__version__)
            Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    summary = _summary(rows, args, t_start, loads, jax.__version__)
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
