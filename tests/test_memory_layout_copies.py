"""XLA:CPU's buffers the memory model counts beyond the values themselves: the transposed
copy of an unbatched dot's lhs (``dot_lhs_copies``), and the zeros of an in-place update
no add absorbs (:mod:`autoshard.intra.memory.update_zeros`); docs/truth.md."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import jax
import pytest

from autoshard.hardware.mesh import XLA_CPU_MEMORY, alpa_test_mesh
from autoshard.intra.memory.layout_copies import transposed_dot_lhs
from autoshard.intra.memory.model import graph_update_zeros, predicted_live_bytes
from autoshard.ir.graph import build_graph
from autoshard.trace.jaxpr import trace


def test_only_a_lhs_contracted_on_its_leading_dims_is_copied():
    """``x @ w`` reads x as [free, contracting]; ``x^T @ g`` (a weight gradient) does not,
    and a transpose that moves only unit dims is a bitcast."""
    import jax.numpy as jnp
    from jax import lax

    def fn(x, w, g, y):
        return x @ w, lax.dot_general(x, g, (((0,), (0,)), ((), ()))), y @ w

    args = (
        jax.ShapeDtypeStruct((64, 32), jnp.float32),
        jax.ShapeDtypeStruct((32, 16), jnp.float32),
        jax.ShapeDtypeStruct((64, 16), jnp.float32),
        jax.ShapeDtypeStruct((1, 32), jnp.float32),
    )
    g = build_graph(trace(fn, *args).records)
    cpu = alpa_test_mesh((1,), ("x",), XLA_CPU_MEMORY)
    dots = [n.index for n in g.nodes if n.primitive == "dot_general"]
    assert transposed_dot_lhs(g, cpu) == [(g.inputs[0], dots[1])]
    off = dataclasses.replace(XLA_CPU_MEMORY, dot_lhs_copies=False)
    assert transposed_dot_lhs(g, alpa_test_mesh((1,), ("x",), off)) == []


@pytest.fixture(scope="module")
def wide_vocab_dp():
    """gpt-tiny with a vocabulary 128x its hidden size (8192 x 64, 128 tokens a device),
    the data-parallel baseline on 8 devices, SGD: at XLA's live peak, the embedding's
    gradient dot from the logits, the vocabulary-sized buffers dominate."""
    import autoshard.verify.check as check
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    # optax's cross-entropy (attention="unfused"): its backward reads the exp kept from
    # the forward; the fused program's custom VJP recomputes exp(logits - lse), and XLA
    # holds that too at this dot (one more logits-sized buffer, which the model misses)
    traced = trace_workload(
        "gpt-tiny", optimizer="sgd", vocab_size=8192, seq_len=128, attention="unfused"
    )
    mesh = device_mesh_for((8,), ("data",))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=30), mesh.mesh, "dp")
    pinned = baseline_inputs(traced.graph, mesh.mesh, "dp")
    plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name="dp")
    peaks, read = [], check.dump_live_peak
    check.dump_live_peak = lambda folder: peaks.append(read(folder)) or peaks[-1]
    try:
        report = check.verify_plan(
            traced.program, plan, devices=jax.devices()[:8], live_peak="always"
        )
    finally:
        check.dump_live_peak = read
    return traced.graph, mesh, plan, report, peaks[-1]


def test_xla_holds_the_transposed_logits_gradient_and_the_embedding_zeros(wide_vocab_dp):
    """What XLA holds at its live peak, the embedding's gradient dot: the logits gradient
    (f32 [1, 128, 8192], 4 MiB a device) and its transposed copy for the dot's lhs (4 MiB
    more), and the zeros the embedding's scatter-add writes into (f32 [8192, 64], 2 MiB),
    made at the start of the step: its result is all-reduced with the other gradients
    before the tied embedding's two terms are added, so no add absorbs them."""
    g, mesh, plan, report, live = wide_vocab_dp
    sizes = sorted((b for _, b in live.values), reverse=True)
    assert sizes[:2] == [4 * 2**20, 4 * 2**20]  # the logits gradient, its transposed copy
    assert sizes[2:5] == [2 * 2**20] * 3  # the embedding, its zeros, the dot's result
    zeros = [z for z in graph_update_zeros(g) if z.add is not None]
    vocab = [z for z in zeros if g.tensors[z.zeros].shape == (8192, 64)]
    assert len(vocab) == 1
    assert plan.operand_specs.get(vocab[0].add, {}).get(vocab[0].slot) is not None  # reduced


