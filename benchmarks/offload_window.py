"""The offloaded state a plan's step may hold on the device at once, before and after
streaming (issue 34), read on this machine from the step lowered for GPU.

XLA:CPU ignores memory kinds, so the device working set of an offloaded step is read from
the program XLA:GPU would get (``ShardedStep.lowered_for("cuda")``, no GPU needed) by
:func:`autoshard.verify.state_window.state_window`: per stream window (``none``: every
fetch where the step starts), the fetches, their bytes and the most of them the data
dependences let be on the device at once; ``--cpu-compile`` adds XLA:CPU's
``memory_analysis`` of each form. Plans bind only to the program the same jax traces: run
with the jax the plans were made with.

    PYTHONPATH=. /work/venv-jax011/bin/python benchmarks/offload_window.py \\
        benchmarks/results/gpu_offload_plans/gpt-1.3b-optimizer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan_files", nargs="+")
    ap.add_argument("--windows", nargs="+", default=["none", "1", "2"])
    ap.add_argument(
        "--cpu-compile",
        action="store_true",
        help="also compile each form for this machine's CPU: XLA:CPU's memory_analysis "
        "(which ignores memory kinds)",
    )
    args = ap.parse_args(argv)
    import jax

    from autoshard.api import bind_plan
    from autoshard.runtime.sharded import build_sharded_step
    from autoshard.verify.state_window import state_window

    for path in args.plan_files:
        bound = bind_plan(path)
        if not (bound.plan.offload or {}).get("host_inputs"):
            print(json.dumps({"plan_file": path, "offloaded": False}))
            continue
        mesh = bound.mesh(jax.devices()[: bound.plan.mesh.num_devices])
        for w in args.windows:
            window = None if w == "none" else int(w)
            t = time.perf_counter()
            step = build_sharded_step(bound.program, bound.plan, mesh, stream_window=window)
            lowered = step.lowered_for("cuda")
            sw = state_window(lowered.as_text(), lowered.as_text(dialect="hlo"))
            row = {
                "plan_file": path,
                "jax": jax.__version__,
                "stream_window": window,
                "groups": None if step.stream is None else len(step.stream.groups),
                **sw.__dict__,
                "seconds": round(time.perf_counter() - t, 1),
            }
            if args.cpu_compile:
                ma = step.compile().memory_analysis()
                row["cpu"] = {
                    k: int(getattr(ma, k))
                    for k in ("temp_size_in_bytes", "argument_size_in_bytes")
                    + ("host_argument_size_in_bytes", "host_temp_size_in_bytes")
                }
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
