"""How much HiGHS's random seed moves the per-demand solve's time (the planner's own program).

For each model and mesh of ``bench_intra``, builds the per-demand program exactly as
``auto_shard_graph`` does at the defaults (``_common`` + ``_finish(common, False)``: the
program whose solve is most of the planning time on the 2-D meshes) and solves it once
per seed with ``solve(..., seed=s)``, HiGHS's ``random_seed`` (the planner's default is
``IntraOptions.seed = 0``). Prints one line per solve and writes the rows (seconds,
objective, status, nodes) with the machine's load before and after each solve:

    python benchmarks/studies/bench_highs_seeds.py --models gpt-39b gpt-2.6b --meshes 8x8 --seeds 8 \
        --out benchmarks/results/bench_highs_seeds.json

Every seed must reach the same proven optimum (the script says so if one does not); what
differs is the path through HiGHS's root node (its cuts and heuristics), hence the time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import figure  # noqa: E402  (experiments/figure.py: the commit helper the figures use)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-39b"])
    ap.add_argument("--meshes", nargs="+", default=["8x8"])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 (default 8)")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: give at least 1")
    import jax

    from autoshard.api import device_mesh_for, parse_mesh_shape, trace_workload

    jax.config.update(
        "jax_num_cpu_devices", max(math.prod(parse_mesh_shape(m)) for m in args.meshes)
    )
    from autoshard.intra.ilp import solve
    from autoshard.intra.problem.build import _common, _finish
    from autoshard.intra.problem.options import IntraOptions

    rows = []
    for mesh_text in args.meshes:
        dmesh = device_mesh_for(mesh_text)
        for model in args.models:
            traced = trace_workload(model, batch_size=2 * dmesh.num_devices)
            options = IntraOptions()
            common = _common(traced.graph, dmesh, options, None, True, None)
            problem = _finish(common, False).problem
            objectives = set()
            for seed in range(args.seeds):
                load = os.getloadavg()[0]
                sol = solve(
                    problem,
                    solver="highs",
                    time_limit_s=options.time_limit_s,
                    mip_gap=options.mip_gap,
                    seed=seed,
                )
                row = dict(
                    model=model,
                    mesh=mesh_text,
                    seed=seed,
                    solve_s=sol.seconds,
                    objective=sol.objective,
                    status=sol.status,
                    nodes=sol.nodes,
                    load_before=load,
                    load_after=os.getloadavg()[0],
                )
                rows.append(row)
                objectives.add(round(sol.objective, 3))
                print(
                    f"{model} {mesh_text} seed {seed}: {sol.seconds:6.2f} s  "
                    f"objective {sol.objective:.10g} ({sol.status}, {sol.nodes} nodes)  "
                    f"load {load:.1f}",
                    flush=True,
                )
            if len(objectives) != 1:
                print(
                    f"{model} {mesh_text}: the seeds disagree on the optimum: {objectives}",
                    file=sys.stderr,
                )
    if args.out:
        doc = dict(
            command="python " + " ".join(sys.argv),
            commit=figure.git_commit(),
            time=time.strftime("%Y-%m-%d %H:%M:%S"),
            cpu_count=os.cpu_count(),
            machine=platform.platform(),
            rows=rows,
        )
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
