"""Simulator validation: predicted vs published (Megatron-LM, SC21 Table 1 on DGX A100) and
predicted vs measured (autoshard's GPT step on one H100), one point per row.

Left: the simulator's TFLOP/s per GPU for every row of Megatron-LM's Table 1, from the
same configurations ``benchmarks/validate_megatron.py`` checks (docs/validation.md),
against the published figure. Right: ``simulate(plan="megatron:1x1x1")`` on one GPU of
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


def _megatron_rows() -> list[dict]:
    spec = importlib.util.spec_from_file_location(
        "validate_megatron", BENCH / "validate_megatron.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [
        {
            "model": r["model"],
            "gpus": r["gpus"],
            "grid": f"TP{r['tp']} PP{r['pp']} DP{r['dp']}",
            "published_tflops_per_gpu": r["published_tflops_per_gpu"],
            "predicted_tflops_per_gpu": r["predicted_tflops_per_gpu"],
        }
        for r in module.validate()
        if r["source"] == "sc21-table1"  # the other sources: docs/validation.md's tables
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
    progress(0, 2, "Megatron-LM Table 1")
    megatron = _megatron_rows()
    progress(1, 2, "one H100")
    h100 = _h100_rows()
    progress(2, 2, "done")
    return {
        "config": {
            "megatron": "Narayanan et al. SC21 Table 1, dgx-a100 preset, fp16, full recompute",
            "h100": "benchmarks/results/gpu_single.json (measured 2026-11-22 on one H100 SXM)",
        },
        "megatron_table_1": megatron,
        "h100": h100,
    }


def megatron_points(data: dict) -> list[tuple[str, float, float]]:
    """(series, published TFLOP/s, simulated TFLOP/s) per Table 1 row."""
    return [
        ("Megatron-LM Table 1", r["published_tflops_per_gpu"], r["predicted_tflops_per_gpu"])
        for r in data["megatron_table_1"]
    ]


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
    return [(x, y) for _, x, y in megatron_points(data) + h100_points(data)]


def plot(doc: dict):
    data = doc["data"]
    fig, (a, b) = figure.plt.subplots(1, 2, figsize=(11, 4.4))
    figure.truth_scatter(
        a, megatron_points(data),
        xlabel="Published TFLOP/s per GPU", ylabel="Simulated TFLOP/s per GPU", log=False,
    )  # fmt: skip
    for r in data["megatron_table_1"]:
        a.annotate(r["model"], (r["published_tflops_per_gpu"], r["predicted_tflops_per_gpu"]),
                   fontsize=6, xytext=(3, 3), textcoords="offset points")  # fmt: skip
    a.set_title("DGX A100, Megatron-LM (published)", fontsize=9)
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
                   fontsize=6, xytext=(3, -9), textcoords="offset points")  # fmt: skip
    b.set_title("One H100 (measured), autoshard's GPT step", fontsize=9)
    fig.suptitle(figure.title(doc, TITLE + " (simulated side rerun)"))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
