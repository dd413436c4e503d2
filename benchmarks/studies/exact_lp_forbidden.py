"""What does ``exact_search="lp"`` (the default) give on meshes of several axes by solving
the exact per-value program's LP relaxation with forbidden collectives too?  Until
2026-11-28 :func:`autoshard.intra.problem.exact_values.unsolved_because` skipped it there
(allow_all_gather=False, allow_all_to_all=False, all_reduce_only -- the strict megatron
baseline -- and force_batch_dim_to_mesh_axis).  Each case is planned with that skip put
back ("skipped") and as the planner is ("lp"; everything else, EXACT_LP_MAX_ITERATIONS
included, as is): the objective, the planning seconds, whether the plans are the same, the
LP's outcome (its status, simplex iterations and seconds, read from HiGHS after the
relaxation) and ``exact_stopped``.  The megatron cases are bench_truth's megatron rows on
2x4 and 4x2 (the only baseline that forbids a collective).  One JSON line per case on
stdout; ``--out`` writes them with the command and the load::

    python benchmarks/studies/exact_lp_forbidden.py [--cases NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_L4 = {"num_layers": 4}
# (name, model, its overrides, mesh, plan ("auto" or a bench_truth baseline), IntraOptions fields)
CASES = [
    ("gpt-tiny 2x4 force=model", "gpt-tiny", {}, "2x4", "auto", {"force_batch_dim_to_mesh_axis": "model"}),
    ("gpt-tiny 4x2 force=model", "gpt-tiny", {}, "4x2", "auto", {"force_batch_dim_to_mesh_axis": "model"}),
    ("gpt-tiny 2x4 force=data", "gpt-tiny", {}, "2x4", "auto", {"force_batch_dim_to_mesh_axis": "data"}),
    ("gpt-tiny 4x2 force=data", "gpt-tiny", {}, "4x2", "auto", {"force_batch_dim_to_mesh_axis": "data"}),
    ("gpt-tiny 2x4 no all-gather", "gpt-tiny", {}, "2x4", "auto", {"allow_all_gather": False}),
    ("gpt-tiny 2x4 megatron", "gpt-tiny", {}, "2x4", "megatron", {}),
    ("gpt-tiny 4x2 megatron", "gpt-tiny", {}, "4x2", "megatron", {}),
    ("gpt-tiny(num_layers=4) 2x4 megatron", "gpt-tiny", _L4, "2x4", "megatron", {}),
    ("gpt-tiny(num_layers=4) 4x2 megatron", "gpt-tiny", _L4, "4x2", "megatron", {}),
    ("moe-tiny 2x4 megatron", "moe-tiny", {}, "2x4", "megatron", {}),
    ("moe-tiny 4x2 megatron", "moe-tiny", {}, "4x2", "megatron", {}),
]  # fmt: skip


class _LpRecorder:
    """Wraps the solver's LP relaxation to record each one's status, iterations and time."""

    def __init__(self):
        from autoshard.intra.ilp import solvers

        self.solvers, self.original, self.runs = solvers, solvers._relaxation, []

    def __enter__(self):
        def recorded(highs, lp, model):
            started = time.perf_counter()
            outcome = self.original(highs, lp, model)
            info = highs.getInfo()
            self.runs.append(
                {
                    "columns": model.num_cols,
                    "status": outcome.status,
                    "iterations": int(info.simplex_iteration_count),
                    "lp_s": round(time.perf_counter() - started, 2),
                }
            )
            return outcome

        self.solvers._relaxation = recorded
        return self

    def __exit__(self, *exc):
        self.solvers._relaxation = self.original
        return False


class _Skipped:
    """``unsolved_because`` with the rule of before 2026-11-28 put back: "lp" does not solve
    the exact program on a mesh of several axes where ``options`` forbid a collective."""

    def __init__(self, options):
        self.forbidden = options.forbidden_collectives()

    def __enter__(self):
        from autoshard.intra.problem import build

        self.build, self.original = build, build.unsolved_because

        def skipped(mesh, search, *args, **kwargs):
            several = sum(1 for n in mesh.mesh.shape if n > 1) > 1
            if several and search == "lp" and self.forbidden:
                return "not solved on this mesh of several axes with forbidden collectives"
            return self.original(mesh, search, *args, **kwargs)

        build.unsolved_because = skipped
        return self

    def __exit__(self, *exc):
        self.build.unsolved_because = self.original
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=None, help="names from CASES (default: all)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument(
        "--lp-max-iterations", type=int, default=None,
        help="EXACT_LP_MAX_ITERATIONS for both searches (default: as is)",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import contextlib

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from bench_truth import plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.problem import exact_values
    from autoshard.intra.problem.build import auto_shard_graph

    if args.lp_max_iterations is not None:
        exact_values.EXACT_LP_MAX_ITERATIONS = args.lp_max_iterations

    rows, traced_by, t_start, loads = [], {}, time.time(), [os.getloadavg()[0]]
    for name, model, overrides, mesh_text, which, fields in CASES:
        if args.cases and name not in args.cases:
            continue
        key = (model, tuple(sorted(overrides.items())))
        if key not in traced_by:  # bench_truth's optimizer
            traced_by[key] = trace_workload(model, optimizer="sgd", **overrides)
        traced, mesh = traced_by[key], truth_mesh(mesh_text)
        options, pinned = plan_settings(traced.graph, mesh, which, args.time_limit)
        options = options.replace(**fields)
        row = {"case": name, "forbidden": sorted(options.forbidden_collectives())}
        plans = []
        for search, rule in (("skipped", _Skipped(options)), ("lp", contextlib.nullcontext())):
            print(f"{name} [{search}] ...", file=sys.stderr, flush=True)
            with rule, _LpRecorder() as lps:
                t0 = time.perf_counter()
                plan = auto_shard_graph(
                    traced.graph, mesh, options, pinned_inputs=pinned, name=which
                )
                seconds = time.perf_counter() - t0
            plans.append(plan)
            row[search] = {
                "objective": plan.objective,
                "plan_s": round(seconds, 2),
                "lps": lps.runs,
                "exact_stopped": plan.solver.get("exact_stopped"),
            }
        a, b = row["skipped"]["objective"], row["lp"]["objective"]
        row["change"] = round(b / a - 1, 4) if a else None
        row["same_plan"] = (
            plans[0].input_specs == plans[1].input_specs
            and plans[0].tensor_specs == plans[1].tensor_specs
        )
        loads.append(os.getloadavg()[0])
        row["load"] = loads[-1]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "rows": len(rows),
        "command": "python benchmarks/studies/exact_lp_forbidden.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "load_1min": [min(loads), max(loads)],
        "lp_max_iterations": exact_values.EXACT_LP_MAX_ITERATIONS,
        "jax": jax.__version__,
    }
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