def test_the_model_holds_what_xla_holds_at_the_embedding_gradient_dot(wide_vocab_dp):
    """At that dot the model is within 5% of XLA's live peak with both rules, and
    more than 10% under with either left out (the lhs copy: ``dot_lhs_copies`` off; the
    zeros: the same plan with the scatter's result read unreduced by the add, which then
    absorbs them)."""
    g, mesh, plan, report, live = wide_vocab_dp
    dot = next(
        n.index
        for n in g.nodes
        if n.primitive == "dot_general" and g.tensors[n.outputs[0]].shape == (8192, 64)
    )
    spec_of = dict(zip(g.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)

    def at_dot(m, operand_specs=plan.operand_specs):
        return predicted_live_bytes(g, spec_of, m, operand_specs)[dot + 1]

    xla = report.compiled_live_peak_bytes
    assert abs(at_dot(mesh) - xla) <= 0.05 * xla, (at_dot(mesh), xla)
    no_copy = dataclasses.replace(
        mesh, memory_layout=dataclasses.replace(mesh.memory_layout, dot_lhs_copies=False)
    )
    assert at_dot(no_copy) < 0.9 * xla
    # the zeros are counted only because the scatter's result is reduced before the add
    add = next(
        z
        for z in graph_update_zeros(g)
        if z.add is not None and g.tensors[z.zeros].shape == (8192, 64)
    )
    unreduced = {
        k: {s: v for s, v in d.items() if (k, s) != (add.add, add.slot)}
        for k, d in plan.operand_specs.items()
    }
    assert at_dot(mesh, unreduced) == at_dot(mesh) - 2 * 2**20  # the zeros, 2 MiB
    assert at_dot(mesh, unreduced) < 0.9 * xla


def test_a_backward_conv_copies_a_forward_value_where_it_is_made():
    """``early_conv_copies``: the transposed copy a weight-gradient conv reads of a forward
    activation is made at the activation's producer (XLA:CPU schedules it in the forward
    pass); a copy of a backward value is still made at its conv."""
    from autoshard.intra.memory.layout_copies import transposed_conv_values

    graph = trace_workload_graph("wresnet-tiny", num_layers=8)
    cpu = alpa_test_mesh((8,), ("data",), XLA_CPU_MEMORY)
    late = alpa_test_mesh(
        (8,), ("data",), dataclasses.replace(XLA_CPU_MEMORY, early_conv_copies=False)
    )
    early_copies, late_copies = (
        transposed_conv_values(graph, cpu),
        transposed_conv_values(graph, late),
    )
    assert [(t, b) for t, _, b in early_copies] == [(t, b) for t, _, b in late_copies]
    moved = 0
    for (tid, first, conv), (_, first_late, _) in zip(early_copies, late_copies):
        producer = graph.tensors[tid].producer
        forward_value = producer is not None and graph.nodes[producer].phase == "forward"
        if forward_value and graph.nodes[conv].phase == "backward":
            assert first == producer < conv
            moved += 1
        else:
            assert first == first_late
    assert moved >= 8  # one per weight-gradient conv of the 8 convolutions


def test_a_forward_value_read_by_several_weight_gradient_convs_is_copied_once():
    """XLA:CPU shares one transposed copy of a forward value among the weight-gradient convs
    that read it in one layout (wresnet-tiny on 2x4: ``block_0``'s output, read by the
    weight gradients of ``block_1``'s ``proj`` and ``conv1``, is one
    ``transpose_copy_fusion``): one buffer, made where the value is, kept to the last of
    those convs; :func:`tensor_buffers` (the ILP's rows and the prediction) counts it once.
    Copies made at their conv stay one per conv."""
    from autoshard.intra.memory.layout_copies import shared_conv_copies, transposed_conv_values
    from autoshard.intra.memory.model import tensor_buffers

    g = trace_workload_graph("wresnet-tiny", num_layers=8)
    cpu = alpa_test_mesh((8,), ("data",), XLA_CPU_MEMORY)
    per_conv = transposed_conv_values(g, cpu)
    shared = shared_conv_copies(g, cpu)
    several = [c for c in shared if len(c[3]) > 1]
    assert several  # block outputs read by a block's proj and conv1 weight gradients
    for tid, first, last, convs in several:
        assert first < min(convs) and last == max(convs)
        assert {(tid, first, c) for c in convs} <= set(per_conv)
        paths = {g.nodes[c].module_path.rsplit("/", 1)[-1] for c in convs}
        assert paths == {"proj", "conv1"}
    assert len(shared) == len(per_conv) - sum(len(c[3]) - 1 for c in several)
    copies = [b for b in tensor_buffers(g, cpu) if (b[0], b[1], b[2]) in {c[:3] for c in shared}]
    assert sum(1 for b in copies if b[0] == several[0][0]) <= 2  # its own buffer and one copy


def _wresnet_pinned_2x4(exact_search: str):
    """wresnet-tiny (two blocks) on 2x4 with the weights replicated and the batch split over
    ``data`` (the old, non-strict megatron baseline's pins: the ILP splits channels over
    ``model``), SGD, planned with ``exact_search`` and compiled: the plan gathers
    activations for the weight gradients. (The strict megatron baseline refuses this
    model: no Megatron-LM rule splits a convolution, tests/test_megatron_strict.py.)"""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.ir.spec import ShardingSpec
    from autoshard.verify.check import verify_plan

    traced = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    options = IntraOptions(solver="highs", time_limit_s=60, exact_search=exact_search)
    options = options.replace(data_parallel_axes=("data",))
    # what the megatron baseline pinned here before it became strict: no Megatron-LM rule
    # splits a convolution, so weights replicated and the batch split over data
    pinned = {
        pos: ShardingSpec.replicated(len(t.shape)).with_dim(0, ("data",))
        if t.kind == "data" and t.shape
        else ShardingSpec.replicated(len(t.shape))
        for pos, t in enumerate(traced.graph.tensors[i] for i in traced.graph.inputs)
    }
    plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name="megatron")
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    return traced.graph, mesh, plan, report


