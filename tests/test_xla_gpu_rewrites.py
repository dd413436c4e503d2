"""XLA:GPU's all-reduce rewrites (AllReduceFolder, AllReduceReassociate) in the predictions.

XLA:CPU keeps what GSPMD emits; XLA:GPU's collective-optimizations pipeline folds an
all-reduce of an all-reduce into one and reassociates ``add(all-reduce(a), all-reduce(b))``
into ``all-reduce(a + b)``, looking through reshapes between them; a reduce-scatter the
partitioner makes (an all-reduce and a slice) after an all-reduce of the same buffer folds
too. :func:`autoshard.verify.xla_gpu.xla_gpu_collectives` applies them to a plan's
predictions; checked on gpt-tiny and wresnet-tiny plans and a hand-made plan here, and
against the real XLA:GPU modules (one H100, 2026-11-27) committed in benchmarks/results.
"""

import re
import tarfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from autoshard.api import plan_workload
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.planfile import load_plan
from autoshard.ir.spec import Collective, Mesh, ShardingSpec
from autoshard.verify.collectives import analyze_collectives
from autoshard.verify.xla_gpu import _values, xla_gpu_collectives

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "benchmarks" / "results" / "gpu_truth_plans"
HLO_TAR = ROOT / "benchmarks" / "results" / "gpu_truth_hlo_h100_2026-11-27.tar.gz"
SCALE_PLANS = ROOT / "benchmarks" / "results" / "gpu_truth_plans_scale"
SCALE_HLO_TAR = ROOT / "benchmarks" / "results" / "gpu_truth_scale_hlo_h100_2026-11-27c.tar.gz"
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


# heavy (CI's heavy step): solving gpt-tiny's zero3 plan on 2x4 is most of the default run's
# time in this file; the same fold (an all-reduce over model, then over data, of one value)
# runs by default on a hand-built sum: test_an_all_reduce_of_an_all_reduce_is_folded_into_one
@pytest.mark.heavy
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


def _sum_over_two_split_dims():
    """``sum(x * w, (0, 1)) * 2`` with ``x`` ``[4@data, 8@model, 16]``, the sum read split
    over data: the sum is reduced over model, then reduce-scattered over data."""
    import jax
    import jax.numpy as jnp

    from autoshard.ir.graph import build_graph
    from autoshard.trace.jaxpr import trace

    def f(x, w):
        return jnp.sum(x * w, axis=(0, 1)) * 2.0

    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16,), jnp.float32)
    graph = build_graph(trace(f, x, w, arg_kinds=("data", "param")).records)
    assert [n.primitive for n in graph.nodes] == ["broadcast_in_dim", "mul", "reduce_sum", "mul"]
    split, by_data = ShardingSpec((("data",), ("model",), ())), ShardingSpec((("data",),))
    sum_id = graph.nodes[2].outputs[0]
    specs = {
        graph.nodes[0].outputs[0]: ShardingSpec.replicated(3),
        graph.nodes[1].outputs[0]: split,
        sum_id: ShardingSpec(((),), partial=("data", "model")),
        graph.nodes[3].outputs[0]: by_data,
    }
    plan = ParallelPlan(
        name="sum",
        mesh=Mesh(("data", "model"), (2, 4)),
        input_specs=(split, ShardingSpec.replicated(1)),
        input_paths=("x", "w"),
        output_specs=(by_data,),
        tensor_specs=specs,
        operand_specs={3: {0: by_data}},
        node_strategies=(),
        predicted_collectives=(),
        predicted_peak_bytes=0.0,
        objective=0.0,
    )
    cols = _values(graph, plan)[sum_id]
    return graph, replace(plan, predicted_collectives=cols), cols


def test_an_all_reduce_of_an_all_reduce_is_folded_into_one():
    """The sum of ``_sum_over_two_split_dims`` read replicated: XLA:CPU all-reduces it over
    model, then over data; XLA:GPU's AllReduceFolder makes that one all-reduce over both
    (the fold gpt-tiny's zero3 loss takes, checked on the real plan in CI's heavy step)."""
    graph, plan, _ = _sum_over_two_split_dims()
    whole = ShardingSpec.replicated(1)
    specs = {**plan.tensor_specs, graph.nodes[3].outputs[0]: whole}
    plan = replace(plan, output_specs=(whole,), tensor_specs=specs, operand_specs={3: {0: whole}})
    cols = _values(graph, plan)[graph.nodes[2].outputs[0]]
    assert cols == (
        Collective("all-reduce", ("model",), 64),
        Collective("all-reduce", ("data",), 64),
    )
    gpu = xla_gpu_collectives(graph, replace(plan, predicted_collectives=cols))
    assert gpu.collectives == (Collective("all-reduce", ("data", "model"), 64),)
    assert gpu.notes == (
        "AllReduceFolder: all-reduce over model then all-reduce over data of reduce_sum "
        "in ? (tensor 4) (64 B) -> one all-reduce",
    )


