"""The exact per-value program's budget on one-axis meshes: status, nodes, objective and
seconds of every plan of bench_truth's suites there, one JSON line per plan on stdout.

    python benchmarks/studies/bench_exact_budget.py MODE SUITES [MESHES] > rows.jsonl

MODE: "default" (the planner as it is), "free" (no node budget: the proven optimum) or
"nodes:N" (a budget of N branch-and-bound nodes); SUITES: bench_truth suites, comma-
separated (intra, moe, memory, conv); MESHES: its one-axis meshes (default 8,1x8).
Run it from a checkout of an older commit (PYTHONPATH) to compare budgets across commits
(docs/sharing.md, "the exact program's budget in nodes").
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_truth

from bench_truth import PLANS, SUITES, _label, plan_settings, truth_mesh  # noqa: E402

import autoshard.intra.problem.exact_values as P  # noqa: E402 - its node budget is patched
from autoshard.api import trace_workload  # noqa: E402

if len(sys.argv) < 3:
    sys.exit(__doc__)
mode = sys.argv[1]
suites = sys.argv[2].split(",")
meshes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["8", "1x8"]
if mode == "free":
    P.EXACT_MAX_NODES = None
elif mode.startswith("nodes:"):
    P.EXACT_MAX_NODES = int(mode.split(":")[1])
for suite in suites:
    for model, overrides, optimizer, ms in SUITES[suite]:
        traced = trace_workload(model, optimizer=optimizer, **overrides)
        for mesh_text in ms:
            if mesh_text not in meshes:
                continue
            mesh = truth_mesh(mesh_text)
            for which in PLANS:
                options, pinned = plan_settings(traced.graph, mesh, which, 300.0)
                t0 = time.perf_counter()
                plan = P.auto_shard_graph(
                    traced.graph, mesh, options, pinned_inputs=pinned, name=which
                )
                s = plan.solver
                r = dict(
                    suite=suite,
                    model=_label(model, overrides),
                    mesh=mesh_text,
                    plan=which,
                    wall=round(time.perf_counter() - t0, 2),
                    objective=s["objective"],
                    status=s["status"],
                    nodes=s.get("nodes"),
                    limit=s.get("limit"),
                    solve_s=round(s["seconds"], 2),
                    exact_stopped=s.get("exact_stopped"),
                )
                print(json.dumps(r), flush=True)