@pytest.fixture(scope="module")
def wresnet_megatron_2x4():
    """The per-demand plan these tests were written on (``exact_search="one-axis"``): the
    exact program's LP is fractional here (42,383 columns)."""
    return _wresnet_pinned_2x4("one-axis")


LP_PLAN = Path(__file__).parent / "fixtures" / "wresnet_2x4" / "lp_plan.json.gz"
LP_PROGRAM = LP_PLAN.with_name("program.json")  # the program it binds to (jax 0.10.2's)


@pytest.fixture(scope="module")
def wresnet_lp_2x4():
    """The plan the default (``exact_search="lp"``) found for :func:`_wresnet_pinned_2x4`
    on 2026-11-28, around the per-demand plan and 3.9% cheaper (objective 30,097 against
    31,331), kept in tests/fixtures/wresnet_2x4/ so that a change of the search does not
    change the plan the model is measured on here; compiled. The plan binds to the program
    jax 0.10 traces (its fingerprint kept beside it): where another jax traces another
    program (jax 0.12 on Python 3.13), the default's own plan for it instead, and the last
    item says which (True: the kept plan)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.ir.plan import ParallelPlan
    from autoshard.ir.planfile import program_fingerprint
    from autoshard.verify.check import verify_plan

    traced = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8)
    kept = json.loads(LP_PROGRAM.read_text())["program_sha256"]
    if program_fingerprint(traced.graph)["sha256"] != kept:
        return (*_wresnet_pinned_2x4("lp"), False)
    with gzip.open(LP_PLAN, "rt") as f:
        plan = ParallelPlan.loads(f.read())
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    return traced.graph, device_mesh_for((2, 4), ("data", "model")), plan, report, True


def _peak(g, mesh, plan) -> float:
    spec_of = plan.specs_by_tensor(g.inputs)
    return max(predicted_live_bytes(g, spec_of, mesh, plan.operand_specs))


def test_wresnet_2x4_memory_needs_the_early_conv_copies(wresnet_megatron_2x4, monkeypatch):
    """With the copies made in the forward pass the model is within 10% of XLA's
    allocation (-4.1% on 2026-11-28; -1.7% with max pooling's backward counted); with them
    made at their convs, more than 10% under (-13.4%; -11.1%); with the input gradients'
    kernel copies made at their convs too
    (:func:`~autoshard.intra.memory.layout_copies.input_derived_values`: XLA makes them from
    the parameters in the forward pass), more than 10% under (-12.7%; -10.4%)."""
    from autoshard.intra.memory import layout_copies

    g, mesh, plan, report = wresnet_megatron_2x4
    assert "exact_search='one-axis'" in plan.solver["exact_stopped"]  # the per-demand plan
    spec_of = dict(zip(g.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)
    xla = report.compiled_peak_bytes
    assert plan.predicted_peak_bytes == max(
        predicted_live_bytes(g, spec_of, mesh, plan.operand_specs)
    )
    assert abs(plan.predicted_peak_bytes - xla) <= 0.10 * xla, (plan.predicted_peak_bytes, xla)
    late = dataclasses.replace(
        mesh, memory_layout=dataclasses.replace(mesh.memory_layout, early_conv_copies=False)
    )
    assert _peak(g, late, plan) < 0.9 * xla
    monkeypatch.setattr(layout_copies, "input_derived_values", lambda graph: set(graph.inputs))
    assert _peak(g, mesh, plan) < 0.9 * xla


def test_wresnet_2x4_the_defaults_cheaper_plan_is_predicted_within_10_percent(
    wresnet_lp_2x4, monkeypatch
):
    """The default's plan gathers ``block_0``'s output over ``model`` for ``block_1``'s
    forward convs (``proj``, ``conv1``) and their weight gradients, which read its
    transposed copy, made in the forward pass: the gathered value ends at its last forward
    conv, as XLA's does (``all-gather.3``, positions 146-150 of 554, beside
    ``transpose_copy_fusion.13``, 147-285), and so do the three smaller ones gathered so
    (:func:`~autoshard.intra.memory.layout_copies.conv_copy_reads`). Within 10% of XLA's
    allocation (-0.2% on 2026-11-28; +2.3% with max pooling's backward counted); with them
    kept to the backward beside their copies, more than 10% over (+11.0%; +11.3%; +11.7%
    before the kernel copies were made early). On another jax's program (the default's own
    plan there) the 10% alone: the counts below were measured on the kept plan."""
    from autoshard.intra.memory import model

    g, mesh, plan, report, kept = wresnet_lp_2x4
    xla = report.compiled_peak_bytes
    assert abs(_peak(g, mesh, plan) - xla) <= 0.10 * xla, (_peak(g, mesh, plan), xla)
    if not kept:
        return
    reads = model.conv_copy_reads(g, mesh)
    gathered = {
        g.nodes[c].inputs[slot]
        for c, slots in plan.operand_specs.items()
        for slot in slots
        if (g.nodes[c].inputs[slot], c) in reads
    }
    # block_0's output and three values in block_0, and two reversed kernels (sliced)
    assert len(gathered) == 6
    monkeypatch.setattr(model, "conv_copy_reads", lambda graph, mesh: {})
    assert _peak(g, mesh, plan) > 1.10 * xla


def test_a_data_parallel_kernel_copy_is_freed_before_its_weight_gradient(monkeypatch):
    """wresnet-tiny data-parallel on 8 devices: XLA:CPU runs every conv's input gradient
    before its weight gradient, so the kernel copy made in the forward pass is freed before
    the weight gradient's result and its copy are made
    (:func:`~autoshard.intra.memory.layout_copies.input_gradient_copy_ends`). Within 10% of
    XLA's allocation (+5.3% on 2026-11-28; +7.4% with max pooling's backward counted); with
    the copy kept to its own conv, more than 10% over (+11.0%; +14.9%)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.memory import transposed_copies
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.verify.check import verify_plan

    traced = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8)
    g, mesh = traced.graph, device_mesh_for((8,), ("data",))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=60), mesh.mesh, "dp")
    pinned = baseline_inputs(g, mesh.mesh, "dp")
    plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name="dp")
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    xla = report.compiled_peak_bytes
    assert abs(_peak(g, mesh, plan) - xla) <= 0.10 * xla, (_peak(g, mesh, plan), xla)
    monkeypatch.setattr(transposed_copies, "input_gradient_copy_ends", lambda graph, mesh: {})
    assert _peak(g, mesh, plan) > 1.10 * xla


