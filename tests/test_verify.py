"""verify_plan's memory report: XLA's live peak, read only where memory disagrees, and
whether a disagreement is a gap in XLA's heap (above its live peak) or a modelling miss."""

import dataclasses
import json
import tempfile

import jax
import pytest
from rich.console import Console

from autoshard.api import plan_workload
from autoshard.cli.report import print_verification
from autoshard.verify import check as verify


@pytest.fixture(scope="module")
def mlp_dp():
    """A 2-layer MLP, data parallel on 4 devices: one compile takes well under a second."""
    return plan_workload("mlp", "4", baseline="dp", optimizer="sgd", batch_size=64, hidden=256)


@pytest.fixture(scope="module")
def mlp_dp_low(mlp_dp):
    """``mlp_dp`` with its predicted peak scaled to 80%: the model predicts this step's
    allocation to 0.01%, so a disagreement has to be made."""
    low = dataclasses.replace(
        mlp_dp.plan, predicted_peak_bytes=0.8 * mlp_dp.plan.predicted_peak_bytes
    )
    return dataclasses.replace(mlp_dp, plan=low)


def _verify(bound, **kw):
    return bound.verify(jax.devices()[:4], **kw)


def _printed(report) -> str:
    console = Console(record=True, width=200)
    print_verification(report, console)
    return console.export_text()


def test_a_memory_disagreement_reads_xla_live_peak(mlp_dp_low, monkeypatch, tmp_path):
    """Forced (the prediction scaled to 80%, a tolerance of 0.1%), the memory check fails; a second, dumped compile reads XLA's live peak, which its
    allocation holds, and the report says how far the prediction is from it.  The dump's
    temporary folder is removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = _verify(mlp_dp_low, memory_rtol=0.001)
    assert not list(tmp_path.iterdir())
    live = report.compiled_live_peak_bytes
    assert not report.memory_agree and not report.agree  # strict, allocation-based
    assert live is not None and 0 < live <= report.compiled_peak_bytes
    assert report.heap_gap_bytes == report.compiled_peak_bytes - live
    error = (report.predicted_peak_bytes - live) / live
    assert report.live_peak_error == pytest.approx(error)
    assert report.memory_explained_by_heap_gap == (
        abs(error) <= 0.001 and report.compiled_peak_bytes > live
    )
    assert "live peak" in report.memory_explanation
    assert report.compiled_live_peak_instruction in report.live_peak_note
    row = json.loads(json.dumps(report.to_json()))
    assert row["compiled_live_peak_bytes"] == live and row["memory_agree"] is False
    assert row["live_peak_error"] == pytest.approx(error)
    assert row["memory_explained_by_heap_gap"] == report.memory_explained_by_heap_gap
    assert row["memory_explanation"] == report.memory_explanation
    assert row["compiled_live_peak_instruction"] == report.compiled_live_peak_instruction != ""
    assert "memory disagreement" in _printed(report)


def test_the_heap_gap_verdict_follows_the_tolerance(mlp_dp_low):
    """The same measured figures under other tolerances.  This plan's heap holds a gap
    above XLA's live peak, and the (lowered) prediction is nearer the live peak than the
    allocation: a tolerance between the two errors calls the disagreement a heap gap; one
    below both, a disagreement not explained; one above both, agreement."""
    report = _verify(mlp_dp_low, memory_rtol=0.001)
    live_error, alloc_error = abs(report.live_peak_error), report.memory_error
    assert report.heap_gap_bytes > 0 and live_error < alloc_error  # the premise
    between = dataclasses.replace(report, memory_rtol=(live_error + alloc_error) / 2)
    assert not between.memory_agree and between.memory_explained_by_heap_gap
    assert "heap fragmentation" in between.memory_explanation
    assert "memory disagreement explained" in _printed(between)
    tight = dataclasses.replace(report, memory_rtol=live_error / 2)
    assert not tight.memory_agree and not tight.memory_explained_by_heap_gap
    assert "misses" in tight.memory_explanation or "adds" in tight.memory_explanation
    assert "not explained" in _printed(tight)
    loose = dataclasses.replace(report, memory_rtol=alloc_error * 1.01)
    assert loose.memory_agree and not loose.memory_explained_by_heap_gap
    assert loose.memory_explanation == "" and "memory disagreement" not in _printed(loose)


def test_memory_that_agrees_is_not_compiled_again(mlp_dp, monkeypatch):
    def no_second_compile(*args, **kwargs):
        raise AssertionError("compiled again although memory agrees")

    monkeypatch.setattr(verify, "measure_live_peak", no_second_compile)
    report = _verify(mlp_dp, memory_rtol=1.0)
    assert report.memory_agree and report.compiled_live_peak_bytes is None
    assert report.to_json()["compiled_live_peak_bytes"] is None


@pytest.mark.parametrize("how", ["no dump file", "compile fails"])
def test_an_unreadable_dump_leaves_the_live_peak_unknown(mlp_dp_low, monkeypatch, how):
    """Another backend or XLA version may write no live-range file, or refuse the dump
    options: the report says the live peak is unknown and does not explain, never raises."""
    if how == "no dump file":
        monkeypatch.setattr(verify, "dump_live_peak", lambda folder: None)
    else:
        options = {**verify.LIVE_RANGE_DUMP_OPTIONS, "xla_no_such_option": True}
        monkeypatch.setattr(verify, "LIVE_RANGE_DUMP_OPTIONS", options)
    report = _verify(mlp_dp_low, memory_rtol=0.001)
    assert not report.memory_agree and report.compiled_live_peak_bytes is None
    assert report.live_peak_error is None and not report.memory_explained_by_heap_gap
    assert report.memory_explanation.startswith("XLA's live peak is unknown")
    why = "no readable live-range" if how == "no dump file" else "dumped compile failed"
    assert report.live_peak_note.startswith("unknown") and why in report.live_peak_note
    row = json.loads(json.dumps(report.to_json()))
    assert row["compiled_live_peak_bytes"] is None and row["live_peak_error"] is None
    assert "live peak is unknown" in _printed(report)


def test_the_live_peak_can_be_read_for_every_plan_or_never(mlp_dp, mlp_dp_low):
    """``live_peak="always"`` reads it where memory agrees too (bench_truth --live-peaks
    always); an agreeing plan needs no explanation whatever its live peak."""
    always = _verify(mlp_dp, memory_rtol=1.0, live_peak="always")
    assert always.memory_agree and always.compiled_live_peak_bytes is not None
    assert always.compiled_live_peak_bytes <= always.compiled_peak_bytes
    assert not always.memory_explained_by_heap_gap and always.memory_explanation == ""
    never = _verify(mlp_dp_low, memory_rtol=0.001, live_peak="never")
    assert not never.memory_agree and never.compiled_live_peak_bytes is None
    assert "not measured" in never.memory_explanation
    with pytest.raises(ValueError, match="live_peak"):
        _verify(mlp_dp, live_peak="sometimes")
