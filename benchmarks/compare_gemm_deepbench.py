"""The modelled V100 GEMM tables against a published V100 GEMM benchmark (DeepBench).

Reads ``benchmarks/results/deepbench_v100_fp16_gemm.json`` (Baidu DeepBench's V100 fp16
dense-GEMM results, CUDA 10.1, transcribed figures; its ``source`` field says from where;
the 159 rows with a time, ``make_gemm_tables.deepbench_rows``)
and compares each row with what a modelled table (``v100`` or ``v100-megatron2019``)
gives for the same M, N, K. The tables' level is a calibrated *effective* efficiency
(docs/validation.md) and DeepBench times kernels alone, so the comparison is of *shape
dependence*: each side's TFLOP/s divided by its own large-GEMM rate (DeepBench: the median
of its rows with every dimension >= 1024; the table: its rate at 8192^3). Rows are grouped
by their smallest dimension; per group the median relative rate of both sides and the
median of measured / modelled.

Writes benchmarks/results/gemm_v100_vs_deepbench.json.
Usage: python benchmarks/compare_gemm_deepbench.py [--table v100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling script below, also when loaded by path

from make_gemm_tables import DEEPBENCH_LARGE, deepbench_rows  # noqa: E402

from autoshard.hardware.gemm import GemmTable  # noqa: E402

OUT = HERE / "results" / "gemm_v100_vs_deepbench.json"
# smallest of M, N, K: (label, lowest, highest)
GROUPS = [("<= 64", 1, 64), ("65-256", 65, 256), ("257-1023", 257, 1023), (">= 1024", 1024, 10**9)]
LARGE = DEEPBENCH_LARGE  # DeepBench rows with every dimension at least this set its level


def compare(table_name: str) -> dict:
    """Per group of rows: count, median relative rate measured and modelled, and the
    median of their ratio (1.0: the table's shape dependence matches DeepBench's)."""
    table = GemmTable.load(table_name)
    rows = deepbench_rows()
    large_measured = statistics.median(
        r["tflops"] for r in rows if min(r["m"], r["n"], r["k"]) >= LARGE
    )
    large_model = table.tflops(8192, 8192, 8192, "fp16")
    groups = []
    for label, lo, hi in GROUPS:
        members = [r for r in rows if lo <= min(r["m"], r["n"], r["k"]) <= hi]
        if not members:
            continue
        measured = [r["tflops"] / large_measured for r in members]
        modelled = [table.tflops(r["m"], r["n"], r["k"], "fp16") / large_model for r in members]
        groups.append(
            {
                "smallest_dim": label,
                "rows": len(members),
                "median_measured_relative": round(statistics.median(measured), 3),
                "median_modelled_relative": round(statistics.median(modelled), 3),
                "median_measured_over_modelled": round(
                    statistics.median(a / b for a, b in zip(measured, modelled, strict=True)), 3
                ),
            }
        )
    return {
        "table": table_name,
        "deepbench_large_gemm_tflops": round(large_measured, 1),
        "table_tflops_8192_cubed": round(large_model, 1),
        "groups": groups,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="v100", help="a modelled V100 table (default v100)")
    args = parser.parse_args(argv)
    result = compare(args.table)
    print(
        f"{args.table}: DeepBench large GEMMs {result['deepbench_large_gemm_tflops']} TFLOP/s, "
        f"table at 8192^3 {result['table_tflops_8192_cubed']} TFLOP/s"
    )
    print("| smallest dim | rows | measured / large | modelled / large | measured / modelled |")
    print("|---|---|---|---|---|")
    for g in result["groups"]:
        print(
            f"| {g['smallest_dim']} | {g['rows']} | {g['median_measured_relative']:.2f} | "
            f"{g['median_modelled_relative']:.2f} | {g['median_measured_over_modelled']:.2f} |"
        )
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"(written to {OUT})")


if __name__ == "__main__":
    main()
