"""Stage ILPs solved in worker processes (``AUTOSHARD_JOBS``; default: one per free CPU,
up to :data:`MAX_DEFAULT_JOBS`).

:meth:`autoshard.inter.stage_cost.IntraStageCost.prepare` hands the units it must solve
to :func:`solve_in_pool` when :func:`jobs_for` says more than one process should.  The
workers are fresh interpreters (``python -c``, this process's ``sys.path``) that import
the jax-free planner only: never forked (a fork of a process that has started jax, or
has run HiGHS's MIP solver, can wait forever for threads it does not have), and not
multiprocessing's spawn either (that re-runs the caller's main script in every worker,
which a script without an ``if __name__ == "__main__"`` guard does not survive).  Each
gets, once per search, a slim copy of the cost object
(:meth:`~autoshard.inter.stage_cost.IntraStageCost.worker_copy`: the settings and the
sub-graphs to plan, not the traced step), then one unit at a time over a pipe, and
returns each unit with what solving it counted.  The caller applies the results in job
order, so the plan does not depend on which worker finished first.

:func:`prestart` starts the workers early (the API calls it before it traces the step, so
that their imports run beside the trace); :func:`release` stops them.  Jax-free.
"""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import selectors
import subprocess
import sys
import time

from autoshard.inter.progress import Progress, quiet

JOBS_ENV = "AUTOSHARD_JOBS"  # processes that solve a search's stage ILPs (1: in this one)
POOL_MIN_UNITS = 4  # fewer units than this are solved in this process
MAX_DEFAULT_JOBS = 8  # the default's cap: one process per CPU up to this many


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average here: count every CPU as free
        return 0.0


