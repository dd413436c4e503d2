"""Simulator validation: predicted vs published and predicted vs measured, one point per row.

Left: the simulator's TFLOP/s per GPU for every published row ``benchmarks/validate_megatron.py``
checks (docs/validation.md): Megatron-LM's SC21 Table 1 and Korthikanti et al. 2022 on
``dgx-a100``, Megatron-LM 2019 (Shoeybi et al.) on V100s, and Alpa's README benchmark on
``alpa-v100``; one series per source, the rows a preset was calibrated on drawn as open
markers (the others are validation: the simulator was not fitted to them). Right: ``simulate(plan="megatron:1x1x1")`` on one GPU of
``dgx-h100`` on both programs (Megatron-LM's kernels and the traced JAX step) against the
step times measured on an H100 (``benchmarks/results/gpu_single.json``, from
``benchmarks/gpu_single.py measure``; the measurement is read, the prediction rerun).

    python experiments/sim_validation.py [--quick] [--out docs/figures]
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import figure

NAME = "sim-validation"
TITLE = "Simulator validation: predicted vs published and measured"
SOURCE = "simulated"
FIGURE = 7

BENCH = figure.ROOT / "benchmarks"


# validate_megatron's source -> the legend's name; gpu-single-h100 is the right panel
SOURCES = {
    "sc21-table1": "Megatron-LM SC21 Table 1 (A100)",
    "korthikanti22": "Korthikanti et al. 2022 (A100)",
    "shoeybi19": "Megatron-LM 2019 (V100)",
    "alpa-readme": "Alpa README (V100)",
}


def _published_rows() -> list[dict]:
    spec = importlib.util.spec_from_file_location(
        "validate_megatron", BENCH / "validate_megatron.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [
        {
            "source": r["source"],
            "role": r["role"],
            "model": r["model"],
            "cluster": r["cluster"],
            "gpus": r["gpus"],
            "grid": f"TP{r['tp']} PP{r['pp']} DP{r['dp']}",
            "published_tflops_per_gpu": r["published_tflops_per_gpu"],
            "predicted_tflops_per_gpu": r["predicted_tflops_per_gpu"],
        }
        for r in module.validate()
        if r["source"] in SOURCES
    ]


def _h100_rows() -> list[dict]:
    from autoshard.sim.simulate import simulate

    measured = json.loads((BENCH / "results" / "gpu_single.json").read_text())
    rows = []
    for r in measured["rows"]:
        model, layers, batch = re.match(r"(\S+) L(\d+) B(\d+)", r["config"]).groups()
        layers, batch = int(layers), int(batch)
        row = {"config": r["config"], "measured_step_time_s": r["measured_step_time_s"]}
        for program in ("megatron-lm", "traced"):
            rep = simulate(
                model, "dgx-h100", 1, "megatron:1x1x1", global_batch=batch,
                microbatch_size=batch, recompute="none", dtype="bf16", program=program,
                num_layers=layers,
            )  # fmt: skip
            row[f"predicted_step_time_s[{program}]"] = rep.step_time_s
        rows.append(row)
    return rows


def run(quick: bool, progress) -> dict:
    progress(0, 2, "published tables")
    published = _published_rows()
    progress(1, 2, "one H100")
    h100 = _h100_rows()
    progress(2, 2, "done")
    return {
        "config": {
            "published": "every published row of benchmarks/validate_megatron.py: "
            + ", ".join(SOURCES.values()),
            "h100": "benchmarks/results/gpu_single.json (measured 2026-11-22 on one H100 SXM)",
        },
        "published": published,
        "h100": h100,
    }


def published_points(data: dict) -> list[tuple[str, float, float]]:
    """(series, published TFLOP/s, simulated TFLOP/s) per published row; series: the
    source, with "(calibration)" for the rows a preset was fitted to."""
    return [
        (SOURCES[r["source"]] + (" (calibration)" if r["role"] == "calibration" else ""),
         r["published_tflops_per_gpu"], r["predicted_tflops_per_gpu"])
        for r in data["published"]
    ]  # fmt: skip


def h100_points(data: dict) -> list[tuple[str, float, float]]:
    """(program, measured ms, simulated ms) per H100 row and program."""
    return [
        (f"{p} program", 1e3 * r["measured_step_time_s"], 1e3 * r[f"predicted_step_time_s[{p}]"])
        for r in data["h100"]
        for p in ("megatron-lm", "traced")
    ]


def scatter_points(doc: dict) -> list[tuple[float, float]]:
    """Every (x, y) the figure plots."""
    data = doc["data"]
    return [(x, y) for _, x, y in published_points(data) + h100_points(data)]


def plot(doc: dict):
    data = doc["data"]
    fig, (a, b) = figure.plt.subplots(1, 2, figsize=(12, 5.2))
    figure.truth_scatter(
        a, published_points(data),
        xlabel="Published TFLOP/s per GPU", ylabel="Simulated TFLOP/s per GPU",
    )  # fmt: skip
    ticks = [10, 15, 20, 30, 50, 70, 100, 150, 200]
    for axis in (a.xaxis, a.yaxis):
        axis.set_major_locator(figure.matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(figure.matplotlib.ticker.ScalarFormatter())
        axis.set_minor_locator(figure.matplotlib.ticker.NullLocator())
    # one colour per source; the calibration rows as open markers of that colour
    colours = {name: figure.PALETTE[i] for i, name in enumerate(SOURCES.values())}
    for coll in a.collections:
        series = (coll.get_gid() or "").removeprefix("points|")
        source = series.removesuffix(" (calibration)")
        if source in colours:
            coll.set_facecolor("none" if series != source else colours[source])
            coll.set_edgecolor(colours[source])
    a.legend(fontsize=6, loc="upper left")
    for r in data["published"]:  # name the rows more than 20% off
        x, y = r["published_tflops_per_gpu"], r["predicted_tflops_per_gpu"]
        if abs(y / x - 1) > 0.20:
            a.annotate(r["model"], (x, y), fontsize=6, xytext=(4, -3), textcoords="offset points")
    n = len(data["published"])
    within = sum(
        abs(r["predicted_tflops_per_gpu"] / r["published_tflops_per_gpu"] - 1) <= 0.10
        for r in data["published"]
    )
    a.set_title(
        f"Published runs (log axes): {within}/{n} rows within 10%; open: calibration rows",
        fontsize=9,
    )
    figure.truth_scatter(
        b,
        h100_points(data),
        xlabel="Measured step time (ms)",
        ylabel="Simulated step time (ms)",
        log=False,
    )
    for r in data["h100"]:
        b.annotate(r["config"], (1e3 * r["measured_step_time_s"],
                                 1e3 * r["predicted_step_time_s[traced]"]),
                   fontsize=6, xytext=(-6, 0), textcoords="offset points", ha="right", va="center")  # fmt: skip
    b.set_title("One H100 (measured), autoshard's GPT step", fontsize=9)
    fig.suptitle(figure.title(doc, TITLE + " (simulated side rerun)"))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
