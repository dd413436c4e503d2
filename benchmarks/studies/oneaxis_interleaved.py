"""Two trees' planning seconds on bench_truth's rows, interleaved row by row, so that both
see the same load: one worker process per tree (its ``PYTHONPATH``), each row planned once
per tree to warm up, then twice per tree in the order A B B A. Each plan as
``oneaxis_plan_seconds.py`` plans it (bench_truth's settings), with its wall and CPU
seconds (``time.process_time``: the solver's threads included). ``--out`` writes every
plan with the command and the UTC start::

    python benchmarks/studies/oneaxis_interleaved.py --trees BEFORE AFTER \\
        --rows gpt-tiny/8/auto ... [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker() -> None:
    """Plan the rows read from stdin, one JSON line out per row."""
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from bench_truth import plan_settings, truth_mesh
    from exact_truth_sample import find_row
    from oneaxis_plan_seconds import TIME_LIMIT, _record

    from autoshard.api import trace_workload
    from autoshard.intra.problem.build import auto_shard_graph

    traced = {}
    for line in sys.stdin:
        text = line.strip()
        _suite, model, overrides, optimizer, mesh_text, which = find_row(text)
        key = (model, tuple(sorted(overrides.items())), optimizer)
        if key not in traced:
            traced[key] = trace_workload(model, optimizer=optimizer, **overrides)
        graph, mesh = traced[key].graph, truth_mesh(mesh_text)
        options, pinned = plan_settings(graph, mesh, which, TIME_LIMIT)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a time-limit warning is in the record
            cpu, wall = time.process_time(), time.perf_counter()
            plan = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        row = {"row": text, **_record(wall, plan), "cpu_seconds": round(cpu, 2)}
        print(json.dumps(row), flush=True)


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        worker()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rows", nargs="+", required=True, help="bench_truth rows LABEL/MESH/PLAN")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    names = ("before", "after")
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": tree},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in zip(names, args.trees, strict=True)
    }

    def plan(name: str, row: str) -> dict:
        procs[name].stdin.write(row + "\n")
        procs[name].stdin.flush()
        line = procs[name].stdout.readline()
        if not line:
            raise RuntimeError(f"the {name} tree's worker stopped at {row!r}")
        return {**json.loads(line), "tree": name}

    start, out = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), []
    for row in args.rows:
        plan("before", row), plan("after", row)  # warm: tracing, first calls
        for name in ("before", "after", "after", "before"):
            out.append(plan(name, row))
            print(json.dumps(out[-1]), flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    if args.out is not None:
        summary = {
            "command": "python "
            + " ".join(["benchmarks/studies/oneaxis_interleaved.py"] + sys.argv[1:]),  # fmt: skip
            "trees": dict(zip(names, args.trees, strict=True)),
            "started_utc": start,
        }
        args.out.write_text(json.dumps({"summary": summary, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
