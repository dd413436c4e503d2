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

The V100 tables' 16-bit rows then follow a published measurement for skinny GEMMs: Baidu
DeepBench's V100 fp16 GEMM timings (benchmarks/results/deepbench_v100_fp16_gemm.json, CUDA
10.1). For each DeepBench row, q = (measured / DeepBench's large-GEMM rate) / (roofline /
roofline at 8192^3): how much slower, *relative to its own large GEMMs*, the shape ran than
the roofline says (a ratio of rates, so the calibrated level stays the calibrated level).
The median q of the rows whose smallest dimension is nearest (in log2) to each power of two
8 .. 512 is an anchor; the factor c(d) is piecewise linear in log2 d between anchors,
constant below the first, 1 from 1024 up (DeepBench's large rows set the level), capped
at 1, and multiplies the roofline rate of every shape by c(smallest of M, N, K).
Assumption (made before looking at any validation error): the factor depends on the
smallest dimension only, whichever of M, N, K it is (DeepBench's skinny rows are skinny in
M or N; a small K, as in the attention GEMMs, is priced by the same curve).

``eff_large`` is the efficiency of large square GEMMs. 16-bit: the table's calibration
(A100 0.65 on Megatron-LM's SC21 Table 1, V100 0.53 on Alpa's published p3.16xlarge step,
``v100-megatron2019`` 0.40 on the single-GPU baseline of Megatron-LM's 2019 paper, the
same V100 under 2019 software;
``python benchmarks/validate_megatron.py --calibrate`` refits them, docs/validation.md):
effective figures that also absorb the overheads the step model leaves out; cuBLAS alone
reaches more on large fp16 GEMMs. Non-tensor-core fp32: 0.90; tf32: 0.75 (assumptions,
not calibrated).

Usage: python benchmarks/make_gemm_tables.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "autoshard" / "hardware" / "gemm_tables"
DEEPBENCH = Path(__file__).resolve().parent / "results" / "deepbench_v100_fp16_gemm.json"
DEEPBENCH_LARGE = 1024  # DeepBench rows with every dimension at least this set its level
DEEPBENCH_ANCHORS = [8, 16, 32, 64, 128, 256, 512]  # smallest dimensions with a factor
SIZES = [2**i for i in range(5, 17)]  # 32 .. 65536
# the tables fitted to DeepBench also cover its skinniest GEMMs (a batch of 8 or 16 rows)
SKINNY_SIZES = [2**i for i in range(3, 17)]  # 8 .. 65536
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
A100_CALIBRATED_EFFICIENCY = 0.67
V100_CALIBRATED_EFFICIENCY = 0.52
# The same V100 running Megatron-LM's 2019 code (PyTorch 1.x, no fused softmax, bias-GeLU or
# bias-dropout-add kernels): fitted to that paper's own single-GPU figure, 39 TFLOP/s for the
# 1.2B model ("30% of peak"), the one calibration row of the dgx2h-v100 preset.
V100_MEGATRON_2019_EFFICIENCY = 0.40
CALIBRATED = {
    "a100": A100_CALIBRATED_EFFICIENCY,
    "v100": V100_CALIBRATED_EFFICIENCY,
    "v100-megatron2019": V100_MEGATRON_2019_EFFICIENCY,
}
# The 2019 software's per-step cost of tensor parallelism, c in c (1 - 1/t) seconds: the
# time its model-parallel runs took beyond what the step model prices (collectives
# included) depends on the model-parallel degree and hardly on the model (docs/validation.md,
# "A per-step cost of tensor parallelism"). Fitted after the level (which a 1-GPU row fixes
# and c does not touch) to the three model-parallel weak-scaling rows of that paper's
# Figure 5 (2.5B on 2, 4.2B on 4, 8.3B on 8 GPUs), on a 0.01 s grid, minimising the worst
# |error| (`python benchmarks/validate_megatron.py --calibrate`). No other table has one.
V100_MEGATRON_2019_TP_STEP_OVERHEAD_S = 0.28
CALIBRATED_TP_STEP_OVERHEAD_S = {
    "v100-megatron2019": V100_MEGATRON_2019_TP_STEP_OVERHEAD_S,
}

DEVICES = {
    "v100": {
        "device": "V100-SXM2-16GB",
        "sms": 80,
        "hbm_bandwidth": 900e9,
        "dtypes": {"fp16": (125.0, V100_CALIBRATED_EFFICIENCY, 2), "fp32": (15.7, 0.90, 4)},
        "calibrated_on": "Alpa's published p3.16xlarge step (2022 software)",
        "small_shapes": "deepbench",
    },
    "v100-megatron2019": {
        "device": "V100-SXM3-32GB (DGX-2H) under Megatron-LM's 2019 software",
        "sms": 80,
        "hbm_bandwidth": 900e9,
        "dtypes": {"fp16": (130.0, V100_MEGATRON_2019_EFFICIENCY, 2), "fp32": (16.4, 0.90, 4)},
        "calibrated_on": "the single-GPU baseline of Megatron-LM 2019 (39 TFLOP/s, 1.2B model)",
        "small_shapes": "deepbench",
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


def deepbench_rows() -> list[dict]:
    """DeepBench's V100 fp16 dense-GEMM rows with a measured time (one transcribed row
    carries a note in place of its time and is left out)."""
    data = json.loads(DEEPBENCH.read_text())
    rows = [dict(zip(data["columns"], r, strict=True)) for r in data["rows"]]
    return [r for r in rows if isinstance(r["time_ms"], (int, float))]


def deepbench_large_tflops(rows: list[dict]) -> float:
    """DeepBench's large-GEMM rate: the median over rows with every dimension >= 1024."""
    return statistics.median(
        r["tflops"] for r in rows if min(r["m"], r["n"], r["k"]) >= DEEPBENCH_LARGE
    )


def small_shape_anchors(peak: float, eff: float, itemsize: int, spec: dict) -> dict[int, float]:
    """{smallest dimension: median of (measured / large) / (roofline / roofline at 8192^3)}
    over DeepBench's rows nearest (in log2) to each anchor of ``DEEPBENCH_ANCHORS``."""
    rows = deepbench_rows()
    large_measured = deepbench_large_tflops(rows)
    large_model = roofline_gemm_tflops(8192, 8192, 8192, peak, eff, itemsize, spec)
    groups: dict[int, list[float]] = {}
    for r in rows:
        d = min(r["m"], r["n"], r["k"])
        if d >= DEEPBENCH_LARGE:
            continue
        anchor = min(DEEPBENCH_ANCHORS, key=lambda a: abs(math.log2(d / a)))
        model = roofline_gemm_tflops(r["m"], r["n"], r["k"], peak, eff, itemsize, spec)
        groups.setdefault(anchor, []).append((r["tflops"] / large_measured) / (model / large_model))
    return {a: statistics.median(q) for a, q in sorted(groups.items())}


def small_shape_factor(d: float, anchors: dict[int, float]) -> float:
    """c(d): the anchors interpolated linearly in log2 d, constant below the first, 1 from
    ``DEEPBENCH_LARGE`` up, never above 1."""
    points = [*anchors.items(), (DEEPBENCH_LARGE, 1.0)]
    x = math.log2(max(d, points[0][0]))
    for (a0, c0), (a1, c1) in zip(points, points[1:], strict=False):
        if x <= math.log2(a1):
            frac = (x - math.log2(a0)) / (math.log2(a1) - math.log2(a0))
            return min(1.0, c0 + frac * (c1 - c0))
    return 1.0


def make_table(
    name: str, half_efficiency: float | None = None, tp_step_overhead_s: float | None = None
) -> dict:
    """The modelled table of ``name``; ``half_efficiency`` replaces the 16-bit large-GEMM
    efficiency (the calibrated one) and ``tp_step_overhead_s`` the per-step tensor-parallel
    cost (``CALIBRATED_TP_STEP_OVERHEAD_S``; 0 for a table without one) -- what calibration
    scans."""
    if tp_step_overhead_s is None:
        tp_step_overhead_s = CALIBRATED_TP_STEP_OVERHEAD_S.get(name) or 0.0
    spec = DEVICES[name]
    rows, peaks, effs = {}, {}, []
    for dtype, (peak, eff, itemsize) in spec["dtypes"].items():
        if half_efficiency is not None and itemsize == 2:
            eff = half_efficiency
        peaks[dtype] = peak
        effs.append(f"{dtype} {eff:.0%}")
        anchors = None
        if spec.get("small_shapes") == "deepbench" and itemsize == 2:
            anchors = small_shape_anchors(peak, eff, itemsize, spec)
        rows[dtype] = []
        sizes = SKINNY_SIZES if spec.get("small_shapes") == "deepbench" else SIZES
        for m in sizes:
            for n in sizes:
                for k in sizes:
                    rate = roofline_gemm_tflops(m, n, k, peak, eff, itemsize, spec)
                    if anchors is not None:
                        rate *= small_shape_factor(min(m, n, k), anchors)
                    rows[dtype].append([m, n, k, float(f"{rate:.5g}")])
    source = (
        f"Modelled, not measured: large GEMMs at {', '.join(effs)} of the data-sheet peak "
        "(the 16-bit figure is this table's calibration, fitted to published end-to-end "
        f"training throughput: {spec['calibrated_on']}; an effective value that absorbs "
        "overheads the step model omits; benchmarks/published_runs.py, docs/validation.md); "
        "smaller and "
        "skinny shapes follow a roofline, time = max(flops / (peak x eff x wave tail), "
        "bytes / HBM bandwidth) + 4 us launch, written by benchmarks/make_gemm_tables.py."
    )
    if spec.get("small_shapes") == "deepbench":
        source += (
            " 16-bit shapes whose smallest dimension is under 1024 are scaled by Baidu "
            "DeepBench's measured V100 fp16 rate relative to its large GEMMs "
            "(benchmarks/results/deepbench_v100_fp16_gemm.json), by smallest dimension."
        )
    table = {
        "device": spec["device"],
        "dtypes": sorted(rows),
        "peak_tflops": peaks,
        "source": source,
    }
    if tp_step_overhead_s:
        table["source"] += (
            f" Tensor parallelism costs this software {tp_step_overhead_s:g} s x (1 - 1/t) "
            "per step beyond its collectives (tp_step_overhead_s; fitted to the paper's "
            "model-parallel weak-scaling runs, docs/validation.md)."
        )
        table["tp_step_overhead_s"] = tp_step_overhead_s
    table["rows"] = rows
    return table


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
    parser = argparse.ArgumentParser(
        description="Write the modelled GEMM tables (autoshard/hardware/gemm_tables/<device>.json) "
        f"of {', '.join(DEVICES)}; takes no options."
    )
    parser.parse_args()
    for name in DEVICES:
        print(f"wrote {write_table(name)}")


if __name__ == "__main__":
    main()
