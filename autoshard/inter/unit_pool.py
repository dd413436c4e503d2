"""Stage ILPs solved in forked processes (opt-in: ``AUTOSHARD_JOBS``).

:meth:`autoshard.inter.stage_cost.IntraStageCost.prepare` hands the units it must solve
to :func:`solve_in_pool` when :func:`jobs_for` says more than one process should: the
workers are forked, inherit the cost object (its graph and sub-graphs are not pickled),
run no jax, and return each unit with what solving it counted.  Jax-free.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import warnings

from autoshard.inter.plan import Shape2

JOBS_ENV = "AUTOSHARD_JOBS"  # processes that solve a search's stage ILPs (1: in this one)
POOL_MIN_UNITS = 4  # fewer units than this are solved in this process


def jobs_for(num_units: int) -> int:
    """How many processes solve ``num_units`` stage ILPs: ``AUTOSHARD_JOBS`` if set, else
    1 (this process: forking a process that runs jax is not safe in general, so the pool is
    opt-in); ``AUTOSHARD_JOBS=0`` one per CPU this process may run on; 1 for fewer than
    :data:`POOL_MIN_UNITS` units, where processes cannot be forked, or once this process
    has run HiGHS (a forked child would wait for HiGHS's threads forever)."""
    from autoshard.intra.ilp import solvers

    if num_units < POOL_MIN_UNITS or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if solvers.highs_ran:  # HiGHS's threads would be missing in a forked child
        return 1
    given = os.environ.get(JOBS_ENV)
    if given is not None:
        try:
            jobs = int(given)
        except ValueError:
            raise ValueError(f"{JOBS_ENV}={given!r}: give a whole number of processes") from None
        if jobs < 0:
            raise ValueError(f"{JOBS_ENV}={given!r}: give 0 (one per CPU) or more processes")
    else:
        jobs = 1
    if jobs == 0:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(jobs or 1, num_units))


_POOL_COST = None  # the cost object the forked workers solve for


def _pool_unit(job: tuple[int, Shape2]):
    """In a forked worker: the unit of layer ``i`` on ``logical`` and what solving it
    counted (ILPs, ILP seconds, cache hits, refusals, disk-cache hits)."""
    i, logical = job
    cost = _POOL_COST
    before = (cost.num_ilps, cost.ilp_seconds, cost.num_cache_hits, len(cost.refusals))
    disk_hits = cost.num_disk_hits
    unit = cost._plan_unit(cost.subgraph(i, i + 1), cost.mesh_for(logical))
    counts = (
        cost.num_ilps - before[0],
        cost.ilp_seconds - before[1],
        cost.num_cache_hits - before[2],
        tuple(cost.refusals[before[3] :]),
        cost.num_disk_hits - disk_hits,
    )
    return i, logical, unit, counts


def _pool_init() -> None:
    """In a forked worker: drop the garbage-collector callbacks jax registered in the
    parent (they call into XLA's runtime, whose threads a forked child does not have)."""
    gc.callbacks[:] = [
        cb for cb in gc.callbacks if not getattr(cb, "__module__", "").startswith("jax")
    ]


def solve_in_pool(cost, jobs_list, jobs: int):
    """Yield ``_pool_unit``'s results for ``jobs_list`` as ``jobs`` forked processes solve
    them (the workers inherit ``cost``: its graph and sub-graphs are not pickled)."""
    global _POOL_COST
    _POOL_COST = cost
    try:
        with warnings.catch_warnings():
            # jax warns at every fork of a process that has started its runtime; the workers
            # run jax-free code only (and _pool_init drops jax's gc callback), so the
            # runtime's threads they lack are never waited for
            warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
            pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_pool_init)
        with pool:
            yield from pool.imap_unordered(_pool_unit, jobs_list, chunksize=1)
    finally:
        _POOL_COST = None
