"""What every experiment shares: the JSON record, the command line, and Alpa-style plots.

An experiment script (``experiments/<name>.py``) defines ``NAME``, ``TITLE``, ``SOURCE``
(``"simulated"``: cluster presets; ``"compiled"``: XLA on fake devices; ``"measured"``:
timed here), ``run(quick, progress) -> dict`` (the figure's data: plain JSON) and
``plot(doc) -> Figure`` (drawn from the JSON document alone), and ends with
``figure.main(sys.modules[__name__])``.  :func:`main` parses ``--quick`` / ``--out`` /
``--plot-only``, runs, wraps the data in a record (config, git commit, machine, date, wall
time) and writes ``<out>/<name>.json`` and ``<out>/<name>.png``.

Plots: :func:`grouped_bars` (Alpa's bars per GPU count with the linear-scaling outline, a
cross where a method ran out of memory and an open circle where it found no plan),
:func:`stacked_bars` (planning time by phase), :func:`truth_scatter` (predicted vs actual
with y = x and a 10% band).  Every drawn bar, cross and circle carries a ``gid``
(``"bar|<series>|<group>"``, ``"oom|<series>|<group>"``, ``"noplan|<series>|<group>"``)
so a test can read back what was drawn and compare it with the JSON.

Progress: ``progress(done, total, label)`` prints ``##progress done total label`` lines
that ``autoshard reproduce`` turns into its progress bar.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = ("simulated", "compiled", "measured")
ROOT = Path(__file__).resolve().parent.parent
# one colour per method, the same in every figure
COLOURS = {
    "autoshard": "#d62728",
    "auto": "#d62728",
    "ilp": "#d62728",
    "stage-dp": "#d62728",
    "megatron": "#1f77b4",
    "megatron-flash": "#6baed6",  # Megatron-LM's blue, lighter: the same grid, flash attention
    "intra-only": "#2ca02c",
    "inter-only": "#9467bd",
    "dp": "#8c564b",
    "zero2": "#e377c2",
    "zero3": "#7f7f7f",
    "heuristic": "#bcbd22",
    "equal-layer": "#17becf",
    "equal-flops": "#ff7f0e",
}
PALETTE = plt.rcParams["axes.prop_cycle"].by_key()["color"]
NO_PLAN = "No plan found"
OUT_OF_MEMORY = "Out of memory"


def progress(done: int, total: int, label: str = "") -> None:
    """Report progress to ``autoshard reproduce`` (one stdout line)."""
    print(f"##progress {done} {total} {label}", flush=True)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if "jax" in sys.modules:
        info["jax"] = sys.modules["jax"].__version__
    return info


def cpu_seconds() -> float:
    """User + system CPU time of this process and its children so far."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def record(module, data: dict, quick: bool, wall_s: float) -> dict:
    """The JSON document of one run: the figure's data plus where and when it was made."""
    return {
        "name": module.NAME,
        "title": module.TITLE,
        "source": module.SOURCE,
        "quick": quick,
        "command": f"autoshard reproduce --only {module.NAME}" + (" --quick" if quick else ""),
        "git_commit": git_commit(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_seconds": wall_s,
        "cpu_seconds": cpu_seconds(),
        "data": data,
    }


def title(doc: Mapping, text: str | None = None) -> str:
    """A figure title that says where its numbers come from."""
    quick = " (quick grid)" if doc.get("quick") else ""
    return f"{text or doc['title']}\n[{doc['source']}{quick}]"


def save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(module) -> None:
    """The command line of an experiment script (module docstring: what it writes)."""
    ap = argparse.ArgumentParser(description=module.TITLE)
    ap.add_argument("--quick", action="store_true", help="the small grid (minutes)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="output folder")
    ap.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from the JSON in --out"
    )
    # an experiment's own flags: add_arguments(ap) names the keyword arguments of its run
    own = module.add_arguments(ap) if hasattr(module, "add_arguments") else ()
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{module.NAME}.json", out / f"{module.NAME}.png"
    if args.plot_only:
        doc = json.loads(json_path.read_text())
    else:
        t0 = time.perf_counter()
        data = module.run(args.quick, progress, **{k: getattr(args, k) for k in own})
        doc = record(module, data, args.quick, time.perf_counter() - t0)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
    save(module.plot(doc), png_path)
    print(f"wrote {json_path} and {png_path}", flush=True)


# ------------------------------------------------------------------------------ the plots


def colour(series: str, i: int) -> str:
    return COLOURS.get(series, PALETTE[i % len(PALETTE)])


def grouped_bars(
    ax,
    groups: Sequence[str],
    series: Sequence[str],
    cells: Mapping[tuple[str, str], tuple[float | None, bool]],
    *,
    linear: Sequence[float] | None = None,
    ylabel: str = "Throughput (PFLOPS)",
    xlabel: str = "The number of GPUs",
    labels: Mapping[str, str] | None = None,
    no_plan: Collection[tuple[str, str]] = (),
) -> None:
    """Alpa's grouped bars: one group per x category, one bar per series.

    ``cells[(series, group)] = (height, out_of_memory)``: a bar of that height, or, when
    out of memory, a cross in the series' colour at the bar's place; a missing cell or a
    None height draws nothing.
    ``no_plan``: (series, group) where the method found no plan at all: an open circle in
    the series' colour at the bar's base (gid ``"noplan|<series>|<group>"``) and one
    legend entry, so a missing bar is not read as a zero or as out of memory.
    ``linear``: per group, an empty black-outlined bar (linear scaling).
    """
    n = len(series) + (1 if linear is not None else 0)
    width = 0.8 / n
    top = 0.0
    for v, out_of_memory in cells.values():
        if v is not None and not out_of_memory:
            top = max(top, v)
    if linear is not None:
        top = max([top, *[v for v in linear if v is not None]])
    cross_y = 0.04 * (top or 1.0)
    for i, s in enumerate(series):
        x0 = [g - 0.4 + width * (i + 0.5) for g in range(len(groups))]
        name = (labels or {}).get(s, s)
        drawn_label = False
        for g, group in enumerate(groups):
            if (s, group) in no_plan:
                ax.plot(
                    [x0[g]], [cross_y], marker="o", markersize=7, mew=1.8, mfc="none",
                    color=colour(s, i), gid=f"noplan|{s}|{group}", linestyle="none",
                    label=None if drawn_label else name,
                )  # fmt: skip
                drawn_label = True
                continue
            v, out_of_memory = cells.get((s, group), (None, False))
            if out_of_memory:
                ax.plot(
                    [x0[g]], [cross_y], marker="x", markersize=9, mew=2.5, color=colour(s, i),
                    gid=f"oom|{s}|{group}", linestyle="none",
                    label=None if drawn_label else name,
                )  # fmt: skip
                drawn_label = True
                continue
            if v is None:
                continue
            ax.bar(
                x0[g], v, width, color=colour(s, i), gid=f"bar|{s}|{group}",
                label=None if drawn_label else name,
            )  # fmt: skip
            drawn_label = True
    if linear is not None:
        x = [g - 0.4 + width * (len(series) + 0.5) for g in range(len(groups))]
        for g, v in enumerate(linear):
            if v is not None:
                ax.bar(
                    x[g], v, width, fill=False, edgecolor="black", gid=f"bar|linear|{groups[g]}",
                    label="Linear-scaling" if g == 0 else None,
                )  # fmt: skip
    # one legend entry, after the series, for every series' cross and open circle
    marks = [(OUT_OF_MEMORY, "x", "black")] if any(oom for _, oom in cells.values()) else []
    marks += [(NO_PLAN, "o", "none")] if no_plan else []
    for text, marker, face in marks:
        ax.plot([], [], marker=marker, mfc=face, mew=2, color="black", linestyle="none",
                label=text)  # fmt: skip
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, 1.35 * (top or 1.0))  # room for the legend above the bars
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    handles, texts = ax.get_legend_handles_labels()  # lines come first: put marks last
    order = sorted(range(len(texts)), key=lambda k: texts[k] in (OUT_OF_MEMORY, NO_PLAN))
    ax.legend([handles[k] for k in order], [texts[k] for k in order], fontsize=7,
              loc="upper left", ncol=2)  # fmt: skip
    ax.grid(axis="y", alpha=0.3)


