"""XLA:GPU's all-reduce rewrites (AllReduceFolder, AllReduceReassociate) in the predictions.

XLA:CPU keeps what GSPMD emits; XLA:GPU's collective-optimizations pipeline folds an
all-reduce of an all-reduce into one and reassociates ``add(all-reduce(a), all-reduce(b))``
into ``all-reduce(a + b)``. :func:`autoshard.verify.xla_gpu.xla_gpu_collectives` applies
both to a plan's predictions; checked on gpt-tiny plans here and against the real XLA:GPU
modules of gpt-1.3b (one H100, 2026-11-27) committed in benchmarks/results.
"""

import tarfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from autoshard.api import plan_workload
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.planfile import load_plan
from autoshard.ir.spec import Collective
from autoshard.verify.collectives import analyze_collectives
from autoshard.verify.xla_gpu import xla_gpu_collectives

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "benchmarks" / "results" / "gpu_truth_plans"
HLO_TAR = ROOT / "benchmarks" / "results" / "gpu_truth_hlo_h100_2026-11-27.tar.gz"
WTE = "[0]['embedding']['wte']"  # the tied embedding table [V, H]


@pytest.fixture(scope="module")
def megatron():
    return _plan("megatron")


def _plan(baseline):
    return plan_workload(
        "gpt-tiny", "2x4", baseline=baseline, options=IntraOptions(solver="highs"), num_layers=1
    )


def _changes(plan, gpu):
    before, after = Counter(plan.predicted_collectives), Counter(gpu.collectives)
    return before - after, after - before


def test_megatron_tied_embedding_gradients_are_reduced_once(megatron):
    bound = megatron
    gpu = xla_gpu_collectives(bound.graph, bound.plan)
    removed, added = _changes(bound.plan, gpu)
    # the embedding table [V, H], split over model on V: its two gradients (the LM head's
    # dot, the lookup's scatter-add) are each partial over data; XLA:GPU adds, then reduces
    tensors = bound.graph.tensors
    (table,) = [tensors[t] for t in bound.graph.inputs if tensors[t].path == WTE]
    vocab, hidden = table.shape
    assert removed == Counter({Collective("all-reduce", ("data",), vocab // 4 * hidden * 4): 1})
    assert added == Counter()
    assert [n.split(":")[0] for n in gpu.notes] == ["AllReduceReassociate"]
    assert "GPT/embedding" in gpu.notes[0]


def test_a_sum_reduced_one_axis_at_a_time_is_folded_into_one_all_reduce():
    bound = _plan("zero3")
    gpu = xla_gpu_collectives(bound.graph, bound.plan)
    removed, added = _changes(bound.plan, gpu)
    # the loss (a scalar summed over a batch split on data and model): XLA:CPU all-reduces
    # it over data, then over model; XLA:GPU folds the two
    assert removed == Counter(
        {Collective("all-reduce", ("data",), 4): 1, Collective("all-reduce", ("model",), 4): 1}
    )
    assert added == Counter({Collective("all-reduce", ("data", "model"), 4): 1})
    assert len(gpu.notes) == 1 and gpu.notes[0].startswith("AllReduceFolder")


def test_no_rewrite_where_the_prediction_lacks_what_it_would_remove(megatron):
    bound = megatron
    gpu = xla_gpu_collectives(bound.graph, bound.plan)
    (gone,) = _changes(bound.plan, gpu)[0]
    plan = replace(
        bound.plan,
        predicted_collectives=tuple(c for c in bound.plan.predicted_collectives if c != gone),
    )
    again = xla_gpu_collectives(bound.graph, plan)
    assert again.collectives == plan.predicted_collectives
    assert "rewrites not applied" in again.notes[0]


@pytest.mark.slow
def test_the_h100_modules_hold_what_the_rewrites_predict():
    # the real XLA:GPU modules: what the plan files predicted (XLA:CPU's collectives) vs
    # what was compiled, at the two values the rewrites touch (no trace needed here)
    with tarfile.open(HLO_TAR) as tar:
        text = {
            m.name: tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if "megatron" in m.name or "auto" in m.name
        }

    def count(name, kind, axes, nbytes):
        plan = load_plan(PLANS / f"{name}.json.gz").plan
        found = analyze_collectives(text[f"{name}.hlo.txt"], plan.mesh, range(8))
        c = Collective(kind, axes, nbytes)
        return (
            Counter(plan.predicted_collectives)[c],
            Counter(x.collective for x in found.collectives)[c],
        )

    # megatron: the embedding gradient's all-reduce over data, predicted twice, compiled once
    assert count("gpt-1.3b-L24-megatron-2x4", "all-reduce", ("data",), 104_857_600) == (2, 1)
    # auto: ln_f's gradient all-reduced over data then model (8,192 B) is one all-reduce
    # over both on XLA:GPU
    auto = "gpt-1.3b-L24-auto-2x4"
    assert count(auto, "all-reduce", ("data", "model"), 8192) == (1, 2)
    assert count(auto, "all-reduce", ("model",), 8192) == (1, 0)


def test_verify_applies_the_rewrites_on_a_gpu_target(megatron, monkeypatch):
    import jax

    from autoshard.verify import check

    # XLA:CPU's module read as if its devices were GPUs: the reassociation is predicted
    # (and the CPU module, which did not run it, moves the embedding gradient twice)
    monkeypatch.setattr(check, "_platform_target", lambda devices: "gpu")
    report = megatron.verify(jax.devices()[:8], live_peak="never")
    assert [n.split(":")[0] for n in report.prediction_notes] == ["AllReduceReassociate"]
    (row,) = [r for r in report.comparison.rows if (r.kind, r.axes) == ("all-reduce", ("data",))]
    tensors = megatron.graph.tensors
    (table,) = [tensors[t] for t in megatron.graph.inputs if tensors[t].path == WTE]
    vocab, hidden = table.shape
    planned = sum(
        c.bytes
        for c in megatron.plan.predicted_collectives
        if (c.kind, c.axes) == ("all-reduce", ("data",))
    )
    assert planned - row.predicted_bytes == vocab // 4 * hidden * 4
    assert row.compiled_bytes == planned  # XLA:CPU: both all-reduces, as the plan says
    assert not row.agree
