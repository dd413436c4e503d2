"""Stage ILPs solved in worker processes (``AUTOSHARD_JOBS``; default: one per CPU, up to
:data:`MAX_DEFAULT_JOBS`).

:meth:`autoshard.inter.stage_cost.IntraStageCost.prepare` hands the units it must solve
to :func:`solve_in_pool` when :func:`jobs_for` says more than one process should.  The
workers are *spawned* (fresh interpreters that import the jax-free planner only), never
forked: forking a process that has started jax, or has run HiGHS's MIP solver, can leave
the child waiting for threads it does not have.  They get a slim copy of the cost object
(:meth:`~autoshard.inter.stage_cost.IntraStageCost.worker_copy`: the settings and the
sub-graphs to plan, not the traced step), pickled once per search and unpickled once per
worker, and return each unit with what solving it counted.  The caller applies the
results in job order, so the plan does not depend on which worker finished first.

:func:`prestart` starts the workers early (the API calls it before it traces the step, so
that their imports run beside the trace); :func:`release` stops them.  Jax-free.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle

JOBS_ENV = "AUTOSHARD_JOBS"  # processes that solve a search's stage ILPs (1: in this one)
POOL_MIN_UNITS = 4  # fewer units than this are solved in this process
MAX_DEFAULT_JOBS = 8  # the default's cap: one process per CPU up to this many


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def requested_jobs() -> int:
    """The processes ``AUTOSHARD_JOBS`` asks for (``0``: one per CPU this process may run
    on), or by default one per CPU up to :data:`MAX_DEFAULT_JOBS`."""
    given = os.environ.get(JOBS_ENV)
    if given is None:
        return max(1, min(_cpus(), MAX_DEFAULT_JOBS))
    try:
        jobs = int(given)
    except ValueError:
        raise ValueError(f"{JOBS_ENV}={given!r}: give a whole number of processes") from None
    if jobs < 0:
        raise ValueError(f"{JOBS_ENV}={given!r}: give 0 (one per CPU) or more processes")
    return _cpus() if jobs == 0 else jobs


def jobs_for(num_units: int) -> int:
    """How many processes solve ``num_units`` stage ILPs: :func:`requested_jobs`, at most
    one per unit; 1 (this process) for fewer than :data:`POOL_MIN_UNITS` units."""
    if num_units < POOL_MIN_UNITS:
        return 1
    return max(1, min(requested_jobs(), num_units))


_WARM: dict = {}  # "pool", "jobs": the workers prestart started (until release)
_TOKENS = itertools.count()


def prestart() -> None:
    """Start the worker processes now (one per :func:`requested_jobs`; none where that is
    1), so that their start-up overlaps what the caller does next (tracing the step);
    the next :func:`solve_in_pool` uses them, and :func:`release` stops them."""
    jobs = requested_jobs()
    if jobs > 1 and "pool" not in _WARM:
        _WARM["pool"], _WARM["jobs"] = _new_pool(jobs), jobs


def release() -> None:
    """Stop the workers :func:`prestart` started (a no-op where there are none)."""
    pool = _WARM.pop("pool", None)
    _WARM.pop("jobs", None)
    if pool is not None:
        pool.terminate()
        pool.join()


def _new_pool(jobs: int):
    return multiprocessing.get_context("spawn").Pool(jobs, initializer=_pool_init)


def _pool_init() -> None:
    """In a fresh worker: import what solving a unit needs (while the parent traces), and
    ml_dtypes, which gives numpy the names of jax's dtypes (``np.dtype("bfloat16")``)."""
    import ml_dtypes  # noqa: F401

    import autoshard.inter.stage_cost  # noqa: F401
    import autoshard.intra.ilp.solvers  # noqa: F401

    try:
        import highspy  # noqa: F401
    except ImportError:  # the solver's own error comes with the first ILP
        pass


_STATES: dict = {}  # in a worker: token -> (cost copy, sub-graph per layer)


def _pool_unit(job):
    """In a worker: the unit of layer ``i`` on ``mesh`` and what solving it counted (ILPs,
    ILP seconds, cache hits, refusals, disk-cache hits)."""
    token, blob, i, logical = job
    if token not in _STATES:
        _STATES.clear()  # one search at a time
        _STATES[token] = pickle.loads(blob)
    cost, subgraphs, meshes = _STATES[token]
    mesh = meshes[logical]
    before = (cost.num_ilps, cost.ilp_seconds, cost.num_cache_hits, len(cost.refusals))
    disk_hits = cost.num_disk_hits
    unit = cost._plan_unit(subgraphs[i], mesh)
    counts = (
        cost.num_ilps - before[0],
        cost.ilp_seconds - before[1],
        cost.num_cache_hits - before[2],
        tuple(cost.refusals[before[3] :]),
        cost.num_disk_hits - disk_hits,
    )
    return i, logical, unit, counts


def solve_in_pool(cost, jobs_list, jobs: int):
    """Yield ``(i, logical, unit, counts)`` for each ``(i, logical)`` of ``jobs_list`` as
    ``jobs`` worker processes solve them, in the order they finish (the prestarted
    workers where there are as many, else a pool made and stopped here)."""
    layers = sorted({i for i, _ in jobs_list})
    # the meshes in one pickle with the cost: the parts they share (a GEMM table) once
    meshes = {tuple(g): cost.mesh_for(tuple(g)) for _, g in jobs_list}
    state = (*cost.worker_copy(layers), meshes)
    blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    token = (os.getpid(), next(_TOKENS))
    work = [(token, blob, i, tuple(g)) for i, g in jobs_list]
    warm = _WARM.get("pool") if _WARM.get("jobs") == jobs else None
    pool = warm if warm is not None else _new_pool(jobs)
    try:
        yield from pool.imap_unordered(_pool_unit, work, chunksize=1)
    except BaseException:
        if warm is not None:  # a worker may be mid-unit: do not hand it to the next search
            release()
        raise
    finally:
        if warm is None:
            pool.terminate()
            pool.join()
