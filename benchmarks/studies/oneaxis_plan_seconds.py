"""Planning seconds and objective of the default plan on one-axis meshes, in whichever
tree ``PYTHONPATH`` selects (run it once per tree to compare two versions of the planner).

Two kinds of row:

* ``--rows LABEL/MESH/PLAN ...``: bench_truth's rows, each planned as bench_truth plans it
  (its ``plan_settings``: the baseline's pins, a 300 s limit), the rows
  ``exact_truth_sample.py`` reads;
* ``--presets MODEL ... --meshes 8 1x8``: full-depth GPT presets planned as bench_intra
  plans them (AdamW, global batch 2 x devices, the planner's defaults with the
  tie-breaking constants, a 300 s limit), without compiling.

Each row: the planning seconds (``auto_shard_graph``, tracing excluded), the plan's
objective, solver status, branch-and-bound nodes, ``exact_stopped`` and the 1-minute load.
One JSON line per row on stdout; ``--out`` writes them with the command, the tree's commit,
the UTC start and the jax version::

    PYTHONPATH=TREE python benchmarks/studies/oneaxis_plan_seconds.py \\
        [--rows LABEL/MESH/PLAN ...] [--presets gpt-350m ...] [--meshes 8 1x8] [--out FILE]
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
# bench_truth's ILP time limit (exact_truth_sample.PLAN_TIME_LIMIT) and bench_intra's default
TIME_LIMIT = 300.0


def _timed(graph, mesh, options, pinned=None, name=None) -> tuple[float, object]:
    from autoshard.intra.problem.build import auto_shard_graph

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a time-limit warning is in the row's record
        started = time.perf_counter()
        plan = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=name)
        return time.perf_counter() - started, plan


def _record(seconds: float, plan) -> dict:
    sol = plan.solver
    return {
        "plan_seconds": round(seconds, 2),
        "objective": plan.objective,
        "status": sol.get("status"),
        "nodes": sol.get("nodes"),
        "columns": sol.get("num_variables"),
        "exact_stopped": sol.get("exact_stopped"),
        "load": round(os.getloadavg()[0], 2),
    }


def truth_rows(texts: list[str]):
    """bench_truth's rows (refused baselines skipped), planned as bench_truth plans them."""
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    from bench_truth import plan_settings, truth_mesh
    from exact_truth_sample import find_row

    from autoshard.api import trace_workload
    from autoshard.intra.baselines.tables import BaselineRefusedError

    traced = {}
    for text in texts:
        _suite, model, overrides, optimizer, mesh_text, which = find_row(text)
        key = (model, tuple(sorted(overrides.items())), optimizer)
        if key not in traced:
            traced[key] = trace_workload(model, optimizer=optimizer, **overrides)
        graph, mesh = traced[key].graph, truth_mesh(mesh_text)
        try:
            options, pinned = plan_settings(graph, mesh, which, TIME_LIMIT)
        except BaselineRefusedError:
            continue
        yield {"row": text, **_record(*_timed(graph, mesh, options, pinned, which))}


def preset_rows(models: list[str], meshes: list[str]):
    """Full-depth presets planned as bench_intra plans them (no compile)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.cost.resharding import CostOptions
    from autoshard.intra.problem.options import IntraOptions

    options = IntraOptions().replace(cost=CostOptions(tie_breakers=True), time_limit_s=TIME_LIMIT)
    for model in models:
        for mesh_text in meshes:
            mesh = device_mesh_for(mesh_text)
            traced = trace_workload(model, batch_size=2 * mesh.num_devices)
            row = {"row": f"{model}/{mesh_text}", **_record(*_timed(traced.graph, mesh, options))}
            yield row


def _commit() -> str | None:
    tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or "."
    try:
        out = subprocess.run(
            ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=[], help="bench_truth rows LABEL/MESH/PLAN")
    ap.add_argument("--presets", nargs="*", default=[], help="full-depth presets, e.g. gpt-350m")
    ap.add_argument("--meshes", nargs="+", default=["8", "1x8"], help="the presets' meshes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    for mesh_text in args.meshes:
        shape = [int(s) for s in mesh_text.split("x")]
        if sum(1 for n in shape if n > 1) > 1:
            ap.error(f"--meshes {mesh_text}: this study times one-axis meshes only")
    if not args.rows and not args.presets:
        ap.error("give --rows or --presets")
    import jax

    start, rows = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), []
    for row in (*truth_rows(args.rows), *preset_rows(args.presets, args.meshes)):
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        summary = {
            "command": "python "
            + " ".join(["benchmarks/studies/oneaxis_plan_seconds.py"] + sys.argv[1:]),  # fmt: skip
            "tree": os.environ.get("PYTHONPATH"),
            "commit": _commit(),
            "started_utc": start,
            "jax": jax.__version__,
        }
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