def stacked_bars(
    ax,
    groups: Sequence[str],
    phases: Sequence[str],
    cells: Mapping[tuple[str, str], float],
    *,
    ylabel: str,
    xlabel: str = "The number of GPUs",
) -> None:
    """Bars per group, stacked by phase (``cells[(phase, group)]``: seconds; missing: 0)."""
    bottom = [0.0] * len(groups)
    for i, phase in enumerate(phases):
        heights = [cells.get((phase, g)) or 0.0 for g in groups]
        bars = ax.bar(range(len(groups)), heights, 0.6, bottom=bottom, label=phase,
                      color=PALETTE[i % len(PALETTE)])  # fmt: skip
        for bar, g in zip(bars, groups, strict=True):
            bar.set_gid(f"bar|{phase}|{g}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def truth_scatter(
    ax,
    points: Sequence[tuple[str, float, float]],
    *,
    xlabel: str,
    ylabel: str,
    band: float = 0.10,
    log: bool = True,
) -> None:
    """``points`` = (series, actual x, predicted y): scatter with y = x and a +-band."""
    series = list(dict.fromkeys(p[0] for p in points))
    for i, s in enumerate(series):
        xs = [p[1] for p in points if p[0] == s]
        ys = [p[2] for p in points if p[0] == s]
        ax.scatter(xs, ys, s=22, color=colour(s, i), label=s, gid=f"points|{s}", zorder=3)
    values = [v for p in points for v in p[1:] if v > 0]
    lo, hi = (min(values), max(values)) if values else (0.1, 10.0)
    lo, hi = (lo / 1.5, hi * 1.5) if log else (lo * 0.85, hi * 1.15)
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1, label="y = x")
    ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line],
                    color="grey", alpha=0.2, label=f"±{band:.0%}")  # fmt: skip
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def drawn(fig) -> dict[str, tuple[float, float]]:
    """What :func:`grouped_bars` / :func:`stacked_bars` drew, by gid: ``(x, height)`` of a
    bar, ``(x, y)`` of a cross or a no-plan circle; the test's view of a figure."""
    out = {}
    for ax in fig.axes:
        for patch in ax.patches:
            gid = patch.get_gid()
            if gid:
                out[f"{ax.get_title() or ''}::{gid}"] = (patch.get_x(), patch.get_height())
        for line in ax.lines:
            gid = line.get_gid()
            if gid:
                out[f"{ax.get_title() or ''}::{gid}"] = (line.get_xdata()[0], line.get_ydata()[0])
    return out
