"""Baselines on the GPT-MoE: each means its name or refuses, saying what does not divide
and what would (issue #14).

moe-tiny's gating runs along groups of 64 tokens. At batch 16 there are 8 groups, one per
device, and the dp baseline is data parallelism: its only collectives are the gradient
all-reduces over the data axis. At batch 8 there are 4 groups, a group spans two devices,
and no plan keeps every activation split over 8 data-parallel devices: dp refuses, naming
the reshape into groups and the batch that would work; zero2, zero3 and megatron (which
do not keep every activation split) plan.
"""

from __future__ import annotations

import jax
import pytest
from conftest import cli_in_process, load_experiment

from autoshard.api import plan_workload
from autoshard.intra.baselines.tables import BaselineRefusedError
from autoshard.intra.problem.options import IntraOptions

HIGHS = IntraOptions(solver="highs", time_limit_s=60.0)


@pytest.fixture(scope="module")
def dp_report():
    bound = plan_workload("moe-tiny", (8,), baseline="dp", options=HIGHS)
    assert bound.plan.name == "dp"
    return bound.verify(jax.devices()[:8])


def test_moe_tiny_dp_on_8_only_all_reduces_over_data(dp_report):
    """The preset's batch (16: 8 groups) keeps data parallelism: XLA's collectives are the
    gradient all-reduces over ('data',), and the plan predicted exactly those."""
    assert dp_report.collectives_agree, dp_report.comparison.format()
    rows = [r for r in dp_report.comparison.rows if r.compiled_bytes or r.predicted_bytes]
    assert rows
    assert {(r.kind, tuple(r.axes)) for r in rows} == {("all-reduce", ("data",))}


def test_moe_tiny_dp_on_8_memory_within_10_percent(dp_report):
    pred, comp = dp_report.predicted_peak_bytes, dp_report.compiled_peak_bytes
    assert abs(pred - comp) <= 0.10 * comp, (pred, comp)


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_dp_refuses_a_batch_whose_expert_groups_do_not_split(mesh):
    with pytest.raises(BaselineRefusedError) as err:
        plan_workload("moe-tiny", mesh, baseline="dp", batch_size=8, options=HIGHS)
    msg = str(err.value)
    assert err.value.devices == 8
    assert "4 expert groups" in msg and "multiple of 16" in msg  # the model's hint
    assert "reshape in layer 'block_0' ((8, 32, 64) -> (4, 64, 64))" in msg  # where it breaks
    assert "'zero2' / 'zero3'" in msg  # what else would plan


def test_cli_refusal_is_exit_2_with_the_reason_on_stderr(capsys):
    argv = "plan --model moe-tiny --mesh 8 --baseline dp --batch 8 --json"
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 2 and out == ""
    assert "multiple of 16" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "baseline, mesh",
    [
        ("zero2", (8,)),
        ("zero3", (2, 4)),
        ("megatron", (8,)),
        ("megatron", (2, 4)),
        pytest.param("zero2", (4, 2), marks=pytest.mark.slow),
        pytest.param("zero3", (1, 8), marks=pytest.mark.slow),
        pytest.param("megatron", (4, 2), marks=pytest.mark.slow),
        pytest.param("megatron", (1, 8), marks=pytest.mark.slow),
    ],
)
def test_other_baselines_plan_moe_tiny_at_batch_8(baseline, mesh):
    # megatron splits the heads over the model axis (the mesh's last): 4 heads cannot
    # take 8 devices (refused, tests/test_megatron_strict.py), 8 can
    heads = 8 if baseline == "megatron" and mesh[-1] == 8 else None
    bound = plan_workload(
        "moe-tiny", mesh, baseline=baseline, batch_size=8, options=HIGHS, num_heads=heads
    )
    assert bound.plan.name == baseline
    assert bound.plan.predicted_peak_bytes > 0
    if baseline == "megatron":  # Megatron-LM's communication: all-reduces only
        assert {c.kind for c in bound.plan.predicted_collectives} == {"all-reduce"}


def test_truth_marks_a_refused_baseline_and_counts_it_apart():
    truth = load_experiment("truth")
    row = truth.measure("moe-tiny", {"batch_size": 8}, "8", "dp", HIGHS)
    assert row["plan"] == "dp" and "multiple of 16" in row["refused"]
    planned = {
        "model": "m", "mesh": "8", "plan": "auto", "collectives_agree": True,
        "memory_agree": True, "predicted_peak_bytes": 100, "compiled_peak_bytes": 105,
        "bytes_by_axes": {"data": {"predicted": 10, "compiled": 10}},
    }  # fmt: skip
    s = truth.summary([row, planned])
    assert (s["plans"], s["refused"], s["memory_within_10_percent"]) == (1, 1, 1)
    assert truth.memory_points([row, planned]) == [("auto", 105 / 2**20, 100 / 2**20)]
    assert truth.byte_points([row, planned]) == [("auto", 10 / 2**20, 10 / 2**20)]
