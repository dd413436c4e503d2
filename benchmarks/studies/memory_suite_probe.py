"""Why bench_truth's memory suite changed plans after 2026-11-25: a plan-only probe and the cause.

Plans one memory-suite row (default: gpt-350m, 2 blocks, batch 8, bfloat16, AdamW, on 8)
as bench_truth does and prints each plan's objective, predicted peak and collectives,
one JSON line per plan.  It uses only ``bench_truth.run`` (``verify_plan`` is stopped
before it compiles), so it runs in an old tree too, which is how the change was bisected:

    git worktree add /tmp/bisect-X <commit>
    cd /tmp/bisect-X && PYTHONPATH=$PWD python /path/to/memory_suite_probe.py [--plans auto,zero3]

``--without-batched-gather-partial`` removes gather's partial-sum ("reduce") strategy on a
collapsed dim beside batching dims (the vocabulary-split target-logit lookup of
``take_along_axis``, added in be99528) before planning; ``--verify`` compiles each plan on 8
fake CPU devices and compares (current tree only); ``--show-replicated`` lists the plan's
values of the logits' shape that no device splits; ``--cluster dgx-a100`` plans on a
cluster's mesh, where compute is priced (seconds), instead of Alpa's test mesh.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
import time
from pathlib import Path

ROW = "gpt-350m(num_layers=2,batch_size=8,dtype=bfloat16)"


def _without_batched_gather_partial() -> None:
    from autoshard.intra.rules.registry import RULES

    gather = RULES["gather"]

    def rule(ctx):
        slots = gather(ctx)
        if slots and ctx.node.params["dimension_numbers"]["operand_batching_dims"]:
            return [s for s in slots if s.kind != "reduce"]
        return slots

    RULES["gather"] = rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", default=ROW, help="a memory-suite row label (bench_truth's)")
    ap.add_argument("--plans", default="auto,zero3", help="comma-separated plans")
    ap.add_argument("--without-batched-gather-partial", action="store_true")
    ap.add_argument("--verify", action="store_true", help="compile each plan (8 CPU devices)")
    ap.add_argument("--show-replicated", action="store_true")
    ap.add_argument(
        "--cluster",
        default=None,
        help="plan on this cluster preset's mesh (costs in seconds, compute priced) instead "
        "of Alpa's test mesh (current tree only; not with --verify)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import bench_truth

    import autoshard.verify.check as check

    if args.cluster:
        if args.verify:
            ap.error("--verify compiles on CPU devices; drop it with --cluster")
        from autoshard.api import device_mesh_for

        def cluster_mesh(text: str):
            shape = tuple(int(s) for s in text.split("x"))
            return device_mesh_for(shape, ("data", "model")[: len(shape)], cluster=args.cluster)

        bench_truth.truth_mesh = cluster_mesh
    if args.without_batched_gather_partial:
        _without_batched_gather_partial()
    verify = check.verify_plan
    got = {}

    class Planned(Exception):
        pass

    def stop(program, plan, **kw):
        got["program"] = program
        raise Planned(plan)

    check.verify_plan = stop
    for which in args.plans.split(","):
        bench_truth.PLANS = (which,)
        t0 = time.perf_counter()
        try:
            bench_truth.run("memory", 300.0, only_models=(args.row,), only_meshes=("8",))
        except Planned as planned:
            plan = planned.args[0]
        else:
            raise SystemExit(f"no plan {which!r} for row {args.row!r} (a memory-suite label?)")
        row = {
            "plan": which,
            "objective": plan.objective,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_collective_bytes": sum(c.bytes for c in plan.predicted_collectives),
            "collectives": dict(collections.Counter(c.kind for c in plan.predicted_collectives)),
            "status": plan.solver.get("status"),
            "plan_digest": hashlib.md5(
                repr((plan.node_strategies, [str(s) for s in plan.input_specs])).encode()
            ).hexdigest()[:10],
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if args.verify:
            report = verify(got["program"], plan)
            row.update(
                collectives_agree=report.collectives_agree,
                compiled_collective_bytes=sum(r.compiled_bytes for r in report.comparison.rows),
                compiled_peak_bytes=report.compiled_peak_bytes,
            )
        print(json.dumps(row), flush=True)
        if args.show_replicated:
            graph = got.get("graph") or got.setdefault("graph", bench_truth_graph(args.row))
            producer = {t: n for n in graph.nodes for t in n.outputs}
            logits = max((graph.tensors[t].shape for t in plan.tensor_specs), key=_size)
            for tid, spec in plan.tensor_specs.items():
                if graph.tensors[tid].shape == logits and not any(spec.dims):
                    node = producer[tid]
                    print(f"  whole on every device: {node.primitive} ({node.phase}) "
                          f"{graph.tensors[tid].shape} {spec}", flush=True)  # fmt: skip


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bench_truth_graph(row: str):
    from bench_truth import SUITES, _label

    from autoshard.api import trace_workload

    for model, overrides, optimizer, _ in SUITES["memory"]:
        if _label(model, overrides) == row:
            return trace_workload(model, optimizer=optimizer, **overrides).graph
    raise SystemExit(f"no memory-suite row {row!r}")


if __name__ == "__main__":
    main()
