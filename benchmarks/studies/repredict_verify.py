"""A stored plan file compiled by this tree's runtime and compared with this tree's
prediction of it (a diagnostic): the plan's specs are kept, its collectives are predicted
again from them (:func:`autoshard.verify.xla_gpu._values`, the per-value prediction of
``collectives_by_value`` from a plan's specs) and its peak again with the GPU's and this
XLA:CPU's memory layout, then ``verify_plan`` compiles it on this process's fake devices::

    python benchmarks/studies/repredict_verify.py PLAN.json.gz [--cluster dgx-h100] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan_file")
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    from autoshard.ir.planfile import load_plan

    pf = load_plan(args.plan_file)
    jax.config.update("jax_num_cpu_devices", pf.plan.mesh.num_devices)
    from autoshard.api import bind_plan, xla_cpu_memory_layout
    from autoshard.hardware.mesh import preset_mesh
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.verify.check import verify_plan
    from autoshard.verify.xla_gpu import _values

    t0 = time.perf_counter()
    bound = bind_plan(pf)
    plan, graph = bound.plan, bound.graph
    cols = tuple(c for _, cs in sorted(_values(graph, plan).items()) for c in cs)
    spec_of = plan.specs_by_tensor(graph.inputs)
    gpu = preset_mesh(args.cluster, plan.mesh.shape, plan.mesh.axis_names)
    cpu = dataclasses.replace(gpu, memory_layout=xla_cpu_memory_layout())
    peak_cpu = predicted_peak_bytes(graph, spec_of, cpu, plan.operand_specs)
    again = dataclasses.replace(plan, predicted_collectives=cols)
    print(f"bound and predicted in {time.perf_counter() - t0:.0f} s; compiling", file=sys.stderr)
    report = verify_plan(bound.program, again, live_peak="never")
    print(report.comparison.format())
    compiled = report.compiled_peak_bytes
    for name, peak in (
        ("GPU layout (as planned)", plan.predicted_peak_bytes),
        ("XLA:CPU layout", peak_cpu),
    ):
        print(
            f"peak, {name}: {peak / 2**20:,.0f} MiB vs compiled {compiled / 2**20:,.0f} MiB "
            f"({(peak - compiled) / compiled:+.1%})"
        )
    if args.out:
        doc = {
            "plan_file": args.plan_file,
            "jax": jax.__version__,
            "collectives_agree": report.collectives_agree,
            "rows": [
                dataclasses.asdict(r) if dataclasses.is_dataclass(r) else str(r)
                for r in report.comparison.rows
            ],
            "predicted_peak_gpu_layout_bytes": plan.predicted_peak_bytes,
            "predicted_peak_cpu_layout_bytes": peak_cpu,
            "compiled_peak_bytes": compiled,
            "compile_seconds": report.compile_seconds,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
