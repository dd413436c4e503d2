"""End-to-end weak scaling (Alpa's main figure), simulated on cluster presets.

For each model family with a weak-scaling suite whose presets the simulator prices (GPT
today; the MoE and Wide-ResNet suites join when their presets exist), each cluster preset
and each point (model, GPUs): autoshard's full search (``simulate(plan="auto")``: intra-op
ILPs + stage DP), Megatron-LM (the best point of its TP x PP x DP x micro-batch grid,
full recompute), intra-op only (the same ILP costs, one stage on the whole mesh) and
inter-op only (the same stage DP, stages restricted to data-parallel logical meshes).
Throughput is model FLOPs per second (PFLOPS, recompute not counted), so methods that
recompute more are not credited for it; out of memory (the memory model against the
device's HBM) is a cross.

    python experiments/weak_scaling.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import math
import sys

import figure

NAME = "weak-scaling"
TITLE = "End-to-end weak scaling"
SOURCE = "simulated"
FIGURE = 1

# family -> [(model preset, GPUs)] (Alpa's suites, REFERENCE.md)
SUITES = {
    "gpt": [
        ("gpt-350m", 1), ("gpt-760m", 2), ("gpt-1.3b", 4), ("gpt-2.6b", 8),
        ("gpt-6.7b", 16), ("gpt-15b", 32), ("gpt-39b", 64),
    ],
    "moe": [
        ("moe-380m", 1), ("moe-690m", 2), ("moe-1.3b", 4), ("moe-2.4b", 8),
        ("moe-10b", 16), ("moe-27b", 32), ("moe-70b", 64),
    ],
    "wresnet": [
        ("wresnet-250m", 1), ("wresnet-500m", 2), ("wresnet-1b", 4), ("wresnet-2b", 8),
        ("wresnet-4b", 16), ("wresnet-6.8b", 32), ("wresnet-13b", 64),
    ],
}  # fmt: skip
CLUSTERS = ("alpa-v100", "dgx-a100", "dgx-h100")
METHODS = ("auto", "megatron", "intra-only", "inter-only")
LABELS = {
    "auto": "autoshard (full search)",
    "megatron": "Megatron-LM (best grid)",
    "intra-only": "Intra-op only",
    "inter-only": "Inter-op only (PP + DP)",
}
GLOBAL_BATCH = 1024
ILP_TIME_LIMIT_S = 20.0


def simulated_presets() -> set[str]:
    """The presets :func:`autoshard.sim.simulate.simulate` prices (looked up at run time,
    so new families join the figure when their presets land)."""
    from autoshard.models.gpt import GPT_PRESETS

    return set(GPT_PRESETS)


def _restricted_searches(report, cluster_name: str, gpus: int) -> dict:
    """Intra-op only and inter-op only, priced with the stage costs ``auto`` uses."""
    from autoshard.hardware.clusters import load_cluster
    from autoshard.inter.stages import RECOMPUTE_MODES, StageCost, optimal_stage_plan
    from autoshard.sim.auto import search_stage_cost

    plan = report.plan
    cluster = load_cluster(cluster_name, gpus)
    m = plan["num_microbatches"]
    cost = search_stage_cost(
        report.model, cluster, GLOBAL_BATCH, m, plan["dtype"], ILP_TIME_LIMIT_S, {}
    )
    n_layers = len(cost.graph.layers)
    hbm = cluster.device.hbm_bytes

    def data_parallel_only(start, end, submesh, logical, *mode):
        if logical[1] > 1:  # a tensor-parallel view: not inter-op only
            return StageCost(math.inf, 0.0, 0.0)
        return cost(start, end, submesh, logical, *mode)

    out = {}
    for method, stage_cost, stages in (
        ("intra-only", cost, 1),
        ("inter-only", data_parallel_only, None),
    ):
        kw = dict(num_stages=stages, recompute_modes=RECOMPUTE_MODES)
        args = (n_layers, cluster.num_nodes, cluster.devices_per_node, stage_cost, m)
        try:
            sp = optimal_stage_plan(*args, memory_budget_bytes=hbm, **kw)
            oom = False
        except ValueError as err:
            if "budget" not in str(err):
                raise
            sp = optimal_stage_plan(*args, **kw)  # the fastest, flagged out of memory
            oom = True
        peak = max(s.peak_bytes for s in sp.stages)
        out[method] = {
            "step_time_s": sp.objective_s,
            "oom": oom or peak > hbm,
            "peak_bytes_per_device": peak,
            "plan": {
                "stages": [
                    {
                        "layers": [s.start_layer, s.end_layer],
                        "submesh": list(s.submesh),
                        "logical_mesh_dp_tp": list(s.logical_mesh),
                        "recompute": s.recompute,
                    }
                    for s in sp.stages
                ],
                "num_microbatches": m,
            },
        }
    return out


def _model_pflops(report) -> float:
    """Model FLOP/s of a report, in PFLOPS (MFU x peak x GPUs)."""
    from autoshard.hardware.clusters import load_cluster

    cluster = load_cluster(report.cluster, report.gpus)
    peak = cluster.device.peak_flops_for(report.plan["dtype"])
    return report.mfu * peak * report.gpus / 1e15


def run(quick: bool, progress) -> dict:
    from autoshard.sim.simulate import simulate

    clusters = CLUSTERS[:1] if quick else CLUSTERS
    max_gpus = 16 if quick else 64
    known = simulated_presets()
    points = [
        (family, model, gpus)
        for family, suite in SUITES.items()
        for model, gpus in suite
        if gpus <= max_gpus
    ]
    todo = [(c, f, m, g) for c in clusters for f, m, g in points if m in known]
    skipped = sorted({f for f, m, _ in points if m not in known})
    rows = []
    for i, (cluster, family, model, gpus) in enumerate(todo):
        progress(i, len(todo), f"{cluster} {model} on {gpus}")
        common = dict(global_batch=GLOBAL_BATCH)
        mega = simulate(model, cluster, gpus, "megatron", recompute="full", **common)
        auto = simulate(model, cluster, gpus, "auto", ilp_time_limit_s=ILP_TIME_LIMIT_S, **common)
        flops_per_step = _model_pflops(auto) * auto.step_time_s  # model PFLOP per step
        rows.append(_row(cluster, family, model, gpus, "megatron", mega, _model_pflops(mega)))
        rows.append(_row(cluster, family, model, gpus, "auto", auto, _model_pflops(auto)))
        for method, r in _restricted_searches(auto, cluster, gpus).items():
            rows.append(
                {"cluster": cluster, "family": family, "model": model, "gpus": gpus,
                 "method": method, "pflops": flops_per_step / r["step_time_s"], **r}
            )  # fmt: skip
    progress(len(todo), len(todo), "done")
    return {
        "config": {
            "global_batch": GLOBAL_BATCH,
            "seq_len": 1024,
            "recompute": "megatron: full; searches: chosen per stage (none/selective/full)",
            "dtype": "the device's 16-bit type (fp16 on V100, bf16 on A100/H100)",
            "ilp_time_limit_s": ILP_TIME_LIMIT_S,
            "clusters": list(clusters),
            "max_gpus": max_gpus,
            "throughput": "model FLOPs per second (PFLOPS), recompute excluded",
        },
        "families_skipped": {
            f: "no presets the simulator prices yet (simulate() takes GPT presets)" for f in skipped
        },
        "rows": rows,
    }


def _row(cluster, family, model, gpus, method, report, pflops) -> dict:
    return {
        "cluster": cluster,
        "family": family,
        "model": model,
        "gpus": gpus,
        "method": method,
        "pflops": pflops,
        "step_time_s": report.step_time_s,
        "oom": bool(report.oom),
        "peak_bytes_per_device": report.peak_bytes_per_device,
        "plan": report.to_json()["plan"],
        "search_seconds": report.search_seconds,
    }


def panels(doc: dict) -> list[tuple[str, str]]:
    """(cluster, family) of each panel, in order."""
    seen = []
    for r in doc["data"]["rows"]:
        key = (r["cluster"], r["family"])
        if key not in seen:
            seen.append(key)
    return seen


def panel_data(doc: dict, cluster: str, family: str):
    """Groups (GPU counts as text), methods, {(method, gpus): row}, and the linear outline."""
    rows = [r for r in doc["data"]["rows"] if r["cluster"] == cluster and r["family"] == family]
    gpus = sorted({r["gpus"] for r in rows})
    by = {(r["method"], str(r["gpus"])): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    base = [by.get((m, str(gpus[0]))) for m in methods]
    base_pflops = max((r["pflops"] for r in base if r and not r["oom"]), default=None)
    linear = [None if base_pflops is None else base_pflops * g / gpus[0] for g in gpus]
    return [str(g) for g in gpus], methods, by, linear


def plot(doc: dict):
    keys = panels(doc)
    fig, axes = figure.plt.subplots(len(keys), 1, figsize=(8, 3.2 * len(keys)), squeeze=False)
    for ax, (cluster, family) in zip(axes[:, 0], keys, strict=True):
        groups, methods, by, linear = panel_data(doc, cluster, family)
        models = {r["gpus"]: r["model"] for r in doc["data"]["rows"] if r["family"] == family}
        figure.grouped_bars(
            ax, groups, methods,
            cells={k: (r["pflops"], r["oom"]) for k, r in by.items()},
            linear=linear, labels=LABELS,
            xlabel="The number of GPUs (model: " + ", ".join(
                models[int(g)].split("-", 1)[1] for g in groups) + ")",
        )  # fmt: skip
        ax.set_title(f"{family.upper()} on {cluster}", fontsize=9)
    fig.suptitle(figure.title(doc, "End-to-end weak scaling, throughput in model PFLOPS"))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
