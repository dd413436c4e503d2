"""Max pooling's backward as XLA:CPU expands it (``MemoryLayout.expanded_select_and_scatter``,
autoshard/intra/memory/pool_workspace.py): the iotas, zeros, padded operand and indices of
the select-and-scatter expansion, on the conv net benchmarks/studies/bench_exact_search.py
plans (two layers of 3x3/2 conv, batch norm, relu and a 2x2/1 "SAME" max pool; batch 8
of 32 x 32 x 8)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import pytest
from conftest import load_benchmark

from autoshard.hardware.mesh import XLA_CPU_MEMORY, alpa_test_mesh
from autoshard.intra.memory.pool_workspace import (
    INDEX_BYTES,
    pool_backwards,
    pool_buffer_intervals,
    pool_buffers,
)
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.spec import ShardingSpec

HIGHS = IntraOptions(solver="highs", time_limit_s=30)
AXES = ("data", "model")


@functools.cache
def _bench():
    return load_benchmark("studies/bench_exact_search")


@functools.cache
def _program():
    return _bench().conv_program(num_layers=2)


@functools.cache
def _graph():
    from autoshard.ir.graph import build_graph

    return build_graph(_program().records)


def _cpu_layout(pool: bool = True):
    from autoshard.api import xla_cpu_memory_layout

    return dataclasses.replace(xla_cpu_memory_layout(), expanded_select_and_scatter=pool)


def test_the_expansion_is_found_at_each_pooling_backward_with_its_forward():
    """One per ``select_and_scatter_add`` (a layer each), paired with the
    ``reduce_window_max`` of the same operand; none on a plain layout."""
    graph = _graph()
    mesh = alpa_test_mesh((8, 1), AXES, memory_layout=XLA_CPU_MEMORY)
    pools = pool_backwards(graph, mesh)
    assert len(pools) == 2
    for pool in pools:
        node = graph.nodes[pool.node]
        assert node.primitive == "select_and_scatter_add"
        forward = graph.nodes[pool.forward]
        assert forward.primitive == "reduce_window_max" and pool.forward < pool.node
        assert forward.inputs[0] == node.inputs[1]  # the operand both read
    assert pool_backwards(graph, alpa_test_mesh((8, 1), AXES)) == []


def test_the_sizes_are_the_per_device_shapes_of_the_expansion():
    """The first layer's pooling backward (operand [8, 16, 16, 8] f32, window 2x2 padded by
    one row and column): split 8 ways over the batch, each device pads [1, 16, 16, 8] to
    [1, 17, 17, 8] (2,312 elements) and pools to [1, 16, 16, 8] (2,048): 4 s32 iotas of
    the padded shape (XLA's wrapped_iota x 3 and a broadcast of 0, 9,248 B each), the f32
    zeros (9,248 B), the padded copy and the selected values (9,248 + 8,192 B) and 4 s32
    index arrays (32,768 B: the 4 x 8,192 B reduce-window results at XLA's live peak)."""
    graph = _graph()
    mesh = alpa_test_mesh((8, 1), AXES, memory_layout=XLA_CPU_MEMORY)
    first = graph.nodes[pool_backwards(graph, mesh)[-1].node]  # backward: the last is layer 1
    assert graph.tensors[first.outputs[0]].shape == (8, 16, 16, 8)
    padded, pooled, rank = 1 * 17 * 17 * 8, 1 * 16 * 16 * 8, 4
    split = ShardingSpec((("data",), (), (), ()))
    sizes = pool_buffers(graph, first, split, mesh)
    assert sizes.iotas == rank * INDEX_BYTES * padded == 4 * 9248
    assert sizes.zeros == 4 * padded == 9248
    assert sizes.window == 4 * padded + 4 * pooled
    assert sizes.indices == rank * INDEX_BYTES * pooled == 32768
    whole = pool_buffers(graph, first, None, mesh)
    assert whole.iotas == 8 * sizes.iotas and whole.indices == 8 * sizes.indices
    with pytest.raises(ValueError, match="select_and_scatter_add"):
        pool_buffers(graph, graph.nodes[0], None, mesh)


def test_the_live_ranges_run_from_the_start_and_the_forward_to_the_backward():
    """Iotas from the step's start to the forward pooling, zeros to just before the
    backward, the indices from the forward pooling to the backward."""
    from autoshard.intra.memory.intervals import program_positions

    graph = _graph()
    mesh = alpa_test_mesh((8, 1), AXES, memory_layout=XLA_CPU_MEMORY)
    pos = program_positions(graph, True)
    spec_of = {t.id: ShardingSpec.replicated(len(t.shape)) for t in graph.tensors}
    found = pool_buffer_intervals(graph, spec_of, mesh, pos)
    pools = pool_backwards(graph, mesh)
    assert len(found) == 4 * len(pools)
    for pool, chunk in zip(pools, (found[i : i + 4] for i in range(0, len(found), 4))):
        back, fwd = pos[pool.node], pos[pool.forward]
        sizes = pool_buffers(graph, graph.nodes[pool.node], None, mesh)
        assert chunk == [
            (0, fwd, sizes.iotas),
            (0, back - 1, sizes.zeros),
            (fwd, fwd, sizes.window),
            (fwd, back, sizes.indices),
        ]


def test_the_ilp_memory_rows_count_them_as_the_prediction_does():
    """The buffers are copy groups of the ILP's memory rows, sized by the backward node's
    strategy: the rows' peak for the chosen plan is the plan's predicted peak, and without
    the rule both are lower."""
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.problem.build import build_problem, plan_from_solution

    graph = _graph()
    on = alpa_test_mesh((2, 4), AXES, memory_layout=XLA_CPU_MEMORY)
    off = alpa_test_mesh(
        (2, 4),
        AXES,
        memory_layout=dataclasses.replace(XLA_CPU_MEMORY, expanded_select_and_scatter=False),
    )
    ip = build_problem(graph, on, HIGHS, copy_buffers=True)
    solution = solve(ip.problem, solver="highs", time_limit_s=10.0, mip_gap=0.5)
    plan = plan_from_solution(ip, solution)
    peak = peak_memory(ip.problem, solution.strategy)
    assert peak == pytest.approx(plan.predicted_peak_bytes, rel=1e-12)
    without = build_problem(graph, off, HIGHS, copy_buffers=True)
    assert peak_memory(without.problem, solution.strategy) < peak


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_the_conv_net_peak_is_within_10_percent_of_xla_cpu(shape):
    """The planned conv net compiled on 8 CPU devices: XLA:CPU's live peak is at the first
    layer's index reduce-window, with both layers' iotas and zeros live.  2026-11-28, jax
    0.10.2: on 8x1 XLA allocates 211,348 B, predicted 221,632 (+4.9%; 120,516, -43.0%,
    without the rule); on 2x4 398,100 B, predicted 409,336 (+2.8%; 318,972, -19.9%)
    (``benchmarks/studies/pool_memory.py``, with the conv copies' rules of 2026-11-28)."""
    from autoshard.verify.check import verify_plan

    mesh = alpa_test_mesh(shape, AXES, memory_layout=_cpu_layout())
    plan = auto_shard_graph(_graph(), mesh, HIGHS)
    report = verify_plan(_program(), plan, devices=jax.devices()[:8], live_peak="never")
    compiled = report.compiled_peak_bytes
    assert math.isclose(plan.predicted_peak_bytes, compiled, rel_tol=0.10)


def test_the_forward_operand_is_freed_at_the_forward_pooling():
    """The expansion reads the pooling's operand only in its index reduce-window, at the
    forward pooling; the backward's scatter reads the indices. An operand with a buffer of
    its own (the conv net's ReLU outputs) ends at its last other reader, not at the
    backward; without the rule it is held to the backward."""
    from autoshard.intra.memory.intervals import mesh_intervals

    graph = _graph()
    on = alpa_test_mesh((8, 1), AXES, memory_layout=_cpu_layout())
    off = alpa_test_mesh((8, 1), AXES, memory_layout=_cpu_layout(pool=False))
    pools = pool_backwards(graph, on)
    assert pools
    held, freed = mesh_intervals(graph, off), mesh_intervals(graph, on)
    for pool in pools:
        operand = graph.nodes[pool.node].inputs[1]
        assert held[operand][1] == pool.node
        assert freed[operand][1] < pool.node
        others = [c for c in graph.tensors[operand].consumers if c != pool.node]
        assert freed[operand][1] == max(others)


def test_wresnet_zero3_on_8_needs_the_operand_freed_at_the_forward_pooling(monkeypatch):
    """wresnet-tiny's ZeRO-3 baseline on 8 devices: XLA:CPU does not hold the stem's ReLU
    output (8 KiB a device, read only by the max pooling and its backward) at its backward
    peak. Within 10% of XLA's allocation with the rule (+8.7% on 2026-11-28); held to the
    pooling's backward, more than 10% over (+13.1%)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.memory import intervals, model
    from autoshard.verify.check import verify_plan

    traced = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8)
    g, mesh = traced.graph, device_mesh_for((8,), ("data",))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=60), mesh.mesh, "zero3")
    pinned = baseline_inputs(g, mesh.mesh, "zero3")
    plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name="zero3")
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    xla = report.compiled_peak_bytes

    def peak():
        spec_of = plan.specs_by_tensor(g.inputs)
        return max(model.predicted_live_bytes(g, spec_of, mesh, plan.operand_specs))

    assert abs(peak() - xla) <= 0.10 * xla, (peak(), xla)
    monkeypatch.setattr(intervals, "_pool_operands_read_forward", lambda graph, mesh, out: out)
    assert peak() > 1.10 * xla, (peak(), xla)
