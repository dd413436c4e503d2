"""Running a :class:`_Model` through a solver (jax-free): HiGHS through ``highspy``, CBC
through PuLP, with their tolerances and gaps, and :func:`solver_output_to_stderr` to
keep their C-level output off stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # planning with CBC (and the solver check) needs PuLP; binding and verifying a saved
    import pulp  # plan do not, so a machine without it (a lent GPU) still imports autoshard
except ImportError:
    pulp = None

from autoshard.intra.ilp.model import OBJECTIVE_RANGE, _Model
from autoshard.intra.ilp.problem import SolverUnavailableError

SOLVERS = {"cbc": "PULP_CBC_CMD", "highs": "HiGHS"}
# absolute MIP gap on the rescaled objective: 1e-9 of its largest coefficient; the
# tie-breaking solve keeps the cost within it of the first solve's (solve._tie_break)
_ABS_GAP = 1e-9 * OBJECTIVE_RANGE


def _new_var(prob: pulp.LpProblem, name: str, low=None, cat=None) -> pulp.LpVariable:
    cat = pulp.LpContinuous if cat is None else cat
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3; constructing LpVariable is deprecated there
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def _expr(terms, constant: float = 0.0) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression(terms, constant=constant)


@dataclass(frozen=True)
class _Outcome:
    # optimal | time_limit | no_incumbent | infeasible | fractional | lp_stopped | neighbourhood
    status: str
    bound: float | None  # best bound on the model objective
    nodes: int | None = None  # branch-and-bound nodes explored
    limit: str | None = None  # what stopped a solve: "time", "nodes" or (LP) "iterations"
    wall_s: float | None = None  # the solver's own run, wall clock (HiGHS)


def _check_solver(name: str) -> None:
    """Clear errors for an unknown solver or one that is not installed."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}")
    if pulp is None:
        raise SolverUnavailableError(
            f"solver {name!r}: PuLP is not installed (pip install 'pulp>=2.8,<4' highspy); "
            "plans saved elsewhere (plan --out) still verify and run here without it"
        )
    available = pulp.listSolvers(onlyAvailable=True)
    if SOLVERS[name] not in available:
        ours = sorted(n for n, p in SOLVERS.items() if p in available)
        raise SolverUnavailableError(
            f"solver {name!r} (PuLP's {SOLVERS[name]}) is not installed; available here: {ours} "
            f"(all PuLP solvers found: {available})"
        )


# CBC honours its -sec limit only between branch-and-bound steps: on a large model its
# root LP and preprocessing run on past it (gpt-tiny on 2x2x2 with megatron's pins: over a
# minute at -sec 20, and SIGINT does not stop it). The wall clock bounds it instead: a CBC
# still running at the limit plus this grace is killed, and the solve has no incumbent.
CBC_GRACE_S = 2.0


def _cbc(
    time_limit_s: float | None, mip_gap: float, seed: int, max_nodes: int | None = None
) -> pulp.PULP_CBC_CMD:
    opts = [f"randomCbcSeed {seed + 1}", f"randomSeed {seed + 1}"]
    if max_nodes is not None:
        opts.append(f"maxNodes {int(max_nodes)}")
    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC for 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, gapRel=mip_gap, gapAbs=_ABS_GAP, options=opts
        )


def _solve_cbc_owned(prob: pulp.LpProblem, opts: tuple, time_limit_s, started: float, tmp) -> bool:
    """Run CBC on ``prob`` the way PuLP's ``solve_CBC`` does, but with its files in ``tmp``
    (a directory the caller owns and deletes) and its process in its own group, killed at
    the wall-clock deadline (``time_limit_s`` after ``started``, plus the grace) and on any
    exception (Ctrl-C included). False: the deadline passed, no solution."""
    mps, sol, log = (os.path.join(tmp, f) for f in ("model.mps", "model.sol", "cbc.log"))
    vs, var_names, con_names, _ = prob.writeMPS(mps, rename=1)
    wall_s = None
    if time_limit_s is not None:  # building and writing the model count against the limit
        time_limit_s -= time.monotonic() - started
        if time_limit_s < 0.001:
            return False
        wall_s = time_limit_s + CBC_GRACE_S
    cmd = _cbc(time_limit_s, *opts)
    args = [cmd.path, mps]
    if time_limit_s is not None:
        args += ["-sec", f"{time_limit_s:.3f}"]
    for option in cmd.options + cmd.getOptions():
        args += ["-" + w for w in option.split()[:1]] + option.split()[1:]
    args += ["-solve", "-printingOptions", "all", "-solution", sol]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False
        except BaseException:
            _kill_group(proc)
            raise
    if proc.returncode != 0 or not os.path.exists(sol):
        tail = Path(log).read_text()[-2000:]
        raise RuntimeError(f"CBC exited with status {proc.returncode}; log tail:\n{tail}")
    status, values, _, _, _, sol_status = cmd.readsol_MPS(sol, prob, vs, var_names, con_names)
    prob.assignVarsVals(values)
    prob.assignStatus(status, sol_status)
    return True


