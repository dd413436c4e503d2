"""The strict ``megatron`` baseline: Megatron-LM's communication, not only its layout.

Megatron-LM never moves a weight: each rank keeps its shard of a column- or row-split
kernel for the forward, the backward and the update, and the only collectives are
all-reduces -- of activations over the tensor-parallel axis, of gradients over the
data-parallel axis. ``baseline_options`` says so with ``keep_weight_layout`` and
``all_reduce_only`` (issue #14: the ILP, free on activations, used to gather weights).
"""

import functools
from collections import Counter

import jax
import pytest
from conftest import shared_plan

from autoshard.api import device_mesh_for, plan_workload, trace_workload
from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.baselines.tables import BaselineRefusedError, baseline_inputs, baseline_options
from autoshard.intra.problem.options import IntraOptions
from autoshard.models import make_optimizer
from autoshard.runtime.reference_check import check_against_single_device
from autoshard.runtime.sharded import make_mesh
from autoshard.verify.check import verify_plan

HIGHS = IntraOptions(solver="highs")
# (mesh, attention heads): Megatron-LM needs the heads divisible by the model axis
CASES = [((2, 4), 4), ((1, 8), 8)]


@functools.cache  # traced once per worker: several tests plan, verify and train one program
def _traced(heads, layers=2, **kw):
    return trace_workload("gpt-tiny", optimizer="sgd", num_heads=heads, num_layers=layers, **kw)


def _megatron(traced, shape):
    """The megatron baseline's plan, solved once per worker for a traced program and mesh
    (the 2x4 plan is checked against Megatron-LM's counts, XLA's and one device's)."""
    mesh = alpa_test_mesh(shape, ("data", "model"))
    options = baseline_options(HIGHS, mesh.mesh, "megatron")
    pinned = baseline_inputs(traced.graph, mesh.mesh, "megatron")
    return shared_plan(traced, mesh, options, pinned_inputs=pinned, name="megatron")


def _counts(plan):
    kinds = Counter((c.kind, c.axes) for c in plan.predicted_collectives)
    nbytes = Counter()
    for c in plan.predicted_collectives:
        nbytes[c.kind, c.axes] += c.bytes
    return kinds, nbytes


