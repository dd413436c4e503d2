"""Which ops a plan's predicted collectives come from (a diagnostic, not a benchmark).

Plans a preset (``plan_workload``, the CLI's ``plan`` path) and groups every predicted
collective by the op that produces the resharded value (its primitive and shape, "input"
for a parameter or data input): kind, mesh axes, count and bytes per device. It reads the
plan's own prediction per value (:func:`autoshard.intra.problem.predict.collectives_by_value`, of
which ``predicted_collectives`` is the flat list that ``plan --verify`` compares with XLA's
compile), for the plan ``plan_from_solution`` was last asked to predict.

    python benchmarks/studies/collectives_by_op.py --model gpt-tiny --mesh 2x4 --baseline megatron
"""

from __future__ import annotations

import argparse
import collections
import math


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument(
        "--baseline", default=None, help="dp, zero2, zero3, megatron, ... (default: the ILP)"
    )
    ap.add_argument("--details", action="store_true", help="also one line per resharded value")
    args = ap.parse_args()
    import jax

    from autoshard.api import device_mesh_for, parse_mesh_shape, plan_workload

    jax.config.update("jax_num_cpu_devices", math.prod(parse_mesh_shape(args.mesh)))
    import autoshard.intra.problem.predict as predict

    # (ip, choice) of every plan predicted: the planner calls collectives_by_value (its
    # flat form, predicted_collectives, is no longer what the plan path calls)
    asked = []
    original = predict.collectives_by_value

    def listen(ip, choice, *rest, **kw):
        asked.append((ip, choice))
        return original(ip, choice, *rest, **kw)

    predict.collectives_by_value = listen
    try:
        plan_workload(args.model, device_mesh_for(args.mesh), baseline=args.baseline)
    finally:
        predict.collectives_by_value = original
    if not asked:
        raise SystemExit("the plan path predicted no collectives through collectives_by_value")
    ip, choice = asked[-1]
    graph = ip.graph
    producer = {t: n for n in graph.nodes for t in n.outputs}
    seen = []
    for tid, cols in original(ip, choice):
        if cols:
            node = producer.get(tid)
            seen.append((node.primitive if node else "input", graph.tensors[tid].shape, cols))
    count, nbytes = collections.Counter(), collections.Counter()
    for prim, shape, cols in seen:
        if args.details:
            print(
                f"{prim} {shape}: "
                + ", ".join(f"{c.kind} over {'+'.join(c.axes)} {c.bytes} B" for c in cols)
            )
        for c in cols:
            key = (c.kind, "+".join(c.axes), prim, shape)
            count[key] += 1
            nbytes[key] += c.bytes
    print(
        f"{args.model} on {args.mesh}, plan {args.baseline or 'auto'}: predicted collectives by producing op"
    )
    print(
        f"{'kind':15s} {'axes':11s} {'producer':12s} {'shape':16s} {'count':>5s} {'bytes/device':>13s}"
    )
    for key in sorted(count, key=lambda k: (k[0], -nbytes[k])):
        kind, axes, prim, shape = key
        print(
            f"{kind:15s} {axes:11s} {prim:12s} {str(shape):16s} {count[key]:5d} {nbytes[key]:13,d}"
        )


if __name__ == "__main__":
    main()
