"""Offload on 16 GB V100s: the out-of-memory points of figures 1 and 2 with state in host memory.

The points are ``benchmarks/offload_v100.py``'s: the intra-op ablation's out-of-memory
points whose method takes offload (the ILP's 1-GPU point, where it finds no plan: GPT,
hidden 2048, batch 8, bf16 + f32 masters, AdamW; and the ZeRO-2 / ZeRO-3 baselines'
points; ``plan_workload(..., offload=...)``) and the V100 weak-scaling rows drawn as
crosses (gpt-39b intra-only on 64 GPUs; moe-27b / moe-70b expert-zero2 on 32 / 64; the
same restricted stage search with every stage under the placement). A bar per placement
(none, optimizer, + master weights, + gradients = the host update; one colour each): the
throughput in model PFLOPS where the plan fits the 16 GiB HBM and the node's host RAM, a
cross where it does not (single-point panels: annotated with the least HBM any layout
needs, or the host bytes over the RAM); a star on the fastest that fits (what
``--offload auto`` takes); a dashed line at the out-of-memory figure's own throughput for
the point (its plan priced as if the HBM were unlimited). A panel per point, the ZeRO
baselines' points grouped in a panel per baseline.

    python experiments/offload.py [--quick] [--out docs/figures]   # quick: the ablation point
    python experiments/offload.py --from-bench benchmarks/results/offload_v100.json \\
        [--out docs/figures]   # the figure from a benchmark run, not rerun
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import figure

NAME = "offload"
TITLE = "Offload on 16 GB V100s: out-of-memory points with state in host memory"
SOURCE = "simulated"
FIGURE = 9

BENCH = figure.ROOT / "benchmarks" / "offload_v100.py"
GIB = 2**30
HBM_GIB = 16.0
PLACEMENTS = ("none", "optimizer", "optimizer,master", "optimizer,master,gradients")
TICKS = {
    "none": "none",
    "optimizer": "optimizer",
    "optimizer,master": "+ master\nweights",
    "optimizer,master,gradients": "+ gradients\n(host update)",
}
COLOURS = {p: figure.colour(p, i) for i, p in enumerate(PLACEMENTS)}  # one per placement
UNTICK = {v: k for k, v in TICKS.items()}
# point -> (its title, the figure it comes from, how to find its out-of-memory row there)
POINTS = {
    "ablation": ("Intra-op ablation, 1 GPU\n(GPT h2048, ILP, AdamW)", "intra-ablation",
                 {"gpus": 1, "hidden": 2048}),
    **{f"ablation:{m}:{g}": (f"{g} GPU{'s' if g > 1 else ''}\nh{h}", "intra-ablation",
                             {"gpus": g, "hidden": h, "method": m})
       for m, sizes in (("zero2", ((2048, 1), (3072, 2), (4096, 4), (5760, 8))),
                        ("zero3", ((2048, 1), (3072, 2))))
       for h, g in sizes},
    "weak:moe-27b:expert-zero2": ("Weak scaling, moe-27b, 32 GPUs\n(expert-zero2, Adafactor)",
                                  "weak-scaling", {"cluster": "alpa-v100", "model": "moe-27b",
                                                   "method": "expert-zero2"}),
    "weak:moe-70b:expert-zero2": ("Weak scaling, moe-70b, 64 GPUs\n(expert-zero2, Adafactor)",
                                  "weak-scaling", {"cluster": "alpa-v100", "model": "moe-70b",
                                                   "method": "expert-zero2"}),
    "weak:gpt-39b:intra-only": ("Weak scaling, gpt-39b, 64 GPUs\n(intra-only, AdamW)",
                                "weak-scaling", {"cluster": "alpa-v100", "model": "gpt-39b",
                                                 "method": "intra-only"}),
}  # fmt: skip
# the panels, in order: (title, points); one point: a bar per placement; several: a group
# per point, a bar per placement (the ZeRO baselines' out-of-memory points)
PANELS = (
    (None, ("ablation",)),
    ("Intra-op ablation: ZeRO-2 (AdamW)", tuple(p for p in POINTS if ":zero2:" in p)),
    ("Intra-op ablation: ZeRO-3 (AdamW)", tuple(p for p in POINTS if ":zero3:" in p)),
    (None, ("weak:moe-27b:expert-zero2",)),
    (None, ("weak:moe-70b:expert-zero2",)),
    (None, ("weak:gpt-39b:intra-only",)),
)


def bench():
    """``benchmarks/offload_v100.py`` as a module (its points and measuring functions)."""
    spec = importlib.util.spec_from_file_location("offload_v100", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(point: str) -> dict:
    """The out-of-memory figure's own throughput for ``point``: its fastest out-of-memory
    row there (``docs/figures/<figure>.json``), priced as if the HBM were unlimited."""
    _, name, match = POINTS[point]
    doc = json.loads((figure.ROOT / "docs" / "figures" / f"{name}.json").read_text())
    rows = [r for r in doc["data"]["rows"] if all(r.get(k) == v for k, v in match.items())]
    rows = [r for r in rows if r.get("oom") and r.get("pflops")]
    if not rows:
        raise ValueError(f"docs/figures/{name}.json has no out-of-memory row with {match}")
    best = max(rows, key=lambda r: r["pflops"])
    return {"figure": name, "method": best["method"], "pflops": best["pflops"],
            "step_time_s": best["step_time_s"]}  # fmt: skip


def cell(row: dict) -> dict:
    """One bar or cross of the figure from a benchmark row."""
    fits = bool(row["fits"])
    peak = row.get("peak_bytes", row.get("least_peak_bytes"))
    leanest = row.get("leanest_bytes", row.get("least_peak_bytes", peak))
    return {
        "offload": row["offload"],
        "fits": fits,
        "pflops": row.get("pflops") if fits else None,
        "step_time_s": row.get("step_time_s") if fits else None,
        "hbm_peak_gib": peak / GIB,
        "least_hbm_gib": leanest / GIB,  # the least any layout / recompute mode needs
        "host_gib_per_node": row.get("host_bytes_per_node", 0.0) / GIB,
        "fits_host": row.get("fits_host", True),
        "commit": row.get("commit"),
        "load": row.get("load"),
    }


def build(bench_rows: list[dict]) -> dict:
    """The figure's data: per point, a cell per placement (rows of other placements and
    ``auto`` left out: ``auto`` is the fastest cell that fits, marked with a star)."""
    points = []
    for point, (title, _, _) in POINTS.items():
        rows = {r["offload"]: r for r in bench_rows if r["point"] == point}
        missing = [p for p in PLACEMENTS if p not in rows]
        if missing:
            raise ValueError(f"the benchmark JSON has no {point} row for {missing}: run "
                             f"python benchmarks/offload_v100.py {point}")  # fmt: skip
        cells = [cell(rows[p]) for p in PLACEMENTS]
        fitting = [c for c in cells if c["fits"]]
        best = max(fitting, key=lambda c: c["pflops"])["offload"] if fitting else None
        points.append({"point": point, "title": title, "cells": cells, "fastest_fit": best,
                       "reference": reference(point)})  # fmt: skip
    return {
        "config": {
            "cluster": "alpa-v100 (16 GiB HBM per GPU, 488 GiB RAM per node, 90% usable)",
            "points": "benchmarks/offload_v100.py (ablation: plan_workload one mesh, the ILP "
            "or the ZeRO baseline's rule table; weak: experiments/weak_scaling.py's "
            "restricted stage search, every stage offloaded)",
        },
        "hbm_gib": HBM_GIB,
        "points": points,
        "panels": [{"title": t, "points": list(names)} for t, names in PANELS],
    }


def run(quick: bool, progress) -> dict:
    """Rerun the benchmark's points (quick: the ablation point only) and build the data."""
    b = bench()
    names = ["ablation"] if quick else list(POINTS)
    rows = []
    for i, name in enumerate(names):
        progress(i, len(names), name)
        rows += b.ablation_point(name) if name in b.ABLATION_POINTS else b.weak_point(name)
    progress(len(names), len(names), "done")
    if quick:  # the weak points from the committed benchmark JSON, said in the data
        done = {r["point"] for r in rows}
        committed = json.loads((figure.ROOT / "benchmarks/results/offload_v100.json").read_text())
        rows += [r for r in committed["rows"] if r["point"] not in done]
    data = build(rows)
    data["measured"] = {"by": "benchmarks/offload_v100.py's functions, rerun" + (
        " (quick: the ILP's ablation point; the other points read from the committed "
        "benchmarks/results/offload_v100.json)" if quick else "")}  # fmt: skip
    return data


