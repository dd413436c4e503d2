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
table for the docs; ``--suite intra|memory`` re-runs one suite and keeps the other's rows
in ``--out``.  Defaults: the intra-op suite (gpt-tiny and a 4-block gpt-tiny on
meshes 8, 2x4, 4x2, 1x8 with SGD) and the simulator's memory suite (gpt-350m and
gpt-1.3b shapes, two blocks, batch 8, AdamW, f32 and bf16, on 8 devices)::

    python benchmarks/bench_truth.py [--suite intra|memory|all] [--out FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
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
    "memory": [
        (model, {"num_layers": 2, "batch_size": 8, "dtype": dtype}, "adamw", ("8",))
        for model in ("gpt-350m", "gpt-1.3b")
        for dtype in ("float32", "bfloat16")
    ],
}


def _label(model: str, overrides: dict) -> str:
    extra = ",".join(f"{k}={v}" for k, v in overrides.items())
    return f"{model}({extra})" if extra else model


def run(suite: str, time_limit: float, live_peak: str = "on_disagreement") -> list[dict]:
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines import baseline_inputs, baseline_options
    from autoshard.intra.options import IntraOptions
    from autoshard.intra.problem import auto_shard_graph
    from autoshard.verify.check import verify_plan

    rows = []
    for model, overrides, optimizer, meshes in SUITES[suite]:
        traced = trace_workload(model, optimizer=optimizer, **overrides)
        for mesh_text in meshes:
            shape = tuple(int(s) for s in mesh_text.split("x"))
            # Alpa's test-mesh costs, laid out for the backend that compiles (XLA:CPU here)
            mesh = device_mesh_for(shape, ("data", "model")[: len(shape)])
            for which in PLANS:
                pinned = (
                    baseline_inputs(traced.graph, mesh.mesh, which) if which != "auto" else None
                )
                options = IntraOptions(solver="highs", time_limit_s=time_limit)
                if which != "auto":
                    options = baseline_options(options, mesh.mesh, which)
                t0 = time.perf_counter()
                plan = auto_shard_graph(
                    traced.graph,
                    mesh,
                    options,
                    pinned_inputs=pinned,
                    name=which,
                )
                plan_s = time.perf_counter() - t0
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
                    "plan_seconds": plan_s,
                    "compile_seconds": report.compile_seconds,
                }
                rows.append(row)
                print(_format_row(row), flush=True)
    return rows


def _format_row(r: dict) -> str:
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
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    print(HEADER)
    t_start = time.perf_counter()
    rows = [row for s in suites for row in run(s, args.time_limit, args.live_peaks)]
    wall = time.perf_counter() - t_start
    out = Path(args.out)
    if args.suite != "all" and out.exists():  # keep the other suites' rows from the last run
        rows = [r for r in json.loads(out.read_text())["rows"] if r["suite"] not in suites] + rows
        rows.sort(key=lambda r: list(SUITES).index(r["suite"]))
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
        "jax": jax.__version__,
        "suites_run": suites,
        "wall_seconds_of_suites_run": wall,
        "command": "python benchmarks/bench_truth.py " + " ".join(sys.argv[1:]),
    }
    counts = (
        f"{coll}/{n} plans: collectives agree; {mem}/{n}: peak memory within 10%; "
        f"{gap}/{n}: outside, explained (heap gap: within 10% of XLA's live peak); "
        f"{n - mem - gap}/{n}: outside, unexplained"
    )
    print("\n" + counts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if args.markdown:
        lines = [HEADER] + [_format_row(r) for r in rows] + ["", counts]
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