def test_a_reversed_kernel_has_no_buffer_beside_its_transposed_copy():
    """Each input gradient's kernel is reversed (``rev``) from the parameter alone and read
    only by its conv, which reads the transposed copy made at the start of the step:
    XLA:CPU fuses the ``rev`` into that copy (wresnet-tiny dp on 8: the kernel copies
    ``transpose_copy_fusion.17``-``.19`` are the only kernel-sized buffers beside the
    parameters at the backward peak), so the value gets no buffer of its own
    (:func:`~autoshard.intra.memory.layout_copies.copied_kernel_values`). With the copies
    made at their convs (no ``early_input_reshards``) the reversed kernel is still one."""
    from autoshard.intra.memory.layout_copies import copied_kernel_values
    from autoshard.intra.memory.model import value_buffers

    g = trace_workload_graph("wresnet-tiny", num_layers=8)
    reversed_kernels = {
        n.outputs[0]
        for n in g.nodes
        if n.primitive == "rev" and len(g.tensors[n.inputs[0]].shape) == 4
    }
    assert len(reversed_kernels) >= 7  # every conv's input gradient but the stem's
    cpu = alpa_test_mesh((8,), ("data",), XLA_CPU_MEMORY)
    assert reversed_kernels <= copied_kernel_values(g, cpu)
    assert not reversed_kernels & {b[0] for b in value_buffers(g, cpu)}
    late = alpa_test_mesh(
        (8,), ("data",), dataclasses.replace(XLA_CPU_MEMORY, early_input_reshards=False)
    )
    assert copied_kernel_values(g, late) == set()
    assert reversed_kernels <= {b[0] for b in value_buffers(g, late)}


