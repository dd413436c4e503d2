"""The per-demand solve on meshes of several axes with ``solve(..., ties_after=True)``
against the planner's way (the lexicographic program solved first), in process CPU
seconds, interleaved A B B A in one process so that both see the same load.

``ties_after`` solves the program reduced on its costs alone first. Up to
:data:`~autoshard.intra.ilp.solve.TIE_MAX_COLUMNS` columns the tie-breaking solve then
runs on the lexicographic program from that plan (the same (cost, preference) optimum);
over it -- every per-demand program on a 2-D mesh here -- no tie-breaking solve runs
either way, and that plan is moved onto the lexicographic program and polished there
(``_polish_after``), where the planner's way polishes its own first plan.

Rows: ``LABEL/MESH/PLAN`` (a bench_truth model by its label, planned as bench_truth
plans it, on any mesh), ``intra:MODEL/MESH`` (bench_intra's planner defaults, batch 2 x
the devices) and ``cli:MODEL/MESH`` (``python -m autoshard plan --model MODEL --mesh
MESH``'s settings: adamw, highs, layer period 2) and ``stage:MODEL/MESH`` (a pipeline
stage's program, ``inter/stage_cost.py``'s options on the whole model, costs in seconds
on a dgx-a100 mesh; its A way is the stage solves' own, the LP first). Each way solves the per-demand program
(what ``build.py``'s ``_solved`` solves first) under ``--time-limit`` (default 600 s, so
that both can finish; the CLI's is 120 s). Per row: the lexicographic and cost-only
programs' columns, each way's CPU and wall seconds (both runs), status, gap, nodes,
objective, preference total, and whether the two ways chose the same plan. One JSON line
per row; ``--out`` writes them with the command, the UTC start and the jax version::

    python benchmarks/studies/per_demand_ties_after.py [--rows gpt-tiny/2x4/auto ...]
        [--time-limit 600] [--seeds N] [--out FILE]

``--seeds N``: instead, each way once at HiGHS seeds 0 .. N-1, to set the differences
against HiGHS's own spread over seeds (docs/sharing.md: the per-demand solve's time is a
seed lottery).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRUTH_2D = tuple(
    f"{label}/{mesh}/{plan}"
    for label in ("gpt-tiny", "moe-tiny", "wresnet-tiny(num_layers=8)")
    for mesh in ("2x4", "4x2")
    for plan in ("auto", "zero2", "zero3")
)
STAGE_CLUSTER = "dgx-a100"
ROWS = (*TRUTH_2D, "intra:gpt-350m/2x4", "intra:gpt-1.3b/2x4", "cli:wresnet-small/2x4")


def _truth_problem(text: str):
    from bench_truth import SUITES, _label, plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.problem.build import build_problem

    label, mesh_text, which = text.split("/")
    for entries in SUITES.values():
        for model, overrides, optimizer, _meshes in entries:
            if _label(model, overrides) == label:
                graph = trace_workload(model, optimizer=optimizer, **overrides).graph
                mesh = truth_mesh(mesh_text)
                options, pinned = plan_settings(graph, mesh, which, 600.0)
                return build_problem(graph, mesh, options, pinned_inputs=pinned).problem
    raise ValueError(f"row {text!r}: no bench_truth model is labelled {label!r}")


def _intra_problem(text: str):
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.cost.resharding import CostOptions
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.options import IntraOptions

    model, mesh_text = text.split("/")
    mesh = device_mesh_for(mesh_text)
    graph = trace_workload(model, batch_size=2 * mesh.num_devices).graph
    options = IntraOptions().replace(cost=CostOptions(tie_breakers=True))  # bench_intra's
    return build_problem(graph, mesh, options).problem


def _cli_problem(text: str):
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.options import IntraOptions

    model, mesh_text = text.split("/")
    graph = trace_workload(model, optimizer="adamw").graph
    options = IntraOptions(solver="highs", time_limit_s=120.0, layer_period=2)  # the CLI's
    return build_problem(graph, device_mesh_for(mesh_text), options).problem


def _stage_problem(text: str):
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.inter.stage_cost import _NO_TIES_OPTIONS
    from autoshard.intra.problem.build import build_problem

    model, mesh_text = text.split("/")
    graph = trace_workload(model, optimizer="adamw").graph
    mesh = device_mesh_for(mesh_text, cluster=STAGE_CLUSTER)
    return build_problem(graph, mesh, _NO_TIES_OPTIONS).problem


def problem_of(text: str):
    """The per-demand ShardingProblem of a row."""
    if text.startswith("stage:"):
        return _stage_problem(text.removeprefix("stage:"))
    if text.startswith("intra:"):
        return _intra_problem(text.removeprefix("intra:"))
    if text.startswith("cli:"):
        return _cli_problem(text.removeprefix("cli:"))
    return _truth_problem(text)


def _columns(problem) -> tuple[int, int]:
    """(lexicographic, cost-only) columns of the reduced program."""
    from autoshard.intra.ilp.model import _build
    from autoshard.intra.ilp.reduce import _reduce

    lex = _build(_reduce(problem, True), False).num_cols
    cost = _build(_reduce(dataclasses.replace(problem, preferences=None), True), False)
    return lex, cost.num_cols


def _one(problem, after: bool, time_limit: float, seed: int = 0, lp_first=False) -> dict:
    from autoshard.intra.ilp import objective_of, solve

    cpu, wall = time.process_time(), time.perf_counter()
    sol = solve(problem, solver="highs", time_limit_s=time_limit, ties_after=after, seed=seed,
                lp_first=lp_first and not after)  # fmt: skip
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    prefs = problem.preferences
    return {
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "status": sol.status,
        "gap": sol.gap,
        "nodes": sol.nodes,
        "tie_break": sol.tie_break,
        "objective": objective_of(problem, sol.strategy),
        "preference": sum(prefs[v][p] for v, p in enumerate(sol.strategy)),
        "strategy": sol.strategy,
    }


def run_row(text: str, time_limit: float) -> dict:
    from autoshard.intra.ilp import SolverTimeLimitWarning

    problem = problem_of(text)
    stage = text.startswith("stage:")  # the stage solves' way: the LP first
    lex_cols, cost_cols = _columns(problem)
    runs: dict[str, list[dict]] = {"lexicographic": [], "ties_after": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeLimitWarning)  # in the record
        for after in (False, True, True, False):  # A B B A
            name = "ties_after" if after else "lexicographic"
            runs[name].append(_one(problem, after, time_limit, lp_first=stage))
    row = {"row": text, "columns_lexicographic": lex_cols, "columns_costs_alone": cost_cols}
    for name, got in runs.items():
        first = got[0]
        row[name] = {
            "cpu_s": statistics.median(r["cpu_s"] for r in got),
            "cpu_runs": [r["cpu_s"] for r in got],
            "wall_runs": [r["wall_s"] for r in got],
            **{k: first[k] for k in ("status", "gap", "nodes", "tie_break")},
            "objective": first["objective"],
            "preference": first["preference"],
            "same_in_both_runs": got[0]["strategy"] == got[1]["strategy"],
        }
    a, b = runs["lexicographic"][0], runs["ties_after"][0]
    row["same_plan"] = a["strategy"] == b["strategy"]
    row["same_objective"] = a["objective"] == b["objective"]
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def seeds_row(text: str, time_limit: float, seeds: int) -> dict:
    """Each way at HiGHS seeds 0 .. seeds-1 (interleaved): its CPU seconds per seed and
    objectives, to set the A/B differences against the spread over seeds."""
    from autoshard.intra.ilp import SolverTimeLimitWarning

    problem = problem_of(text)
    row = {"row": text, "seeds": seeds, "lexicographic": [], "ties_after": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeLimitWarning)
        for seed in range(seeds):
            for after in (False, True) if seed % 2 == 0 else (True, False):
                got = _one(problem, after, time_limit, seed)
                name = "ties_after" if after else "lexicographic"
                row[name].append({k: got[k] for k in ("cpu_s", "status", "objective")})
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS))
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument(
        "--seeds", type=int, default=0, help="N > 0: each way once at seeds 0..N-1 instead"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    start, rows = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), []
    for text in args.rows:
        if args.seeds > 0:
            row = seeds_row(text, args.time_limit, args.seeds)
        else:
            row = run_row(text, args.time_limit)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out is not None:  # after every row: a long run leaves what it finished
            summary = {
                "command": "python "
                + " ".join(["benchmarks/studies/per_demand_ties_after.py"] + sys.argv[1:]),
                "started_utc": start,
                "jax": jax.__version__,
            }
            text = json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n"
            args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
