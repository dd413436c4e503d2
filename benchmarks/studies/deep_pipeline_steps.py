"""What-if: the A100 validation rows under each step-model change of issue #32, one at a time.

Prices Korthikanti et al.'s four rows (benchmarks/published_runs.py) with the a100 table
at its former level (0.65) -- without the overlapped reduce-scatter, then with it -- and
at the shipped level (0.67, refitted after SC21's rows were priced with 2021's unfused
gradient accumulation). The bubble change (the other stages' time) is in every line: the
code has no switch for it. Answer in docs/validation.md ("Deep pipelines").

Usage: python benchmarks/studies/deep_pipeline_steps.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_gemm_tables  # noqa: E402
import validate_megatron  # noqa: E402
from published_runs import KORTHIKANTI_22  # noqa: E402

from autoshard.hardware.gemm import GemmTable  # noqa: E402


def main() -> None:
    steps = [
        ("bubble, a100 at 0.65", 0.65, False),
        ("+ overlapped reduce-scatter, 0.65", 0.65, None),
        ("+ SC21 unfused accumulation, refit 0.67", make_gemm_tables.CALIBRATED["a100"], None),
    ]
    for label, eff, overlap in steps:
        table = GemmTable.from_json(make_gemm_tables.make_table("a100", eff), f"a100@{eff}")
        errors = [
            100
            * validate_megatron.price(dataclasses.replace(r, tp_comm_overlap=overlap), table)[
                "error"
            ]
            for r in KORTHIKANTI_22
        ]
        cells = " | ".join(f"{r.name} {e:+.1f}%" for r, e in zip(KORTHIKANTI_22, errors))
        mean = sum(abs(e) for e in errors) / len(errors)
        print(f"{label}: {cells} | mean {mean:.1f}%, worst {max(map(abs, errors)):.1f}%")


if __name__ == "__main__":
    main()
