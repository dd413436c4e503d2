"""A feasible assignment without a solver (jax-free): :func:`greedy_assignment`, the
fallback when the solver's time limit passes before it finds any incumbent.

Takes a :class:`ShardingProblem`; returns one strategy per node that honours every tie
and picks no infinite cost, or None when the greedy pass runs into a forbidden pair (or
the memory budget). No optimality claim: each group of tied nodes, in the order of its
root, takes the strategy that is cheapest given the groups already decided.
"""

from __future__ import annotations

import math

import numpy as np

from autoshard.intra.ilp.problem import ShardingProblem, objective_of, peak_memory, resolve_ties


def greedy_assignment(problem: ShardingProblem) -> tuple[int, ...] | None:
    """A feasible assignment of ``problem`` chosen greedily, or None (see the module)."""
    roots, maps = resolve_ties(problem)
    maps_np = [np.asarray(m) for m in maps]
    group: dict[int, list[int]] = {}
    for v, r in enumerate(roots):
        group.setdefault(r, []).append(v)
    touching: dict[int, list] = {}
    for e in problem.edges:
        touching.setdefault(roots[e.src], []).append(e)
        if roots[e.dst] != roots[e.src]:
            touching.setdefault(roots[e.dst], []).append(e)
    choice = [-1] * problem.num_nodes
    decided = [False] * problem.num_nodes
    for r in sorted(group):
        k = problem.num_strategies[r]
        total = np.zeros(k)
        for v in group[r]:
            m = maps_np[v]
            costs = np.asarray(problem.node_costs[v])
            total += np.where(m >= 0, costs[np.maximum(m, 0)], math.inf)
        for e in touching.get(r, ()):
            src_in, dst_in = roots[e.src] == r, roots[e.dst] == r
            mat = np.asarray(e.costs)
            if src_in and dst_in:
                ms, md = np.maximum(maps_np[e.src], 0), np.maximum(maps_np[e.dst], 0)
                total += mat[ms, md]
            elif src_in and decided[e.dst]:
                total += mat[np.maximum(maps_np[e.src], 0), choice[e.dst]]
            elif dst_in and decided[e.src]:
                total += mat[choice[e.src], np.maximum(maps_np[e.dst], 0)]
        p = int(np.argmin(total))
        if not math.isfinite(total[p]):
            return None
        for v in group[r]:
            choice[v], decided[v] = int(maps_np[v][p]), True
    if not math.isfinite(objective_of(problem, choice)):
        return None
    budget = problem.memory_budget_bytes
    if budget is not None and problem.live_sets and peak_memory(problem, choice) > budget:
        return None
    return tuple(choice)
