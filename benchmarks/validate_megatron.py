"""The simulator against published training runs: calibration rows and validation rows apart.

Every run of ``benchmarks/published_runs.py`` (A100: Megatron-LM SC21 Table 1, Korthikanti
et al. 2022; V100: Megatron-LM 2019; H100: autoshard's step measured here) is priced by
:func:`autoshard.sim.megatron.simulate_megatron` on its cluster preset with the shipped
GEMM tables; each row's predicted figure is printed next to the published one with the
error in *throughput* (positive: the simulator is too optimistic), rows grouped by source
and split into calibration rows (used to fit a GEMM table's one number, the 16-bit
large-GEMM efficiency of its modelled table) and validation rows (never used to fit).

``--calibrate`` refits those numbers: per modelled GEMM table (``a100``; ``v100``, the V100
under 2022 software; ``v100-megatron2019``, the same V100 under Megatron-LM's 2019 code),
the efficiency on a 0.01 grid that minimises the worst |error| over the calibration rows
priced with it, printed next to the shipped constant of ``benchmarks/make_gemm_tables.py``.
The summary groups rows by GPU (both V100 tables are "v100").

Writes benchmarks/results/megatron_validation.json.
Usage: python benchmarks/validate_megatron.py [--calibrate]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling scripts below, also when loaded by path

import make_gemm_tables  # noqa: E402
from published_runs import ALL_RUNS, PublishedRun  # noqa: E402

from autoshard.hardware.clusters import load_cluster  # noqa: E402
from autoshard.hardware.gemm import GemmTable  # noqa: E402
from autoshard.sim.megatron import GPTShape, MegatronConfig, simulate_megatron  # noqa: E402

OUT = HERE / "results" / "megatron_validation.json"
CALIBRATION_GRID = [round(0.20 + 0.01 * i, 2) for i in range(71)]  # 0.20 .. 0.90
OVERHEAD_GRID = [round(0.01 * i, 2) for i in range(101)]  # 0 .. 1 s per step
UNITS = {"tflops_per_gpu": "TFLOP/s/GPU", "mfu": "MFU", "step_time_s": "s/step"}


def table_of(run: PublishedRun) -> str:
    """The GEMM table a run's cluster uses (``a100``, ``v100``, ``v100-megatron2019``,
    ``h100``): what a calibration row fits."""
    return load_cluster(run.cluster).device.gemm_table


def device_of(run: PublishedRun) -> str:
    """The GPU a run ran on (``a100``, ``v100``, ``h100``): what the acceptance is per."""
    return table_of(run).split("-")[0]


def price(run: PublishedRun, table: GemmTable | None = None, elementwise: str = "fused") -> dict:
    """Predicted figure of ``run`` (``table``: a GEMM table to use instead of the shipped
    one; ``elementwise``: a structure of ``autoshard.sim.megatron.ELEMENTWISE_PASSES``) and
    the throughput error against the published figure."""
    model = GPTShape(run.hidden, run.layers, run.heads, run.vocab, run.seq_len)
    cfg = MegatronConfig(
        tp=run.tp,
        pp=run.pp,
        dp=run.dp,
        micro_batch=run.micro_batch,
        global_batch=run.global_batch,
        recompute=run.recompute,
        attention=run.attention,
        sequence_parallel=run.sequence_parallel,
        virtual_stages=run.virtual_stages,
        dtype=run.dtype,
        elementwise=elementwise,
        grad_accumulation=run.grad_accumulation,
        tp_comm_overlap=run.tp_comm_overlap,
    )
    result = simulate_megatron(model, cfg, load_cluster(run.cluster, num_gpus=run.gpus), table)
    predicted = {
        "tflops_per_gpu": result.tflops_per_device,
        "mfu": result.mfu,
        "step_time_s": result.step_time_s,
    }[run.metric]
    # throughput error: predicted / published rate - 1 (a step time is an inverse rate)
    if run.metric == "step_time_s":
        error = run.published / predicted - 1
    else:
        error = predicted / run.published - 1
    return {"predicted": predicted, "error": error, "result": result}


def validate() -> list[dict]:
    """Every published run priced with the shipped tables, as JSON-ready rows. A run with
    ``relative_to`` also gets ``relative_error_percent``: the error of its figure divided by
    that row's, predicted against published (how well the *scaling* is predicted)."""
    rows = []
    priced_by_name = {(run.source, run.name): price(run) for run in ALL_RUNS}
    for run in ALL_RUNS:
        priced = priced_by_name[run.source, run.name]
        result = priced["result"]
        relative = None
        if run.relative_to is not None:
            base = priced_by_name[run.source, run.relative_to]
            relative = round(100 * ((1 + priced["error"]) / (1 + base["error"]) - 1), 2)
        rows.append(
            {
                "source": run.source,
                "role": run.role,
                "device": device_of(run),
                "gemm_table": table_of(run),
                "model": run.name,
                "cluster": run.cluster,
                "heads": run.heads,
                "hidden": run.hidden,
                "layers": run.layers,
                "seq_len": run.seq_len,
                "tp": run.tp,
                "pp": run.pp,
                "dp": run.dp,
                "gpus": run.gpus,
                "global_batch": run.global_batch,
                "micro_batch": run.micro_batch,
                "virtual_stages": run.virtual_stages,
                "sequence_parallel": run.sequence_parallel,
                "recompute": run.recompute,
                "attention": run.attention,
                "metric": run.metric,
                "published": run.published,
                "predicted": round(priced["predicted"], 6),
                "error_percent": round(100 * priced["error"], 2),
                "relative_to": run.relative_to,
                "relative_error_percent": relative,
                # every row also as hardware TFLOP/s per GPU, the published figure converted
                # with the row's own FLOP count (what experiments/sim_validation.py plots)
                "published_tflops_per_gpu": round(
                    result.tflops_per_device / (1 + priced["error"]), 2
                ),
                "predicted_tflops_per_gpu": round(result.tflops_per_device, 2),
                "predicted_mfu": round(result.mfu, 4),
                "step_time_s": round(result.step_time_s, 5),
                "memory_gib": round(result.memory_bytes_per_device / 2**30, 2),
                "oom": result.oom,
                "step_breakdown_s": {k: round(v, 6) for k, v in result.step_breakdown.items()},
            }
        )
    return rows


