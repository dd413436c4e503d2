"""Write the modelled GEMM tables in autoshard/hardware/gemm_tables/ (v100, a100 and more).

No V100 or A100 was available to measure, so these tables are generated from a
documented roofline model. The h100 table is *measured* (benchmarks/measure_gemm_table.py
on one H100 SXM5, 2026-11-22) and this script no longer writes it; a measured table (same
format, written by that profiler) may replace either modelled one too.

Model, for C[M, N] = A[M, K] @ B[K, N] with element size e bytes:

    flops = 2 M N K
    bytes = e (M K + K N + M N)                     (each operand read or written once)
    tiles = ceil(M / 128) ceil(N / 128)             (128 x 128 output tiles)
    split = clamp(K / 512, 1, SMs / tiles)          (split-K when tiles do not fill the GPU)
    waves = tiles split / SMs
    tail  = waves / (waves + 0.15)                  (smoothed last-wave under-occupancy)
    time  = max(flops / (peak eff_large tail), bytes / hbm_bandwidth) + 4 us launch

``eff_large`` is the efficiency of large square GEMMs. 16-bit: the table's calibration
(A100 0.65 on Megatron-LM's SC21 Table 1, V100 0.49 on Alpa's published p3.16xlarge step,
``v100-megatron2019`` 0.36 on the single-GPU baseline of Megatron-LM's 2019 paper, the
same V100 under 2019 software;
``python benchmarks/validate_megatron.py --calibrate`` refits them, docs/validation.md):
effective figures that also absorb the overheads the step model leaves out; cuBLAS alone
reaches more on large fp16 GEMMs. Non-tensor-core fp32: 0.90; tf32: 0.75 (assumptions,
not calibrated).

Usage: python benchmarks/make_gemm_tables.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "autoshard" / "hardware" / "gemm_tables"
SIZES = [2**i for i in range(5, 17)]  # 32 .. 65536
LAUNCH_OVERHEAD_S = 4e-6
TILE = 128
TAIL_SMOOTHING = 0.15
# The simulator's calibrations, one per modelled device: the 16-bit large-GEMM efficiency
# that minimises the worst |error| over that device's calibration rows, on a 0.01 grid
# (`python benchmarks/validate_megatron.py --calibrate` finds them; benchmarks/
# published_runs.py lists the rows): A100 on Megatron-LM's SC21 Table 1, V100 on Alpa's
# published p3.16xlarge step. They are *effective*
# efficiencies that also absorb what the step model leaves out (docs/validation.md);
# cuBLAS alone reaches more on large fp16 GEMMs.
A100_CALIBRATED_EFFICIENCY = 0.65
V100_CALIBRATED_EFFICIENCY = 0.49
# The same V100 running Megatron-LM's 2019 code (PyTorch 1.x, no fused softmax, bias-GeLU or
# bias-dropout-add kernels): fitted to that paper's own single-GPU figure, 39 TFLOP/s for the
# 1.2B model ("30% of peak"), the one calibration row of the dgx2h-v100 preset.
V100_MEGATRON_2019_EFFICIENCY = 0.36
CALIBRATED = {
    "a100": A100_CALIBRATED_EFFICIENCY,
    "v100": V100_CALIBRATED_EFFICIENCY,
    "v100-megatron2019": V100_MEGATRON_2019_EFFICIENCY,
}

DEVICES = {
    "v100": {
        "device": "V100-SXM2-16GB",
        "sms": 80,
        "hbm_bandwidth": 900e9,
        "dtypes": {"fp16": (125.0, V100_CALIBRATED_EFFICIENCY, 2), "fp32": (15.7, 0.90, 4)},
        "calibrated_on": "Alpa's published p3.16xlarge step (2022 software)",
    },
    "v100-megatron2019": {
        "device": "V100-SXM3-32GB (DGX-2H) under Megatron-LM's 2019 software",
        "sms": 80,
        "hbm_bandwidth": 900e9,
        "dtypes": {"fp16": (130.0, V100_MEGATRON_2019_EFFICIENCY, 2), "fp32": (16.4, 0.90, 4)},
        "calibrated_on": "the single-GPU baseline of Megatron-LM 2019 (39 TFLOP/s, 1.2B model)",
    },
    "a100": {
        "device": "A100-SXM4-80GB",
        "sms": 108,
        "hbm_bandwidth": 2.0e12,
        "dtypes": {
            "bf16": (312.0, A100_CALIBRATED_EFFICIENCY, 2),
            "fp16": (312.0, A100_CALIBRATED_EFFICIENCY, 2),
            "tf32": (156.0, 0.75, 4),
            "fp32": (19.5, 0.90, 4),
        },
        "calibrated_on": "Megatron-LM SC21 Table 1",
    },
}


def roofline_gemm_tflops(
    m: int, n: int, k: int, peak_tflops: float, eff_large: float, itemsize: int, spec: dict
) -> float:
    """Achieved TFLOP/s of one GEMM under the model in the module docstring."""
    flops = 2.0 * m * n * k
    nbytes = itemsize * (m * k + k * n + m * n)
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    split = min(max(k / 512, 1.0), max(spec["sms"] / tiles, 1.0))
    waves = tiles * split / spec["sms"]
    tail = waves / (waves + TAIL_SMOOTHING)
    compute_s = flops / (peak_tflops * 1e12 * eff_large * tail)
    memory_s = nbytes / spec["hbm_bandwidth"]
    return flops / (max(compute_s, memory_s) + LAUNCH_OVERHEAD_S) / 1e12


def make_table(name: str, half_efficiency: float | None = None) -> dict:
    """The modelled table of ``name``; ``half_efficiency`` replaces the 16-bit large-GEMM
    efficiency (the calibrated one) -- what calibration scans."""
    spec = DEVICES[name]
    rows, peaks, effs = {}, {}, []
    for dtype, (peak, eff, itemsize) in spec["dtypes"].items():
        if half_efficiency is not None and itemsize == 2:
            eff = half_efficiency
        peaks[dtype] = peak
        effs.append(f"{dtype} {eff:.0%}")
        rows[dtype] = [
            [m, n, k, float(f"{roofline_gemm_tflops(m, n, k, peak, eff, itemsize, spec):.5g}")]
            for m in SIZES
            for n in SIZES
            for k in SIZES
        ]
    source = (
        f"Modelled, not measured: large GEMMs at {', '.join(effs)} of the data-sheet peak "
        "(the 16-bit figure is this table's calibration, fitted to published end-to-end "
        f"training throughput: {spec['calibrated_on']}; an effective value that absorbs "
        "overheads the step model omits; benchmarks/published_runs.py, docs/validation.md); "
        "smaller and "
        "skinny shapes follow a roofline, time = max(flops / (peak x eff x wave tail), "
        "bytes / HBM bandwidth) + 4 us launch, written by benchmarks/make_gemm_tables.py."
    )
    return {
        "device": spec["device"],
        "dtypes": sorted(rows),
        "peak_tflops": peaks,
        "source": source,
        "rows": rows,
    }


def write_table(name: str) -> Path:
    table = make_table(name)
    path = OUT_DIR / f"{name}.json"
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = [json.dumps(head)[:-1] + ', "rows": {']
    for i, (dtype, rows) in enumerate(table["rows"].items()):
        body = ",\n".join("  " + json.dumps(r) for r in rows)
        lines.append(
            f"{json.dumps(dtype)}: [\n{body}\n]" + ("," if i < len(table["rows"]) - 1 else "")
        )
    lines.append("}}")
    path.write_text("\n".join(lines) + "\n")
    json.loads(path.read_text())  # the file must parse
    return path


def main() -> None:
    for name in DEVICES:
        print(f"wrote {write_table(name)}")


if __name__ == "__main__":
    main()