def from_bench(doc: dict, path: str) -> dict:
    """The figure's data from an ``offload_v100.py`` JSON (the same rows, not rerun)."""
    data = build(doc["rows"])
    data["measured"] = {"by": f"benchmarks/offload_v100.py, read from {path} (not rerun); "
                        "each cell carries its row's commit and load"}  # fmt: skip
    return data


# ------------------------------------------------------------------------------ the plot


def _panel(ax, p: dict, hbm_gib: float) -> None:
    groups = [TICKS[c["offload"]] for c in p["cells"]]
    cells = {("offload", TICKS[c["offload"]]): (c["pflops"], not c["fits"]) for c in p["cells"]}
    # "_": no legend entry for the bars (the y axis says what they are)
    figure.grouped_bars(ax, groups, ["offload"], cells, labels={"offload": "_fits"},
                        xlabel="In host memory")  # fmt: skip
    for artist in [*ax.patches, *ax.lines]:  # each placement in its colour, as in every panel
        gid = artist.get_gid() or ""
        if gid.startswith(("bar|offload|", "oom|offload|")):
            artist.set_color(COLOURS[UNTICK[gid.split("|", 2)[2]]])
    ref = p["reference"]
    top = max([ref["pflops"], *[c["pflops"] or 0.0 for c in p["cells"]]])
    ax.axhline(ref["pflops"], color="black", ls="--", lw=1, gid=f"reference|{p['point']}",
               label=f"{ref['figure']}'s OOM plan ({ref['method']}), HBM unlimited")  # fmt: skip
    crosses = {ln.get_gid(): ln.get_ydata()[0] for ln in ax.lines if ln.get_gid()}
    for g, c in enumerate(p["cells"]):
        if c["fits"]:  # inside the bar, at its top
            ax.annotate(f"{c['step_time_s']:.3g} s\n{c['hbm_peak_gib']:.1f} GiB HBM\n"
                        f"{c['host_gib_per_node']:.0f} GiB host\nper node", (g, c["pflops"]),
                        fontsize=6, ha="center", va="top", xytext=(0, -3), color="white",
                        textcoords="offset points")  # fmt: skip
        else:  # above the cross
            text = (f"host {c['host_gib_per_node']:.0f} GiB\nper node > RAM" if not c["fits_host"]
                    else f"needs {c['least_hbm_gib']:.1f}\nGiB HBM")  # fmt: skip
            ax.annotate(text, (g, crosses[f"oom|offload|{TICKS[c['offload']]}"]), fontsize=6,
                        ha="center", va="bottom", xytext=(0, 7), textcoords="offset points")  # fmt: skip
        if c["offload"] == p["fastest_fit"]:  # a white star near the bar's foot
            ax.plot([g], [c["pflops"] * 0.12], marker="*", ms=13, mfc="white", mec="black",
                    linestyle="none", gid=f"fastest|{p['point']}|{c['offload']}",
                    label="fastest that fits (--offload auto)")  # fmt: skip
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, 1.9 * top)
    handles, texts = ax.get_legend_handles_labels()
    ax.legend(handles, texts, fontsize=6, loc="upper left")
    ax.set_title(p["title"], fontsize=9)
    if p["fastest_fit"] is None:
        ax.text(0.5, 0.62, "no placement fits", transform=ax.transAxes, ha="center", fontsize=8)