def _minimax(grid, runs, table_for) -> tuple[float, float]:
    """The grid value whose table prices ``runs`` with the smallest worst |error|."""
    best = None
    for value in grid:
        table = table_for(value)
        worst = max(abs(price(run, table)["error"]) for run in runs)
        if best is None or worst < best[1] - 1e-12:
            best = (value, worst)
    return best


def calibrate(table_name: str, source: str | None = None) -> dict:
    """The calibrated numbers of the modelled table ``table_name``, each minimising the
    worst |error| over the calibration rows priced with it, on a grid: its 16-bit
    large-GEMM efficiency, and for a table with a per-step tensor-parallel cost
    (``make_gemm_tables.CALIBRATED_TP_STEP_OVERHEAD_S``) that cost too -- the efficiency
    then on the rows without tensor parallelism (where the cost is 0), the cost on those
    with it, at the fitted efficiency. ``source``: fit the efficiency on that source's rows
    instead (those not compared relative to another row) -- what-if only, the shipped
    tables stay calibrated on the calibration rows."""
    if source is None:
        runs = [r for r in ALL_RUNS if r.role == "calibration" and table_of(r) == table_name]
    else:
        runs = [
            r
            for r in ALL_RUNS
            if r.source == source and r.relative_to is None and table_of(r) == table_name
        ]
    if not runs:
        raise ValueError(f"no calibration rows for {table_name!r}")
    has_overhead = table_name in make_gemm_tables.CALIBRATED_TP_STEP_OVERHEAD_S
    level_runs = [r for r in runs if r.tp == 1] if has_overhead and source is None else runs
    tp_runs = [r for r in runs if r.tp > 1] if has_overhead and source is None else []

    def table_for(eff: float, overhead: float = 0.0) -> GemmTable:
        return GemmTable.from_json(
            make_gemm_tables.make_table(table_name, eff, overhead),
            f"{table_name}@{eff},{overhead}",
        )

    eff, worst = _minimax(CALIBRATION_GRID, level_runs, table_for)
    fit = {
        "table": table_name,
        "rows": len(runs),
        "efficiency": eff,
        "efficiency_rows": len(level_runs),
        "worst_error_percent": round(100 * worst, 2),
        "shipped": make_gemm_tables.CALIBRATED[table_name],
    }
    if tp_runs:  # the GEMM rows do not depend on the cost: one table, the cost replaced
        base = table_for(eff)
        overhead, tp_worst = _minimax(
            OVERHEAD_GRID, tp_runs, lambda c: dataclasses.replace(base, tp_step_overhead_s=c)
        )
        fit.update(
            tp_step_overhead_s=overhead,
            tp_step_overhead_rows=len(tp_runs),
            worst_error_percent=round(100 * max(worst, tp_worst), 2),
            shipped_tp_step_overhead_s=make_gemm_tables.CALIBRATED_TP_STEP_OVERHEAD_S[table_name],
        )
    return fit


