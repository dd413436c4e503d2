"""Exact mode of the simulator: the plan compiled on fake CPU devices, next to the model."""

import argparse
import dataclasses
import json

import jax
import pytest

from autoshard.api import plan_workload, xla_cpu_memory_layout
from autoshard.hardware.clusters import load_cluster
from autoshard.hardware.gemm import GemmTable
from autoshard.hardware.mesh import to_device_mesh
from autoshard.intra.memory.model import predicted_peak_bytes
from autoshard.intra.problem.options import IntraOptions
from autoshard.sim.exact import MAX_EXACT_DEVICES, check_exact_devices
from autoshard.sim.simulate import simulate
from autoshard.verify.check import verify_plan

# 2 blocks of GPT-125m on 8 GPUs (conftest: 8 fake CPU devices): ~10 s per compile
SMALL = dict(num_layers=2, global_batch=16)
EXACT_KEYS = (
    "compiled_peak_bytes",
    "predicted_peak_bytes",
    "memory_error",
    "compiled_collective_bytes",
    "predicted_collective_bytes",
    "compile_seconds",
    "devices",
    "fits_hbm",
    "notes",
)


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_dp_exact_numbers_are_the_compiled_executables():
    report = simulate("gpt-125m", "dgx-a100", 8, "dp", microbatch_size=2, exact=True, **SMALL)
    exact = report.exact
    assert exact.available and exact.devices == 8 and exact.mesh_dp_tp == (8, 1)
    assert exact.compiled_batch == 16  # micro-batch 2 on each of 8 replicas, 1 micro-batch
    assert exact.predicted_peak_bytes == report.peak_bytes_per_device
    # the same plan built and compiled independently: the numbers are XLA's
    cluster = load_cluster("dgx-a100", 8)
    mesh = to_device_mesh(
        cluster, (8, 1), ("data", "model"), "bf16", GemmTable.load(cluster.device.gemm_table)
    )
    bound = plan_workload(
        "gpt-125m", mesh, baseline="dp", options=IntraOptions(solver="highs", time_limit_s=20.0),
        num_layers=2, batch_size=16, dtype="bfloat16",
    )  # fmt: skip
    want = verify_plan(bound.program, bound.plan, devices=jax.devices()[:8])
    assert exact.compiled_peak_bytes == want.compiled_peak_bytes > 0
    # the intra-op prediction in this jaxlib's XLA:CPU layout (what was compiled), not the
    # GPUs' one
    spec_of = bound.plan.specs_by_tensor(bound.graph.inputs)
    cpu = dataclasses.replace(mesh, memory_layout=xla_cpu_memory_layout())
    cpu_layout = predicted_peak_bytes(bound.graph, spec_of, cpu, bound.plan.operand_specs)
    assert exact.intra_predicted_peak_bytes == cpu_layout
    assert exact.intra_predicted_peak_bytes != want.predicted_peak_bytes  # the GPU layout
    compiled = {
        f"{r.kind}@{','.join(r.axes)}": r.compiled_bytes
        for r in want.comparison.rows
        if r.compiled_count
    }
    assert dict(exact.compiled_collective_bytes) == compiled
    assert exact.memory_error == pytest.approx(
        abs(report.peak_bytes_per_device - want.compiled_peak_bytes) / want.compiled_peak_bytes
    )
    assert exact.fits_hbm == (want.compiled_peak_bytes <= cluster.device.hbm_bytes)
    # the gradient all-reduce over the data axis: compiled as the plan predicts
    grads = exact.compiled_collective_bytes["all-reduce@data"]
    assert grads == pytest.approx(exact.predicted_collective_bytes["all-reduce@data"], rel=0.02)
    data = report.to_json()["exact"]
    for key in EXACT_KEYS:
        assert key in data, key
    json.dumps(data)


