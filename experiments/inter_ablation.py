"""Inter-op ablation: Alpa's stage DP vs equal-layer vs equal-FLOPs stages, simulated.

GPT on Alpa's V100 cluster preset (``alpa-v100``): gpt-6.7b on 16 GPUs and gpt-2.6b on 8
(quick: gpt-2.6b only), global batch 1024, 64 micro-batches, recompute chosen per stage.
All three methods use the same stage costs (intra-op ILPs on each sub-mesh,
:func:`autoshard.sim.auto.search_stage_cost`) and the same memory budget (the device's
HBM); the equal methods try every stage count whose equal sub-meshes tile the cluster and
keep the fastest (each stage on its fastest logical mesh). Throughput: model PFLOPS.

    python experiments/inter_ablation.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import sys

import figure

NAME = "inter-ablation"
TITLE = "Inter-op ablation: stage DP vs equal-layer vs equal-FLOPs"
SOURCE = "simulated"
FIGURE = 3

POINTS = (("gpt-2.6b", 8), ("gpt-6.7b", 16))
CLUSTER = "alpa-v100"
METHODS = ("auto", "equal-layer", "equal-flops")
LABELS = {
    "auto": "Stage DP (autoshard)",
    "equal-layer": "Equal layer",
    "equal-flops": "Equal FLOPs",
}
GLOBAL_BATCH, MICROBATCHES, ILP_TIME_LIMIT_S = 1024, 64, 20.0


def _best(graph, cluster, options, cost, model):
    """search_stages under the HBM budget; (plan, oom) -- the unbudgeted one if none fits."""
    import dataclasses

    from autoshard.inter.search import search_stages

    budget = cluster.device.hbm_bytes
    args = (graph, cluster.num_nodes, cluster.devices_per_node)
    try:
        plan = search_stages(
            *args, dataclasses.replace(options, memory_budget_bytes=budget), cost=cost, model=model
        )
        return plan, False
    except ValueError as err:
        if "budget" not in str(err) and "fits" not in str(err):
            raise
    return search_stages(*args, options, cost=cost, model=model), True


def run(quick: bool, progress) -> dict:
    from autoshard.hardware.clusters import load_cluster
    from autoshard.inter.options import StageSearchOptions
    from autoshard.inter.stages import RECOMPUTE_MODES
    from autoshard.sim import formulas
    from autoshard.sim.auto import search_stage_cost
    from autoshard.sim.simulate import gpt_shape

    points = POINTS[:1] if quick else POINTS
    rows = []
    for i, (model, gpus) in enumerate(points):
        progress(i, len(points), f"{model} on {gpus}")
        cluster = load_cluster(CLUSTER, gpus)
        dtype = cluster.device.default_dtype
        cost = search_stage_cost(model, cluster, GLOBAL_BATCH, MICROBATCHES, dtype,
                                 ILP_TIME_LIMIT_S, {})  # fmt: skip
        shape, _ = gpt_shape(model)
        flops = formulas.model_flops_per_step(
            GLOBAL_BATCH, shape.seq_len, shape.layers, shape.hidden, shape.vocab
        )
        n_layers = len(cost.graph.layers)
        for method in METHODS:
            counts = [None] if method == "auto" else range(1, min(gpus, n_layers) + 1)
            best = None
            for k in counts:
                options = StageSearchOptions(
                    MICROBATCHES, stages=method, num_stages=k, recompute_modes=RECOMPUTE_MODES
                )
                try:
                    plan, oom = _best(cost.graph, cluster, options, cost, model)
                except ValueError as err:
                    if "cannot be split" in str(err):  # equal sub-meshes do not tile
                        continue
                    raise
                key = (oom, plan.objective_s)
                if best is None or key < best[0]:
                    best = (key, plan, oom)
            _, plan, oom = best
            rows.append({
                "model": model, "gpus": gpus, "method": method, "oom": oom,
                "step_time_s": plan.objective_s,
                "pflops": flops / plan.objective_s / 1e15,
                "num_stages": len(plan.stages),
                "stages": [
                    {"layers": [s.start_layer, s.end_layer], "submesh": list(s.submesh),
                     "logical_mesh_dp_tp": list(s.logical_mesh), "recompute": s.recompute,
                     "latency_s": s.latency_s}
                    for s in plan.stages
                ],
            })  # fmt: skip
    progress(len(points), len(points), "done")
    return {
        "config": {
            "cluster": CLUSTER,
            "global_batch": GLOBAL_BATCH,
            "num_microbatches": MICROBATCHES,
            "ilp_time_limit_s": ILP_TIME_LIMIT_S,
            "throughput": "model FLOPs per second (PFLOPS)",
        },
        "rows": rows,
    }


def panel_title(doc: dict) -> str:
    return f"GPT on {doc['data']['config']['cluster']}"


def plot(doc: dict):
    rows = doc["data"]["rows"]
    groups = [f"{r['gpus']}" for r in rows if r["method"] == "auto"]
    models = [r["model"] for r in rows if r["method"] == "auto"]
    by = {(r["method"], str(r["gpus"])): r for r in rows}
    fig, ax = figure.plt.subplots(figsize=(6, 3.6))
    figure.grouped_bars(
        ax, groups, list(METHODS),
        cells={k: (r["pflops"], r["oom"]) for k, r in by.items()},
        labels=LABELS,
        xlabel="The number of GPUs (model: " + ", ".join(models) + ")",
    )  # fmt: skip
    ax.set_title(panel_title(doc), fontsize=9)
    fig.suptitle(figure.title(doc))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
