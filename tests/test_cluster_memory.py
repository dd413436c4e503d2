"""Issue #14, finding 10: with a cluster preset the device's HBM is the default memory
budget, the output says so, and a model that cannot fit is refused with the least peak
any plan reaches."""

import json

import pytest
from conftest import cli_in_process

from autoshard.api import plan_workload
from autoshard.hardware.clusters import load_cluster
from autoshard.intra.ilp import InfeasibleBudgetError
from autoshard.intra.problem.options import IntraOptions

HIGHS = IntraOptions(solver="highs", time_limit_s=120)
TINY = dict(num_layers=1)


def _preset_with_hbm(tmp_path, hbm_bytes: int) -> str:
    from importlib import resources

    text = (resources.files("autoshard.hardware") / "presets" / "alpa-v100.json").read_text()
    preset = json.loads(text)
    preset["name"] = "small-hbm"
    preset["device"]["hbm_bytes"] = hbm_bytes
    path = tmp_path / "small-hbm.json"
    path.write_text(json.dumps(preset))
    return str(path)


def test_cluster_hbm_is_the_default_budget_and_the_plan_says_so():
    bound = plan_workload("gpt-tiny", "2x4", options=HIGHS, cluster="alpa-v100", **TINY)
    hbm = load_cluster("alpa-v100").device.hbm_bytes
    (note,) = [n for n in bound.plan.notes if n.startswith("memory budget")]
    assert "16.0 GiB per device, the alpa-v100 preset's HBM" in note
    assert "predicted peak only" in note
    assert bound.plan.predicted_peak_bytes <= hbm
    assert bound.report is None  # no CPU compile stands in for the GPU's


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_cluster_budget_binds_the_plan(tmp_path):
    # on a 1-D mesh of 4: the budgeted solve under the V100's prices takes ~15 s there,
    # past the 120 s limit on 2x4 (the binding works the same on any mesh)
    free = plan_workload("gpt-tiny", "4", options=HIGHS, cluster="alpa-v100", **TINY)
    least = free.plan.predicted_peak_bytes * 0.9  # the unbounded plan does not fit this
    bound = plan_workload(
        "gpt-tiny", "4", options=HIGHS, cluster=_preset_with_hbm(tmp_path, int(least)), **TINY
    )
    assert bound.plan.predicted_peak_bytes <= int(least)


def test_model_that_cannot_fit_the_device_is_refused_with_its_least_peak(tmp_path):
    path = _preset_with_hbm(tmp_path, 2**16)
    with pytest.raises(InfeasibleBudgetError, match="cannot fit the device") as caught:
        plan_workload("gpt-tiny", "2x4", options=HIGHS, cluster=path, **TINY)
    err = caught.value
    assert err.memory_budget_bytes == 2**16
    assert err.min_feasible_bytes > 2**16
    assert "preset's HBM" in str(err) and "--memory-budget" in str(err)


def test_explicit_budget_wins_over_the_cluster_hbm():
    opts = HIGHS.replace(memory_budget_bytes=64 * 2**30)
    bound = plan_workload("gpt-tiny", "2x4", options=opts, cluster="alpa-v100", **TINY)
    (note,) = [n for n in bound.plan.notes if n.startswith("memory budget")]
    assert note.startswith("memory budget: 64.0 GiB per device, checked against")
    assert bound.report is None


# the CLI's two tests run main() in this process (its 8 fake devices are the mesh's): a
# fresh process would pay the JAX import again; stdout's one JSON document in a fresh
# process is tests/test_cli.py's test_json_output_is_one_document_whichever_solver_runs
def test_cli_cluster_that_cannot_fit_exits_2_with_the_least_peak(tmp_path, capsys):
    path = _preset_with_hbm(tmp_path, 2**16)
    argv = f"plan --model gpt-tiny --layers 1 --mesh 2x4 --solver highs --cluster {path}"
    rc, stdout, stderr = cli_in_process(capsys, *argv.split())
    assert rc == 2, stdout + stderr
    assert "Traceback" not in stderr
    assert "cannot fit the device" in stderr
    # 64 KiB is below the parameters and optimizer state alone: refused before any solve
    assert "the parameters and optimizer state alone take" in stderr
    assert "raise the budget to at least that" in stderr


def test_cli_cluster_json_carries_the_budget_note(capsys):
    argv = "plan --model gpt-tiny --layers 1 --mesh 2x4 --solver highs --cluster alpa-v100 --json"
    rc, stdout, stderr = cli_in_process(capsys, *argv.split())
    assert rc == 0, stderr
    out = json.loads(stdout)
    assert any("alpa-v100 preset's HBM" in n for n in out["notes"])
    assert out["predicted_peak_bytes"] <= 16 * 2**30