def _up(ax, points: float):
    """A transform offset ``points`` upwards (a mark just above a bar's top)."""
    from matplotlib.transforms import ScaledTranslation

    return ScaledTranslation(0, points / 72, ax.figure.dpi_scale_trans)


def _group_panel(ax, title: str, points: list[dict]) -> None:
    """Several points of one method: a group per point, a bar per placement."""
    groups = [p["title"] for p in points]
    cells = {(c["offload"], p["title"]): (c["pflops"], not c["fits"])
             for p in points for c in p["cells"]}  # fmt: skip
    labels = {k: v.replace("\n", " ") for k, v in TICKS.items()}
    figure.grouped_bars(ax, groups, PLACEMENTS, cells, labels=labels, xlabel="")
    width = 0.8 / len(PLACEMENTS)
    starred = False  # one legend entry for the stars
    for g, p in enumerate(points):
        ref = p["reference"]["pflops"]
        ax.hlines(ref, g - 0.42, g + 0.42, color="black", ls="--", lw=1,
                  gid=f"reference|{p['point']}",
                  label="the figure's OOM plan, HBM unlimited" if g == 0 else None)  # fmt: skip
        for i, c in enumerate(p["cells"]):
            if c["offload"] == p["fastest_fit"]:  # above its bar
                ax.plot([g - 0.4 + width * (i + 0.5)], [c["pflops"]], marker="*", ms=11,
                        mfc="white", mec="black", linestyle="none",
                        gid=f"fastest|{p['point']}|{c['offload']}",
                        label=None if starred else "fastest that fits",
                        transform=ax.transData + _up(ax, 8))  # fmt: skip
                starred = True
    top = max(c["pflops"] or p["reference"]["pflops"] for p in points for c in p["cells"])
    ax.set_ylim(0, 1.6 * top)
    # the legend: a patch per placement (grouped_bars labels each series' first mark,
    # a cross where its first point is out of memory), then the marks
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=COLOURS[k], label=v) for k, v in labels.items()]
    handles += [Line2D([], [], marker="x", mew=2, color="black", ls="none",
                       label=figure.OUT_OF_MEMORY),
                Line2D([], [], color="black", ls="--", lw=1,
                       label="the figure's OOM plan, HBM unlimited"),
                Line2D([], [], marker="*", ms=11, mfc="white", mec="black", ls="none",
                       label="fastest that fits")]  # fmt: skip
    ax.legend(handles=handles, fontsize=6, loc="upper left", ncol=2)
    ax.set_title(title, fontsize=9)


