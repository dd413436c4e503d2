"""The plan to hand back when the solver's time limit passes with no incumbent (jax-free).

Takes the greedy plan the ILP layer fell back to (:func:`autoshard.intra.ilp.greedy`)
and the problem it was made from; plans each baseline (dp, zero2, zero3, megatron) the
same greedy way on that same problem, its inputs restricted to the baseline's specs (no
second problem is built: the time is already spent), and returns the cheapest feasible
one, with a note naming what was compared. Never calls a solver.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.intra.baselines.tables import BASELINES, baseline_inputs
from autoshard.intra.ilp import objective_of
from autoshard.intra.ilp.greedy import greedy_assignment


def _pinned(ip, pinned):
    """``ip.problem`` with every input in ``pinned`` held to its spec (the other strategies
    of that input forbidden); None when a spec is not among the input's candidates."""
    costs = list(ip.problem.node_costs)
    for pos, spec in pinned.items():
        keep = [p for p, s in enumerate(ip.strategies[pos]) if s.output_specs[0] == spec]
        if not keep:
            return None
        costs[pos] = tuple(c if p in keep else math.inf for p, c in enumerate(costs[pos]))
    return dataclasses.replace(ip.problem, node_costs=tuple(costs))


def cheapest_fallback(plan, solution, ip, options, plan_from_solution):
    """The cheapest of ``plan`` (greedy, unpinned, from ``solution``) and the greedy
    baseline plans on ``ip`` (an IntraProblem; ``plan_from_solution`` reads a plan off it)."""
    best, costs = plan, {"greedy": plan.objective}
    for name in BASELINES:
        if name == "heuristic":  # its operators' restriction is not in this problem
            continue
        try:
            pinned = baseline_inputs(ip.graph, ip.mesh.mesh, name)
        except ValueError:  # the baseline does not apply to this graph and mesh
            continue
        problem = _pinned(ip, pinned)
        choice = None if problem is None else greedy_assignment(problem)
        if choice is None:
            continue
        costs[name] = objective = objective_of(ip.problem, choice)
        if math.isfinite(objective) and objective < best.objective:
            sol = dataclasses.replace(solution, strategy=choice, objective=objective, fallback=name)
            best = plan_from_solution(ip, sol, name=plan.name)
    listed = ", ".join(f"{k} {v:.6g}" for k, v in costs.items())
    from autoshard.intra.problem.options import solve_time_limit

    limit = solve_time_limit(options)  # the safety net where a node budget was in charge
    note = (
        f"the solver found no plan within the time limit ({limit} s); this is the "
        f"cheapest feasible fallback ({best.solver.get('fallback')}) of: {listed}; raise the time "
        "limit (--time-limit) for the ILP's plan"
    )
    return dataclasses.replace(best, notes=best.notes + (note,))
