"""Search time at frontier scale: GPT-175B / 530B / 1T on 1,024-3,072 simulated A100s and H100s.

The rows are ``benchmarks/bench_frontier.py``'s (``ROWS``, ``DEFAULT_ROWS``, measured by its
``measure_row``): each a cold ``autoshard simulate --plan auto`` in a fresh process, three
times (the median is the row's time), then SC21's published layout priced the same way
where the row has one. Quick: the 1T row on 3,072 A100s, once (about a minute on an idle
machine).

Left: wall seconds per row against GPUs (log-log), the bar stacked by the phases of the
run the plan comes from (trace, intra-op ILPs, stage DP, and the rest of that process:
start-up, imports, pricing the plan), a marker per cluster at the median over the runs
(whiskers: fastest and slowest). Published planner search times are stars, drawn where a
source gives one (Alpa's ~2,400 s for gpt-39b on 64 GPUs, OSDI'22;
Aceso's measurement of Alpa on gpt-1.3b / 4 GPUs, 4,092 s); none was found published for a
175B+ model, and the figure says so. Right: the predicted model-FLOPs utilisation of the
search's plan (TP x PP x DP and micro-batches written above) and of SC21's layout priced
the same way, a cross where that layout does not fit the simulator's memory model.

    python experiments/frontier.py [--quick] [--out docs/figures]
    python experiments/frontier.py --from-bench benchmarks/results/bench_frontier.json \\
        [--out docs/figures]   # the figure from a bench_frontier.py run, not rerun
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import figure

NAME = "frontier"
TITLE = "Search time at frontier scale: GPT-175B / 530B / 1T"
SOURCE = "measured"
FIGURE = 8

BENCH = figure.ROOT / "benchmarks" / "bench_frontier.py"
QUICK_ROWS = ("1t-a100-3072",)
# bench_frontier's phase_seconds keys -> legend
PHASES = {
    "trace": "trace",
    "intra_op_ilps": "intra-op ILPs",
    "stage_dp": "stage DP",
    "rest": "rest of the process (start-up, imports, pricing)",
}
# published search times (/work/shared/REFERENCE.md), not measured here
REPORTED = (
    {"planner": "Alpa", "model": "gpt-39b", "gpus": 64, "seconds": 2400.0,
     "source": "Alpa (OSDI'22): ~2,400 s (compilation ~1,580, profiling ~800, stage DP ~2)"},
    {"planner": "Alpa, per Aceso", "model": "gpt-1.3b", "gpus": 4, "seconds": 4092.0,
     "source": "Aceso (EuroSys'24) measuring Alpa"},
)  # fmt: skip
NOT_FOUND = "no published search time of any planner for a 175B+ model was found"
PHASE_COLOURS = (figure.PALETTE[0], figure.PALETTE[1], figure.PALETTE[2], "#bbbbbb")
CLUSTERS = {"dgx-a100": ("A100", "o"), "dgx-h100": ("H100", "s")}


def bench():
    """``benchmarks/bench_frontier.py`` as a module (its rows and ``measure_row``)."""
    spec = importlib.util.spec_from_file_location("bench_frontier", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(rows: list[dict], measured: dict) -> dict:
    return {
        "config": {
            "rows": "benchmarks/bench_frontier.py ROWS: cold `autoshard simulate --plan auto` "
            "in a fresh process per run; SC21's layout priced with --program traced "
            "--recompute full --microbatch-size 1",
        },
        "measured": measured,
        "rows": rows,
        "reported": list(REPORTED),
        "reported_note": NOT_FOUND,
    }


def run(quick: bool, progress) -> dict:
    import os

    b = bench()
    names, repeats = (QUICK_ROWS, 1) if quick else (b.DEFAULT_ROWS, 3)
    total = len(names) * (repeats + 1)
    done = [0]

    def on_run(label: str) -> None:
        progress(min(done[0], total), total, label)
        done[0] += 1

    load = os.getloadavg()
    rows = []
    for name in names:
        rows.append(b.measure_row(name, repeats, on_run=on_run))
        done[0] = len(rows) * (repeats + 1)
    progress(total, total, "done")
    measured = {
        "by": f"measure_row of benchmarks/bench_frontier.py, {repeats} run(s) per row",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_before": list(load),
        "loadavg_after": list(os.getloadavg()),
    }
    return _data(rows, measured)


def from_bench(doc: dict, path: str) -> dict:
    """The figure's data from a ``bench_frontier.py`` JSON (the same rows, not rerun)."""
    import subprocess

    commit = subprocess.run(
        ["git", "-C", str(figure.ROOT), "log", "-1", "--format=%H", "--", path],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    measured = {
        "by": f"benchmarks/bench_frontier.py, read from {path} (not rerun)",
        "committed_in": commit or None,
        "date": doc["date"],
        "loadavg_before": doc["loadavg_before"],
        "loadavg_after": doc["loadavg_after"],
    }
    return _data(doc["rows"], measured)


# ------------------------------------------------------------------------------ the plot


def phase_seconds(row: dict) -> dict[str, float]:
    """Seconds per phase of the run the plan comes from; ``rest``: that run's wall minus
    its search (process start-up, imports, pricing the plan)."""
    auto = row["auto"]
    run_wall = row["wall_seconds"][row.get("summary_run", len(row["wall_seconds"]) - 1)]
    out = {k: auto["phase_seconds"][k] for k in PHASES if k != "rest"}
    out["rest"] = max(0.0, run_wall - auto["search_seconds"])
    return out


def plan_label(auto: dict) -> str:
    """``TPxPPxDP``; stages on different logical meshes of one sub-mesh shape: each view."""
    tp, pp, dp = auto["tp_pp_dp"]
    if tp is not None:
        return f"{tp}x{pp}x{dp}"
    views = sorted({(s[1][1], s[1][0]) for s in auto.get("stages", [])}, reverse=True)
    return "\n".join(f"{t}x{pp}x{d}" for t, d in views) + "\n(mixed)"


def row_label(row: dict) -> str:
    gpu = CLUSTERS.get(row["cluster"], (row["cluster"], "D"))[0]
    return f"{row['model'][4:].upper()}\n{row['gpus']:,} {gpu}"


def _positions(rows: list[dict]) -> list[float]:
    """x of each row's bar: its GPU count, rows sharing a count set side by side."""
    pos = []
    for i, r in enumerate(rows):
        same = [j for j, q in enumerate(rows) if q["gpus"] == r["gpus"]]
        k = same.index(i) - (len(same) - 1) / 2
        pos.append(r["gpus"] * 1.2**k)
    return pos


def _search_panel(ax, rows: list[dict], reported: list[dict]) -> None:
    planned = [r for r in rows if "auto" in r]
    xs = _positions(planned)
    f = 1.1  # half a bar's width, as a factor on the log axis
    bottom = [0.0] * len(planned)
    for i, (key, label) in enumerate(PHASES.items()):
        heights = [phase_seconds(r)[key] for r in planned]
        for x, h, b, r in zip(xs, heights, bottom, planned, strict=True):
            ax.bar(x / f, h, x * f - x / f, bottom=b, align="edge", color=PHASE_COLOURS[i],
                   gid=f"bar|{key}|{r['row']}", label=label if r is planned[0] else None)  # fmt: skip
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for cluster, (gpu, marker) in CLUSTERS.items():
        these = [(x, r) for x, r in zip(xs, planned, strict=True) if r["cluster"] == cluster]
        for x, r in these:
            w = r["wall_seconds"]
            med = r["median_wall_seconds"]
            bars = ax.errorbar(
                [x], [med], yerr=[[med - min(w)], [max(w) - med]], marker=marker, color="black",
                mfc="white", ms=7, capsize=3, lw=1, zorder=4,
                label=(f"{gpu}: median wall of {len(w)} runs, min-max" if len(w) > 1
                       else f"{gpu}: wall of 1 run") if x == these[0][0]
                else None,
            )  # fmt: skip
            bars.lines[0].set_gid(f"median|{r['row']}")  # the marker, not the caps
            ax.annotate(f"{row_label(r).replace(chr(10), ' on ')}: {med:.0f} s",
                        (x, max([med, *w])), fontsize=7, rotation=90, ha="center",
                        va="bottom", xytext=(0, 6), textcoords="offset points")  # fmt: skip
    for k, ref in enumerate(reported):
        ax.plot([ref["gpus"]], [ref["seconds"]], marker="*", ms=13, color="black",
                linestyle="none", gid=f"reported|{ref['planner']}|{ref['gpus']}",
                label="published, not measured here" if k == 0 else None)  # fmt: skip
        ax.annotate(f"{ref['planner']} ({ref['model'][4:].upper()}, {ref['gpus']} GPUs):\n"
                    f"{ref['seconds']:,.0f} s", (ref["gpus"], ref["seconds"]), fontsize=7,
                    xytext=(8, -4), textcoords="offset points", va="top")  # fmt: skip
    for r in rows:
        if "auto" not in r:  # no plan: an open circle on the axis, said in the legend
            ax.plot([r["gpus"]], [1.0], marker="o", mfc="none", ms=8, mew=1.8, color="black",
                    linestyle="none", gid=f"noplan|{r['row']}", label=figure.NO_PLAN)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted({r["gpus"] for r in rows} | {ref["gpus"] for ref in reported})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], rotation=45, fontsize=7)
    ax.minorticks_off()
    ax.set_xlim(min(ticks) / 2, max(ticks) * 2)
    ax.set_ylim(0.5, 30 * max([1.0, *[ref["seconds"] for ref in reported],
                               *[max(r["wall_seconds"]) for r in rows]]))  # fmt: skip
    ax.set_xlabel("The number of GPUs (simulated)")
    ax.set_ylabel("Search wall time (s)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Cold search, a fresh process per run; bars: the phases of the run the plan "
                 "is from.\nStars: published search times (none found for a 175B+ model)",
                 fontsize=8)  # fmt: skip