def summary(rows: list[dict]) -> list[dict]:
    """Per device and role: rows, mean and worst |error| (%)."""
    out = []
    for device in sorted({r["device"] for r in rows}):
        for role in ("calibration", "validation"):
            errs = [
                abs(r["error_percent"]) for r in rows if (r["device"], r["role"]) == (device, role)
            ]
            if errs:
                out.append(
                    {
                        "device": device,
                        "role": role,
                        "rows": len(errs),
                        "mean_abs_error_percent": round(sum(errs) / len(errs), 2),
                        "max_abs_error_percent": round(max(errs), 2),
                    }
                )
    return out


def _fmt(metric: str, value: float) -> str:
    return f"{value:.1%}" if metric == "mfu" else f"{value:.4g}"


def markdown(rows: list[dict]) -> str:
    lines = []
    for source in dict.fromkeys(r["source"] for r in rows):
        group = [r for r in rows if r["source"] == source]
        lines += [
            f"\n{source} ({group[0]['cluster']}, {UNITS[group[0]['metric']]})\n",
            "| role | model | GPUs | t | p | d | B | b | v | SP | recompute | published |"
            " predicted | error | error of the ratio to the baseline row |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            rel = r["relative_error_percent"]
            lines.append(
                f"| {r['role']} | {r['model']} | {r['gpus']} | {r['tp']} | {r['pp']} | "
                f"{r['dp']} | {r['global_batch']} | {r['micro_batch']} | "
                f"{r['virtual_stages']} | {'yes' if r['sequence_parallel'] else 'no'} | "
                f"{r['recompute']} | {_fmt(r['metric'], r['published'])} | "
                f"{_fmt(r['metric'], r['predicted'])} | {r['error_percent']:+.1f}% | "
                + ("" if rel is None else f"{rel:+.1f}%")
                + " |"
            )
    lines += [
        "\n| device | rows | n | mean abs error | worst abs error |",
        "|---|---|---|---|---|",
    ]
    for s in summary(rows):
        lines.append(
            f"| {s['device']} | {s['role']} | {s['rows']} | {s['mean_abs_error_percent']:.1f}% "
            f"| {s['max_abs_error_percent']:.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--calibrate", action="store_true", help="refit each modelled table's efficiency"
    )
    parser.add_argument(
        "--source", help="with --calibrate: fit on this source's rows instead (what-if)"
    )
    args = parser.parse_args(argv)
    if args.calibrate:
        tables = sorted(make_gemm_tables.CALIBRATED)
        if args.source:
            tables = sorted({table_of(r) for r in ALL_RUNS if r.source == args.source})
        for table in tables:
            fit = calibrate(table, args.source)
            line = (
                f"{table}: efficiency {fit['efficiency']:.2f} (shipped {fit['shipped']:.2f}, "
                f"on {fit['efficiency_rows']} rows)"
            )
            if "tp_step_overhead_s" in fit:
                line += (
                    f", tensor-parallel step overhead {fit['tp_step_overhead_s']:.2f} s x "
                    f"(1 - 1/t) (shipped {fit['shipped_tp_step_overhead_s']}, on "
                    f"{fit['tp_step_overhead_rows']} rows)"
                )
            print(
                f"{line}; worst |error| {fit['worst_error_percent']:.1f}% over "
                f"{fit['rows']} calibration rows"
            )
        return
    rows = validate()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1) + "\n")
    print(markdown(rows))
    print(f"\n(written to {OUT})")


if __name__ == "__main__":
    main()
