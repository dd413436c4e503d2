"""Planning time per GPU count, stacked by phase, measured here, beside Alpa's reported cost.

For each point of Alpa's GPT weak-scaling suite (gpt-350m on 1 GPU ... gpt-39b on 64;
quick: up to 8): the full search of ``simulate(plan="auto")`` on ``alpa-v100`` (phases
as it times them: trace, the intra-op ILPs of every stage candidate -- strategies and
solve -- and the stage DP), then XLA's compile of the step on that many fake CPU devices
(the intra-op plan of the whole step, ``plan_workload`` + ``bound.verify()``, whose
compile time is XLA's alone; Alpa compiles one program per stage, so this is the
compile of a one-stage plan). Alpa's reported search cost (gpt-39b on 64 GPUs, about
2,400 s) and Aceso's report of Alpa on gpt-1.3b / 4 GPUs (4,092 s) are drawn beside, as
reported, not measured. The machine was shared: the record keeps the load average.

    python experiments/planning_time.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import sys

import figure

NAME = "planning-time"
TITLE = "Planning time by phase"
SOURCE = "measured"
FIGURE = 4

SUITE = (
    ("gpt-350m", 1), ("gpt-760m", 2), ("gpt-1.3b", 4), ("gpt-2.6b", 8),
    ("gpt-6.7b", 16), ("gpt-15b", 32), ("gpt-39b", 64),
)  # fmt: skip
PHASES = ("trace", "intra-op ILPs (strategies + solve)", "stage DP", "XLA compile")
# REFERENCE.md: Alpa (OSDI'22) for gpt-39b on 64 GPUs; Aceso's measurement of Alpa on 4
REPORTED = {64: ("Alpa, reported (gpt-39b)", 2400.0), 4: ("Alpa per Aceso (gpt-1.3b)", 4092.0)}
CLUSTER = "alpa-v100"


def _mesh(gpus: int) -> str:
    return str(gpus) if gpus <= 8 else f"{gpus // 8}x8"


def measure_point(model: str, gpus: int, progress=lambda *a: None) -> dict:
    """The phases of one point (needs ``gpus`` fake CPU devices set up before jax starts)."""
    import jax

    import autoshard
    from autoshard.sim.simulate import simulate

    progress(f"{model} on {gpus}: search")
    report = simulate(model, CLUSTER, gpus, "auto", global_batch=1024)
    phases = report.plan["phase_seconds"]
    progress(f"{model} on {gpus}: XLA compile")
    options = autoshard.IntraOptions(solver="highs", time_limit_s=60.0)
    bound = autoshard.plan_workload(model, _mesh(gpus), options=options, batch_size=2 * gpus)
    verified = bound.verify(devices=jax.devices()[:gpus])
    return {
        "model": model, "gpus": gpus, "mesh": _mesh(gpus),
        "phase_seconds": {
            PHASES[0]: phases["trace"], PHASES[1]: phases["intra_op_ilps"],
            PHASES[2]: phases["stage_dp"], PHASES[3]: verified.compile_seconds,
        },
        "search_seconds": report.search_seconds,
        "num_ilps": report.plan["num_ilps"],
        "compile_batch": 2 * gpus,
    }  # fmt: skip


def run(quick: bool, progress) -> dict:
    import jax

    points = [p for p in SUITE if p[1] <= (8 if quick else 64)]
    jax.config.update("jax_num_cpu_devices", max(g for _, g in points))
    rows = []
    for i, (model, gpus) in enumerate(points):
        rows.append(measure_point(model, gpus, lambda text, i=i: progress(i, len(points), text)))
    progress(len(points), len(points), "done")
    return {
        "config": {
            "cluster": CLUSTER,
            "global_batch": 1024,
            "compile": "the whole step's intra-op plan on as many fake CPU devices (XLA:CPU), "
            "batch 2 per device",
        },
        "rows": rows,
        "reported": {str(g): {"label": lbl, "seconds": s} for g, (lbl, s) in REPORTED.items()},
    }


def plot(doc: dict):
    rows = doc["data"]["rows"]
    groups = [str(r["gpus"]) for r in rows]
    by = {str(r["gpus"]): r for r in rows}
    fig, ax = figure.plt.subplots(figsize=(8, 4.2))
    figure.stacked_bars(
        ax, groups, PHASES, {(p, g): by[g]["phase_seconds"][p] for g in groups for p in PHASES},
        ylabel="Planning time (s)",
        xlabel="The number of GPUs (model: " + ", ".join(r["model"][4:] for r in rows) + ")",
    )  # fmt: skip
    for g, ref in doc["data"]["reported"].items():
        if g in by:
            x = groups.index(g) + 0.42
            ax.bar(x, ref["seconds"], 0.2, fill=False, hatch="//", edgecolor="black",
                   gid=f"bar|reported|{g}")  # fmt: skip
            ax.annotate(f"{ref['label']}: {ref['seconds']:,.0f} s", (x, ref["seconds"]),
                        fontsize=7, ha="right", xytext=(0, 3), textcoords="offset points")  # fmt: skip
    ax.set_yscale("log")
    smallest = min(s for r in rows for s in r["phase_seconds"].values() if s > 0)
    tallest = max(
        [sum(r["phase_seconds"].values()) for r in rows]
        + [ref["seconds"] for g, ref in doc["data"]["reported"].items() if g in by]
    )
    ax.set_ylim(smallest / 3, tallest * 40)  # every first phase visible, room for the labels
    ax.legend(fontsize=7, ncol=2, loc="upper left")  # above the reported bars' labels
    ax.set_title(f"autoshard's search on {doc['data']['config']['cluster']} + XLA compile; "
                 "hatched: reported, not measured", fontsize=8)  # fmt: skip
    load = doc.get("machine", {}).get("load_average_1m")
    fig.suptitle(figure.title(doc, f"{TITLE} (2-core machine, shared: load {load:.0f})"
                              if load else None))  # fmt: skip
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