def test_the_ilp_memory_rows_count_the_conv_copies_as_the_prediction_does():
    """For random assignments of wresnet-tiny on 2x4 (XLA:CPU's layout) the ILP's own peak
    equals the prediction: the transposed conv copies in the layout their convs read, the
    gathered values their weight gradients read through those copies, and the sources
    freed after them (on 2026-11-28, before the copies were rows of their own, the two
    differed by up to 20% either way)."""
    import numpy as np
    from test_gathered_sources import _layouts

    from autoshard.api import device_mesh_for
    from autoshard.intra.ilp import peak_memory, resolve_ties
    from autoshard.intra.problem.build import build_problem

    g = trace_workload_graph("wresnet-tiny", num_layers=8)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    ip = build_problem(g, mesh, copy_buffers=True)
    pb = ip.problem
    roots, maps = resolve_ties(pb)
    allowed: dict[int, np.ndarray] = {}
    for v, r in enumerate(roots):
        ok = allowed.setdefault(r, np.ones(pb.num_strategies[r], bool))
        m = np.asarray(maps[v])
        ok &= m >= 0
        ok[m >= 0] &= np.isfinite(np.asarray(pb.node_costs[v])[m[m >= 0]])
    rng = np.random.default_rng(0)
    rows, predicted = [], []
    for _ in range(20):
        pick = {r: int(rng.choice(np.flatnonzero(ok))) for r, ok in allowed.items()}
        s = tuple(int(maps[v][pick[r]]) for v, r in enumerate(roots))
        spec_of, operand_specs = _layouts(ip, s)
        rows.append(peak_memory(pb, s))
        predicted.append(max(predicted_live_bytes(g, spec_of, mesh, operand_specs)))
    assert rows == pytest.approx(predicted, rel=1e-12)


def trace_workload_graph(name: str, **overrides):
    from autoshard.api import trace_workload

    return trace_workload(name, optimizer="sgd", **overrides).graph