def test_an_all_reduce_then_a_reduce_scatter_of_one_buffer_is_folded_into_one_all_reduce():
    graph, plan, cols = _sum_over_two_split_dims()
    # as XLA:CPU compiles it: an all-reduce over model, then an all-reduce over data and a
    # dynamic-slice (read as a reduce-scatter), both of the whole [16] f32 sum
    assert cols == (
        Collective("all-reduce", ("model",), 64),
        Collective("reduce-scatter", ("data",), 64),
    )
    gpu = xla_gpu_collectives(graph, plan)
    # XLA:GPU's AllReduceFolder folds the two all-reduces; the slice of 1/2 that is left is
    # no reduce-scatter of the 8 devices' group, so ReduceScatterCreator leaves it
    assert gpu.collectives == (Collective("all-reduce", ("data", "model"), 64),)
    assert gpu.notes == (
        "AllReduceFolder: all-reduce over model then reduce-scatter over data of reduce_sum "
        "in ? (tensor 4) (64 B) -> one all-reduce",
    )


def test_batchnorm_mean_cotangents_are_reassociated_through_their_reshapes():
    bound = plan_workload(
        "wresnet-tiny", "2x4", baseline="dp", options=IntraOptions(solver="highs")
    )
    graph = bound.graph
    gpu = xla_gpu_collectives(graph, bound.plan)
    removed, added = _changes(bound.plan, gpu)
    # every BatchNorm's backward adds its mean's two cotangents, each summed over the batch
    # (split over data and model: all-reduced), reshaped to [1, 1, 1, C] and summed back
    # over the size-1 dims: one all-reduce of C floats fewer per BatchNorm
    scales = [
        graph.tensors[t]
        for t in graph.inputs
        if graph.tensors[t].kind == "param" and graph.tensors[t].path.endswith("['scale']")
    ]
    assert len(scales) >= 10
    expected = Counter(Collective("all-reduce", ("data", "model"), t.shape[0] * 4) for t in scales)
    assert removed == expected
    assert added == Counter()
    assert len(gpu.notes) == len(scales)
    note = re.compile(
        r"AllReduceReassociate: add\(WideResNet/\w+/bn(\d|_proj)?\) of two all-reduces over "
        r"data,model \([\d,]+ B each\) -> one all-reduce of the sum"
    )
    assert all(note.fullmatch(n) for n in gpu.notes), gpu.notes


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


@pytest.mark.slow
def test_the_h100_scale_modules_hold_the_folded_and_reassociated_all_reduces():
    # the XLA:GPU modules of the 2026-11-27c lease, against their plan files' predictions
    # (XLA:CPU's collectives): what the two rewrites remove is missing there, what they
    # add is present (no trace needed here)
    names = ("gpt-6.7b-L32-zero2-2x8-B16", "wresnet-1b-L50-dp-2x4-B128")
    with tarfile.open(SCALE_HLO_TAR) as tar:
        text = {
            Path(m.name).name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if m.isfile() and Path(m.name).name.removesuffix(".hlo.txt") in names
        }

    def counts(name):
        plan = load_plan(SCALE_PLANS / f"{name}.json.gz").plan
        found = analyze_collectives(text[name], plan.mesh, range(plan.mesh.num_devices))
        return Counter(plan.predicted_collectives), Counter(x.collective for x in found.collectives)

    # gpt-6.7b zero2: ln_f's gradient (16,384 B) all-reduced over model, then reduce-scattered
    # over data, is one all-reduce over both
    planned, compiled = counts(names[0])
    over_model, over_data = (
        Collective("all-reduce", ("model",), 16384),
        Collective("reduce-scatter", ("data",), 16384),
    )
    both = Collective("all-reduce", ("data", "model"), 16384)
    assert (planned[over_model], planned[over_data], planned[both]) == (1, 1, 0)
    assert (compiled[over_model], compiled[over_data], compiled[both]) == (0, 0, 1)
    # wresnet-1b dp: each BatchNorm's all-reduces over (data, model), 7 predicted, 6 compiled
    # (the 4 BatchNorms of 320 channels: 1,280 B; the 14 of 1,280 channels: 5,120 B)
    planned, compiled = counts(names[1])
    for nbytes, layers in ((1280, 4), (5120, 14)):
        c = Collective("all-reduce", ("data", "model"), nbytes)
        assert (planned[c], compiled[c]) == (7 * layers, 6 * layers)


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
