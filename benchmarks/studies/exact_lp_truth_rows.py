"""Which of bench_truth's rows on meshes of several axes does ``exact_search="lp"`` (the
default since 2026-11-27) plan differently from ``"one-axis"`` (the default before)?
Plans each row both ways, without compiling: the objective, whether the plans are the
same (every input's and tensor's spec), the planning seconds and ``exact_stopped``. Rows
whose plan changes are the ones to re-verify with ``bench_truth.py --models/--meshes/--plans``.
One JSON line per row on stdout, progress on stderr; ``--out`` writes them with the command
and the load::

    python benchmarks/studies/exact_lp_truth_rows.py [--suites intra moe conv] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", nargs="+", default=["intra", "moe", "conv"])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from bench_truth import PLANS, SUITES, _label, plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.baselines.tables import BaselineRefusedError
    from autoshard.intra.problem.build import auto_shard_graph

    rows, t_start, loads = [], time.time(), [os.getloadavg()[0]]
    for suite in args.suites:
        for model, overrides, optimizer, meshes in SUITES[suite]:
            two_d = [m for m in meshes if sum(int(n) > 1 for n in m.split("x")) > 1]
            if not two_d:
                continue
            traced = trace_workload(model, optimizer=optimizer, **overrides)
            for mesh_text in two_d:
                mesh = truth_mesh(mesh_text)
                for which in PLANS:
                    row = {"suite": suite, "model": _label(model, overrides),
                           "mesh": mesh_text, "plan": which}  # fmt: skip
                    print(f"{row['model']} {mesh_text} {which} ...", file=sys.stderr, flush=True)
                    plans = {}
                    for search in ("one-axis", "lp"):
                        try:
                            options, pinned = plan_settings(
                                traced.graph, mesh, which, args.time_limit, search
                            )
                        except BaselineRefusedError as err:
                            row["refused"] = str(err)[:200]
                            break
                        t0 = time.perf_counter()
                        plan = auto_shard_graph(
                            traced.graph, mesh, options, pinned_inputs=pinned, name=which
                        )
                        plans[search] = plan
                        row[search] = {
                            "objective": plan.objective,
                            "plan_s": round(time.perf_counter() - t0, 2),
                            "exact_stopped": plan.solver.get("exact_stopped"),
                            "predicted_peak_bytes": plan.predicted_peak_bytes,
                        }
                    if len(plans) == 2:
                        a, b = plans["one-axis"], plans["lp"]
                        row["same_plan"] = (
                            a.input_specs == b.input_specs and a.tensor_specs == b.tensor_specs
                        )
                    loads.append(os.getloadavg()[0])
                    row["load"] = loads[-1]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = {
        "rows": len(rows),
        "plan_changed": [
            f"{r['model']} {r['mesh']} {r['plan']}" for r in rows if r.get("same_plan") is False
        ],
        "command": "python benchmarks/studies/exact_lp_truth_rows.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "load_1min": [min(loads), max(loads)],
        "jax": jax.__version__,
    }
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
