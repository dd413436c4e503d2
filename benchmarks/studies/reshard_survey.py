"""Every reshard a plan file asks for, compiled alone (a diagnostic, not a benchmark).

Binds a plan file to its re-traced program and collects each distinct (made spec, read
spec, shape) of an operand the plan reads in another spec than its producer made it
(partial sums left out: a program cannot be handed one), then compiles each as an
identity with that input sharding and a ``with_sharding_constraint`` to the read spec on
this process's fake devices, and compares XLA's collectives with
:func:`autoshard.intra.cost.resharding.reshard`'s prediction. Prints the ones that differ, with the
bytes per step of the plan they account for::

    python benchmarks/studies/reshard_survey.py \
        benchmarks/results/gpu_truth_plans_scale/moe-1.3b-L16-auto-2x4.json.gz
"""

from __future__ import annotations

import argparse
import collections
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan_file")
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--limit", type=int, default=0, help="compile at most this many")
    ap.add_argument(
        "--free", action="store_true", help="leave the route to XLA (no constraint per step)"
    )
    args = ap.parse_args()
    import jax

    from autoshard.ir.planfile import load_plan

    pf = load_plan(args.plan_file)
    jax.config.update("jax_num_cpu_devices", pf.plan.mesh.num_devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from autoshard.api import bind_plan, device_mesh_for
    from autoshard.intra.cost.resharding import reshard
    from autoshard.runtime.sharded import make_mesh, reshard_route, to_partition_spec
    from autoshard.verify.collectives import analyze_collectives

    t0 = time.perf_counter()
    bound = bind_plan(pf)
    print(f"bound in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    plan, graph = bound.plan, bound.graph
    priced = device_mesh_for(plan.mesh.shape, plan.mesh.axis_names, cluster=args.cluster)
    spec_of = dict(zip(graph.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)
    uses = collections.Counter()
    for node, ops in plan.operand_specs.items():
        for slot, want in ops.items():
            tid = graph.nodes[node].inputs[slot]
            made = spec_of.get(tid)
            if made is None or made.partial or want.partial:
                continue
            t = graph.tensors[tid]
            uses[(made, want, tuple(t.shape), t.dtype)] += 1
    print(f"{len(uses)} distinct reshards, {sum(uses.values())} uses", file=sys.stderr)
    jmesh = make_mesh(plan.mesh, jax.devices()[: plan.mesh.num_devices])
    ids = [d.id for d in np.asarray(jmesh.devices).flat]
    tot_p, tot_c = collections.Counter(), collections.Counter()
    bad = 0
    items = sorted(uses.items(), key=lambda kv: -kv[1])
    if args.limit:
        items = items[: args.limit]
    for k, ((made, want, shape, dtype), n) in enumerate(items):
        itemsize = np.dtype(dtype).itemsize
        pred = reshard(made, want, shape, itemsize, priced).collectives
        sh_in = NamedSharding(jmesh, to_partition_spec(made))
        sh_out = NamedSharding(jmesh, to_partition_spec(want))
        route = () if args.free else reshard_route(made, want, shape, dtype, plan.mesh)
        chain = [NamedSharding(jmesh, to_partition_spec(s)) for s in route] + [sh_out]

        def pinned(x, chain=chain):
            for s in chain:
                x = jax.lax.with_sharding_constraint(x, s)
            return x * 1

        fn = jax.jit(
            pinned,
            in_shardings=sh_in,
            out_shardings=sh_out,
        )
        text = fn.lower(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))).compile().as_text()
        comp = tuple(c.collective for c in analyze_collectives(text, plan.mesh, ids).collectives)
        for c in pred:
            tot_p[(c.kind, c.axes)] += c.bytes * n
        for c in comp:
            tot_c[(c.kind, c.axes)] += c.bytes * n
        if sorted(map(str, pred)) != sorted(map(str, comp)):
            bad += 1
            print(f"{n:>4}x {shape} {dtype} {made} -> {want}")
            print(f"      predicted {[str(c) for c in pred]}")
            print(f"      compiled  {[str(c) for c in comp]}")
        if k % 50 == 0:
            print(f"  {k}/{len(items)}", file=sys.stderr)
    print(f"\n{bad} of {len(items)} distinct reshards differ; totals per step (bytes):")
    for key in sorted(set(tot_p) | set(tot_c)):
        print(
            f"  {key[0]:>15} {','.join(key[1]):<12} predicted {tot_p[key]:>16,} compiled {tot_c[key]:>16,}"
        )


if __name__ == "__main__":
    main()
