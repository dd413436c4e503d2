"""Planner scaling: the intra-op ILP's size and solve time vs layers, and the stage DP's
time vs devices, measured on this machine.

ILP: gpt-125m's shapes (batch 8) with 1, 2, 4, 8 transformer blocks (quick: 1, 2, 3) on
a 2x4 mesh, HiGHS with a 60 s limit and Alpa's elementwise merging, with and without identical-layer sharing
(``IntraOptions(share_layers=...)``: identical blocks take one strategy, so the program
stays the size of one block). Stage DP: Alpa's DP
(:func:`autoshard.inter.stages.optimal_stage_plan`) over gpt-2.6b's 34 layers (embedding,
32 blocks, head), 64 micro-batches, on 1 to 512 simulated GPUs (8 per host; quick: up to
64), with the FLOPs-only stage cost (:mod:`autoshard.inter.flops_cost`), so the time is the
DP's own and not the ILPs' behind it.

    python experiments/planner_scaling.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import sys
import time

import figure

NAME = "planner-scaling"
TITLE = "Planner scaling: ILP size and time vs layers, stage DP time vs GPUs"
SOURCE = "measured"
FIGURE = 6

ILP_MODEL, ILP_MESH, ILP_BATCH = "gpt-125m", "2x4", 8
DP_MODEL, DP_MICROBATCHES = "gpt-2.6b", 64


def run(quick: bool, progress) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import autoshard
    from autoshard.inter.flops_cost import flops_stage_cost, layer_stats
    from autoshard.inter.stages import optimal_stage_plan

    layers = (1, 2, 3) if quick else (1, 2, 4, 8)
    time_limit = 60.0
    gpus = (1, 2, 4, 8, 16, 32, 64) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    total, done = 2 * len(layers) + len(gpus), 0
    ilp = []
    for share in (True, False):
        for n in layers:
            progress(done, total, f"ILP {n} block(s), share_layers={share}")
            options = autoshard.IntraOptions(
                solver="highs", time_limit_s=time_limit, share_layers=share, merge_elementwise=True
            )
            t0 = time.perf_counter()
            bound = autoshard.plan_workload(
                ILP_MODEL, ILP_MESH, options=options, num_layers=n, batch_size=ILP_BATCH
            )
            wall = time.perf_counter() - t0
            s = bound.plan.solver
            ilp.append({
                "num_layers": n, "share_layers": share, "num_variables": s["num_variables"],
                "num_constraints": s["num_constraints"], "solve_seconds": s["seconds"],
                "build_seconds": s["build_seconds"], "status": s["status"], "gap": s["gap"],
                "plan_seconds": wall, "objective": s["objective"],
            })  # fmt: skip
            done += 1
    traced = autoshard.trace_workload(DP_MODEL, batch_size=1024 // DP_MICROBATCHES)
    cost = flops_stage_cost(layer_stats(traced.program.records))
    n_layers = len(traced.graph.layers)
    dp = []
    for g in gpus:
        progress(done, total, f"stage DP on {g} GPUs")
        hosts, per = (1, g) if g <= 8 else (g // 8, 8)
        t0 = time.perf_counter()
        plan = optimal_stage_plan(n_layers, hosts, per, cost, DP_MICROBATCHES)
        dp.append({
            "gpus": g, "hosts": hosts, "devices_per_host": per, "num_layers": n_layers,
            "seconds": time.perf_counter() - t0, "num_stages": len(plan.stages),
            "num_cost_calls": plan.num_cost_calls,
        })  # fmt: skip
        done += 1
    progress(total, total, "done")
    return {
        "config": {
            "ilp": {
                "model": ILP_MODEL,
                "mesh": ILP_MESH,
                "batch": ILP_BATCH,
                "solver": "highs",
                "time_limit_s": time_limit,
            },
            "stage_dp": {
                "model": DP_MODEL,
                "num_microbatches": DP_MICROBATCHES,
                "cost": "FLOPs-only (autoshard.inter.flops_cost)",
            },
        },  # fmt: skip
        "ilp": ilp,
        "stage_dp": dp,
    }


def plot(doc: dict):
    data = doc["data"]
    fig, (a, b, c) = figure.plt.subplots(1, 3, figsize=(13, 3.8))
    for share, style in ((True, "o-"), (False, "s--")):
        rows = [r for r in data["ilp"] if r["share_layers"] == share]
        label = "identical layers shared" if share else "no sharing"
        xs = [r["num_layers"] for r in rows]
        a.plot(xs, [r["num_variables"] for r in rows], style, label=label, gid=f"vars|{share}")
        b.plot(xs, [r["solve_seconds"] for r in rows], style, label=label, gid=f"time|{share}")
        for r in rows:
            if r["status"] != "optimal":  # stopped at the time limit: say so on the point
                b.annotate(f"{r['status']}\ngap {r['gap']:.0%}", (r["num_layers"], r["solve_seconds"]),
                           fontsize=6, textcoords="offset points", xytext=(4, -12))  # fmt: skip
    for ax in (a, b):
        ax.set_xticks(sorted({r["num_layers"] for r in data["ilp"]}))
    a.set_xlabel("Transformer blocks")
    a.set_ylabel("ILP variables")
    a.set_title(f"{data['config']['ilp']['model']} on {data['config']['ilp']['mesh']}", fontsize=9)
    b.set_xlabel("Transformer blocks")
    b.set_ylabel("ILP solve time (s)")
    b.set_title(f"HiGHS, limit {data['config']['ilp']['time_limit_s']:.0f} s", fontsize=9)
    xs = [r["gpus"] for r in data["stage_dp"]]
    c.plot(xs, [r["seconds"] for r in data["stage_dp"]], "o-", color="black", gid="stage-dp")
    c.set_xscale("log", base=2)
    c.set_xticks(xs, [str(x) for x in xs])
    c.minorticks_off()
    c.set_yscale("log")
    c.set_xlabel("The number of GPUs (simulated)")
    c.set_ylabel("Stage DP time (s)")
    c.set_title(f"{data['config']['stage_dp']['model']}, "
                f"{data['stage_dp'][0]['num_layers']} layers", fontsize=9)  # fmt: skip
    for ax in (a, b):
        ax.legend(fontsize=7)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    load = doc.get("machine", {}).get("load_average_1m")
    fig.suptitle(figure.title(doc, f"{TITLE} (2-core machine, shared: load {load:.0f})"
                              if load else None))  # fmt: skip
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
