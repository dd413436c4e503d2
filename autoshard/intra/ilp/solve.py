"""The entry points (jax-free): :func:`solve` and :func:`min_peak_memory` reduce the
problem, build the model, run the solver and decode the choice back onto the original
nodes as a :class:`Solution`.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from autoshard.intra.ilp.greedy import greedy_assignment
from autoshard.intra.ilp.model import _build, _Model
from autoshard.intra.ilp.problem import (
    InfeasibleBudgetError,
    InfeasibleProblemError,
    ShardingProblem,
    SolverTimeLimitError,
    SolverTimeLimitWarning,
    objective_of,
    peak_lower_bound,
    peak_memory,
    with_preferences,
)
from autoshard.intra.ilp.reduce import _reduce, _Reduced
from autoshard.intra.ilp.solvers import SOLVERS, _Outcome, _run


@dataclass(frozen=True)
class Solution:
    """The chosen strategy of every original node and how the solve went.

    ``status`` is "optimal" (within ``mip_gap``) or "time_limit" (best incumbent; when the
    solver found none, ``fallback`` says which feasible assignment was returned instead).
    ``gap`` is (objective - best bound) / |objective|, None where the solver gave no bound.
    ``seconds`` covers build + solve; ``build_seconds`` the model building alone.
    ``exact_stopped``: where the exact per-value program, started from the per-demand
    plan, stopped unproven (its own time budget), or None.
    """

    strategy: tuple[int, ...]
    objective: float
    status: str
    gap: float | None
    solver: str
    seconds: float
    build_seconds: float
    num_variables: int
    num_constraints: int
    num_roots: int
    fallback: str | None = None
    exact_stopped: str | None = None  # the exact per-value program stopped before proof
    nodes: int | None = None  # branch-and-bound nodes explored (HiGHS; None: not reported)
    limit: str | None = None  # "time" or "nodes": which limit stopped a "time_limit" solve

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Solution:
        d = json.loads(text)
        d["strategy"] = tuple(d["strategy"])
        return cls(**d)


def _decode(red: _Reduced, model: _Model) -> tuple[int, ...]:
    chosen = []
    for b, cols in enumerate(red.cols):
        if cols.size:
            o = red.offset[b]
            vals = model.values[o : o + cols.size]
            chosen.append(int(cols[int(np.argmax(vals))]))
        else:
            chosen.append(red.fixed[b])
    for b, c, parts in reversed(red.eliminated):
        total = c + sum(m[:, chosen[u]] for u, m in parts)
        chosen[b] = int(np.argmin(total))
    return tuple(int(red.maps[v][chosen[red.block_of[v]]]) for v in range(red.problem.num_nodes))


def _start(red: _Reduced, initial) -> tuple[list[int], list[float]]:
    """The strategy columns of ``initial`` (one per node) in the reduced program: 1 on the
    column of each block's chosen strategy, 0 on the others; blocks whose choice has no
    column (eliminated, or a dominated strategy) are left to the solver."""
    cols: list[int] = []
    vals: list[float] = []
    for b, allowed in enumerate(red.cols):
        if not allowed.size:
            continue
        hit = np.flatnonzero(allowed == initial[red.blocks[b]])
        if not hit.size:
            continue
        o = int(red.offset[b])
        cols.extend(range(o, o + allowed.size))
        vals.extend(float(j == hit[0]) for j in range(allowed.size))
    return cols, vals


def _solve_model(red, model, solver, time_limit_s, mip_gap, seed) -> _Outcome:
    if model.violated:
        return _Outcome("infeasible", None)
    if not model.num_binary:  # everything fixed: nothing for a solver to do
        return _Outcome("optimal", 0.0)
    return _run(model, solver, time_limit_s, mip_gap, seed)


def _min_peak(pb: ShardingProblem, solver: str, time_limit_s, seed: int) -> tuple[float, bool]:
    red = _reduce(pb, merge=True, eliminate=False, memory=True)  # eliminating follows costs
    model = _build(red, minimise_peak=True)
    out = _solve_model(red, model, solver, time_limit_s, 0.0, seed)
    if out.status == "infeasible":
        raise InfeasibleProblemError("no assignment avoids infinite costs while honouring the ties")
    if out.status == "no_incumbent":
        raise SolverTimeLimitError(
            f"{solver} found no feasible assignment (ignoring the budget) within "
            f"time_limit_s={time_limit_s}; raise the time limit (--time-limit)"
        )
    return peak_memory(pb, _decode(red, model)), out.status == "optimal"


def min_peak_memory(
    problem: ShardingProblem,
    *,
    solver: str = "cbc",
    time_limit_s: float | None = 60.0,
    seed: int = 0,
) -> float:
    """Smallest peak live-set memory any feasible assignment reaches, ignoring costs."""
    return _min_peak(problem, solver, time_limit_s, seed)[0]


def solve(
    problem: ShardingProblem,
    solver: str = "cbc",
    time_limit_s: float | None = 60.0,
    mip_gap: float = 0.0,
    seed: int = 0,
    merge: bool = True,
    initial: tuple[int, ...] | None = None,
    presolve: bool = False,
    max_nodes: int | None = None,
) -> Solution:
    """Minimise total cost over one strategy per node; see :mod:`autoshard.intra.ilp`.

    Raises InfeasibleBudgetError (with ``min_feasible_bytes``) when only the budget is in
    the way, InfeasibleProblemError when infinite costs and ties leave no assignment,
    SolverTimeLimitError when the time limit passes with no incumbent, and
    SolverUnavailableError / ValueError for a missing or unknown solver. Returns the
    incumbent with a SolverTimeLimitWarning when the time limit passes with one.
    ``initial``: a feasible assignment the solver starts from (HiGHS; CBC ignores it).
    ``presolve``: HiGHS's presolve (CBC ignores it). Off by default: on the GPT presets'
    programs HiGHS reached the same optimum 1.2-3.8x faster without it (its presolve and
    the sub-MIPs' took most of the time; docs/sharing.md).
    ``max_nodes``: a limit on branch-and-bound nodes; unlike a time limit it stops at the
    same point on a busy machine and an idle one, so the plan does not depend on the load.
    Reaching it is reported like the time limit (status "time_limit", best plan kept).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    if not 0.0 <= mip_gap < 1.0:
        raise ValueError(f"mip_gap={mip_gap} is a relative gap; give a value in [0, 1)")
    if max_nodes is not None and (
        isinstance(max_nodes, bool) or int(max_nodes) != max_nodes or max_nodes < 1
    ):
        raise ValueError(f"max_nodes={max_nodes!r}: give a positive whole number of nodes, or None")
    start = time.perf_counter()
    work = with_preferences(problem)
    red = _reduce(work, merge)
    model = _build(red, minimise_peak=False)
    if initial is not None:
        model.start = _start(red, initial)
    model.presolve = presolve
    model.max_nodes = None if max_nodes is None else int(max_nodes)
    build_seconds = time.perf_counter() - start
    out = _solve_model(red, model, solver, time_limit_s, mip_gap, seed)
    if out.status == "infeasible":
        if problem.memory_budget_bytes is None or model.violated == "tie" or not red.mem_rows:
            raise InfeasibleProblemError(
                "no assignment avoids infinite costs while honouring the ties"
            )
        try:
            need, proven = _min_peak(problem, solver, time_limit_s, seed)
        except SolverTimeLimitError:  # the budget is still proven out of reach
            need, proven = math.inf, False
        err = InfeasibleBudgetError(problem.memory_budget_bytes, need, proven)
        err.lower_bound_bytes = peak_lower_bound(problem.node_memory, problem.live_sets)
        raise err
    fallback = None
    if out.status == "no_incumbent":
        greedy = greedy_assignment(problem)
        if greedy is None:
            raise SolverTimeLimitError(
                f"{solver} found no feasible assignment within time_limit_s={time_limit_s} "
                f"({model.num_binary} binary variables), and no greedy plan fits; raise the time "
                "limit (--time-limit) or the memory budget"
            )
        strategy, fallback = greedy, "greedy"
        out = _Outcome("time_limit", out.bound, out.nodes, out.limit)
    else:
        strategy = _decode(red, model)
    objective = objective_of(problem, strategy)
    if not math.isfinite(objective):
        raise RuntimeError(
            f"internal error: the {solver} solution breaks a tie or picks an infinite cost"
        )
    gap = None
    if out.bound is not None:  # a bound on cost + preferences
        bound = out.bound * model.scale + red.constant
        solved = objective_of(work, strategy)
        gap = max(0.0, solved - bound) / max(abs(solved), 1e-300)
    elif out.status == "optimal" and mip_gap == 0.0:
        gap = 0.0
    if out.status == "time_limit":
        found = (
            "found no plan; returning a greedy feasible plan"
            if fallback
            else "stopped with its best plan"
        )
        where = f"max_nodes={max_nodes}" if out.limit == "nodes" else f"time_limit_s={time_limit_s}"
        warnings.warn(
            f"{solver} {found} at {where}: objective {objective:.6g}, "
            f"relative gap {'unknown' if gap is None else f'{gap:.3g}'}; raise "
            + ("max_nodes" if out.limit == "nodes" else "the time limit (--time-limit)")
            + " for a better plan",
            SolverTimeLimitWarning,
            stacklevel=2,
        )
    return Solution(
        strategy=strategy,
        objective=objective,
        status=out.status,
        gap=gap,
        solver=solver,
        seconds=time.perf_counter() - start,
        build_seconds=build_seconds,
        num_variables=model.num_cols,
        num_constraints=model.num_rows,
        num_roots=len(red.blocks),
        fallback=fallback,
        nodes=out.nodes,
        limit=out.limit,
    )
