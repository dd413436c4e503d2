"""How far to trust a plan: predicted vs compiled, for every plan the acceptance names.

For each model, mesh and plan (the ILP's own, and every baseline pinned through the same
plan object), compile the sharded step with abstract shapes on fake CPU devices and
compare with the plan's predictions:

* collectives -- the same (kind, mesh axes) pairs, total bytes within 2% per pair;
* peak memory per device -- within 10% of XLA's (arguments + outputs - aliases + temp).
  Where it is not, ``verify_plan`` compiles again with an XLA dump and reads XLA's live
  peak (the most bytes its schedule holds at once); a row whose prediction is within 10%
  of that live peak, with XLA's allocation above it, is counted as "explained (heap
  gap)", separately.  ``--live-peaks always`` reads the live peak for every row.

Writes one JSON row per plan and prints a table; ``--markdown FILE`` also writes the
table for the docs; ``--suite intra|moe|memory|conv`` re-runs one suite and keeps the other's rows
in ``--out``.  Defaults: the intra-op suite (gpt-tiny and a 4-block gpt-tiny on
meshes 8, 2x4, 4x2, 1x8 with SGD) and the simulator's memory suite (gpt-350m and
gpt-1.3b shapes, two blocks, batch 8, AdamW, f32 and bf16, on 8 devices), the GPT-MoE
suite (moe-tiny on the intra suite's meshes, SGD; moe-380m's dimensions, two blocks, batch
16, AdamW, on 8 devices) and ``--suite conv``, a two-block wresnet-tiny (convolutions,
batch norm, max pooling) on meshes 8 and 2x4::

    python benchmarks/bench_truth.py [--suite intra|moe|memory|conv|all] [--out FILE] [--markdown FILE]

``--models``, ``--meshes`` and ``--plans`` (e.g. ``--plans megatron``) re-run some rows and
keep the rest of ``--out``. A baseline that cannot mean its name on a row (the strict
``megatron`` with heads the model axis does not divide) is written as a row with
``refused`` and the planner's reason, counted apart.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PLANS = ("auto", "dp", "zero2", "zero3", "megatron")
SUITES = {
    # (model, overrides, optimizer, meshes)
    "intra": [
        ("gpt-tiny", {}, "sgd", ("8", "2x4", "4x2", "1x8")),
        ("gpt-tiny", {"num_layers": 4}, "sgd", ("8", "2x4", "4x2", "1x8")),
    ],
    # GPT-MoE (GShard top-2 gating, experts split by the plan): the rules of intra/rules/moe.py
    "moe": [
        ("moe-tiny", {}, "sgd", ("8", "2x4", "4x2", "1x8")),
        ("moe-380m", {"num_layers": 2, "batch_size": 16}, "adamw", ("8",)),
    ],
    "memory": [
        (model, {"num_layers": 2, "batch_size": 8, "dtype": dtype}, "adamw", ("8",))
        for model in ("gpt-350m", "gpt-1.3b")
        for dtype in ("float32", "bfloat16")
    ],
    # Wide-ResNet: wresnet-250m's structure, reduced (2 bottleneck blocks, 32x32 images)
    "conv": [("wresnet-tiny", {"num_layers": 8}, "sgd", ("8", "2x4"))],
}


def _label(model: str, overrides: dict) -> str:
    extra = ",".join(f"{k}={v}" for k, v in overrides.items())
    return f"{model}({extra})" if extra else model


def _objective_split(graph, mesh, plan, pinned, exact_values, options) -> tuple[float, float]:
    """(seconds of the plan's predicted collectives, its compute term), as the ILP prices
    them under the plan's ``options`` (whose strategies its solver record indexes)."""
    from autoshard.intra.cost.resharding import collective_cost
    from autoshard.intra.problem.build import build_problem

    ip = build_problem(graph, mesh, options, pinned_inputs=pinned, exact_values=exact_values)
    choice = plan.solver["strategy"]
    compute = sum(ip.problem.node_costs[i][choice[i]] for i in range(len(ip.strategies)))
    return sum(collective_cost(mesh, c) for c in plan.predicted_collectives), compute


def truth_mesh(text: str):
    """The mesh of a suite's mesh text ("8", "2x4"): axes ("data", "model"), Alpa's
    test-mesh costs laid out for the backend that compiles (XLA:CPU here)."""
    from autoshard.api import device_mesh_for

    shape = tuple(int(s) for s in text.split("x"))
    return device_mesh_for(shape, ("data", "model")[: len(shape)])


def plan_settings(graph, mesh, which: str, time_limit: float, exact_search: str | None = None):
    """(IntraOptions, pinned inputs) that plan ``which`` ("auto" or a baseline) here;
    ``exact_search`` None: the planner's default."""
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.options import IntraOptions

    options = IntraOptions(solver="highs", time_limit_s=time_limit)
    if exact_search is not None:
        options = options.replace(exact_search=exact_search)
    if which == "auto":
        return options, None
    return baseline_options(options, mesh.mesh, which), baseline_inputs(graph, mesh.mesh, which)


def run(
    suite: str,
    time_limit: float,
    live_peak: str = "on_disagreement",
    exact_values: bool = True,
    only_models: tuple[str, ...] = (),
    only_meshes: tuple[str, ...] = (),
    only_plans: tuple[str, ...] = (),
    attention: str | None = None,
    exact_search: str | None = None,
    replay_cache: str | None = None,
) -> list[dict]:
    from autoshard.api import trace_workload
    from autoshard.intra.baselines.tables import BaselineRefusedError
    from autoshard.intra.ilp import InfeasibleProblemError
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.verify.check import verify_plan

    rows = []
    for model, overrides, optimizer, meshes in SUITES[suite]:
        if only_models and _label(model, overrides) not in only_models:
            continue
        extra = {"attention": attention} if attention and model.startswith(("gpt", "moe")) else {}
        traced = trace_workload(model, optimizer=optimizer, **overrides, **extra)
        for mesh_text in meshes:
            if only_meshes and mesh_text not in only_meshes:
                continue
            mesh = truth_mesh(mesh_text)
            for which in PLANS:
                if only_plans and which not in only_plans:
                    continue
                t0 = time.perf_counter()
                try:
                    options, pinned = plan_settings(
                        traced.graph, mesh, which, time_limit, exact_search
                    )
                except BaselineRefusedError as err:  # no Megatron-LM split in this model
                    rows.append(_refused(suite, _label(model, overrides), mesh_text, which, err))
                    print(f"| {rows[-1]['model']} | {mesh_text} | {which} | refused: "
                          f"{rows[-1]['refused'][:160]}... |", flush=True)  # fmt: skip
                    continue
                try:
                    plan = auto_shard_graph(
                        traced.graph,
                        mesh,
                        options,
                        pinned_inputs=pinned,
                        name=which,
                        exact_values=exact_values,
                    )
                except InfeasibleProblemError as err:
                    if which == "auto":
                        raise
                    row = _refused(suite, _label(model, overrides), mesh_text, which, err)
                    row["refused"] = _why(traced.graph, mesh, options, pinned, which, err)
                    rows.append(row)
                    print(f"| {row['model']} | {mesh_text} | {which} | refused: "
                          f"{row['refused'][:160]}... |", flush=True)  # fmt: skip
                    continue
                plan_s = time.perf_counter() - t0
                comm_s, compute_s = _objective_split(
                    traced.graph, mesh, plan, pinned, exact_values, options
                )
                report = verify_plan(traced.program, plan, live_peak=live_peak)
                disagree = [
                    f"{r.kind}@{','.join(r.axes) or '?'}"
                    for r in report.comparison.rows
                    if not r.agree
                ]
                row = {
                    "suite": suite,
                    "model": _label(model, overrides),
                    "mesh": mesh_text,
                    "plan": which,
                    **extra,
                    "collectives_agree": report.collectives_agree,
                    "disagreeing_rows": disagree,
                    "predicted_collective_bytes": sum(
                        r.predicted_bytes for r in report.comparison.rows
                    ),
                    "compiled_collective_bytes": sum(
                        r.compiled_bytes for r in report.comparison.rows
                    ),
                    "predicted_peak_bytes": report.predicted_peak_bytes,
                    "compiled_peak_bytes": report.compiled_peak_bytes,
                    "memory_error": (report.predicted_peak_bytes - report.compiled_peak_bytes)
                    / report.compiled_peak_bytes,
                    "memory_agree": report.memory_agree,
                    "compiled_live_peak_bytes": report.compiled_live_peak_bytes,
                    "compiled_live_peak_instruction": report.compiled_live_peak_instruction,
                    "live_peak_error": report.live_peak_error,
                    "memory_explained_by_heap_gap": report.memory_explained_by_heap_gap,
                    "memory_explanation": report.memory_explanation,
                    "solver_status": plan.solver.get("status"),
                    "exact_search": options.exact_search,
                    "exact_stopped": plan.solver.get("exact_stopped"),
                    "objective": plan.objective,
                    "predicted_collectives_cost": comm_s,
                    "compute_cost": compute_s,
                    "objective_over_prediction": (
                        plan.objective / (comm_s + compute_s)
                        if comm_s + compute_s
                        else (1.0 if plan.objective == 0 else math.inf)
                    ),
                    "plan_seconds": plan_s,
                    "compile_seconds": report.compile_seconds,
                }
                rows.append(row)
                print(_format_row(row), flush=True)
                if replay_cache:  # memory_replay.py's record of this plan and its compile
                    path = replay_path(
                        replay_cache,
                        suite,
                        row["model"],
                        mesh_text,
                        which,
                        attention if extra else None,
                    )
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(replay_record(plan, report)))
    return rows


