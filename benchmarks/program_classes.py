"""One GPU, one plan, two programs: where the traced step's price differs from Megatron-LM's.

On one GPU no parallelism is chosen, so a difference between ``simulate``'s traced step
and Megatron-LM's closed form (``--program megatron-lm-flash``, or ``megatron-lm``) at the
same micro-batch size is the two programs' pricing alone. This prices the traced step of
``--microbatches`` micro-batches on one GPU of ``--cluster`` node by node, as the intra-op
ILP does (one device: each node's one replicated strategy; the update once per step,
dead nodes free), sums it by class -- GEMMs (``dot_general``), the fused attention,
memory-bound work (every other node, also by primitive), the update -- and puts it beside
the closed form's ``breakdown`` (``compute_gemm``, ``compute_attention``,
``compute_elementwise``, ``optimizer``) and both programs' ``simulate`` step times.
Seconds per step. Writes ``benchmarks/results/program_classes_<cluster>_<model>.json``.

    python benchmarks/program_classes.py --model gpt-350m --cluster dgx-h100 --microbatches 32
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import figure  # noqa: E402


def traced_classes(model: str, cluster_name: str, m: int, batch: int, dtype: str) -> dict:
    """Seconds per step of the traced step of ``m`` micro-batches on one GPU, by class."""
    from autoshard.api_pipeline import microbatch_graph
    from autoshard.hardware.clusters import load_cluster
    from autoshard.inter.submesh import cluster_for, logical_mesh_costs
    from autoshard.intra.problem.build import build_problem
    from autoshard.ir.primitives import ATTENTION

    cluster = load_cluster(cluster_name)
    device = dataclasses.replace(cluster.device, default_dtype=dtype)
    mesh = logical_mesh_costs(cluster_for(dataclasses.replace(cluster, device=device), 1, 1))
    mesh = mesh((1, 1))
    trace_dtype = "float32" if dtype == "fp32" else "bfloat16"
    _, graph = microbatch_graph(model, m, "adamw", batch_size=batch, dtype=trace_dtype)
    ip = build_problem(graph, mesh)
    dead = graph.dead_nodes()
    classes: collections.Counter = collections.Counter()
    memory_bound: collections.Counter = collections.Counter()
    for node in graph.nodes:
        if node.index in dead:
            continue
        seconds = min(s.compute_cost for s in ip.strategies[ip.node_of(node.index)])
        if node.phase == "update":
            classes["update"] += seconds  # once per step
        elif node.primitive == "dot_general":
            classes["gemm"] += seconds * m
        elif node.primitive in ATTENTION:
            classes["attention"] += seconds * m
        else:
            classes["memory_bound"] += seconds * m
            memory_bound[node.primitive] += seconds * m
    return {
        "classes_s": dict(classes),
        "total_s": sum(classes.values()),
        "memory_bound_by_primitive_s": dict(memory_bound.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-350m", help="GPT preset (default: gpt-350m)")
    ap.add_argument("--cluster", default="dgx-h100", help="cluster preset (default: dgx-h100)")
    ap.add_argument("--microbatches", type=int, default=32, help="per step (default: 32)")
    ap.add_argument("--global-batch", type=int, default=1024, help="sequences (default: 1024)")
    ap.add_argument(
        "--program",
        default="megatron-lm-flash",
        choices=("megatron-lm", "megatron-lm-flash"),
        help="the closed form to compare with (default: megatron-lm-flash)",
    )
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/program_classes_...)")
    args = ap.parse_args()
    from autoshard.hardware.clusters import load_cluster
    from autoshard.sim.simulate import simulate

    if args.global_batch % args.microbatches:
        ap.error(f"--microbatches {args.microbatches} must divide --global-batch")
    dtype = load_cluster(args.cluster).device.default_dtype
    size = args.global_batch // args.microbatches
    t0 = time.perf_counter()
    print(f"pricing {args.model}'s traced step on one {args.cluster} GPU ...", file=sys.stderr)
    traced = traced_classes(args.model, args.cluster, args.microbatches, args.global_batch, dtype)
    common = dict(global_batch=args.global_batch, microbatch_size=size)
    print("simulating both programs ...", file=sys.stderr)
    grid = simulate(args.model, args.cluster, 1, "megatron:1x1x1", program=args.program, **common)
    on_traced = simulate(args.model, args.cluster, 1, "megatron:1x1x1", program="traced", **common)
    doc = {
        "command": "python benchmarks/program_classes.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "git_commit": figure.git_commit(),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "model": args.model,
        "cluster": args.cluster,
        "dtype": dtype,
        "num_microbatches": args.microbatches,
        "microbatch_size": size,
        "unit": "seconds per step",
        "traced": {**traced, "simulate_step_s": on_traced.step_time_s},
        args.program: {"breakdown_s": dict(grid.breakdown), "simulate_step_s": grid.step_time_s},
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(
        args.out or ROOT / f"benchmarks/results/program_classes_{args.cluster}_{args.model}.json"
    )
    out.write_text(json.dumps(doc, indent=1) + "\n")
    b = grid.breakdown
    c = traced["classes_s"]
    rows = [
        ("GEMMs", c.get("gemm", 0.0), b.get("compute_gemm", 0.0)),
        ("attention", c.get("attention", 0.0), b.get("compute_attention", 0.0)),
        ("memory-bound", c.get("memory_bound", 0.0), b.get("compute_elementwise", 0.0)),
        ("update", c.get("update", 0.0), b.get("optimizer", 0.0)),
    ]
    print(f"{args.model}, one {args.cluster} GPU, {args.microbatches} x {size} sequences (s/step)")
    print(f"{'class':<14}{'traced':>10}{args.program:>20}")
    for name, t, g in rows:
        print(f"{name:<14}{t:>10.3f}{g:>20.3f}")
    print(f"{'step':<14}{on_traced.step_time_s:>10.3f}{grid.step_time_s:>20.3f}  (simulate)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