def _idle_cpus(window_s: float = 0.1) -> float | None:
    """The CPUs idle over the next ``window_s`` seconds (Linux ``/proc/stat``; None
    elsewhere): what other work leaves free now, where the 1-minute load average still
    counts work that has ended (this command's previous run, for one)."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)

    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (idle1 - idle0) / (total1 - total0) * _cpus()


def requested_jobs() -> int:
    """The processes ``AUTOSHARD_JOBS`` asks for (``0``: one per CPU this process may run
    on), or by default one per CPU that is free -- the CPUs idle over a tenth of a second
    (:func:`_idle_cpus`, rounded; where that cannot be read, the CPUs less the 1-minute
    load average, this process's own CPU counted free) -- up to :data:`MAX_DEFAULT_JOBS`:
    on a machine other work keeps busy, workers add their start-up and gain no CPU
    (measured on the 2-core development machine at load 14-20: 17.3 against 16.8 CPU-s,
    the same wall time; docs/results.md)."""
    given = os.environ.get(JOBS_ENV)
    if given is None:
        cpus = _cpus()
        idle = _idle_cpus()
        free = int(cpus + 1 - _load()) if idle is None else round(idle)
        return max(1, min(cpus, MAX_DEFAULT_JOBS, free))
    try:
        jobs = int(given)
    except ValueError:
        raise ValueError(f"{JOBS_ENV}={given!r}: give a whole number of processes") from None
    if jobs < 0:
        raise ValueError(f"{JOBS_ENV}={given!r}: give 0 (one per CPU) or more processes")
    return _cpus() if jobs == 0 else jobs


def jobs_for(num_units: int) -> int:
    """How many processes solve ``num_units`` stage ILPs: :func:`requested_jobs`, at most
    one per unit; 1 (this process) for fewer than :data:`POOL_MIN_UNITS` units, and off
    POSIX (the workers' pipes are polled with ``selectors``, which Windows cannot)."""
    if num_units < POOL_MIN_UNITS or os.name != "posix":
        return 1
    warm = _WARM.get("workers")  # started for this search (prestart): the count it chose
    return max(1, min(len(warm) if warm else requested_jobs(), num_units))


_WARM: dict = {}  # "workers": the processes prestart started (until release)
_TOKENS = itertools.count()


def prestart() -> None:
    """Start the worker processes now (one per :func:`requested_jobs`; none where that is
    1), so that their start-up overlaps what the caller does next (tracing the step);
    the next :func:`solve_in_pool` with as many jobs uses them, :func:`release` stops them."""
    jobs = requested_jobs() if os.name == "posix" else 1
    if jobs > 1 and "workers" not in _WARM:
        _WARM["workers"] = [_Worker() for _ in range(jobs)]


def release() -> None:
    """Stop the workers :func:`prestart` started (a no-op where there are none)."""
    for worker in _WARM.pop("workers", ()):
        worker.stop()


_BOOT = (
    "import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
    "from autoshard.inter.unit_worker import worker_main; worker_main()"
)


class _Worker:
    """One worker process: pickles in on its stdin, pickles out on its stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.tokens: set = set()  # the searches whose cost copy it has
        self.job = None
        self.send(list(sys.path))

    def send(self, obj) -> None:
        pickle.dump(obj, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()

    def receive(self):
        try:
            return pickle.load(self.proc.stdout)
        except EOFError:
            code = self.proc.wait()
            raise RuntimeError(
                f"a stage-ILP worker process ended (exit status {code}) before returning "
                f"its unit; its error is above on stderr. {JOBS_ENV}=1 solves the ILPs in "
                "this process instead"
            ) from None

    def stop(self, kill: bool = False) -> None:
        """End the process: at the end of its input, or at once (``kill``: mid-unit)."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of input: the worker exits
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def solve_in_pool(cost, jobs_list, jobs: int, ready=None):
    """Yield ``(i, logical, unit, counts)`` for each ``(i, logical)`` of ``jobs_list`` as
    ``jobs`` worker processes solve them, in the order they finish (the prestarted
    workers where there are as many, else workers started and stopped here).

    ``ready(i, logical)``: what a job reads from units planned before it (its handoffs,
    sent with it), or ``False`` while one of those is not planned yet: the job waits for
    a later result (the caller records each unit before it asks for the next). Jobs are
    handed out in ``jobs_list``'s order, the first ready one first. None: every job is
    ready and reads nothing."""
    layers = sorted({i for i, _ in jobs_list})
    # the meshes in one pickle with the cost: the parts they share (a GEMM table) once
    meshes = {tuple(g): cost.mesh_for(tuple(g)) for _, g in jobs_list}
    blob = pickle.dumps((*cost.worker_copy(layers), meshes), protocol=pickle.HIGHEST_PROTOCOL)
    token = (os.getpid(), next(_TOKENS))
    warm = _WARM.get("workers")
    workers = warm[:jobs] if warm is not None and len(warm) >= jobs else None
    own = workers is None
    if own:
        workers = [_Worker() for _ in range(jobs)]
    pending = [(i, tuple(g)) for i, g in jobs_list]
    done = False

    def take():
        for k, (i, logical) in enumerate(pending):
            handoffs = None if ready is None else ready(i, logical)
            if handoffs is not False:
                del pending[k]
                return i, logical, handoffs
        return None

    try:
        with selectors.DefaultSelector() as selector:

            def feed(worker: _Worker) -> bool:
                job = take()
                if job is None:
                    return False
                i, logical, handoffs = job
                worker.job = (i, logical)
                first = token not in worker.tokens
                worker.tokens.add(token)
                worker.send((token, blob if first else None, i, logical, handoffs))
                return True

            idle = []
            for worker in workers:
                selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
                if not feed(worker):
                    idle.append(worker)
            busy = len(workers) - len(idle)
            while busy:
                for key, _ in selector.select():
                    worker = key.data
                    result = worker.receive()
                    worker.job = None
                    busy -= 1
                    idle.append(worker)
                    if result[0] == "error":
                        raise RuntimeError(f"a stage-ILP worker failed: {result[1]}\n{result[2]}")
                    yield result[1]  # the caller records the unit: jobs reading it are ready
                    while idle and feed(idle[-1]):
                        idle.pop()
                        busy += 1
            if pending:  # a job waits for a unit no job makes: the caller's mistake
                raise RuntimeError(
                    f"{len(pending)} stage-ILP jobs wait for units no job plans: {pending[:3]}"
                )
        done = True
    finally:
        if own or not done:  # a worker may be mid-unit: do not hand it to the next search
            for worker in workers:
                worker.stop(kill=not done)
            if not own:
                release()  # and any prestarted worker this search did not use


class PooledUnits:
    """Planning a stage cost's units ahead, in worker processes where CPUs are free: the
    :class:`~autoshard.inter.stage_cost.IntraStageCost` methods that feed this pool (a
    mixin of it, which owns every attribute they read)."""

    def prepare(self, logicals, progress: Progress | None = None) -> None:
        """Plan every layer on each of ``logicals`` now (the stage DP calls this before it
        reads costs), counting the distinct ILPs on ``progress`` ("stage ILPs k/N")."""
        progress = progress or quiet()
        if self._source is not None:  # a derived cost (with_offload): its source's plans
            self._source.prepare(logicals, progress)
            return
        if self.granularity != "layer":
            return
        first = {}  # (signature, mesh) -> a layer with it, in layer order
        for logical in dict.fromkeys(tuple(g) for g in logicals):
            mesh = self.mesh_for(logical)
            for i, sig in enumerate(self.signatures):
                first.setdefault((sig, mesh), (i, logical))
        todo = [
            (i, g) for (sig, mesh), (i, g) in first.items() if ((sig,), mesh) not in self._units
        ]
        t0 = time.perf_counter()
        # the units to solve (not a twin's, see _twin), biggest first: the pool's share.
        # A unit that reads other signatures' plans (fed by them, or read by them) waits
        # in the pool for those planned before it in :meth:`unit`'s order and is sent
        # what it reads from them -- exactly what it reads when planned in this process
        solve = [(i, g) for i, g in todo if self._twin(g, self.mesh_for(g)) is None]
        jobs = jobs_for(len(solve))
        # in todo's order, as the loop below plans them (only the pool needs it)
        position = self._planning_order(solve) if jobs > 1 else {}
        solve.sort(key=lambda ig: -len(self.subgraph(ig[0], ig[0] + 1).graph.nodes) * min(ig[1]))

        def ready(i, logical):
            if not self._linked(i):
                return None
            mesh = self.mesh_for(logical)
            own = position[(self.signatures[i],), mesh]
            seen = [k for k in self._handoff_units(i, mesh) if position.get(k, -1) < own]
            if any(k not in self._units for k in seen):
                return False
            rg = self.subgraph(i, i + 1)
            return self._fed_specs(rg, mesh, seen), self._drain_reads(rg, mesh, seen)

        try:
            with progress.phase("stage ILPs", len(todo)) as phase:
                if jobs > 1:
                    solved = {}
                    for i, logical, unit, counts in solve_in_pool(self, solve, jobs, ready):
                        solved[i, logical] = unit, counts
                        self._units[((self.signatures[i],), self.mesh_for(logical))] = unit
                        phase.advance()
                    for i, logical in solve:  # counted in job order, whatever finished first
                        unit, counts = solved[i, logical]
                        self.num_ilps += counts[0]
                        self.ilp_seconds += counts[1]
                        self.num_cache_hits += counts[2]
                        self.refusals.extend(r for r in counts[3] if r not in self.refusals)
                        self.num_disk_hits += counts[4]
                pooled = set(solved) if jobs > 1 else set()
                for i, logical in todo:
                    if (i, logical) in pooled:
                        continue  # solved (and counted) by the pool
                    if ((self.signatures[i],), self.mesh_for(logical)) not in self._units:
                        self.unit(i, i + 1, logical)  # (or planned already, fed to another's)
                    phase.advance()
        finally:
            self.seconds += time.perf_counter() - t0

    def _planning_order(self, jobs) -> dict:
        """Unit key -> its place in the order :meth:`unit` plans ``jobs`` (``(layer,
        logical)`` pairs on meshes that are not twins) one after another in this process:
        each job after the units that feed it, unless that closes a cycle. Units planned
        already are not listed (they come before all)."""
        order, planning = {}, set()

        def visit(i: int, logical) -> None:
            mesh = self.mesh_for(logical)
            key = ((self.signatures[i],), mesh)
            if key in order or key in self._units:
                return
            planning.add(key)
            for producer in self._feeders(self.subgraph(i, i + 1)):
                if ((producer,), mesh) not in planning:
                    visit(self._rep[producer], logical)
            planning.discard(key)
            order[key] = len(order)

        for i, logical in jobs:
            visit(self._rep[self.signatures[i]], logical)
        return order

    def worker_copy(self, layers) -> tuple:
        """What a worker process needs to plan the units of ``layers`` (one layer each):
        a copy of this cost with its settings and counters, without the traced step, the
        mesh factory or any memo, and each layer's sub-graph
        (:mod:`autoshard.inter.unit_pool`)."""
        subgraphs = {i: self.subgraph(i, i + 1) for i in layers}
        twin = copy.copy(self)
        twin.graph = twin.mesh_for = twin.replicas = None  # the replicas plan here
        twin.signatures, twin._rep, twin._crossings, twin._pair_rep = (), {}, (), {}
        for memo in (
            "_units",
            "_subgraphs",
            "_junctions",
            "_tables",
            "_solutions",
            "_borrowers",
            "_range_keys",
            "_key_ids",
            "_owners_of",
            "_graph_keys",
            "_offloaded",
            "_replica_layers",
        ):
            setattr(twin, memo, {})
        twin._nodes_by_layer = twin._crossings_by_high = None
        twin.refusals = []
        return twin, subgraphs
