"""moe-70b on 64 V100s (``alpa-v100``), ``plan="auto"``, per optimizer: why AdamW is out of
memory and Alpa's Adafactor fits (docs/experiments.md, section 1, 2026-11-25 night).

For each optimizer: ``simulate(MODEL, "alpa-v100", GPUS, "auto", global_batch=1024,
optimizer=...)``; the model state per GPU (whole model / GPUS); each chosen stage's memory
terms under every recompute mode (``IntraStageCost.range_cost``: state + in-flight x kept
activations + working bytes) and its leanest layout; and the budgeted stage DP over the
same costs (fits, or the smallest per-device budget any plan needs). Minutes per optimizer
for moe-70b; prints text::

    python benchmarks/studies/moe70_memory.py [MODEL [GPUS [OPTIMIZER ...]]]
"""

from __future__ import annotations

import json
import math
import sys
import time

from autoshard.hardware.clusters import load_cluster
from autoshard.inter.stages import RECOMPUTE_MODES, optimal_stage_plan
from autoshard.sim import auto as sim_auto
from autoshard.sim.simulate import simulate

GIB = 2**30


def _logical_views(submesh) -> list[tuple[int, int]]:
    """(data, model) views of a sub-mesh: every factorisation of its device count."""
    n = submesh[0] * submesh[1]
    return [(d, n // d) for d in range(1, n + 1) if n % d == 0]


def report(model: str, gpus: int, optimizer: str) -> None:
    cluster = load_cluster("alpa-v100", gpus)
    hbm = cluster.device.hbm_bytes
    sim_auto._STAGE_COSTS.clear()  # this optimizer's ILPs, read back below
    t0 = time.time()
    rep = simulate(model, "alpa-v100", gpus, "auto", global_batch=1024, optimizer=optimizer)
    plan = rep.to_json()["plan"]
    print(
        f"== {optimizer}: wall {time.time() - t0:.0f} s  step {rep.step_time_s:.4f} s  "
        f"peak {rep.peak_bytes_per_device / GIB:.2f} GiB  oom {rep.oom}  mfu {rep.mfu:.4f}  "
        f"m {plan['num_microbatches']}"
    )
    keys = ("tp", "pp", "dp", "microbatch_size", "num_microbatches", "num_ilps", "phase_seconds")
    print(json.dumps({k: plan[k] for k in keys}))
    cost = next(iter(sim_auto._STAGE_COSTS.values()))
    graph = cost.graph
    params = sum(t.nbytes for t in graph.tensors if t.kind == "param")
    opt = sum(t.nbytes for t in graph.tensors if t.kind == "opt_state")
    state = (2 * params + opt) / gpus
    print(
        f"state: params {params / 1e9:.2f} GB, grads {params / 1e9:.2f} GB, optimizer "
        f"{opt / 1e9:.2f} GB; /{gpus} = {state / 1e9:.3f} GB = {state / GIB:.3f} GiB per "
        f"device vs HBM {hbm / GIB:.2f} GiB"
    )
    index = {name: i for i, name in enumerate(graph.layers)}
    for st in plan["stages"]:
        a, b = index[st["layers"][0]], index[st["layers"][1]] + 1
        logical, k = tuple(st["logical_mesh_dp_tp"]), st["microbatches_in_flight"]
        terms = []
        for mode in RECOMPUTE_MODES:
            c = cost.range_cost(a, b, logical, mode)
            terms.append(
                f"{mode}: state {c.param_bytes / GIB:.2f} + {k} x act "
                f"{c.activation_bytes / GIB:.3f} + work {c.working_bytes / GIB:.3f} = "
                f"{c.memory_bytes(k) / GIB:.2f} GiB"
            )
        lean = min(
            (cost.range_cost(a, b, lg, mode).memory_bytes(k), lg, mode)
            for lg in _logical_views(st["submesh"])
            for mode in RECOMPUTE_MODES
            if math.isfinite(cost.range_cost(a, b, lg, mode).latency_s)
        )
        print(
            f"stage {st['layers']} {st['submesh']} {logical} chosen {st['recompute']} peak "
            f"{st['peak_bytes'] / GIB:.2f} GiB | "
            + " | ".join(terms)
            + f" | leanest {lean[0] / GIB:.2f} GiB on {lean[1]} {lean[2]}"
        )
    try:
        optimal_stage_plan(
            len(graph.layers), cluster.num_nodes, cluster.devices_per_node, cost,
            plan["num_microbatches"], memory_budget_bytes=hbm, recompute_modes=RECOMPUTE_MODES,
        )  # fmt: skip
        print("fits the budget")
    except ValueError as err:
        print("budgeted DP:", err)


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "moe-70b"
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    for optimizer in sys.argv[3:] or ("adafactor", "adamw"):
        report(model, gpus, optimizer)
        sys.stdout.flush()