def replay_path(cache, suite: str, label: str, mesh_text: str, which: str, attention=None) -> Path:
    """Where ``benchmarks/studies/memory_replay.py`` caches one row's plan and compile."""
    tag = f"__{attention}" if attention else ""
    return Path(cache) / f"{suite}__{label}__{mesh_text}__{which}{tag}.json"


def replay_record(plan, report) -> dict:
    """A row's plan and what XLA compiled for it, as memory_replay.py caches them."""
    return {
        "plan": plan.dumps(),
        "compiled": report.compiled_peak_bytes,
        "live": report.compiled_live_peak_bytes,
        "live_at": report.compiled_live_peak_instruction,
        "collectives_agree": report.collectives_agree,
    }


def _refused(suite, model, mesh_text, which, err) -> dict:
    return {"suite": suite, "model": model, "mesh": mesh_text, "plan": which, "refused": str(err)}


def _why(graph, mesh, options, pinned, which, err) -> str:
    """The baseline's refusal (the op where it cannot mean its name), as the API says it."""
    from autoshard.intra.baselines.tables import data_parallel_refusal
    from autoshard.intra.problem.build import build_problem

    refusal = data_parallel_refusal(
        build_problem(graph, mesh, options, pinned_inputs=pinned), which
    )
    return str(refusal if refusal is not None else err)