# (mesh, heads, the two depths compared): on 2x4 1 and 2 blocks by default, 2 and 4 in
# CI's heavy step (tracing and planning the 4-block program: 9.9 CPU-s against ~5)
@pytest.mark.parametrize(
    "shape, heads, depths",
    [
        ((2, 4), 4, (1, 2)),
        pytest.param((2, 4), 4, (2, 4), marks=pytest.mark.heavy),
        ((1, 8), 8, (2, 4)),
    ],
    ids=["2x4", "2x4-deeper", "1x8"],
)
def test_megatron_plan_has_megatron_lms_collectives(shape, heads, depths):
    """gpt-tiny (hidden h = 64, S = 32 tokens, batch B = 8, vocab 256) with L = ``depths``
    blocks; dp = shape[0] data-parallel devices, each holding B / dp sequences.

    Megatron-LM's collectives over the model axis, all all-reduces of activations:
    per block 4 -- forward, one after the attention projection and one after the MLP
    projection (the row-parallel dots' partial sums, g in the paper); backward, one of
    the input gradient of the QKV dot and one of the MLP fc dot (the column-parallel dots,
    f) -- each of [B / dp, S, h] f32. Outside the blocks 5: the vocabulary-parallel
    embedding lookup (forward), the tied LM head's input gradient (backward), and the
    vocabulary-parallel cross-entropy's max, sum of exponentials and target logit.

    Over the data axis (on 2x4 only), one all-reduce per parameter gradient: per block 12
    (QKV, attention projection, MLP fc and projection: kernel and bias each; two
    LayerNorms: scale and bias each); outside them 6: the token embedding's two
    gradient terms (the lookup's scatter-add and the tied head's dot), the position
    embedding, the final LayerNorm's scale and bias, and the loss.

    So 4 L + 5 over model and 12 L + 6 over data; a block adds exactly 4 and 12, and
    nothing else moves: no all-gather, all-to-all or reduce-scatter of any weight or
    activation.

    Megatron-LM's program: one QKV GEMM (``attention="unfused"``).  The fused program's
    q, k, v are three GEMMs, whose input-gradient partial sums are all-reduced one by
    one (6 a block over model) and whose kernel and bias gradients come in three pieces
    each (16 a block over data)."""
    dp = shape[0]
    unfused = {"attention": "unfused"}
    plans = {layers: _megatron(_traced(heads, layers, **unfused), shape) for layers in depths}
    counts = {layers: _counts(plan) for layers, plan in plans.items()}
    for layers, (kinds, _) in counts.items():
        assert {k for k, _ in kinds} == {"all-reduce"}, kinds
        expected = {("all-reduce", ("model",)): 4 * layers + 5}
        if dp > 1:
            expected["all-reduce", ("data",)] = 12 * layers + 6
        assert dict(kinds) == expected, (layers, kinds)
    # what one block adds: its 4 activation all-reduces of [B / dp, S, h] f32 over model
    low, high = depths
    block_bytes = {
        axes: (counts[high][1]["all-reduce", axes] - counts[low][1]["all-reduce", axes])
        // (high - low)
        for axes in (("model",), ("data",))
    }
    assert block_bytes[("model",)] == 4 * (8 // dp) * 32 * 64 * 4
    # and its 12 parameter gradients in f32, each in its parameter's layout: the four
    # kernels (12 h^2) and the column-split biases (QKV 3h, fc 4h) split over the tp
    # devices, the row-parallel biases (2h) and the LayerNorms (4h) whole
    h, tp = 64, shape[1]
    per_device = (12 * h * h + 7 * h) // tp + 6 * h
    assert block_bytes[("data",)] == (4 * per_device if dp > 1 else 0)
    # weights stay where Megatron-LM puts them
    plan = plans[2]  # both pairs of depths hold 2 blocks
    graph = _traced(heads, **unfused).graph
    for tid, spec in zip(graph.inputs, plan.input_specs):
        path = graph.tensors[tid].path
        if path.endswith("['qkv']['kernel']") or path.endswith("['fc']['kernel']"):
            assert spec.dims == ((), ("model",)), (path, spec)
        if path.endswith("['proj']['kernel']"):
            assert spec.dims == (("model",), ()), (path, spec)


@pytest.mark.parametrize("shape, heads", CASES, ids=["2x4", "1x8"])
def test_megatron_plan_trains_like_one_device(shape, heads):
    traced = _traced(heads)
    plan = _megatron(traced, shape)
    jmesh = make_mesh(plan.mesh, jax.devices()[: plan.mesh.num_devices])
    args = traced.workload.init_train_args(make_optimizer("sgd"))
    report = check_against_single_device(traced.program, plan, jmesh, args, num_steps=2, rtol=1e-5)
    assert report.ok, report


def test_megatron_collectives_are_what_xla_compiles_on_2x4():
    traced = _traced(4)
    plan = _megatron(traced, (2, 4))
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()
    assert {c.kind for c in report.compiled_collectives} == {"all-reduce"}


def test_megatron_refuses_heads_the_model_axis_does_not_divide():
    """gpt-tiny's 4 heads on an 8-way model axis: Megatron-LM would refuse too; the
    error names the op (the QKV reshape into heads) and what would work."""
    with pytest.raises(BaselineRefusedError) as err:
        plan_workload(
            "gpt-tiny",
            device_mesh_for("1x8"),
            optimizer="sgd",
            baseline="megatron",
            attention="unfused",  # the QKV reshape named is the one-GEMM program's
        )
    text = str(err.value)
    assert "reshape in layer 'block_0' ((8, 32, 192) -> (8, 32, 4, 48))" in text, text
    assert "no all-gather, all-to-all or reduce-scatter" in text, text
    assert "attention heads and MLP width divisible by 8" in text, text


def test_megatron_refuses_a_model_without_megatron_split_weights():
    """wresnet-tiny: no Megatron-LM rule splits a convolution, so the model axis would
    only repeat the work; refused rather than labelled megatron."""
    traced = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8)
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    with pytest.raises(BaselineRefusedError, match="no weight of this model has a Megatron-LM"):
        baseline_inputs(traced.graph, mesh.mesh, "megatron")


def test_strict_options_are_validated():
    for knob in ("keep_weight_layout", "all_reduce_only"):
        with pytest.raises(TypeError, match=knob):
            IntraOptions(**{knob: 1})
    assert IntraOptions(all_reduce_only=True).forbidden_collectives() == {
        "all-gather",
        "all-to-all",
        "reduce-scatter",
        "collective-permute",  # XLA's tile moves (autoshard.intra.cost.reshard_tiles)
    }
    assert not IntraOptions().forbidden_collectives()
