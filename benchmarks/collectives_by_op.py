"""Which ops a plan's predicted collectives come from (a diagnostic, not a benchmark).

Plans a preset (``plan_workload``, the CLI's ``plan`` path) and groups every predicted
collective by the op that produces the resharded value (its primitive and shape, "input"
for a parameter or data input): kind, mesh axes, count and bytes per device. It listens
to :func:`autoshard.intra.predict.reshard_to_consumers`, the one call that turns a value's
spec and its consumers' specs into collectives, so the totals are the plan's own
prediction (``plan --verify`` compares that with XLA's compile).

    python benchmarks/collectives_by_op.py --model gpt-tiny --mesh 2x4 --baseline megatron
"""

from __future__ import annotations

import argparse
import collections
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument(
        "--baseline", default=None, help="dp, zero2, zero3, megatron, ... (default: the ILP)"
    )
    ap.add_argument("--details", action="store_true", help="also one line per resharded value")
    args = ap.parse_args()
    devices = 1
    for part in args.mesh.split("x"):
        devices *= int(part)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")

    import autoshard.intra.predict as predict
    from autoshard.api import device_mesh_for, plan_workload

    seen = []
    original = predict.reshard_to_consumers

    def listen(src, wants, shape, itemsize, mesh, *rest, **kw):
        out = original(src, wants, shape, itemsize, mesh, *rest, **kw)
        caller = sys._getframe(1).f_locals  # predicted_collectives' loop: tid, graph
        tid, graph = caller["tid"], caller["graph"]
        producer = next((n for n in graph.nodes if tid in n.outputs), None)
        prim = producer.primitive if producer is not None else "input"
        if out.collectives:
            seen.append((prim, tuple(shape), str(src), [str(w) for w in wants], out.collectives))
        return out

    predict.reshard_to_consumers = listen
    try:
        plan_workload(args.model, device_mesh_for(args.mesh), baseline=args.baseline)
    finally:
        predict.reshard_to_consumers = original
    count, nbytes = collections.Counter(), collections.Counter()
    for prim, shape, src, wants, cols in seen:
        if args.details:
            print(f"{prim} {shape} {src} -> {wants}: " + ", ".join(
                f"{c.kind} over {'+'.join(c.axes)} {c.bytes} B" for c in cols))  # fmt: skip
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
