"""A memory-model change measured on fixed plans: plan each bench_truth row once and
compile it once (both cached as JSON in ``--cache``), then predict the peak of the same
plan with the memory model of the autoshard that is imported.

bench_truth re-plans every row, and the ILP's exact phase stops at a time budget, so on
a loaded machine the plans (and XLA's peaks) move from run to run; replaying cached plans
separates the model's change from the planner's.  Run it once per code version against
the same cache (``PYTHONPATH=<other checkout>`` imports another version)::

    python benchmarks/studies/memory_replay.py --suite memory [--cache DIR] [--live] [--json]

Prints one line per row (XLA's allocation, the prediction, its error, and with ``--live``
the error against XLA's live peak), or with ``--json`` one JSON document.  Each row is
planned as bench_truth plans it (a baseline that cannot mean its name there is skipped,
as bench_truth counts it apart), and the cache keeps whether the compiled collectives
agreed with the plan's, so a replay also gives the suite's collective count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--suite", default="memory", help="a bench_truth suite: intra, moe, memory, conv"
    )
    ap.add_argument("--cache", default="/tmp/autoshard-memory-replay")
    ap.add_argument("--models", default="", help="only these row labels, ';'-separated")
    ap.add_argument("--plans", default="", help="only these plans, e.g. dp,zero3")
    ap.add_argument("--meshes", default="", help="only these meshes, e.g. 8,2x4")
    ap.add_argument("--attention", default=None, choices=("fused", "unfused"))
    ap.add_argument("--live", action="store_true", help="also read XLA's live peak (new rows)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from bench_truth import PLANS, SUITES, _label, plan_settings, replay_path, replay_record

    import autoshard
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import BaselineRefusedError
    from autoshard.intra.ilp import InfeasibleProblemError
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.ir.plan import ParallelPlan
    from autoshard.verify.check import verify_plan

    if args.suite not in SUITES:
        ap.error(f"--suite must be one of {sorted(SUITES)}")
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, overrides, optimizer, meshes in SUITES[args.suite]:
        label = _label(model, overrides)
        if args.models and label not in args.models.split(";"):
            continue
        extra = {}
        if args.attention and model.startswith(("gpt", "moe")):
            extra = {"attention": args.attention}
        traced = trace_workload(model, optimizer=optimizer, **overrides, **extra)
        g = traced.graph
        for mesh_text in meshes:
            if args.meshes and mesh_text not in args.meshes.split(","):
                continue
            shape = tuple(int(s) for s in mesh_text.split("x"))
            mesh = device_mesh_for(shape, ("data", "model")[: len(shape)])
            for which in PLANS:
                if args.plans and which not in args.plans.split(","):
                    continue
                path = replay_path(
                    cache, args.suite, label, mesh_text, which, extra.get("attention")
                )
                if not path.exists():
                    print(f"{label} {mesh_text} {which}: planning and compiling", file=sys.stderr)
                    try:  # as bench_truth plans the row
                        options, pinned = plan_settings(g, mesh, which, 60)
                        plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name=which)
                    except (BaselineRefusedError, InfeasibleProblemError) as err:
                        if which == "auto":
                            raise
                        path.write_text(json.dumps({"refused": str(err)}))
                    else:
                        report = verify_plan(
                            traced.program, plan, live_peak="always" if args.live else "never"
                        )
                        path.write_text(json.dumps(replay_record(plan, report)))
                record = json.loads(path.read_text())
                if "refused" in record:  # a baseline that cannot mean its name here
                    continue
                plan = ParallelPlan.loads(record["plan"])
                spec_of = dict(zip(g.inputs, plan.input_specs))
                spec_of.update({int(t): s for t, s in plan.tensor_specs.items()})
                operand_specs = {
                    int(n): {int(k): s for k, s in slots.items()}
                    for n, slots in plan.operand_specs.items()
                }
                predicted = predicted_peak_bytes(g, spec_of, mesh, operand_specs)
                compiled, live = record["compiled"], record.get("live")
                row = {
                    "model": label,
                    "mesh": mesh_text,
                    "plan": which,
                    "compiled_peak_bytes": compiled,
                    "predicted_peak_bytes": predicted,
                    "memory_error": (predicted - compiled) / compiled,
                    "compiled_live_peak_bytes": live,
                    "live_peak_error": None if not live else (predicted - live) / live,
                    "compiled_live_peak_instruction": record.get("live_at"),
                    # compiled once, when cached (None: a cache made before it was kept)
                    "collectives_agree": record.get("collectives_agree"),
                }
                rows.append(row)
                if not args.json:
                    live_text = "" if not live else f"  live {row['live_peak_error']:+.1%}"
                    print(
                        f"{label} {mesh_text} {which}: XLA {compiled / 2**20:,.1f} MiB, "
                        f"predicted {predicted / 2**20:,.1f} MiB, {row['memory_error']:+.1%}"
                        f"{live_text}",
                        flush=True,
                    )
    within = sum(abs(r["memory_error"]) <= 0.10 for r in rows)
    coll = sum(bool(r["collectives_agree"]) for r in rows)
    if args.json:
        doc = {
            "suite": args.suite,
            "attention": args.attention,
            "autoshard": autoshard.__file__,
            "plans": len(rows),
            "within_10pct": within,
            "collectives_agree": coll,
        }
        json.dump({**doc, "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print(f"memory within 10%: {within}/{len(rows)}; collectives agree: {coll}/{len(rows)}")


if __name__ == "__main__":
    main()
