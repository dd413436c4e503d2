"""The GEMM profiler's jax-free parts: sizing a shape, the grid walk, raw files -> table.

The measuring itself needs a GPU (benchmarks/measure_gemm_table.py measure); its --quick
mode runs on the CPU, and a test runs it on a 3-size grid of one dtype.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_benchmark

from autoshard.hardware.gemm import GemmTable


@pytest.fixture(scope="module")
def profiler():
    return load_benchmark("measure_gemm_table")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("m, n, k", [(64, 64, 64), (1024, 1024, 1024), (64, 16384, 16384),
                                     (16384, 16384, 16384)])  # fmt: skip
def test_plan_shape_bounds_memory_and_burst(profiler, dtype, m, n, k):
    plan = profiler.plan_shape(m, n, k, dtype)
    operand_bytes = profiler.ITEMSIZE[dtype] * (m * k + k * n)
    assert 1 <= plan["copies"] <= profiler.MAX_COPIES
    assert 1 <= plan["calls"] <= profiler.MAX_CALLS
    assert plan["copies"] == 1 or plan["copies"] * operand_bytes <= profiler.MAX_OPERAND_BYTES
    # a burst lasts about BURST_S by the guess, unless a single call is already longer
    burst = plan["copies"] * plan["calls"] * plan["guess_s"]
    assert burst >= profiler.BURST_S or plan["calls"] == profiler.MAX_CALLS


def test_grid_order_finishes_a_coarse_grid_of_every_dtype_in_order(profiler):
    sizes = [64, 128, 256, 512, 1024]
    order = profiler._grid_order(sizes, ["bf16", "fp32"])
    assert len(order) == len(set(order)) == 2 * len(sizes) ** 3
    coarse = [64, 256, 1024]
    n_coarse = len(coarse) ** 3
    assert {o[1:] for o in order[:n_coarse]} == {
        (m, n, k) for m in coarse for n in coarse for k in coarse
    }
    assert all(o[0] == "bf16" for o in order[: len(sizes) ** 3])  # then bf16's fine grid
    fp32_coarse = order[len(sizes) ** 3 : len(sizes) ** 3 + n_coarse]
    assert all(o[0] == "fp32" and set(o[1:]) <= set(coarse) for o in fp32_coarse)


def _row(dtype, m, n, k, seconds):
    return {"dtype": dtype, "m": m, "n": n, "k": k, "median_s": seconds,
            "tflops": 2.0 * m * n * k / seconds / 1e12}  # fmt: skip


def _raw(rows, date="2026-11-22 19:00 UTC"):
    env = {"device_kind": "NVIDIA H100 80GB HBM3", "core_count": 132, "jax": "0.11.2",
           "jaxlib": "0.11.2", "platform_version": "cuda 13000", "date": date}  # fmt: skip
    return {"environment": env, "command": "measure", "rows": rows,
            "accuracy": {"bf16": {"size": 64, "relative_error": 1e-3}}}  # fmt: skip


def test_table_takes_the_finest_complete_grid(profiler, tmp_path):
    fine, coarse = [64, 128, 256], [64, 256]
    bf16 = [_row("bf16", m, n, k, 1e-5 * (1 + m / n)) for m in fine for n in fine for k in fine]
    fp32 = [_row("fp32", m, n, k, 1e-4) for m in coarse for n in coarse for k in coarse]
    fp32.append(_row("fp32", 128, 64, 64, 1e-4))  # a fine row, grid incomplete
    # two runs, the second resumed from the first: rows are tagged with the run that timed them
    merged = profiler.merge_raw([_raw(bf16[:5]), _raw(bf16 + fp32, "2026-11-23 08:00 UTC")])
    assert len(merged["rows"]) == len(bf16) + len(fp32)
    assert {r["run"] for r in merged["rows"][:5]} == {0}
    table = profiler.build_table(merged, "the command")
    assert table["source"].startswith("Measured, not modelled")
    assert "the command" in table["source"] and "not measured: fp16, tf32" in table["source"]
    assert table["dtypes"] == ["bf16", "fp32"]
    assert len(table["rows"]["bf16"]) == 27 and len(table["rows"]["fp32"]) == 8
    path = tmp_path / "h100.json"
    profiler.write_table(table, path)
    loaded = GemmTable.load(path)
    for r in bf16:
        assert math.isclose(
            loaded.tflops(r["m"], r["n"], r["k"], "bf16"), r["tflops"], rel_tol=1e-4
        )
    assert json.loads(path.read_text())["peak_tflops"] == {"bf16": 989.0, "fp32": 67.0}


def test_table_refuses_an_unknown_device_or_mixed_runs(profiler):
    rows = [_row("bf16", m, n, k, 1e-5) for m in (64, 128) for n in (64, 128) for k in (64, 128)]
    other = _raw(rows)
    other["environment"] = {**other["environment"], "device_kind": "Some GPU"}
    with pytest.raises(ValueError, match="no data-sheet peaks"):
        profiler.build_table(profiler.merge_raw([other]), "c")
    with pytest.raises(ValueError, match="different devices"):
        profiler.build_table(profiler.merge_raw([_raw(rows), other]), "c")


def test_measure_quick_runs_on_the_cpu_and_resumes(profiler, tmp_path, monkeypatch):
    out = tmp_path / "raw.json"
    argv = ["measure_gemm_table.py", "measure", "--quick", "--dtypes", "bf16", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    assert profiler.main() == 0
    raw = json.loads(out.read_text())
    assert len(raw["rows"]) == 27  # 16, 32, 64 cubed
    for r in raw["rows"]:
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert math.isclose(r["tflops"], 2 * r["m"] * r["n"] * r["k"] / r["median_s"] / 1e12)
    assert raw["accuracy"]["bf16"]["relative_error"] < 1e-2  # bf16 result rounding
    again = tmp_path / "raw2.json"
    monkeypatch.setattr("sys.argv", [*argv[:-1], str(again), "--resume", str(out)])
    assert profiler.main() == 0
    assert json.loads(again.read_text())["rows"] == raw["rows"]  # nothing left to time
