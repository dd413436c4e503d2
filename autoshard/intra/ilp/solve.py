"""The entry points (jax-free): :func:`solve` and :func:`min_peak_memory` reduce the
problem, build the model, run the solver and decode the choice back onto the original
nodes as a :class:`Solution`.
"""

from __future__ import annotations

import dataclasses
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
    cost_quantum,
    objective_of,
    peak_lower_bound,
    peak_memory,
)
from autoshard.intra.ilp.reduce import _reduce
from autoshard.intra.ilp.reduced import _Reduced
from autoshard.intra.ilp.solvers import _ABS_GAP, SOLVERS, _check_solver, _Outcome, _run
from autoshard.intra.ilp.stops import LOAD_DEPENDENT, _by_clock, _overrun  # noqa: F401


@dataclass(frozen=True)
class Solution:
    """The chosen strategy of every original node and how the solve went.

    ``status`` is "optimal" (within ``mip_gap``) or "time_limit" (best incumbent; when the
    solver found none, ``fallback`` says which feasible assignment was returned instead), or
    "fractional" (``mip_max_columns``: the LP relaxation alone, fractional; the strategy is
    the start given, ``gap`` its distance to the LP's bound) or "lp_stopped" (that LP
    stopped unfinished; the start given) or "neighbourhood" (that LP fractional: the best
    plan of the integer program around the start given, ``neighbourhood_free`` binary
    columns left free in its first round, ``neighbourhood_rounds`` rounds kept, ``gap``
    its distance to the LP's bound; "optimal" where it reaches that bound).
    ``gap`` is (objective - best bound) / |objective|, None where the solver gave no bound.
    ``seconds`` covers build + solve; ``build_seconds`` the model building alone.
    ``exact_stopped``: where the exact per-value program, started from the per-demand
    plan, stopped unproven (its own time budget), or None.
    ``tie_break``: how the second solve that breaks ties by the preferences went:
    "optimal", "time_limit" (its best plan kept: still of the least cost), "skipped" (no
    time left, or the first solve was not proven optimal), or None (no preferences, or
    none left to decide once the reductions had resolved them).
    ``load_dependent``: True where a wall-clock limit (``time_limit_s``), not a count,
    decided the plan: it stopped the first solve, its LP or the tie-breaking solve, or left
    no time for the tie-breaking solve. Another run, on a machine more or less loaded, can
    then return another plan (a warning says so). Where the counts (``max_nodes``, the
    tie-break's nodes, iteration caps) end every solve, HiGHS's path does not depend on
    the clock, and the same problem, seed and solver give the same plan.
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
    tie_break: str | None = None  # the preference solve: optimal | time_limit | skipped
    neighbourhood_free: int | None = None  # "neighbourhood": the binary columns left free
    # "neighbourhood": its rounds whose plan was kept (each around the last one's plan)
    neighbourhood_rounds: int | None = None
    load_dependent: bool = False  # a wall-clock limit, not a count, decided the plan

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


# what one unit of preference weighs in the tie-breaking solve, in rescaled cost units: ten
# times the absolute gap the solves prove, so the solver sees every step of preference;
# the cost row, not this weight, keeps the cost at the first solve's
TIE_WEIGHT = 10 * _ABS_GAP
# programs with more columns skip the tie-breaking solve (the last pass, _polish, still
# runs). On large programs the preferences are a hard problem of their own: on gpt-350m's
# per-demand program on 2x4 (85,000 columns) HiGHS spent 50 s at the root of that solve
# against 39 s for the whole first solve, and in a budget of half the first solve's time
# it improved neither that plan nor gpt-1.3b's on 8x8. A rule on the program's size
# keeps the plan independent of the machine's load, which a time budget would not.
TIE_MAX_COLUMNS = 20_000
# and branch-and-bound nodes (its best plan kept at the limit, status "time_limit"): also
# a rule that does not depend on the load; gpt-350m's exact program on 8 devices (10,000
# columns) explored 658 nodes in 2 minutes without proving its tie-break
TIE_MAX_NODES = 20


def _tie_break(
    model: _Model, solver: str, time_limit_s, seed: int, within: float | None = None
) -> _Outcome | None:
    """The second, lexicographic solve: among the plans whose cost is at most the first
    solve's (``model.values``) plus the gap it proved (``_ABS_GAP``), the least preference
    total. Started from the first solve's plan, it minimises cost + :data:`TIE_WEIGHT` x
    preference under that cost row: every plan it may return costs what the first did
    (to the solver's tolerance). ``model``'s values are the new plan's where the outcome
    has one (else the first plan's, kept). None: no preference left to decide (the
    reductions resolved them, or they are constant on every block).
    ``within``: the first plan's cost in ``model``'s units where that plan was solved on
    another program (:func:`_ties_after`; ``model.start`` then holds its columns and
    ``model.values`` is None, and stays None where this solve finds no plan)."""
    preference = np.asarray(model.preference)
    if not preference.any() or (within is None and model.values is None):
        return None
    first = model.values
    cost = np.asarray(model.cost)
    if within is None:
        within = float(cost @ first)
        model.start = (list(range(model.num_binary)), np.round(first[: model.num_binary]).tolist())
    paid = [(j, float(c)) for j, c in enumerate(cost.tolist()) if c]
    model.row(paid, -math.inf, within + _ABS_GAP)
    model.cost = (cost + TIE_WEIGHT * preference).tolist()
    model.max_nodes = min(model.max_nodes or TIE_MAX_NODES, TIE_MAX_NODES)
    model.values = None
    out = _run(model, solver, time_limit_s, 0.0, seed)
    if model.values is None or out.status not in ("optimal", "time_limit"):
        model.values = first  # no plan from the second solve: the first stays
    return out


def _rounded_objective(problem: ShardingProblem, strategy) -> float:
    """:func:`objective_of` with every cost rounded to :func:`cost_quantum` as the
    lexicographic reductions round them: the cost the lexicographic program (plus its
    reductions' constant) charges ``strategy``, or less where its reductions picked a
    cheaper strategy for a node they eliminated or dropped (dominance keeps a strategy
    no dearer whatever the neighbours pick)."""
    q = cost_quantum(problem)
    s = tuple(strategy)
    node = (problem.node_costs[v][s[v]] for v in range(problem.num_nodes))
    edge = (e.costs[s[e.src]][s[e.dst]] for e in problem.edges)
    return math.fsum(float(np.round(c / q) * q) for c in (*node, *edge))


def _breaks_ties(red: _Reduced, model: _Model) -> bool:
    """Whether :func:`solve`'s tie-breaking solve runs on ``model`` (of ``red``): it has
    preferences left to decide, at most :data:`TIE_MAX_COLUMNS` columns and no memory
    rows (else :func:`_polish` alone breaks its ties)."""
    return (
        np.asarray(model.preference).any()
        and model.num_cols <= TIE_MAX_COLUMNS
        and not red.mem_rows
    )


def _ties_after(
    red: _Reduced, model: _Model, plan, merge: bool, solver: str, time_limit_s, seed: int
):
    """The tie-breaking solve on the lexicographic program (``red``, ``model``) from
    ``plan``, a least-cost plan of the program reduced on its costs alone (``ties_after``):
    under the cost row at ``plan``'s cost, from ``plan``'s columns (a node whose strategy
    the lexicographic reductions dropped as dominated is left to the solver). (Its
    outcome or None, the strategy: the tie-broken plan, else ``plan``.)"""
    within = (_rounded_objective(red.problem, plan) - red.constant.real) / model.scale
    model.start = _start(red, plan)
    model.values = None
    second = _tie_break(model, solver, time_limit_s, seed, within)
    if model.values is None:  # no plan from it (or no preference to decide): plan stays
        return second, tuple(int(p) for p in plan)
    if merge:  # (tie rows bind unmerged)
        _polish(red, model)
    return second, _decode(red, model)


def _ties_later(red: _Reduced, model: _Model, merge: bool) -> bool:
    """Whether ``ties_after`` solves the costs alone first on ``model`` (of ``red``, the
    lexicographic program): it has preferences left to decide and no memory rows, and
    either the tie-breaking solve runs on it (:func:`_breaks_ties`) or, over
    :data:`TIE_MAX_COLUMNS` columns, :func:`_polish` does (``merge``)."""
    if _breaks_ties(red, model):
        return True
    return merge and np.asarray(model.preference).any() and not red.mem_rows


def _polish_after(red: _Reduced, model: _Model, plan) -> tuple[int, ...]:
    """``plan`` (a least-cost plan of the program reduced on its costs alone) moved onto
    the lexicographic program (``red``, ``model``, over :data:`TIE_MAX_COLUMNS` columns:
    no tie-breaking solve) and polished there (:func:`_polish`), as that program's own
    first plan would be. A block whose strategy in ``plan`` the lexicographic reductions
    dropped (dominated) starts on its least (cost, preference) column given the
    neighbours placed before it. The polished plan where its (rounded cost, preference)
    is no worse than ``plan``'s, else ``plan``: never a dearer plan."""
    plan = tuple(int(p) for p in plan)
    around: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b, mat in red.pairs:
        around.setdefault(a, []).append((b, mat))
        around.setdefault(b, []).append((a, mat.T))
    chosen: dict[int, int] = {}
    dropped = []
    for b, cols in enumerate(red.cols):
        if cols.size:
            hit = np.flatnonzero(cols == plan[red.blocks[b]])
            if hit.size:
                chosen[b] = int(hit[0])
            else:
                dropped.append(b)
    for b in dropped:
        total = red.costs[b].astype(complex)
        for u, mat in around.get(b, ()):
            if u in chosen:
                total = total + mat[:, chosen[u]]
        chosen[b] = int(np.argmin(total))  # complex: cost, then preference
    model.values = np.zeros(model.num_cols)
    for b, j in chosen.items():
        model.values[red.offset[b] + j] = 1.0
    _polish(red, model)
    polished = _decode(red, model)

    def key(s):
        prefs = red.problem.preferences
        return _rounded_objective(red.problem, s), math.fsum(prefs[v][p] for v, p in enumerate(s))

    return polished if key(polished) <= key(plan) else plan


def _polish(red: _Reduced, model: _Model, rounds: int = 50) -> int:
    """Move single blocks to a preferred strategy of equal cost, given their neighbours'
    (``model.values``, updated in place), until no move helps: each move lowers the
    (cost, preference) pair lexicographically -- exactly, on the rounded costs -- so it
    never buys cost. What the tie-breaking solve left undecided within its budget, a
    large program's many independent ties, goes this way in milliseconds. Not with
    memory rows (a move could break the budget). Returns the number of moves."""
    if red.mem_rows or red.ties or model.values is None:
        return 0
    live = [b for b, cols in enumerate(red.cols) if cols.size > 1]
    if not live:
        return 0
    chosen = {}
    for b, cols in enumerate(red.cols):
        if cols.size:
            o = red.offset[b]
            chosen[b] = int(np.argmax(model.values[o : o + cols.size]))
    around: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b, mat in red.pairs:
        around.setdefault(a, []).append((b, mat))
        around.setdefault(b, []).append((a, mat.T))
    moves = 0
    for _ in range(rounds):
        moved = False
        for b in live:
            total = red.costs[b].astype(complex)
            for u, mat in around.get(b, ()):
                total = total + mat[:, chosen[u]]
            best = int(np.argmin(total))  # numpy orders complex numbers lexicographically
            if total[best] < total[chosen[b]]:
                chosen[b], moved = best, True
                moves += 1
        if not moved:
            break
    for b, j in chosen.items():
        o, size = red.offset[b], red.cols[b].size
        model.values[o : o + size] = np.arange(size) == j
    return moves


def _min_peak(pb: ShardingProblem, solver: str, time_limit_s, seed: int) -> tuple[float, bool]:
    red = _reduce(pb, merge=True, eliminate=False, memory=True, lexicographic=False)
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
    lp_first: bool = False,
    mip_max_columns: int | None = None,
    lp_max_iterations: int | None = None,
    ties_after: bool = False,
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
    ``lp_first``: HiGHS solves the LP relaxation first and keeps its solution when it is
    integral (an optimum of the program: its objective is the bound), running the integer
    program only when it is not (CBC ignores it).  The optimum is the same; where several
    plans reach it, which one comes back may differ from the integer program's.
    ``mip_max_columns`` (with ``lp_first`` and ``initial``): where the relaxation is
    fractional and the program has more columns than this, no integer program runs on the
    whole program: the integer program on ``initial``'s neighbourhood does (the binary
    columns where ``initial`` and the LP agree fixed, at most
    :data:`~autoshard.intra.ilp.solvers.NEIGHBOURHOOD_MAX_FREE` left free, ``max_nodes``
    nodes a round, up to :data:`~autoshard.intra.ilp.solvers.NEIGHBOURHOOD_ROUNDS` rounds,
    each around the last one's plan; status "neighbourhood", or "optimal" where its plan
    reaches the LP's bound);
    where it cannot run, the solution is ``initial`` with status "fractional" and its gap
    to the LP's bound (no warning either way: the caller asked for the LP alone).  A rule
    on the program's size, so which programs get the integer program does not depend on
    the load.  ``lp_max_iterations``
    (with ``mip_max_columns``): the LP's simplex iteration limit; an LP stopped there or by
    the time limit also returns ``initial``, with status "lp_stopped" (``limit``
    "iterations" or "time").
    ``ties_after`` (not with ``lp_first``): where the tie-breaking solve runs, the first
    solve runs on the program reduced on its costs alone, and the tie-breaking solve on
    the lexicographic program from its plan, under the same cost row. The lexicographic
    reductions keep every strategy that costs what another does but is preferred
    differently, which the costs alone let dominance drop: a larger program whose
    equal-cost alternatives HiGHS's root closes slowly (gpt-tiny's exact program on 8:
    7,141 columns against 6,979, 3.8 s and 3 nodes against 0.6 s and 1 node, the same
    optimum; docs/sharing.md). Same (cost, preference) optimum; where several plans reach
    it, which one comes back may differ. Over :data:`TIE_MAX_COLUMNS` columns (no
    tie-breaking solve; ``merge`` only) the first solve's plan is moved onto the
    lexicographic program and polished there (:func:`_polish_after`) instead: the same
    cost, its preference total neither the least nor always that of the lexicographic
    program's own polished plan (the per-demand programs on 2-D meshes: not faster on every
    row, docs/sharing.md; not the planner's default there).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    _check_solver(solver)  # also where the reductions leave the solver nothing to do
    if not 0.0 <= mip_gap < 1.0:
        raise ValueError(f"mip_gap={mip_gap} is a relative gap; give a value in [0, 1)")
    if max_nodes is not None and (
        isinstance(max_nodes, bool) or int(max_nodes) != max_nodes or max_nodes < 1
    ):
        raise ValueError(f"max_nodes={max_nodes!r}: give a positive whole number of nodes, or None")
    if mip_max_columns is not None and (not lp_first or initial is None):
        raise ValueError("mip_max_columns needs lp_first=True and an initial assignment")
    if lp_max_iterations is not None and mip_max_columns is None:
        raise ValueError("lp_max_iterations needs mip_max_columns")
    if ties_after and lp_first:
        raise ValueError("ties_after needs lp_first=False (the LP first breaks no ties)")
    start = time.perf_counter()
    # ``lex`` the program as given (lexicographic with preferences), ``red`` and ``model``
    # the one the first solve runs on: the costs alone with ties_after where the
    # tie-breaking solve will run, else the same
    red = lex_red = _reduce(problem, merge)
    model = lex = _build(red, minimise_peak=False)
    if ties_after and _ties_later(lex_red, lex, merge):
        red = _reduce(dataclasses.replace(problem, preferences=None), merge)
        model = _build(red, minimise_peak=False)
    if initial is not None:
        model.start = _start(red, initial)
    model.presolve = lex.presolve = presolve
    model.max_nodes = lex.max_nodes = None if max_nodes is None else int(max_nodes)
    model.lp_first = lp_first
    model.mip_max_columns = mip_max_columns
    model.lp_max_iterations = lp_max_iterations
    build_seconds = time.perf_counter() - start
    out = _solve_model(red, model, solver, time_limit_s, mip_gap, seed)
    # which stops were the clock's (the plan then depends on the load), not a count's
    clock = _by_clock(out)
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
    if out.status in ("fractional", "lp_stopped"):  # the LP alone: the start stands
        model.values = None
        strategy = tuple(initial)
    if out.status == "no_incumbent":
        greedy = greedy_assignment(problem)
        if greedy is None:
            raise SolverTimeLimitError(
                f"{solver} found no feasible assignment within time_limit_s={time_limit_s} "
                f"({model.num_binary} binary variables), and no greedy plan fits; raise the time "
                "limit (--time-limit) or the memory budget"
            )
        strategy, fallback = greedy, "greedy"
        out = _Outcome("time_limit", out.bound, out.nodes, out.limit, out.wall_s)
    tie_break, tie_clock = None, False
    ties_later = model is not lex and out.status == "optimal"
    if ties_later:  # (no values: the reductions fixed every block, _decode needs none)
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
        if lex.num_cols > TIE_MAX_COLUMNS:  # no tie-breaking solve: the polish alone
            tie_break = "skipped"
            strategy = _polish_after(lex_red, lex, _decode(red, model))
        elif left is None or left > 0.0:
            second, strategy = _ties_after(
                lex_red, lex, _decode(red, model), merge, solver, left, seed
            )
            if second is not None:
                statuses = {"optimal": "optimal", "time_limit": "time_limit"}
                tie_break = statuses.get(second.status, "skipped")
                out = dataclasses.replace(out, nodes=_add(out.nodes, second.nodes))
                tie_clock = _by_clock(second)
        else:
            tie_break, strategy = "skipped", _decode(red, model)
            tie_clock = True
    elif out.status == "optimal" and model.values is not None:
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
        if model.num_cols > TIE_MAX_COLUMNS or red.mem_rows:
            # under a memory budget the rows make the second solve 2-10x the first (gpt-350m,
            # 2 blocks, 8 devices, 1.6 GB: 44.5 s against 4.5 s, same cost and peak)
            tie_break = "skipped" if np.asarray(model.preference).any() else None
            if merge and problem.preferences is not None:
                _polish(red, model)
        elif left is None or left > 0.0:
            second = _tie_break(model, solver, left, seed)
            if merge and problem.preferences is not None:  # (tie rows bind unmerged)
                _polish(red, model)
            if second is not None:
                statuses = {"optimal": "optimal", "time_limit": "time_limit"}
                tie_break = statuses.get(second.status, "skipped")
                out = dataclasses.replace(out, nodes=_add(out.nodes, second.nodes))
                tie_clock = _by_clock(second)
        elif np.asarray(model.preference).any():
            tie_break, tie_clock = "skipped", True
    elif np.asarray(lex.preference).any():
        tie_break = "skipped"
    if fallback is None and out.status not in ("fractional", "lp_stopped") and not ties_later:
        strategy = _decode(red, model)
    objective = objective_of(problem, strategy)
    if out.status == "neighbourhood":  # the start is inside it: never a dearer plan
        start_cost = objective_of(problem, tuple(initial))
        if not objective <= start_cost:
            strategy, objective = tuple(initial), start_cost
    if not math.isfinite(objective):
        raise RuntimeError(
            f"internal error: the {solver} solution breaks a tie or picks an infinite cost"
        )
    gap = None
    if out.bound is not None:  # a bound on the cost (the first solve's)
        bound = out.bound * model.scale + red.constant.real
        gap = max(0.0, objective - bound) / max(abs(objective), 1e-300)
    elif out.status == "optimal" and mip_gap == 0.0:
        gap = 0.0
    status = out.status
    if status == "neighbourhood" and out.bound is not None:
        reach = objective - (out.bound * model.scale + red.constant.real)
        if reach <= max(_ABS_GAP * model.scale, _PROVEN_GAP * abs(objective)):
            status = "optimal"  # the neighbourhood's plan reaches the whole program's LP bound
    if out.status == "time_limit":
        found = (
            "found no plan; returning a greedy feasible plan"
            if fallback
            else "stopped with its best plan"
        )
        where = f"max_nodes={max_nodes}" if out.limit == "nodes" else f"time_limit_s={time_limit_s}"
        warnings.warn(
            f"{solver} {found} at {where}{_overrun(out, time_limit_s, model)}: "
            f"objective {objective:.6g}, "
            f"relative gap {'unknown' if gap is None else f'{gap:.3g}'}; raise "
            + ("max_nodes" if out.limit == "nodes" else "the time limit (--time-limit)")
            + " for a better plan"
            + (f"; {LOAD_DEPENDENT}" if clock else ""),
            SolverTimeLimitWarning,
            stacklevel=2,
        )
    elif tie_clock:
        warnings.warn(
            f"{solver}'s tie-breaking solve "
            + ("stopped at" if tie_break == "time_limit" else "had no time left of")
            + f" time_limit_s={time_limit_s} (its plan still costs the least; among the plans"
            f" of that cost, the preferences did not decide which); {LOAD_DEPENDENT}",
            SolverTimeLimitWarning,
            stacklevel=2,
        )
    return Solution(
        strategy=strategy,
        objective=objective,
        status=status,
        gap=gap,
        solver=solver,
        seconds=time.perf_counter() - start,
        build_seconds=build_seconds,
        num_variables=lex.num_cols,
        num_constraints=lex.num_rows,
        num_roots=len(red.blocks),
        fallback=fallback,
        nodes=out.nodes,
        limit=out.limit,
        tie_break=tie_break,
        neighbourhood_free=model.neighbourhood_free if out.status == "neighbourhood" else None,
        neighbourhood_rounds=(
            model.neighbourhood_rounds if out.status == "neighbourhood" else None
        ),
        load_dependent=clock or tie_clock,
    )


# a neighbourhood's plan within the absolute gap the solvers prove (_ABS_GAP of the
# rescaled range), or within this fraction of its objective (the simplex's own
# tolerances), of the whole program's LP bound counts as proven optimal
_PROVEN_GAP = 1e-7


def _add(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else a + b
