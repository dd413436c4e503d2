"""What-if: the shape of the 2019 software's per-step tensor-parallel cost (V100 rows).

The shipped model charges Megatron-LM 2019's runs ``c (1 - 1/t)`` seconds per step beyond
their collectives (``make_gemm_tables.CALIBRATED_TP_STEP_OVERHEAD_S``, docs/validation.md),
``c`` fitted to the paper's three model-parallel weak-scaling runs. The form was chosen
before it was fitted (the shape the missing time of the strong-scaling rows had suggested,
2026-11-25); this script shows how much the validation result depends on it. Each form
g(t) is fitted the same way (minimise the worst |error| over the three calibration runs,
0.005 s grid) on top of the shipped level with the cost at 0, and every other row is
priced with it. Forms: ``1 - 1/t`` (shipped), ``log2 t``, ``t - 1`` (ring steps),
``1`` for t > 1 (a constant).

Usage: python benchmarks/studies/tp_overhead_forms.py [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE))  # the sibling scripts below, also when loaded by path

import make_gemm_tables  # noqa: E402
import validate_megatron  # noqa: E402
from published_runs import SHOEYBI_19  # noqa: E402

from autoshard.hardware.gemm import GemmTable  # noqa: E402

TABLE = "v100-megatron2019"
FORMS = {
    "1 - 1/t": lambda t: 1 - 1 / t,
    "log2 t": lambda t: math.log2(t),
    "t - 1": lambda t: t - 1.0,
    "1 (t > 1)": lambda t: 1.0 if t > 1 else 0.0,
}
GRID = [round(0.005 * i, 3) for i in range(301)]  # 0 .. 1.5 s


def _error(base: dict, run, extra_s: float) -> float:
    """Throughput error with ``extra_s`` added to the step (a rate scales as 1/step)."""
    step = base["result"].step_time_s
    return (1 + base["error"]) * step / (step + extra_s) - 1


def analyse() -> dict:
    eff = make_gemm_tables.CALIBRATED[TABLE]
    table = GemmTable.from_json(make_gemm_tables.make_table(TABLE, eff, 0.0), f"{TABLE}@{eff}")
    base = {run.name: validate_megatron.price(run, table) for run in SHOEYBI_19}
    tp_calibration = [r for r in SHOEYBI_19 if r.role == "calibration" and r.tp > 1]
    validation = [r for r in SHOEYBI_19 if r.role == "validation"]
    out = {"table": TABLE, "efficiency": eff, "forms": []}
    for name, g in FORMS.items():
        c, worst = min(
            ((c, max(abs(_error(base[r.name], r, c * g(r.tp))) for r in tp_calibration))
             for c in GRID),
            key=lambda cw: cw[1],
        )  # fmt: skip
        rows = [
            {"model": r.name, "error_percent": round(100 * _error(base[r.name], r, c * g(r.tp)), 2)}
            for r in validation
        ]
        errors = [abs(x["error_percent"]) for x in rows]
        out["forms"].append(
            {
                "form": name,
                "c_s": c,
                "calibration_worst_abs_error_percent": round(100 * worst, 2),
                "validation_mean_abs_error_percent": round(sum(errors) / len(errors), 2),
                "validation_max_abs_error_percent": round(max(errors), 2),
                "rows": rows,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    result = analyse()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    names = [r["model"] for r in result["forms"][0]["rows"]]
    print(f"{TABLE}, level {result['efficiency']:.2f}; throughput error on the validation rows")
    print("| form g(t) | c (s) | calibration worst | validation mean | validation worst | "
          + " | ".join(names) + " |")  # fmt: skip
    print("|---" * (5 + len(names)) + "|")
    for f in result["forms"]:
        print(
            f"| {f['form']} | {f['c_s']:.3f} | {f['calibration_worst_abs_error_percent']:.1f}% | "
            f"{f['validation_mean_abs_error_percent']:.1f}% | "
            f"{f['validation_max_abs_error_percent']:.1f}% | "
            + " | ".join(f"{r['error_percent']:+.1f}%" for r in f["rows"])
            + " |"
        )


if __name__ == "__main__":
    main()