def _mfu_panel(ax, rows: list[dict]) -> None:
    groups = [row_label(r) for r in rows]
    cells, no_plan = {}, set()
    for g, r in zip(groups, rows, strict=True):
        if "auto" in r:
            cells[("autoshard", g)] = (100 * r["auto"]["mfu"], bool(r["auto"]["oom"]))
        else:
            no_plan.add(("autoshard", g))
        priced = r.get("published", {}).get("priced", {}).get("microbatch_1", {})
        if "mfu" in priced:
            cells[("megatron", g)] = (100 * priced["mfu"], bool(priced["oom"]))
        elif "error" in priced:  # the published layout could not be priced
            no_plan.add(("megatron", g))
    figure.grouped_bars(
        ax, groups, ["autoshard", "megatron"], cells,
        labels={"autoshard": "the search's plan", "megatron": "SC21's layout, priced the same way"},
        ylabel="Predicted MFU (%, model FLOPs / peak)", xlabel="", no_plan=no_plan,
    )  # fmt: skip
    top = ax.get_ylim()[1]
    for g, r in enumerate(rows):
        if "auto" in r:
            a = r["auto"]
            ax.annotate(f"{plan_label(a)}\nm={a['num_microbatches']}", (g - 0.2, 100 * a["mfu"]),
                        fontsize=6, ha="center", va="bottom", xytext=(0, 2),
                        textcoords="offset points")  # fmt: skip
        pub = r.get("published")
        priced = (pub or {}).get("priced", {}).get("microbatch_1", {})
        if pub is None:
            ax.annotate("no published\nlayout", (g + 0.2, 0), fontsize=6, ha="center",
                        va="bottom", xytext=(0, 3), textcoords="offset points")  # fmt: skip
        if "error" in priced:
            ax.annotate("x".join(map(str, pub["tp_pp_dp"])) + "\nnot priced", (g + 0.2, 0.04 * top),
                        fontsize=6, ha="center", va="bottom", xytext=(0, 6),
                        textcoords="offset points")  # fmt: skip
        if "mfu" in priced:
            y = 0.04 * top if priced["oom"] else 100 * priced["mfu"]
            oom = f"\nOOM: {priced['peak_gib_per_device']:.0f} GiB" if priced["oom"] else ""
            ax.annotate("x".join(map(str, pub["tp_pp_dp"])) + oom, (g + 0.2, y), fontsize=6,
                        ha="center", va="bottom", xytext=(0, 6), textcoords="offset points")  # fmt: skip
    ax.set_ylim(0, 1.6 * max([1.0, *[v for v, _ in cells.values() if v is not None]]))
    ax.set_title("Plan (TP x PP x DP, micro-batches) and predicted MFU", fontsize=8)


