"""What XLA holds at its live peak for one plan file, value by value (a diagnostic).

Binds the plan file, compiles its step with XLA's dumps (every equation in a named scope
``e<index>``, as ``truth_by_op.py`` does) and prints the live peak, the instruction there
and the largest values live at it with their HLO shape and ``op_name``, beside the plan's
predicted peak::

    python benchmarks/studies/memory_at_peak.py PLAN.json.gz [--top 30]
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


if __name__ == "__main__":
    main()
