"""Intra-op ablation (Alpa's setting): the ILP vs data parallel vs ZeRO-2 vs ZeRO-3 vs
the "shard the largest dimension" heuristic.

GPT with batch 8, sequence 1024, 8 layers, vocabulary 25600 and hidden 2048 / 3072 /
4096 / 5760 on 1 / 2 / 4 / 8 GPUs of ``alpa-v100`` (one node: one mesh axis over the
GPUs; quick: the first two sizes), bf16 compute with f32 master weights and AdamW.
Each method is a :func:`autoshard.plan_workload` plan priced in seconds on the preset
(``cluster=``): the ILP under the device's HBM as its memory budget (a budget it cannot
meet, or no plan within the time limit, is a cross), the baselines pinned by their rule
tables with no budget (a cross where their predicted peak exceeds the HBM); the
heuristic baseline also splits the largest dim of every operator's output
(``baseline="heuristic"``, :mod:`autoshard.intra.baselines.tables`).
Throughput: model FLOPs over the plan's predicted step time (the ILP objective: compute
plus communication). Then every plan that fits is compiled by XLA on as many fake CPU
devices (``bound.verify()``): compiled peak memory and collective bytes per device beside
the predictions, in the JSON and the right-hand panels.

    python experiments/intra_ablation.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import sys
import time

import figure

NAME = "intra-ablation"
TITLE = "Intra-op ablation: ILP vs data parallel vs ZeRO-2 vs ZeRO-3 vs heuristic"
SOURCE = "simulated"  # throughput on the preset; memory and bytes also compiled
FIGURE = 2

SIZES = ((2048, 1), (3072, 2), (4096, 4), (5760, 8))  # (hidden, GPUs)
SHAPE = dict(num_layers=8, vocab_size=25600, batch_size=8, seq_len=1024, dtype="bfloat16")
BASE_PRESET = "gpt-1.3b"  # 32 heads: every hidden above divides
METHODS = ("ilp", "dp", "zero2", "zero3", "heuristic")
LABELS = {
    "ilp": "ILP (autoshard)",
    "dp": "Data parallel",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "heuristic": "Heuristic (largest dim)",
}
CLUSTER = "alpa-v100"
TIME_LIMIT_S = 120.0


def _plan(method: str, hidden: int, gpus: int):
    """(bound plan or None, why it failed)."""
    import autoshard
    from autoshard.intra.ilp import InfeasibleBudgetError, SolverTimeLimitError

    options = autoshard.IntraOptions(
        solver="highs", time_limit_s=TIME_LIMIT_S, merge_elementwise=True
    )
    if method != "ilp":
        options = options.replace(memory_budget_bytes=1e15)  # no budget: report the peak
    try:
        bound = autoshard.plan_workload(
            BASE_PRESET, str(gpus), baseline=None if method == "ilp" else method,
            options=options, cluster=CLUSTER, hidden=hidden, **SHAPE,
        )  # fmt: skip
    except (InfeasibleBudgetError, SolverTimeLimitError) as err:
        return None, str(err).split("\n")[0]
    return bound, ""


def run(quick: bool, progress) -> dict:
    import jax

    sizes = SIZES[:2] if quick else SIZES
    jax.config.update("jax_num_cpu_devices", max(g for _, g in sizes))
    from autoshard.hardware.clusters import load_cluster
    from autoshard.sim import formulas

    rows, todo = [], [(h, g, m) for h, g in sizes for m in METHODS]
    for i, (hidden, gpus, method) in enumerate(todo):
        progress(i, len(todo), f"hidden {hidden} on {gpus}: {method}")
        hbm = load_cluster(CLUSTER, gpus).device.hbm_bytes
        flops = formulas.model_flops_per_step(
            SHAPE["batch_size"], SHAPE["seq_len"], SHAPE["num_layers"], hidden,
            SHAPE["vocab_size"],
        )  # fmt: skip
        t0 = time.perf_counter()
        bound, why = _plan(method, hidden, gpus)
        row = {"hidden": hidden, "gpus": gpus, "method": method, "hbm_bytes": hbm}
        if bound is None:
            rows.append(row | {"oom": True, "why": why, "pflops": None})
            continue
        plan = bound.plan
        oom = plan.predicted_peak_bytes > hbm
        row |= {
            "oom": oom,
            "why": "predicted peak over the HBM" if oom else "",
            "step_time_s": plan.objective,
            "pflops": flops / plan.objective / 1e15,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_collective_bytes": sum(c.bytes for c in plan.predicted_collectives),
            "solver_status": plan.solver.get("status"),
            "plan_seconds": time.perf_counter() - t0,
        }
        if not oom:  # the same plan, compiled by XLA on fake CPU devices
            report = bound.verify(devices=jax.devices()[:gpus])
            row |= {
                "compiled_peak_bytes": report.compiled_peak_bytes,
                "compiled_collective_bytes": sum(r.compiled_bytes for r in report.comparison.rows),
                "collectives_agree": report.collectives_agree,
            }
        rows.append(row)
    progress(len(todo), len(todo), "done")
    return {
        "config": {
            "cluster": CLUSTER,
            "model": f"{BASE_PRESET} shapes with overrides",
            **SHAPE,
            "optimizer": "adamw",
            "ilp_time_limit_s": TIME_LIMIT_S,
            "merge_elementwise": True,
            "mesh": "one axis over the GPUs",
            "throughput": "model FLOPs per second (PFLOPS)",
        },  # fmt: skip
        "rows": rows,
    }


def panel_title(doc: dict) -> str:
    return f"Throughput on {doc['data']['config']['cluster']}"


def plot(doc: dict):
    rows = doc["data"]["rows"]
    groups = list(dict.fromkeys(str(r["gpus"]) for r in rows))
    hidden = {str(r["gpus"]): r["hidden"] for r in rows}
    by = {(r["method"], str(r["gpus"])): r for r in rows}
    fig, (a, b) = figure.plt.subplots(1, 2, figsize=(12, 4.2))
    figure.grouped_bars(
        a, groups, list(METHODS), {k: (r["pflops"], r["oom"]) for k, r in by.items()},
        labels=LABELS,
        xlabel="The number of GPUs (hidden: " + ", ".join(str(hidden[g]) for g in groups) + ")",
    )  # fmt: skip
    a.set_title(panel_title(doc), fontsize=9)
    # predicted and compiled peak memory per device, side by side, for the plans that fit
    width = 0.8 / (2 * len(METHODS))
    for i, m in enumerate(METHODS):
        for g, group in enumerate(groups):
            r = by.get((m, group))
            if not r or "compiled_peak_bytes" not in r:
                continue
            x = g - 0.4 + width * (2 * i + 0.5)
            c = figure.colour(m, i)
            b.bar(x, r["predicted_peak_bytes"] / 2**30, width, color=c, alpha=0.5,
                  gid=f"bar|predicted|{m}|{group}")  # fmt: skip
            b.bar(x + width, r["compiled_peak_bytes"] / 2**30, width, color=c,
                  gid=f"bar|compiled|{m}|{group}", label=LABELS[m] if g == 0 else None)  # fmt: skip
    b.axhline(rows[0]["hbm_bytes"] / 2**30, color="black", ls=":", lw=1, label="V100 HBM")
    b.set_xticks(range(len(groups)), groups)
    b.set_xlim(-0.5, len(groups) - 0.5)  # every group, even one with no plan that fits
    b.set_xlabel("The number of GPUs")
    b.set_ylabel("Peak memory per device (GiB)")
    b.set_title("Predicted (light) vs compiled by XLA:CPU (dark)", fontsize=9)
    b.legend(fontsize=7)
    b.grid(axis="y", alpha=0.3)
    fig.suptitle(figure.title(doc, TITLE + "; memory also compiled"))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