def plot(doc: dict):
    data = doc["data"]
    rows = sorted(data["rows"], key=lambda r: (r["gpus"], r["cluster"]))
    fig, (left, right) = figure.plt.subplots(
        1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.5, 1]}
    )
    _search_panel(left, rows, data["reported"])
    _mfu_panel(right, rows)
    load = data.get("measured", {}).get("loadavg_before", [None])[0]
    text = f"{TITLE} (2-core machine, shared: load {load:.0f})" if load is not None else None
    fig.suptitle(figure.title(doc, text))
    fig.tight_layout()
    return fig


def _from_bench_main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=f"{TITLE}: the figure from a bench_frontier run")
    ap.add_argument("--from-bench", required=True, help="a bench_frontier.py JSON")
    ap.add_argument("--out", default=str(figure.ROOT / "docs" / "figures"), help="output folder")
    args = ap.parse_args(argv)
    path = Path(args.from_bench).resolve()
    if path.is_relative_to(figure.ROOT):
        path = path.relative_to(figure.ROOT)
    doc = figure.record(sys.modules[__name__], from_bench(json.loads((figure.ROOT / path).read_text()),
                        str(path)), False, 0.0)  # fmt: skip
    doc["command"] = f"python experiments/frontier.py --from-bench {path}"
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