def _format_row(r: dict) -> str:
    if "refused" in r:
        return f"| {r['model']} | {r['mesh']} | {r['plan']} | refused | | | | | |"
    coll = "yes" if r["collectives_agree"] else "NO: " + " ".join(r["disagreeing_rows"])
    live = r.get("compiled_live_peak_bytes")
    if live is not None:
        live_text = f"{live / 2**20:,.1f} ({r['live_peak_error']:+.1%})"
    else:
        live_text = "" if r["memory_agree"] else "unknown"
    if r["memory_agree"]:
        verdict = "yes"
    else:
        verdict = "NO, heap gap" if r.get("memory_explained_by_heap_gap") else "NO"
    return (
        f"| {r['model']} | {r['mesh']} | {r['plan']} | {coll} | "
        f"{r['predicted_peak_bytes'] / 2**20:,.1f} | {r['compiled_peak_bytes'] / 2**20:,.1f} | "
        f"{r['memory_error']:+.1%} | {live_text} | {verdict} |"
    )


HEADER = (
    "| model | mesh | plan | collectives agree | predicted peak MiB | compiled peak MiB "
    "| memory error | XLA live peak MiB (error) | memory within 10% |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--suite", choices=(*SUITES, "all"), default="all")
    ap.add_argument("--time-limit", type=float, default=300.0, help="ILP time limit (s)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_truth.json"))
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument(
        "--live-peaks",
        choices=("on_disagreement", "always"),
        default="on_disagreement",
        help="when to read XLA's live peak (a second, dumped compile per plan)",
    )
    ap.add_argument("--models", default="", help="only these row labels, e.g. gpt-tiny")
    ap.add_argument("--meshes", default="", help="only these meshes, e.g. 8,1x8")
    ap.add_argument("--plans", default="", help="only these plans, e.g. megatron,dp")
    ap.add_argument(
        "--per-demand-pricing",
        action="store_true",
        help="plan with the per-demand pricing alone (the planner's default adds the exact "
        "per-value program, started from that plan)",
    )
    ap.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        default=None,
        help="the GPT and GPT-MoE rows' attention program (default: the model's default)",
    )
    ap.add_argument(
        "--exact-search",
        choices=("lp", "auto", "one-axis", "always", "never"),
        default=None,
        help="where the exact per-value program is solved (IntraOptions.exact_search; "
        "default: the planner's)",
    )
    ap.add_argument(
        "--replay-cache",
        default=None,
        help="also write each plan and its compiled peaks here, as "
        "benchmarks/studies/memory_replay.py caches them (replay a memory-model change "
        "on this run's plans)",
    )
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    print(HEADER)
    t_start = time.perf_counter()
    rows = [
        row
        for s in suites
        for row in run(
            s,
            args.time_limit,
            args.live_peaks,
            not args.per_demand_pricing,
            tuple(m for m in args.models.split(";") if m),
            tuple(m for m in args.meshes.split(",") if m),
            tuple(p for p in args.plans.split(",") if p),
            args.attention,
            args.exact_search,
            args.replay_cache,
        )
    ]
    wall = time.perf_counter() - t_start
    out = Path(args.out)
    if out.exists() and (args.suite != "all" or args.plans or args.models or args.meshes):
        # keep the last run's rows of what was not run: the other suites, or (--plans)
        # the other plans; the rows run replace theirs in place
        def key(r):
            return r["suite"], r["model"], r["mesh"], r["plan"]

        old = json.loads(out.read_text())["rows"]
        subset = args.plans or args.models or args.meshes
        merged = {key(r): r for r in old if subset or r["suite"] not in suites}
        merged.update({key(r): r for r in rows})
        rows = sorted(merged.values(), key=lambda r: list(SUITES).index(r["suite"]))
    rows_all = rows
    rows = [r for r in rows_all if "refused" not in r]
    n = len(rows)
    coll = sum(r["collectives_agree"] for r in rows)
    mem = sum(r["memory_agree"] for r in rows)
    gap = sum(bool(r.get("memory_explained_by_heap_gap")) for r in rows)
    summary = {
        "plans": n,
        "collectives_agree": coll,
        "memory_within_10pct": mem,
        "memory_explained_heap_gap": gap,
        "memory_unexplained": n - mem - gap,
        "refused": len(rows_all) - n,
        "objective_within_1pct_of_prediction": sum(
            abs(r.get("objective_over_prediction", math.inf) - 1) <= 0.01 for r in rows
        ),
        "jax": jax.__version__,
        "suites_run": suites,
        "wall_seconds_of_suites_run": wall,
        "command": "python benchmarks/bench_truth.py " + " ".join(sys.argv[1:]),
    }
    counts = (
        f"{coll}/{n} plans: collectives agree; {mem}/{n}: peak memory within 10%; "
        f"{gap}/{n}: outside, explained (heap gap: within 10% of XLA's live peak); "
        f"{n - mem - gap}/{n}: outside, unexplained"
        + (f"; {len(rows_all) - n} baselines refused (not counted)" if len(rows_all) > n else "")
    )
    print("\n" + counts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows_all}, indent=1))
    if args.markdown:
        lines = [HEADER] + [_format_row(r) for r in rows_all] + ["", counts]
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
