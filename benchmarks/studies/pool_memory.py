"""Max pooling's backward on XLA:CPU: the conv net's predicted peak with and without the
memory model's ``expanded_select_and_scatter`` rule, beside XLA's (a diagnostic).

Plans ``bench_exact_search.py``'s conv net (``--layers`` times 3x3/2 conv, batch norm,
relu and a 2x2/1 "SAME" max pool; batch 8 of 32 x 32 x 8) on each mesh of ``--meshes``
with XLA:CPU's memory layout, once with the rule and once without, compiles each plan on
8 CPU devices with XLA's dumps and prints the predicted peak, XLA's allocation and live
peak (bytes per device), the error against the allocation and the instruction at XLA's
live peak::

    python benchmarks/studies/pool_memory.py [--meshes 8x1,2x4] [--layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--meshes", default="8x1,2x4", help="two-axis meshes of 8 devices")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_exact_search import conv_program

    from autoshard.api import xla_cpu_memory_layout
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.ir.graph import build_graph
    from autoshard.verify.check import verify_plan

    program = conv_program(num_layers=args.layers)
    graph = build_graph(program.records)
    cpu = xla_cpu_memory_layout()
    for text in args.meshes.split(","):
        shape = tuple(int(s) for s in text.split("x"))
        if len(shape) != 2 or shape[0] * shape[1] != 8:
            ap.error(f"--meshes: {text!r} is not a two-axis mesh of 8 devices (e.g. 8x1, 2x4)")
        for rule in (True, False):
            layout = dataclasses.replace(cpu, expanded_select_and_scatter=rule)
            mesh = alpa_test_mesh(shape, ("data", "model"), memory_layout=layout)
            plan = auto_shard_graph(graph, mesh, IntraOptions(solver="highs"))
            r = verify_plan(program, plan, devices=jax.devices()[:8], live_peak="always")
            error = plan.predicted_peak_bytes / r.compiled_peak_bytes - 1
            print(
                f"{text} {'with' if rule else 'without'} the rule: predicted "
                f"{plan.predicted_peak_bytes:,.0f} B, XLA allocates {r.compiled_peak_bytes:,.0f} B "
                f"({error:+.1%}), live peak {r.compiled_live_peak_bytes:,.0f} B at "
                f"{r.compiled_live_peak_instruction}",
                flush=True,
            )


if __name__ == "__main__":
    main()
