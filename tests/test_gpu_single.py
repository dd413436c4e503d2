"""benchmarks/gpu_single.py off the GPU: its --quick measurement on the CPU, the prediction
side, and how it names the kernels of a GPU profile (a synthetic one here)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def gpu_single():
    return load_benchmark("gpu_single")


def test_attention_squares_are_told_from_activations_when_hidden_equals_seq(gpu_single):
    # gpt-350m: hidden 1024 = seq 1024, 16 heads, batch 8 -> B H = 128
    assert gpu_single._is_attention_square((8, 16, 1024, 1024), 1024, 128)
    assert gpu_single._is_attention_square((128, 1024, 1024), 1024, 128)
    assert not gpu_single._is_attention_square((8, 1024, 1024), 1024, 128)  # [B, S, h]
    assert not gpu_single._is_attention_square((1024, 1024), 1024, 128)  # a weight
    assert not gpu_single._is_attention_square((8, 16, 1024), 1024, 128)


HLO = """\
ENTRY %main {
  %get-tuple-element.1 = bf16[128,1024,1024]{2,1,0} get-tuple-element(%t), index=0
  %fusion.7 = f32[8,16,1024]{2,1,0} fusion(%get-tuple-element.1), kind=kCustom, calls=%c, metadata={op_name="jit(train_step)/jvp(GPT)/block_0/attn/reduce_sum"}
  %loop_add_fusion.3 = f32[1024,4096]{1,0} fusion(%p, %q), kind=kLoop, calls=%d, metadata={op_name="jit(train_step)/add"}
  %input_reduce_fusion = f32[64,1024]{1,0} fusion(%x), kind=kInput, calls=%e, metadata={op_name="jit(train_step)/transpose(jvp(GPT))/block_3/ln_2/reduce_sum"}
}
"""


def test_measured_breakdown_names_kernels_through_the_hlo(gpu_single):
    kernels = [
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 3000.0),  # cuBLAS
        ("gemm_fusion_dot_12", 1500.0),  # XLA's Triton GEMM
        ("fusion_7", 900.0),  # reads the S x S scores
        ("loop_add_fusion_3", 300.0),  # the optimizer update
        ("input_reduce_fusion", 150.0),  # a LayerNorm reduction
        ("mystery_kernel_9", 60.0),
    ]
    top = [{"name": n, "us": us, "count": 3} for n, us in kernels]
    total_us = sum(us for _, us in kernels) / 3
    run = {"model": "gpt-350m", "batch": 8, "seq_len": 1024, "step_time_s": 0.003,
           "profile": {"steps": 3, "top_kernels": top, "kernel_us_per_step": total_us,
                       "kernels_per_step": 6}}  # fmt: skip
    named = gpu_single.measured_breakdown(run, HLO)
    assert named["gemm"] == pytest.approx(1.5e-3)
    assert named["attention_sxs"] == pytest.approx(0.3e-3)
    assert named["optimizer"] == pytest.approx(0.1e-3)
    assert named["other_memory_bound"] == pytest.approx(0.05e-3)
    assert named["unnamed"] == pytest.approx(0.02e-3)
    assert named["idle_between_kernels"] == pytest.approx(0.003 - total_us / 1e6)
    assert named["not_profiled"] == pytest.approx(0.0, abs=1e-12)
    plain = gpu_single.measured_breakdown(run, None)  # without the HLO: GEMM or not
    assert plain["gemm"] == pytest.approx(1.5e-3)
    assert plain["other_kernels"] == pytest.approx((900 + 300 + 150 + 60) / 3 / 1e6)
    assert gpu_single.measured_breakdown({**run, "profile": {"error": "x"}}, HLO) is None


def test_measure_then_predict_on_the_cpu(gpu_single, tmp_path, monkeypatch):
    measured = tmp_path / "measured.json"
    monkeypatch.setattr(
        "sys.argv", ["gpu_single.py", "measure", "--quick", "--steps", "2", "--out", str(measured)]
    )
    assert gpu_single.main() == 0
    run = json.loads(measured.read_text())["runs"][0]
    assert "error" not in run, run.get("error")
    assert len(run["step_times_s"]) == 2 and run["step_time_s"] > 0
    mem = run["memory_analysis"]
    assert mem["compiled_peak_bytes"] == (
        mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
    )
    assert mem["alias_bytes"] > 0  # params and optimizer state are donated
    out = tmp_path / "predicted.json"
    monkeypatch.setattr(
        "sys.argv", ["gpu_single.py", "predict", "--measured", str(measured), "--out", str(out)]
    )
    assert gpu_single.main() == 0
    row = json.loads(out.read_text())["rows"][0]
    pred = row["predicted"]
    for program in ("megatron-lm", "traced"):
        err = row["errors"][f"step_time_{program.replace('-', '_')}"]
        assert math.isclose(
            err, pred[program]["step_time_s"] / row["measured_step_time_s"] - 1, rel_tol=1e-9
        )
    # the breakdown prices the whole step as one graph; the simulator prices it layer by
    # layer (a tensor crossing a layer boundary is a buffer there), a little more
    total = sum(pred["traced_breakdown_s"].values())
    assert 0.9 * pred["traced"]["step_time_s"] <= total <= pred["traced"]["step_time_s"]
    assert pred["intra_predicted_peak_bytes"] > 0
