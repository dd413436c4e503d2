"""Is the exact per-value program's LP relaxation integral on the small 2-D cases of
bench_exact_verify, and how long does the LP take? Per case x mesh: the plan's objective
under exact_search="one-axis" and "auto", auto's planning seconds, and every LP relaxation
HiGHS solves while auto plans (columns, seconds, integral or not). The data for a rule that
would keep the exact program's LP only where it is integral (docs/sharing.md). One JSON
line per case on stdout:

    python benchmarks/studies/exact_lp_integral.py > benchmarks/results/exact_lp_integral_2026-11-27.jsonl
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
from bench_exact_search import conv_program  # noqa: E402
from bench_exact_verify import CASES  # noqa: E402

import autoshard.intra.ilp.solvers as S  # noqa: E402
from autoshard.api import trace_workload  # noqa: E402
from autoshard.hardware.mesh import alpa_test_mesh  # noqa: E402
from autoshard.intra.problem.build import auto_shard_graph  # noqa: E402
from autoshard.intra.problem.options import IntraOptions  # noqa: E402
from autoshard.ir.graph import build_graph  # noqa: E402

log = []
orig = S._relaxation


def spy(highs, lp, model):
    t = time.perf_counter()
    out = orig(highs, lp, model)
    log.append(
        {
            "cols": model.num_cols,
            "binary": model.num_binary,
            "presolve": bool(model.presolve),
            "lp_s": round(time.perf_counter() - t, 2),
            "integral": out is not None,
        }
    )
    return out


S._relaxation = spy
for name, (model, kw) in CASES.items():
    if model == "conv":
        graph = build_graph(conv_program(**kw).records)
    else:
        graph = trace_workload(model, optimizer="sgd", **kw).graph
    for m in ("2x2", "2x4", "4x2"):
        mesh = alpa_test_mesh(tuple(int(x) for x in m.split("x")), ("data", "model"))
        one = auto_shard_graph(graph, mesh, IntraOptions(solver="highs", exact_search="one-axis"))
        log.clear()
        t = time.perf_counter()
        auto = auto_shard_graph(graph, mesh, IntraOptions(solver="highs", exact_search="auto"))
        row = {
            "case": name,
            "mesh": m,
            "one_axis": one.objective,
            "auto": auto.objective,
            "auto_s": round(time.perf_counter() - t, 1),
            "relaxations": list(log),
            "exact_stopped": auto.solver.get("exact_stopped"),
            "load": os.getloadavg()[0],
        }
        print(json.dumps(row), flush=True)
