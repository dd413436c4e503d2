"""``simulate``'s published-configuration knobs and its step breakdown.

Model dimensions (``--layers --hidden --heads --seq --vocab``), one meaning per
micro-batch flag (``--microbatch-size`` per data-parallel replica, ``--microbatches`` per
step), ``--sequence-parallel``, ``--virtual-stages``; bad combinations exit 2 with a
message; ``step_breakdown`` adds up to the step time on every path.
"""

from __future__ import annotations

import json
import math

import pytest

from autoshard.cli.main import main
from autoshard.sim.breakdown import STEP_COMPONENTS, step_breakdown
from autoshard.sim.simulate import simulate

BASE = ["simulate", "--model", "gpt-2.6b", "--cluster", "alpa-v100", "--gpus", "8"]
SMALL_AUTO = dict(global_batch=16, num_layers=2, ilp_time_limit_s=20)


def _run(capsys, *argv):
    code = main([*BASE, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _check_breakdown(report) -> None:
    parts = report.step_breakdown
    assert set(STEP_COMPONENTS) <= set(parts)
    assert all(k in STEP_COMPONENTS or k.startswith("comm_") for k in parts)
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(report.step_time_s, rel=1e-9)
    assert report.to_json()["step_breakdown"] == dict(parts)


def test_dimension_flags_reach_the_model(capsys):
    """--layers/--hidden/--heads/--seq/--vocab change the simulated model: halving the
    layers of a 1x1x8 data-parallel run (no pipeline) about halves the layer compute."""
    argv = ["--plan", "megatron:1x1x8", "--global-batch", "64", "--microbatch-size", "8"]
    code, out, _ = _run(capsys, *argv, "--json")
    full = json.loads(out)
    code2, out2, _ = _run(
        capsys, *argv, "--layers", "16", "--hidden", "2560", "--heads", "40", "--seq", "1024",
        "--vocab", "51200", "--json",
    )  # fmt: skip
    half = json.loads(out2)
    # exit 1: the plan does not fit the V100's 16 GiB (the step is still priced, in --json)
    assert (code, code2) == (int(full["oom"]), int(half["oom"]))
    ratio = half["step_breakdown"]["compute"] / full["step_breakdown"]["compute"]
    assert 0.5 < ratio < 0.6  # the embedding and logits do not halve
    # heads change only the attention-score GEMMs' shapes: a different, finite step
    code3, out3, _ = _run(capsys, *argv, "--heads", "20", "--json")
    third = json.loads(out3)
    assert code3 == int(third["oom"]) and third["step_time_s"] != full["step_time_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "7"], "divisible"),
        (["--plan", "auto", "--microbatch-size", "2"], "--microbatches"),
        (["--microbatch-size", "2", "--microbatches", "4"], "not both"),
        (["--plan", "dp", "--sequence-parallel"], "tensor-parallel"),
        (["--plan", "megatron:1x2x4", "--sequence-parallel"], "TP = 1"),
        (["--plan", "auto", "--sequence-parallel"], "Megatron-LM's program only"),
        (["--plan", "megatron", "--program", "traced", "--virtual-stages", "2"], "only"),
        (["--plan", "megatron:2x1x4", "--virtual-stages", "2"], "interleaving needs pp > 1"),
        (["--plan", "zero3", "--virtual-stages", "2"], "has none"),
        (["--plan", "megatron:2x2x2", "--virtual-stages", "3"], "layers 32 do not split"),
        (["--plan", "megatron:2x2x2", "--global-batch", "31"], "global batch 31"),
        (["--plan", "megatron:2x1x4", "--sequence-parallel", "--exact"], "drop --exact"),
    ],
)
def test_bad_combinations_exit_2_with_a_message(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_microbatch_size_is_per_replica_and_microbatches_per_step():
    """One meaning each: micro-batch 2 per replica on DP 4 with global batch 32 is 4
    micro-batches per step, and asking for 4 micro-batches gives the same simulation."""
    kw = dict(global_batch=32, recompute="full")
    by_size = simulate("gpt-2.6b", "alpa-v100", 8, "megatron:2x1x4", microbatch_size=2, **kw)
    by_count = simulate("gpt-2.6b", "alpa-v100", 8, "megatron:2x1x4", num_microbatches=4, **kw)
    assert by_size.plan["microbatch_size"] == 2 and by_size.plan["num_microbatches"] == 4
    assert by_count.to_json() == {**by_size.to_json(), "search_seconds": by_count.search_seconds}


def test_interleaving_shrinks_the_bubble_and_sequence_parallel_the_memory():
    kw = dict(global_batch=64, microbatch_size=1, recompute="selective")
    plain = simulate("gpt-2.6b", "alpa-v100", 8, "megatron:2x4x1", **kw)
    inter = simulate("gpt-2.6b", "alpa-v100", 8, "megatron:2x4x1", virtual_stages=2, **kw)
    sp = simulate("gpt-2.6b", "alpa-v100", 8, "megatron:2x4x1", sequence_parallel=True, **kw)
    for r in (plain, inter, sp):
        _check_breakdown(r)
    assert inter.plan["virtual_stages"] == 2 and sp.plan["sequence_parallel"] is True
    # bubble (p - 1) / v slowest-stage times: half, up to the extra point-to-point sends
    ratio = inter.step_breakdown["pipeline_bubble"] / plain.step_breakdown["pipeline_bubble"]
    assert 0.5 <= ratio < 0.55
    assert inter.step_breakdown["comm_pipe"] > plain.step_breakdown["comm_pipe"]
    assert sp.peak_bytes_per_device < plain.peak_bytes_per_device
    assert plain.step_breakdown["recompute"] > 0


@pytest.mark.parametrize("plan", ["dp", "zero2", "zero3", "megatron", "megatron:2x2x2"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_step_breakdown_adds_up_on_megatron_lms_program(plan, recompute):
    r = simulate("gpt-1.3b", "alpa-v100", 8, plan, global_batch=64, recompute=recompute)
    _check_breakdown(r)
    assert r.plan["program"] == "megatron-lm"
    assert (r.step_breakdown["recompute"] > 0) == (recompute == "full")
    assert r.step_breakdown["comm_data"] > 0 or r.plan["dp"] == 1
    if r.plan["tp"] > 1:
        assert r.step_breakdown["comm_model"] > 0


def test_step_breakdown_adds_up_on_the_traced_program():
    auto = simulate("gpt-125m", "alpa-v100", 4, "auto", recompute="none", **SMALL_AUTO)
    grid = simulate(
        "gpt-125m", "alpa-v100", 4, "megatron:2x2x1", program="traced", recompute="none",
        num_microbatches=4, **SMALL_AUTO,
    )  # fmt: skip
    for r in (auto, grid):
        _check_breakdown(r)
        assert r.plan["program"] == "traced"
    assert grid.step_breakdown["comm_model"] > 0  # TP 2 all-reduces
    assert grid.step_breakdown["pipeline_bubble"] > 0  # PP 2


def test_step_breakdown_refuses_parts_that_do_not_add_up():
    with pytest.raises(ValueError, match="add up"):
        step_breakdown(1.0, {"compute": 0.5})
    with pytest.raises(ValueError, match="unknown"):
        step_breakdown(1.0, {"compute": 0.5, "gossip": 0.5})
    with pytest.raises(ValueError, match="finite"):
        step_breakdown(math.inf, {"compute": math.inf})


def test_json_parses_with_and_without_auto(capsys):
    for argv in (
        ["--plan", "megatron", "--global-batch", "64", "--sequence-parallel"],
        ["--plan", "auto", "--layers", "2", "--global-batch", "16", "--microbatches", "2"],
    ):
        code, out, _ = _run(capsys, *argv, "--json")
        data = json.loads(out)
        assert code == 0 and "step_breakdown" in data and "program" in data["plan"]


def test_a_published_configuration_runs_from_the_cli(capsys):
    """Korthikanti et al.'s 175B row (TP 8, PP 8, sequence parallel, selective recompute)
    written as flags gives the validation script's prediction for that row."""
    from conftest import load_benchmark

    bench = load_benchmark("validate_megatron")
    run = next(r for r in load_benchmark("published_runs").ALL_RUNS if r.name == "175B")
    code = main(
        [
            "simulate", "--model", "gpt-39b", "--layers", str(run.layers), "--hidden",
            str(run.hidden), "--heads", str(run.heads), "--seq", str(run.seq_len), "--cluster",
            run.cluster, "--gpus", str(run.gpus), "--plan", f"megatron:{run.tp}x{run.pp}x{run.dp}",
            "--global-batch", str(run.global_batch), "--microbatch-size", str(run.micro_batch),
            "--sequence-parallel", "--recompute", run.recompute, "--dtype", run.dtype, "--json",
        ]
    )  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plan"]["sequence_parallel"] is True
    assert data["mfu"] == pytest.approx(bench.price(run)["predicted"], rel=1e-12)
