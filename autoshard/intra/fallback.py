"""The plan to hand back when the solver's time limit passes with no incumbent (jax-free).

Takes the greedy plan the ILP layer fell back to (:func:`autoshard.intra.ilp.greedy`)
and the problem's graph and mesh; plans each baseline (dp, zero2, zero3, megatron) the
same greedy way through the same problem with its inputs pinned, and returns the cheapest
feasible one, with a note naming what was compared. Guarantees a plan whenever the greedy
pass finds one; never calls a solver (the time is already spent).
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.intra.baselines import BASELINES, baseline_inputs
from autoshard.intra.ilp import objective_of
from autoshard.intra.ilp.greedy import greedy_assignment


def cheapest_fallback(plan, solution, graph, mesh, options):
    """The cheapest of ``plan`` (greedy, unpinned, from ``solution``) and the greedy
    baseline plans."""
    from autoshard.intra.problem import build_problem, plan_from_solution  # it calls us

    best, costs = plan, {"greedy": plan.objective}
    for name in BASELINES:
        try:
            ip = build_problem(
                graph, mesh, options, pinned_inputs=baseline_inputs(graph, mesh.mesh, name)
            )
        except ValueError:  # the baseline does not apply to this graph and mesh
            continue
        choice = greedy_assignment(ip.problem)
        if choice is None:
            continue
        costs[name] = objective = objective_of(ip.problem, choice)
        if math.isfinite(objective) and objective < best.objective:
            sol = dataclasses.replace(solution, strategy=choice, objective=objective, fallback=name)
            best = plan_from_solution(ip, sol, name=plan.name)
    listed = ", ".join(f"{k} {v:.6g}" for k, v in costs.items())
    note = (
        f"the solver found no plan within the time limit ({options.time_limit_s} s); this is the "
        f"cheapest feasible fallback ({best.solver.get('fallback')}) of: {listed}; raise the time "
        "limit (--time-limit) for the ILP's plan"
    )
    return dataclasses.replace(best, notes=best.notes + (note,))