def plot(doc: dict):
    data = doc["data"]
    by_name = {p["point"]: p for p in data["points"]}
    panels = data["panels"]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = figure.plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows),
                                    squeeze=False, layout="constrained")  # fmt: skip
    for k, panel in enumerate(panels):
        ax = axes[k // cols][k % cols]
        points = [by_name[n] for n in panel["points"]]
        if len(points) == 1:
            _panel(ax, points[0], data["hbm_gib"])
        else:
            _group_panel(ax, panel["title"], points)
    for k in range(len(panels), rows * cols):
        axes[k // cols][k % cols].set_axis_off()
    fig.suptitle(figure.title(doc, f"{TITLE} (throughput in model PFLOPS)"))
    return fig


def _from_bench_main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=f"{TITLE}: the figure from an offload_v100 run")
    ap.add_argument("--from-bench", required=True, help="an offload_v100.py JSON")
    ap.add_argument("--out", default=str(figure.ROOT / "docs" / "figures"), help="output folder")
    args = ap.parse_args(argv)
    path = Path(args.from_bench).resolve()
    if path.is_relative_to(figure.ROOT):
        path = path.relative_to(figure.ROOT)
    data = from_bench(json.loads((figure.ROOT / path).read_text()), str(path))
    doc = figure.record(sys.modules[__name__], data, False, 0.0)
    doc["command"] = f"python experiments/offload.py --from-bench {path}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure.save(plot(doc), out / f"{NAME}.png")
    print(f"wrote {out / f'{NAME}.json'} and {out / f'{NAME}.png'}", flush=True)


if __name__ == "__main__":
    if any(a.startswith("--from-bench") for a in sys.argv[1:]):
        _from_bench_main(sys.argv[1:])
    else:
        figure.main(sys.modules[__name__])