def test_megatron_exact_on_a_dp_tp_mesh_with_notes():
    report = simulate(
        "gpt-125m", "dgx-a100", 8, "megatron:2x1x4", microbatch_size=1, recompute="full",
        exact=True, num_layers=2, global_batch=8,
    )  # fmt: skip
    exact = report.exact
    assert exact.available and exact.mesh_dp_tp == (4, 2) and exact.intra_plan == "megatron"
    assert exact.compiled_batch == 4  # micro-batch 1 x DP 4; the step runs 2 micro-batches
    for side in (exact.compiled_collective_bytes, exact.predicted_collective_bytes):
        assert side["all-reduce@model"] > 0  # tensor parallel: activations reduced over TP
        assert side["all-reduce@data"] > 0  # data parallel: gradients reduced over DP
    notes = " ".join(exact.notes)
    assert "recomputes activations (full)" in notes
    assert "runs 2 micro-batches" in notes
    assert "Megatron-LM" in notes


def test_pipelines_are_reported_unavailable_with_the_reason():
    report = simulate("gpt-125m", "dgx-a100", 8, "megatron:2x2x2", exact=True, **SMALL)
    assert not report.exact.available
    assert "2 pipeline stages" in report.exact.why and "pp = 1" in report.exact.why
    assert report.to_json()["exact"] == {"available": False, "why": report.exact.why}
    assert report.step_time_s > 0  # the simulation itself is still reported


def test_device_guards():
    check_exact_devices(MAX_EXACT_DEVICES)
    with pytest.raises(ValueError, match=f"at most {MAX_EXACT_DEVICES}"):
        check_exact_devices(MAX_EXACT_DEVICES + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_EXACT_DEVICES}"):
        simulate("gpt-125m", "dgx-h100", 1024, "dp", exact=True, num_layers=2)
    with pytest.raises(ValueError, match="needs 16 CPU devices but JAX has 8"):
        simulate("gpt-125m", "dgx-a100", 16, "dp", exact=True, **SMALL)


def _cli(*argv):
    from autoshard.cli.simulate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_cli_exact_unavailable_in_text_and_json(capsys):
    argv = ["--model", "gpt-125m", "--cluster", "dgx-a100", "--gpus", "8", "--exact"]
    assert _cli(*argv, "--plan", "megatron:1x4x2", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exact"]["available"] is False and "4 pipeline stages" in data["exact"]["why"]
    assert _cli(*argv, "--plan", "megatron:1x4x2") == 0
    assert "exact mode: not available" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, devices",
    [
        (["--gpus", "16", "--exact"], 16),
        (["--gpus", "16"], None),
        (["--gpus", "1024", "--exact"], None),  # over the guard: simulate() raises
        (["--gpus", "16", "--exact", "--plan", "dp"], 16),
    ],
)
def test_cli_sets_one_fake_device_per_gpu_for_exact(monkeypatch, argv, devices):
    import autoshard.cli.main as cli
    import autoshard.cli.simulate as cli_simulate

    seen = []
    monkeypatch.setattr(cli, "_setup_devices", seen.append)
    monkeypatch.setattr(cli_simulate, "cmd_simulate", lambda args: 0)
    argv = ["simulate", "--model", "gpt-125m", "--cluster", "dgx-h100", *argv]
    assert cli.main(argv) == 0
    assert seen == [devices]


def test_auto_with_one_stage_compiles_the_ilp_plan_on_its_logical_mesh():
    report = simulate(
        "gpt-125m", "alpa-v100", 1, "auto", recompute="none", exact=True, **SMALL
    )  # fmt: skip
    (stage,) = report.plan["stages"]
    exact = report.exact
    assert exact.available and exact.intra_plan == "auto" and exact.devices == 1
    assert list(exact.mesh_dp_tp) == stage["logical_mesh_dp_tp"] == [1, 1]
    assert exact.compiled_batch == report.plan["microbatch_size"]  # spans all devices
    assert exact.predicted_peak_bytes == report.peak_bytes_per_device == stage["peak_bytes"]
    assert exact.compiled_peak_bytes > 0 and not exact.compiled_collective_bytes  # one device
