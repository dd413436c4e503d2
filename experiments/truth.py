"""Truth: predicted vs compiled communication bytes per mesh axis and peak memory per device.

On 8 fake CPU devices, for the ILP's plan and every baseline (dp, zero2, zero3,
megatron): ``plan_workload(...)`` then ``bound.verify()`` compiles the step with XLA and
reads back its collectives and its memory. Models: gpt-tiny (meshes 8 and 2x4; full run
also 4x2 and 1x8) and mid-size GPTs at their real width with 2 blocks, batch 8 (gpt-350m
on 8, full run also on 2x4 and gpt-1.3b on 8); further model families join when
``autoshard.models.model_names()`` lists them (``EXTRA_FAMILIES``: moe-tiny and
wresnet-tiny on 8). One point per (model, mesh, plan, mesh axes) for
bytes, one per plan for memory; a baseline that refuses (it cannot mean its name for that
model and mesh) is a row marked ``refused`` with the reason, counted apart.

The third panel is XLA:GPU's: the committed runs of ``benchmarks/gpu_truth.py`` (plan files
compiled ahead of time for 8 to 512 H100s on one lent GPU, ``GPU_RESULTS``), read from
their JSON; no GPU is needed to draw it.

    python experiments/truth.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import figure

NAME = "truth"
TITLE = "Truth: predicted vs compiled collectives and memory"
SOURCE = "compiled"
FIGURE = 5

PLANS = ("auto", "dp", "zero2", "zero3", "megatron")
# XLA:GPU runs, oldest first (a later row of the same name replaces an earlier one); a
# "_reread" file beside a run holds that run's HLO read again by a newer verifier
GPU_RESULTS = (
    "benchmarks/results/gpu_truth_h100_2026-11-27.json",
    "benchmarks/results/gpu_truth_scale_h100_2026-11-27.json",
)
MID = {"num_layers": 2, "batch_size": 8}
QUICK_CASES = (("gpt-tiny", {}, ("8", "2x4")), ("gpt-350m", MID, ("8",)))
FULL_CASES = (
    ("gpt-tiny", {}, ("8", "2x4", "4x2", "1x8")),
    ("gpt-350m", MID, ("8", "2x4")),
    ("gpt-1.3b", MID, ("8",)),
)
# the smallest preset of each family joins when it exists, with these sizes; moe-tiny keeps
# its own batch (16: 8 expert groups, one per device), since at batch 8 its 4 groups cannot
# be split over 8 data-parallel devices and the dp baseline refuses (a row marked refused)
EXTRA_FAMILIES = {"moe-": {}, "wresnet-": {"batch_size": 8}}


def _cases(quick: bool):
    from autoshard.models import model_names

    cases = list(QUICK_CASES if quick else FULL_CASES)
    names = model_names()
    for prefix, overrides in EXTRA_FAMILIES.items():
        family = [n for n in names if n.startswith(prefix)]
        if family:
            cases.append((family[0], overrides, ("8",)))
    return cases


def measure(model: str, overrides: dict, mesh: str, plan: str, options) -> dict:
    """One row: the plan's predicted and compiled bytes per mesh axes and peak memory, or,
    where a baseline cannot mean its name for this model and mesh
    (:class:`~autoshard.intra.baselines.tables.BaselineRefusedError`), the row marked refused
    with the planner's reason."""
    import autoshard
    from autoshard.intra.baselines.tables import BaselineRefusedError

    label = model + "".join(f" {k}={v}" for k, v in overrides.items())
    t0 = time.perf_counter()
    try:
        bound = autoshard.plan_workload(
            model, mesh, baseline=None if plan == "auto" else plan, options=options, **overrides
        )
    except BaselineRefusedError as err:
        return {"model": label, "mesh": mesh, "plan": plan, "refused": str(err),
                "seconds": time.perf_counter() - t0}  # fmt: skip
    report = bound.verify()
    by_axes = {}
    for r in report.comparison.rows:
        axes = ",".join(r.axes) or "?"
        pred, comp = by_axes.get(axes, (0, 0))
        by_axes[axes] = (pred + r.predicted_bytes, comp + r.compiled_bytes)
    return {
        "model": label, "mesh": mesh, "plan": plan,
        "bytes_by_axes": {a: {"predicted": p, "compiled": c} for a, (p, c) in by_axes.items()},
        "collectives_agree": report.collectives_agree,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "compiled_peak_bytes": report.compiled_peak_bytes,
        "memory_agree": report.memory_agree,
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def run(quick: bool, progress) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import autoshard

    options = autoshard.IntraOptions(solver="highs", time_limit_s=60.0)
    todo = [(m, o, mesh, p) for m, o, meshes in _cases(quick) for mesh in meshes for p in PLANS]
    rows = []
    for i, (model, overrides, mesh, plan) in enumerate(todo):
        label = model + "".join(f" {k}={v}" for k, v in overrides.items())
        progress(i, len(todo), f"{label} on {mesh}: {plan}")
        rows.append(measure(model, overrides, mesh, plan, options))
    progress(len(todo), len(todo), "done")
    return {
        "config": {
            "devices": "8 fake CPU devices (XLA:CPU)",
            "solver": "highs, 60 s",
            "optimizer": "adamw",
            "bytes": "per device, summed over the step's collectives on those mesh axes",
        },
        "rows": rows,
        "summary": summary(rows),
        "xla_gpu": xla_gpu_rows(),
    }


def xla_gpu_rows(root: Path | None = None) -> dict:
    """The compiled rows of :data:`GPU_RESULTS`: name, plan, devices, predicted and
    compiled peak bytes, whether the collectives agree, and the files they came from.
    Where a re-read exists (``gpu_truth.py --reread``: the run's HLO read by a newer
    verifier and the plan files predicted by a newer memory model), its verdict and its
    prediction; the prediction stored when the plan was made is kept beside it."""
    root = root or Path(__file__).resolve().parent.parent
    rows, sources = {}, []
    for rel in GPU_RESULTS:
        path = root / rel
        if not path.exists():
            continue
        sources.append(rel)
        doc = json.loads(path.read_text())
        reread = path.with_name(path.stem + "_reread.json")
        again = {}
        if reread.exists():
            sources.append(str(reread.relative_to(root)))
            again = {r["name"]: r for r in json.loads(reread.read_text())["rows"]}
        for r in doc["rows"]:
            if r.get("status") != "compiled":
                continue
            later = again.get(r["name"], {})
            memory = later.get("memory") or {}  # re-predicted by the re-read's memory model
            rows[r["name"]] = {
                "name": r["name"],
                "plan": r["plan"],
                "target": r.get("target"),
                "predicted_peak_bytes": memory.get("predicted_peak_bytes")
                or r["predicted_peak_bytes"],
                "predicted_peak_bytes_when_planned": r["predicted_peak_bytes"],
                "compiled_peak_bytes": r["compiled_peak_bytes"],
                "collectives_agree": later.get("collectives_agree", r["collectives_agree"]),
                "date": doc.get("date"),
            }
    return {"sources": sources, "rows": list(rows.values())}


def summary(rows: list[dict]) -> dict:
    """Counts over the planned rows; ``refused``: the rows whose baseline refused."""

    def within(p, c, tol=0.10):
        return abs(p - c) <= tol * max(c, 1)

    refused = [r for r in rows if "refused" in r]
    rows = [r for r in rows if "refused" not in r]
    points = [(v["predicted"], v["compiled"]) for r in rows for v in r["bytes_by_axes"].values()]
    return {
        "plans": len(rows),
        "collectives_agree": sum(r["collectives_agree"] for r in rows),
        "memory_within_10_percent": sum(
            within(r["predicted_peak_bytes"], r["compiled_peak_bytes"]) for r in rows
        ),
        "byte_points": len(points),
        "byte_points_within_10_percent": sum(within(p, c) for p, c in points),
        "refused": len(refused),
    }


def byte_points(rows) -> list[tuple[str, float, float]]:
    """(plan, compiled MiB, predicted MiB) per (model, mesh, plan, mesh axes) with traffic."""
    return [
        (r["plan"], v["compiled"] / 2**20, v["predicted"] / 2**20)
        for r in rows
        for v in r.get("bytes_by_axes", {}).values()
        if v["compiled"] or v["predicted"]
    ]


def memory_points(rows) -> list[tuple[str, float, float]]:
    """(plan, compiled MiB, predicted MiB) of the peak memory per device, one per plan."""
    return [
        (r["plan"], r["compiled_peak_bytes"] / 2**20, r["predicted_peak_bytes"] / 2**20)
        for r in rows
        if "refused" not in r
    ]


def scatter_points(doc: dict) -> list[tuple[float, float]]:
    """Every (x, y) the figure plots."""
    rows = doc["data"]["rows"]
    points = byte_points(rows) + memory_points(rows) + gpu_points(gpu_rows(doc))
    return [(x, y) for _, x, y in points]


def gpu_rows(doc: dict) -> list[dict]:
    """The XLA:GPU rows of ``doc``; a JSON written before they were recorded: the
    committed runs."""
    return (doc["data"].get("xla_gpu") or xla_gpu_rows())["rows"]


def gpu_points(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(plan, XLA:GPU compiled GiB, predicted GiB) of the peak memory per plan file."""
    return [
        (r["plan"], r["compiled_peak_bytes"] / 2**30, r["predicted_peak_bytes"] / 2**30)
        for r in rows
    ]


def plot(doc: dict):
    rows = doc["data"]["rows"]
    fig, (a, b, g) = figure.plt.subplots(1, 3, figsize=(16, 4.8))
    figure.truth_scatter(
        a, byte_points(rows),
        xlabel="Compiled bytes per device (MiB)", ylabel="Predicted bytes per device (MiB)",
    )  # fmt: skip
    s = doc["data"]["summary"]
    zeros = sum(1 for _, x, y in byte_points(rows) if not (x > 0 and y > 0))
    hidden = f"\n({zeros} with a zero on one side: off the log axes)" if zeros else ""
    a.set_title(f"Collectives per (model, mesh, plan, mesh axes): "
                f"{s['byte_points_within_10_percent']}/{s['byte_points']} within 10%{hidden}",
                fontsize=8)  # fmt: skip
    figure.truth_scatter(
        b, memory_points(rows),
        xlabel="Compiled peak memory per device (MiB)",
        ylabel="Predicted peak memory per device (MiB)",
    )  # fmt: skip
    refused = f"; {s['refused']} refused" if s.get("refused") else ""
    b.set_title(f"Peak memory per plan: {s['memory_within_10_percent']}/{s['plans']} within 10%"
                f"{refused}", fontsize=8)  # fmt: skip
    gpu_panel(g, gpu_rows(doc))
    models = ", ".join(dict.fromkeys(r["model"] for r in rows))
    fig.suptitle(
        figure.title(doc, f"{TITLE}: 8 fake CPU devices ({models}); XLA:GPU, right"), fontsize=10
    )
    fig.tight_layout()
    return fig


def gpu_panel(ax, rows: list[dict]) -> None:
    """Peak memory per device on XLA:GPU (H100s, compiled ahead of time), predicted
    against compiled, one point per plan file; the title counts the collectives too."""
    figure.truth_scatter(
        ax,
        gpu_points(rows),
        xlabel="XLA:GPU compiled peak per device (GiB)",
        ylabel="Predicted peak per device (GiB)",
    )  # fmt: skip
    within = sum(
        abs(r["predicted_peak_bytes"] - r["compiled_peak_bytes"]) <= 0.10 * r["compiled_peak_bytes"]
        for r in rows
    )
    agree = sum(bool(r["collectives_agree"]) for r in rows)
    for r in rows:  # the rows out of the band, named
        x, y = r["compiled_peak_bytes"] / 2**30, r["predicted_peak_bytes"] / 2**30
        if abs(y - x) > 0.10 * x:
            ax.annotate(r["name"], (x, y), fontsize=6, xytext=(4, -8), textcoords="offset points")
    ax.set_title(
        f"XLA:GPU, H100s compiled ahead of time (8-512 GPUs), {len(rows)} plan files\n"
        "(re-read: this model's prediction of each plan file):\n"
        f"memory within 10% on {within}/{len(rows)}, collectives agree on {agree}/{len(rows)}",
        fontsize=8,
    )


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