# CBC's summary says what stopped it ("Result - Stopped on node limit") and how many
# branch-and-bound nodes it enumerated
_CBC_STOPS = {"time limit": "time", "node limit": "nodes", "iteration limit": "iterations"}


def _cbc_stop(log: str) -> tuple[str | None, int | None]:
    """(what stopped CBC: "time", "nodes", "iterations" or None where it ran to its end or
    its log does not say, the nodes it enumerated or None) from CBC's log."""
    stopped = re.search(r"Result - Stopped on (\w+ limit)", log)
    enumerated = re.search(r"Enumerated nodes:\s+(\d+)", log)
    return (
        _CBC_STOPS.get(stopped.group(1)) if stopped else None,
        int(enumerated.group(1)) if enumerated else None,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def solver_output_to_stderr():
    """Send whatever is written to file descriptor 1 meanwhile to descriptor 2.

    Solvers print from C and C++ (HiGHS 1.16 prints its banner on stdout when a ``Highs``
    object is made, before any option can silence it); Python-level redirection cannot
    catch that, so this swaps the descriptors and flushes C's buffers on the way out. The
    stdout of a ``--json`` command then holds the JSON alone.
    """
    try:
        sys.stdout.flush()
        out_fd, err_fd = 1, 2
        saved = os.dup(out_fd)
    except (OSError, ValueError):  # no descriptors to swap (embedded interpreters)
        yield
        return
    try:
        os.dup2(err_fd, out_fd)
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, out_fd)
        os.close(saved)


