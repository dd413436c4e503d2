"""What XLA holds at its live peak for one plan file, value by value (a diagnostic).

Binds the plan file, compiles its step with XLA's dumps (every equation in a named scope
``e<index>``, as ``truth_by_op.py`` does) and prints the live peak, the instruction there
and the largest values live at it with their HLO shape and ``op_name``, beside the plan's
predicted peak::

    python benchmarks/studies/memory_at_peak.py PLAN.json.gz [--top 30] [--cluster dgx-h100]

then the memory model's own side: its peak with this XLA:CPU's layout and its own buffers
live there, by producing primitive (:func:`autoshard.intra.memory.model.tensor_buffers`).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan_file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cluster", default="dgx-h100", help="the priced mesh's cluster")
    args = ap.parse_args()
    import jax

    from autoshard.ir.planfile import load_plan

    pf = load_plan(args.plan_file)
    jax.config.update("jax_num_cpu_devices", pf.plan.mesh.num_devices)
    sys.path.insert(0, os.path.dirname(__file__))
    from truth_by_op import _name_equations

    from autoshard.api import bind_plan
    from autoshard.runtime.sharded import abstract_args, build_sharded_step, make_mesh
    from autoshard.verify.memory import dump_live_peak

    _name_equations()
    bound = bind_plan(pf)
    plan = bound.plan
    jmesh = make_mesh(plan.mesh, jax.devices()[: plan.mesh.num_devices])
    step = build_sharded_step(bound.program, plan, jmesh, donate=True)
    with tempfile.TemporaryDirectory() as tmp:
        opts = {"xla_dump_to": tmp, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "NONE"}
        compiled = step.lower(*abstract_args(bound.program, plan, jmesh)).compile(opts)
        peak = dump_live_peak(tmp)
        texts = glob.glob(os.path.join(tmp, "*after_optimizations.txt"))
        text = open(max(texts, key=os.path.getsize)).read() if texts else ""
    m = compiled.memory_analysis()
    alloc = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    info = {}
    for line in text.splitlines():
        g = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?(?:op_name=\"([^\"]*)\")?", line)
        if g:
            op = re.search(r'op_name="([^"]*)"', line)
            info[g.group(1)] = (g.group(2), op.group(1) if op else "")
    print(
        f"predicted peak {plan.predicted_peak_bytes / 2**20:,.1f} MiB; XLA allocation {alloc / 2**20:,.1f} MiB "
        f"(args {m.argument_size_in_bytes / 2**20:,.1f}, temp {m.temp_size_in_bytes / 2**20:,.1f}); "
        f"live peak {peak.bytes / 2**20:,.1f} MiB at {peak.instruction}"
    )
    for name, nbytes in peak.values[: args.top]:
        base = name.split("{")[0].lstrip("%")
        shape, op = info.get(base, ("?", ""))
        print(f"  {nbytes / 2**20:>10,.1f} MiB  {name:<40} {shape:<32} {op[-60:]}")

    _model_side(bound, args.cluster)


def _model_side(bound, cluster: str) -> None:
    import collections
    import dataclasses

    from autoshard.api import xla_cpu_memory_layout
    from autoshard.hardware.mesh import preset_mesh
    from autoshard.intra.memory.model import predicted_live_bytes, tensor_buffers

    plan, graph = bound.plan, bound.graph
    spec_of = plan.specs_by_tensor(graph.inputs)
    priced = preset_mesh(cluster, plan.mesh.shape, plan.mesh.axis_names)
    mesh = dataclasses.replace(priced, memory_layout=xla_cpu_memory_layout())
    live = predicted_live_bytes(graph, spec_of, mesh, plan.operand_specs)
    at = max(range(len(live)), key=lambda i: live[i]) - 1
    where = f"{graph.nodes[at].primitive} in {graph.nodes[at].module_path}" if at >= 0 else "inputs"
    print(f"model, XLA:CPU layout: peak {live[at + 1] / 2**20:,.1f} MiB at node {at} ({where})")
    total, count = collections.Counter(), collections.Counter()
    for tid, first, last, nbytes in tensor_buffers(graph, mesh):
        if first <= at <= last and tid in spec_of:
            t = graph.tensors[tid]
            key = (
                graph.nodes[t.producer].primitive if t.producer is not None else f"input ({t.kind})"
            )
            total[key] += nbytes * spec_of[tid].shard_fraction(mesh.mesh)
            count[key] += 1
    print(f"  own buffers there {sum(total.values()) / 2**20:,.1f} MiB, by producer:")
    for key, nbytes in total.most_common():
        print(f"  {nbytes / 2**20:>10,.1f} MiB  {count[key]:>4}  {key}")


if __name__ == "__main__":
    main()