def test_a_forward_value_gathered_for_weight_gradients_is_gathered_early():
    """``early_backward_operand_reshards``: gpt-tiny's ZeRO-2 plan on 2x4 (AdamW) gathers
    MLP activations over ``model`` for their weight gradients only; XLA:CPU makes those
    copies in the forward pass and keeps them to the backward dots. With the rule the
    model is within 10% of XLA's allocation (+3.8% on 2026-11-25), without it more than
    10% under (-13.1%) where the copies are live at the peak. Since the ILP's rows keep a
    gradient for every layout (2026-11-27) the plan traced with jax 0.12 is a cheaper one
    (objective 239,096 against 240,448) that gathers 8 KiB early, none at its peak: there
    the rule moves the peak by little. Not "only up": since ``freed_gathered_sources``
    (2026-11-27) an early copy also lets its source die at its forward reader, so on that
    plan the rule lowers the peak by 8,192 B (-9.9% against -9.5% of XLA's 2,158,296 B)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.memory.reshard_copies import _backward_operand
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.verify.check import verify_plan

    # the unfused program, as measured (2026-11-27, jax 0.10.2: -5.9% with the rule, -11.8%
    # without). The fused program, the default since, is within 10% either way on this
    # row (+5.5% with, -3.0% without): its plan's early copies are not all early in XLA
    traced = trace_workload("gpt-tiny", optimizer="adamw", attention="unfused")
    g = traced.graph
    mesh = device_mesh_for((2, 4), ("data", "model"))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=60), mesh.mesh, "zero2")
    pinned = baseline_inputs(g, mesh.mesh, "zero2")
    plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name="zero2")
    readers: dict[tuple, list[int]] = {}
    for node, slots in plan.operand_specs.items():
        for slot, spec in slots.items():
            readers.setdefault((g.nodes[node].inputs[slot], spec), []).append(node)
    assert any(_backward_operand(g, tid, rs) for (tid, _), rs in readers.items())
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    xla = report.compiled_peak_bytes
    assert abs(plan.predicted_peak_bytes - xla) <= 0.10 * xla, (plan.predicted_peak_bytes, xla)
    spec_of = dict(zip(g.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)
    late = dataclasses.replace(
        mesh,
        memory_layout=dataclasses.replace(
            mesh.memory_layout, early_backward_operand_reshards=False
        ),
    )
    without = max(predicted_live_bytes(g, spec_of, late, plan.operand_specs))
    with_rule = plan.predicted_peak_bytes
    if with_rule - without > 0.05 * xla:  # the early copies are live at the peak (jax 0.10)
        assert without < 0.9 * xla, (without, xla)
        assert abs(with_rule - xla) < abs(without - xla)
    else:  # none at the peak (jax 0.12's cheaper plan): the rule moves it by little
        assert abs(with_rule - without) <= 0.01 * xla, (with_rule, without, xla)


def test_a_narrow_logits_gradient_is_written_once_for_its_f32_copies():
    """The fused cross-entropy's bf16 logits gradient, read by the embedding's gradient dot
    (transposed) and by the hidden state's: on XLA:CPU with bf16 dots in f32 both read f32
    copies of one bf16 buffer, and the fusion that writes it computes ``exp(logits - lse)``
    itself, so no float32 ``exp`` is kept to the dots (the model kept one, logits-sized:
    +18.1% over XLA:CPU's peak on this plan with it, +7.9% without; gpt-350m bf16 dp
    +12.3% -> +4.1%)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.memory.materialized import copied_lhs_sources
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.verify.check import verify_plan

    traced = trace_workload(
        "gpt-tiny",
        optimizer="sgd",
        vocab_size=8192,
        seq_len=128,
        dtype="bfloat16",
        attention="fused",
    )
    g = traced.graph
    mesh = device_mesh_for((8,), ("data",))
    kept = copied_lhs_sources(g, set(), narrow_dots_in_f32=False)
    assert any(g.nodes[g.tensors[t].producer].primitive == "exp" for t in kept)
    assert not copied_lhs_sources(g, set(), narrow_dots_in_f32=True)
    # on a jaxlib whose XLA:CPU runs bf16 dots in bf16 (jax 0.12) the mesh says so, the
    # rule is off and the model keeps the exp buffer: the compiled peak agrees either way
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=30), mesh.mesh, "dp")
    pinned = baseline_inputs(g, mesh.mesh, "dp")
    plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name="dp")
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    figures = (report.predicted_peak_bytes, report.compiled_peak_bytes)
    if mesh.memory_layout.narrow_dots_in_f32:
        # +11.0% since 2026-11-28: the model's forward f32 exp (4 MiB) that XLA:CPU does not
        # write on this shape, hidden until then by a held tanh the model under-counted
        # (docs/truth_memory.md, "Known gaps"). Fails when the row is back within 10%
        assert not report.memory_agree, f"now agrees {figures}: assert agreement again"
        assert report.predicted_peak_bytes > report.compiled_peak_bytes, figures
        pytest.xfail(f"the cross-entropy's f32 exp counted, XLA:CPU fuses it: {figures}")
    # jaxlib 0.11+ (bf16 dots in bf16): a known gap, docs/truth_memory.md ("Known gaps":
    # +23.7% on jax 0.12, 18,188,800 vs 14,700,508 B, not itemised). Fails when it closes
    assert not report.memory_agree, f"now agrees {figures}: assert agreement on both branches"
    pytest.xfail(f"jax {jax.__version__}'s bf16 peak over-predicted {figures}")
