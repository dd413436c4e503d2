"""The per-demand solve under its node budget, with the time limit as a safety net (the
planner's way since 2026-11-28), against the way before (the time limit alone, HiGHS on
its default threads), at the machine's load and with CPU burners beside it: whether the
plan depends on the load.

Rows as in ``per_demand_ties_after.py`` (``LABEL/MESH/PLAN`` for a bench_truth model,
``intra:MODEL/MESH``, ``cli:MODEL/MESH``). Each row's per-demand program is built once;
then each ``--ways`` entry solves it, once per ``--burn`` count (that many busy-loop
processes run beside the solve, started before it and ended after it). ``--time-limit``
is the user's limit (the CLI's 120 s by default): the planner's way solves under
``max_nodes=PER_DEMAND_MAX_NODES`` and ``SAFETY_NET_FACTOR`` times that limit
(``build.solve_time_limit``), HiGHS on ``HIGHS_THREADS``; the way before under the limit
alone, on HiGHS's default thread count. One JSON line per solve: CPU and wall seconds
(``time.process_time``: this process's; the burners are not counted), the 1-minute load
before and after, status, limit, nodes, gap, objective, ``load_dependent`` and a hash of
the plan; ``--out`` writes them with the command, the UTC start and the jax version::

    python benchmarks/studies/per_demand_budget.py --rows cli:wresnet-small/2x4
        [--ways planner before] [--burn 0 2] [--time-limit 120] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
BURNER = "while True:\n    pass\n"


def _burners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(count)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:  # only the burners this run started, by their own handles
        proc.kill()
        proc.wait()


def _solve(problem, way: str, limit: float):
    import highspy

    from autoshard.intra.ilp import solve, solvers
    from autoshard.intra.problem.options import PER_DEMAND_MAX_NODES, SAFETY_NET_FACTOR

    if way == "planner":
        solvers.HIGHS_THREADS = _THREADS
        return solve(
            problem,
            solver="highs",
            time_limit_s=SAFETY_NET_FACTOR * limit,
            max_nodes=PER_DEMAND_MAX_NODES,
        )
    if way == "before":
        solvers.HIGHS_THREADS = 0  # HiGHS's own choice (half the cores), as before
        highspy.Highs.resetGlobalScheduler(True)  # so it starts on that count
        return solve(problem, solver="highs", time_limit_s=limit)
    raise ValueError(f"unknown way {way!r}: planner or before")


def run(text: str, ways, burns, limit: float):
    from per_demand_ties_after import problem_of

    from autoshard.intra.ilp import SolverTimeLimitWarning

    problem = problem_of(text)
    first = None
    for burn in burns:
        for way in ways:
            procs = _burners(burn)
            try:
                time.sleep(2.0 if burn else 0.0)  # the burners running before the solve
                load0 = os.getloadavg()[0]
                cpu, wall = time.process_time(), time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", SolverTimeLimitWarning)
                    sol = _solve(problem, way, limit)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                load1 = os.getloadavg()[0]
            finally:
                _stop(procs)
            plan = hashlib.sha1(repr(tuple(sol.strategy)).encode()).hexdigest()[:12]
            first = first or plan
            yield {
                "row": text,
                "way": way,
                "burn": burn,
                "load": [round(load0, 2), round(load1, 2)],
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "status": sol.status,
                "limit": sol.limit,
                "nodes": sol.nodes,
                "gap": sol.gap,
                "objective": sol.objective,
                "load_dependent": sol.load_dependent,
                "plan": plan,
                "same_plan_as_first": plan == first,
                "warnings": [str(w.message)[:300] for w in caught],
            }


_THREADS = 1


def main() -> int:
    global _THREADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", required=True)
    ap.add_argument("--ways", nargs="+", default=["planner", "before"])
    ap.add_argument("--burn", nargs="+", type=int, default=[0, 2])
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import jax

    from autoshard.intra.ilp import solvers

    _THREADS = solvers.HIGHS_THREADS
    jax.config.update("jax_num_cpu_devices", 8)
    start, rows = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), []
    for text in args.rows:
        for row in run(text, args.ways, args.burn, args.time_limit):
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out is not None:  # after every solve: a long run leaves what it finished
                summary = {
                    "command": "python "
                    + " ".join(["benchmarks/studies/per_demand_budget.py"] + sys.argv[1:]),
                    "started_utc": start,
                    "jax": jax.__version__,
                    "cpus": os.cpu_count(),
                }
                doc = json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n"
                args.out.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