@contextlib.contextmanager
def _banner_to_devnull():
    """Descriptor 1 to /dev/null meanwhile: HiGHS prints its copyright banner there when a
    ``Highs`` object is made, before ``output_flag`` can silence it (every plan's stderr
    showed it). Nothing else is printed while the object is made."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # no descriptors to swap (embedded interpreters)
        yield
        return
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to reach (not POSIX)
        pass


def _run(
    model: _Model, solver: str, time_limit_s: float | None, mip_gap: float, seed: int
) -> _Outcome:
    with solver_output_to_stderr():
        _check_solver(solver)
        if solver == "highs":
            return _run_highs(model, time_limit_s, mip_gap, seed)
        return _run_cbc(model, time_limit_s, mip_gap, seed)


def _run_highs(model: _Model, time_limit_s: float | None, mip_gap: float, seed: int) -> _Outcome:
    """HiGHS through its own Python API, the matrix passed as is (no PuLP objects)."""
    import highspy

    with _banner_to_devnull():  # the licence banner, printed before any option is read
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    if time_limit_s is not None:
        highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(mip_gap))
    highs.setOptionValue("mip_abs_gap", _ABS_GAP)
    highs.setOptionValue("random_seed", int(seed))
    highs.setOptionValue("threads", HIGHS_THREADS)
    highs.setOptionValue("presolve", "on" if model.presolve else "off")
    if model.max_nodes is not None:
        highs.setOptionValue("mip_max_nodes", int(model.max_nodes))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_ = np.asarray(model.cost, dtype=float)
    lp.col_lower_ = np.zeros(model.num_cols)
    upper = np.full(model.num_cols, highspy.kHighsInf)
    upper[: model.num_binary] = 1.0
    lp.col_upper_ = upper
    lp.row_lower_ = np.asarray(model.row_lower, dtype=float).clip(-highspy.kHighsInf)
    lp.row_upper_ = np.asarray(model.row_upper, dtype=float).clip(None, highspy.kHighsInf)
    start, index, value = model.csc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
    if model.lp_first:
        relaxed = _relaxation(highs, lp, model)
        if relaxed.status in ("optimal", "infeasible"):
            return relaxed
        big = model.mip_max_columns is not None and model.num_cols > model.mip_max_columns
        if big and relaxed.status == "fractional":  # the start's neighbourhood, the LP's bound
            return _neighbourhood(highs, lp, model, relaxed) or relaxed
        if big or relaxed.status == "lp_stopped":  # no integer program: the LP's bound
            return relaxed
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger] * model.num_binary + [kinds.kContinuous] * (
        model.num_cols - model.num_binary
    )
    highs.passModel(lp)
    if model.start is not None:  # HiGHS completes the continuous columns itself
        cols, vals = model.start
        try:
            highs.setSolution(len(cols), np.asarray(cols, np.int32), np.asarray(vals, float))
        except TypeError:  # highspy < 1.8 takes only a whole HighsSolution: no warm start
            # (a start changes the solve's time, not its optimum; tests/test_value_edges.py)
            pass
    started = time.monotonic()
    _run_fixed(highs)
    wall_s = time.monotonic() - started
    ms, info, status = highs.getModelStatus(), highs.getInfo(), highspy.HighsModelStatus
    if ms in (status.kInfeasible, status.kUnboundedOrInfeasible):
        return _Outcome("infeasible", None)
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if has:
        model.values = np.asarray(highs.getSolution().col_value)
    nodes = int(info.mip_node_count)
    if ms == status.kOptimal:
        return _Outcome("optimal", info.mip_dual_bound, nodes, wall_s=wall_s)
    # kSolutionLimit: the node limit (model.max_nodes)
    if ms in (status.kTimeLimit, status.kIterationLimit, status.kInterrupt, status.kSolutionLimit):
        limit = "nodes" if ms == status.kSolutionLimit else "time"
        return _Outcome(
            "time_limit" if has else "no_incumbent", info.mip_dual_bound, nodes, limit, wall_s
        )
    raise RuntimeError(f"HiGHS ended with model status {highs.modelStatusToString(ms)}")


# HiGHS's worker threads, fixed: its branch-and-bound takes another path with another
# count (tests/test_ilp.py's dense_random(14, 4, seed=0): 5 nodes on one thread, 3 on two,
# the same optimum), and by default it takes half the machine's cores, so a node budget
# would stop at another point, with another plan, on another machine. One thread: the
# per-demand programs measured close at their root node, where a second thread saved
# nothing (the same plans and CPU seconds; docs/sharing.md).
HIGHS_THREADS = 1


def _run_fixed(highs) -> None:
    """``highs.run()`` with :data:`HIGHS_THREADS` threads. HiGHS runs every solve of the
    process on one scheduler, sized by the first run; one started with another count
    (highspy used before with its default) refuses the option and solves nothing
    (``kError``, model status not set), so that scheduler is shut down and the solve run
    again on a new one. (The planner solves one program at a time.)"""
    import highspy

    if highs.run() == highspy.HighsStatus.kError:
        if highs.getModelStatus() == highspy.HighsModelStatus.kNotset:
            highspy.Highs.resetGlobalScheduler(True)
            highs.run()


# a binary column this close to 0 or 1 counts as integral (HiGHS's default
# mip_feasibility_tolerance, what its MIP solver accepts as an integer value)
_INTEGRAL_TOL = 1e-6


# the integer program of :func:`_neighbourhood` runs only where at most this many binary
# columns are left free (the others fixed where the start and the LP agree).
NEIGHBOURHOOD_MAX_FREE = 2_500
# A node whose start and LP disagree on some strategy is freed whole (its every strategy,
# not only the columns where they differ) where that frees at most this many columns:
# the 2-layer conv net on 2x4 then reached the whole integer program's optimum (478
# columns free, 0.3 s; 74 columns alone stopped 1.4% above it), and on 4x2 costs 0.5 s
# (618); random problems where whole nodes find what the columns miss: tests/test_ilp.py.
# Where whole nodes would free more, see :func:`_neighbourhoods`
NEIGHBOURHOOD_WHOLE_NODES_MAX = 1_000
# rounds of the neighbourhood search, each around the plan the last one kept, while one
# finds a cheaper plan: a count, so the plan does not depend on the load. The 4-layer conv
# net on 4x2 (whole nodes 2,429 columns; 108 s for one branch-and-bound node) reached its
# per-value optimum in the second round (the rule before: 0.74% above it), the 5-layer one
# on 4x2 a plan 0.75% below the rule before's; a third round found nothing on the 4-layer one
# (benchmarks/studies/neighbourhood_rounds.py, docs/sharing.md)
NEIGHBOURHOOD_ROUNDS = 2


def _neighbourhoods(model: _Model, incumbent: np.ndarray, first: bool) -> list[np.ndarray]:
    """The free binary columns (masks) of the integer programs a round of
    :func:`_neighbourhood` solves around ``incumbent`` (0/1 per binary column, NaN where
    the start set none; ``first``: the round around the start).  Every node on which the
    incumbent and the LP's solution disagree, whole, where that is at most
    :data:`NEIGHBOURHOOD_WHOLE_NODES_MAX` columns.  Where it is more (the LP fractional
    across much of the program), a narrower set, and no one rule won on every conv net of
    benchmarks/studies/neighbourhood_rounds.py: the first round tries both the columns
    where the two differ (the rule before; the 3-layer net on 2x4: 213 columns, 9.5%
    cheaper than the other) and the nodes where the LP puts under half its weight on the
    incumbent's strategy (:func:`_minority_nodes`; the 4-layer net on 4x2: 0.6% cheaper
    than the columns), keeping the cheaper plan; a later round the minority nodes and the
    nodes they enclose.  Without ``model.node_of``: the columns where the two differ."""
    differ = _differing_columns(model, incumbent)
    if model.node_of is None or not differ.any():
        return [differ]
    whole = np.isin(model.node_of, model.node_of[differ])
    if whole.sum() <= NEIGHBOURHOOD_WHOLE_NODES_MAX:
        return [whole]
    if first:
        return [differ, _minority_nodes(model, incumbent, enclosed=False)]
    return [_minority_nodes(model, incumbent, enclosed=True)]


def _differing_columns(model: _Model, incumbent: np.ndarray) -> np.ndarray:
    """The binary columns on which ``incumbent`` and the LP's solution disagree (the LP
    fractional there, or integral at another value), as a mask."""
    lp_bin = model.lp_values[: model.num_binary]
    rounded = np.round(lp_bin)
    return ~((np.abs(lp_bin - rounded) <= _INTEGRAL_TOL) & (incumbent == rounded))


def _minority_nodes(model: _Model, incumbent: np.ndarray, enclosed: bool) -> np.ndarray:
    """The binary columns of the nodes where the LP relaxation puts under half its weight
    on ``incumbent``'s strategy (the LP's majority, if any, is elsewhere), as a mask; with
    ``enclosed``, within :data:`NEIGHBOURHOOD_WHOLE_NODES_MAX` columns, also every node all
    of whose neighbours (nodes sharing an edge, ``model.node_pairs``) are among them: its
    cost then depends on free nodes alone, and fixed it pins the region around it (the
    4-layer conv net on 4x2 reached its optimum only with them: 983 columns, against 0.12%
    above it with the minority nodes alone)."""
    nb = model.num_binary
    node_of = model.node_of
    nodes = int(node_of.max()) + 1
    weight = model.lp_values[:nb] * np.nan_to_num(incumbent)  # unset: weight 0, freed
    share = np.bincount(node_of, weights=weight, minlength=nodes)
    has_columns = np.bincount(node_of, minlength=nodes) > 0
    free = has_columns & (share < 0.5)
    pairs = model.node_pairs
    if enclosed and pairs is not None and len(pairs):
        ends = np.concatenate([pairs[:, 0], pairs[:, 1]])
        others = np.concatenate([pairs[:, 1], pairs[:, 0]])
        degree = np.bincount(ends, minlength=nodes)
        free_around = np.bincount(ends, weights=free[others], minlength=nodes)
        inside = has_columns & ~free & (degree > 0) & (free_around == degree)
        if (free | inside)[node_of].sum() <= NEIGHBOURHOOD_WHOLE_NODES_MAX:
            free |= inside
    return free[node_of]


def _neighbourhood(highs, lp, model: _Model, relaxed: _Outcome) -> _Outcome | None:
    """Where the LP relaxation of a program too large for its integer program is
    fractional (``relaxed``): the integer program on the start's neighbourhood (RINS, the
    relaxation-induced neighbourhood search of Danna, Rothberg and Le Pape, 2005) -- the
    binary columns :func:`_neighbourhoods` picks free (where the start and the LP's
    solution disagree), the others fixed at the start's values, within ``model.max_nodes``
    nodes, from the start; then around the plan it kept, up to
    :data:`NEIGHBOURHOOD_ROUNDS` rounds, while a round finds a cheaper plan. Its plan is
    at worst the start; the LP's objective bounds it from below (a bound on the whole
    program, so a plan that reaches it is proven optimal). Outcome "neighbourhood" with
    the LP's bound and the values (``model.neighbourhood_free``: the free columns of the
    first round's kept plan, ``model.neighbourhood_rounds``: the rounds that found a
    cheaper plan), or None where there is no start, the two agree everywhere (nothing to
    search), more than :data:`NEIGHBOURHOOD_MAX_FREE` columns would be free or it found
    no plan. Rules on counts (nodes, columns, rounds), so the plan does not depend on the
    load."""
    import highspy

    if model.start is None or model.lp_values is None:
        return None
    nb = model.num_binary
    incumbent = np.full(nb, np.nan)
    cols, vals = model.start
    incumbent[np.asarray(cols, dtype=np.int64)] = vals
    bounds = (np.asarray(lp.col_lower_, dtype=float), np.asarray(lp.col_upper_, dtype=float))
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger] * nb + [kinds.kContinuous] * (model.num_cols - nb)
    found, best, nodes, wall_s, rounds = None, math.inf, 0, 0.0, 0
    for round_ in range(NEIGHBOURHOOD_ROUNDS):
        kept = None
        for free in _neighbourhoods(model, incumbent, first=round_ == 0):
            count = int(free.sum())
            if count == 0 or count > NEIGHBOURHOOD_MAX_FREE:
                continue
            objective, values, n, seconds = _around(highs, lp, bounds, incumbent, free)
            nodes, wall_s = nodes + n, wall_s + seconds
            if values is not None and (found is None or objective < best - _ABS_GAP):
                found, best, kept = values, objective, count
        if kept is None:  # nothing (cheaper) around the incumbent
            break
        rounds += 1
        if round_ == 0:
            model.neighbourhood_free = kept
        incumbent = np.round(found[:nb])
        if relaxed.bound is not None and best <= relaxed.bound + _ABS_GAP:
            break  # the LP's bound reached: proven optimal
    if found is None:
        return None
    model.values = found
    model.neighbourhood_rounds = rounds
    return _Outcome("neighbourhood", relaxed.bound, nodes, wall_s=wall_s)


def _around(highs, lp, bounds, incumbent: np.ndarray, free: np.ndarray):
    """The integer program with the binary columns outside ``free`` fixed at
    ``incumbent``'s values (set there: a column the start left unset is free), from
    ``incumbent``: (its objective, its column values, nodes, seconds); (None, None, ...)
    where it found no plan."""
    nb = free.size
    lower, upper = bounds[0].copy(), bounds[1].copy()
    lower[:nb][~free] = incumbent[~free]
    upper[:nb][~free] = incumbent[~free]
    lp.col_lower_, lp.col_upper_ = lower, upper
    highs.passModel(lp)
    given = np.flatnonzero(~np.isnan(incumbent))
    try:
        highs.setSolution(len(given), given.astype(np.int32), incumbent[given])
    except TypeError:  # highspy < 1.8: no warm start (the start is still inside)
        pass
    started = time.monotonic()
    _run_fixed(highs)
    seconds = time.monotonic() - started
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return None, None, int(info.mip_node_count), seconds
    values = np.asarray(highs.getSolution().col_value)
    return float(info.objective_function_value), values, int(info.mip_node_count), seconds


def _relaxation(highs, lp, model: _Model) -> _Outcome:
    """The LP relaxation of ``model`` solved (dual simplex, no presolve): "optimal" with
    its solution when every binary column is integral -- then it is an optimal solution of
    the integer program too, its objective the bound; "fractional" with its objective as
    the bound when it is not; "no_incumbent" (limit "time") when it did not finish.  Where
    it is not "optimal", ``highs`` is left for the integer program.  The tie-breaking solve
    goes the same way (its start is then unused).  On the stage search's programs every
    relaxation was integral (gpt-39b on 64 GPUs: 52 of 52, first and tie-breaking solves)
    and HiGHS solved them 3-5x faster than its MIP solver reached the same point at its
    root node (gpt-39b's block on 2 x 32: 0.3 s against 1.3 s), with the same plan."""
    import highspy

    highs.setOptionValue("presolve", "off")
    if model.lp_max_iterations is not None:
        highs.setOptionValue("simplex_iteration_limit", int(model.lp_max_iterations))
    highs.passModel(lp)
    started = time.monotonic()
    _run_fixed(highs)
    wall_s = time.monotonic() - started
    info = highs.getInfo()
    presolve = "on" if model.presolve else "off"
    highs.setOptionValue("presolve", presolve)
    highs.setOptionValue("simplex_iteration_limit", highspy.kHighsIInf)
    ms, status = highs.getModelStatus(), highspy.HighsModelStatus
    if ms != status.kOptimal:
        if ms == status.kInfeasible:  # so is the integer program
            return _Outcome("infeasible", None)
        if model.mip_max_columns is None:  # the integer program follows
            return _Outcome("no_incumbent", None)
        limit = "iterations" if ms == status.kIterationLimit else "time"
        return _Outcome("lp_stopped", None, 0, limit, wall_s)
    values = np.asarray(highs.getSolution().col_value)
    binary = values[: model.num_binary]
    if np.any(np.minimum(np.abs(binary), np.abs(1.0 - binary)) > _INTEGRAL_TOL):
        model.lp_values = values
        return _Outcome("fractional", info.objective_function_value, 0, wall_s=wall_s)
    model.values = values
    return _Outcome("optimal", info.objective_function_value, 0, wall_s=wall_s)


def _run_cbc(model: _Model, time_limit_s: float | None, mip_gap: float, seed: int) -> _Outcome:
    """CBC through PuLP: the matrix model rebuilt as a PuLP problem."""
    started = time.monotonic()
    prob = pulp.LpProblem("autoshard_intra_op", pulp.LpMinimize)
    x = [
        _new_var(
            prob, f"x{j}", low=0, cat=pulp.LpBinary if j < model.num_binary else pulp.LpContinuous
        )
        for j in range(model.num_cols)
    ]
    by_row: list[list[tuple]] = [[] for _ in range(model.num_rows)]
    for r, c, v in zip(model.rows, model.cols, model.vals, strict=True):
        by_row[r].append((x[c], v))
    for terms, lo, hi in zip(by_row, model.row_lower, model.row_upper, strict=True):
        if lo == hi:
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintEQ, rhs=lo))
            continue
        if math.isfinite(lo):
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintGE, rhs=lo))
        if math.isfinite(hi):
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintLE, rhs=hi))
    prob.setObjective(_expr([(x[j], w) for j, w in enumerate(model.cost) if w]))
    with tempfile.TemporaryDirectory(prefix="autoshard-cbc-") as tmp:
        opts = (mip_gap, seed, model.max_nodes)
        if not _solve_cbc_owned(prob, opts, time_limit_s, started, tmp):
            return _Outcome("no_incumbent", None)
        log = Path(tmp, "cbc.log").read_text()
    found = re.search(r"Lower bound:\s+(\S+)", log)
    bound = float(found.group(1)) if found else None
    limit, nodes = _cbc_stop(log)
    status, sol_status = prob.status, prob.sol_status
    if status == pulp.LpStatusInfeasible:
        return _Outcome("infeasible", None)
    if status == pulp.LpStatusNotSolved:
        return _Outcome("no_incumbent", bound, nodes, limit)
    if status == pulp.LpStatusOptimal:
        model.values = np.array([v.varValue or 0.0 for v in x])
        optimal = sol_status == pulp.LpSolutionOptimal
        return _Outcome("optimal" if optimal else "time_limit", bound, nodes, limit)
    raise RuntimeError(
        f"CBC ended with PuLP status {pulp.LpStatus[status]}; log tail:\n{log[-2000:]}"
    )
