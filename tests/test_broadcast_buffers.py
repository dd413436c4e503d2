"""LayerNorm broadcasts XLA:CPU keeps from the forward pass to the backward
(``MemoryLayout.materialized_broadcasts``, autoshard/intra/memory/broadcast_buffers.py): a stack
of LayerNorm + Dense residual blocks, whose held broadcasts are counted against the
compiled program's, on both sides of the sizes where XLA:CPU starts keeping them, and
gpt-tiny's strict megatron on 2x4, whose compiled peak the model under-predicted by a
quarter without them."""

from __future__ import annotations

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from autoshard.api import device_mesh_for
from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
from autoshard.intra.memory.broadcast_buffers import (
    held_broadcast_buffers,
    held_broadcasts,
    held_bytes,
)
from autoshard.intra.memory.model import mesh_intervals, predicted_peak_bytes, program_positions
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.graph import build_graph
from autoshard.ir.spec import ShardingSpec
from autoshard.trace.jaxpr import trace_train_step
from autoshard.verify.check import verify_plan

BATCH, SEQ, HIDDEN, BLOCKS = 16, 128, 128, 4


class _Blocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(BLOCKS):
            x = x + nn.Dense(x.shape[-1])(nn.LayerNorm()(x))
        return nn.LayerNorm()(x)


def _step(shape=(BATCH, SEQ, HIDDEN)):
    """The SGD step of :class:`_Blocks` and its abstract arguments for input ``shape``."""
    net = _Blocks()

    def loss(params, batch):
        return jnp.mean(net.apply({"params": params}, batch["x"]) ** 2)

    opt = optax.sgd(1e-2)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    params = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros(x.shape))["params"])
    return step, (params, jax.eval_shape(opt.init, params), {"x": x})


def _program(shape=(BATCH, SEQ, HIDDEN)):
    step, args = _step(shape)
    return trace_train_step(step, *args)


@pytest.fixture(scope="module")
def blocks():
    program = _program()
    return program, build_graph(program.records)


def _without_rule(mesh):
    layout = dataclasses.replace(mesh.memory_layout, materialized_broadcasts=False)
    return dataclasses.replace(mesh, memory_layout=layout)


def test_three_held_buffers_a_layernorm_that_passes_a_gradient_on(blocks):
    _, graph = blocks
    mesh = device_mesh_for((8,), ("data",))
    held = held_broadcasts(graph, mesh, set(mesh_intervals(graph, mesh)))
    by_layer: dict[str, int] = {}
    for h in held:
        node = graph.nodes[h.sized_by]
        assert graph.nodes[h.first].phase == "forward" or h.first == 0
        assert graph.nodes[h.last].phase == "backward"
        assert graph.tensors[node.outputs[0]].shape == (BATCH, SEQ, HIDDEN)
        by_layer[node.layer] = by_layer.get(node.layer, 0) + 1
    # rsqrt and scale broadcast to [B, S, h] for the backward's reductions, and the
    # forward's rsqrt * scale; the first LayerNorm reads the data, whose gradient is not
    # taken: its backward reduces for the scale's gradient alone (rsqrt broadcast)
    assert sorted(by_layer.values()) == [1] + [3] * BLOCKS
    assert held_broadcasts(graph, _without_rule(mesh), set()) == []


def _compiled_broadcasts(shape) -> tuple[int, int]:
    """(broadcasts, products) XLA:CPU compiles for :func:`_step` on one device: fusions of
    the activation's full shape made from smaller values only -- one operand (a 1/std or a
    scale broadcast), two (the forward's 1/std * scale)."""
    step, args = _step(shape)
    text = jax.jit(step).lower(*args).compile().as_text().split("ENTRY", 1)[1]
    full = "f32[" + ",".join(map(str, shape)) + "]"
    size = {}
    counts = {1: 0, 2: 0}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])\S* (\w+)\((.*?)\)", line)
        if not m:
            continue
        name, result, op, operands = m.groups()
        dims = [int(d) for d in result[result.index("[") + 1 : -1].split(",") if d]
        size[name] = math.prod(dims)
        names = re.findall(r"%([\w.\-]+)", operands)
        small = all(size.get(o, 0) < math.prod(shape) for o in names)
        if op == "fusion" and result == full and names and small and len(names) in counts:
            counts[len(names)] += 1
    return counts[1], counts[2]


@pytest.mark.parametrize(
    "shape",
    # each side of the 4,096 elements XLA:CPU's library reductions start at, and of the
    # 4,096 rows from which its library fusions read the forward's product too
    [(1, 63, 64), (1, 64, 64), (1, 4095, 16), (1, 4096, 16)],
)
def test_the_held_broadcasts_are_those_xla_cpu_compiles(shape):
    program = _program(shape)
    graph = build_graph(program.records)
    mesh = device_mesh_for((8,), ("data",))
    spec_of = {t.id: ShardingSpec.replicated(len(t.shape)) for t in graph.tensors}
    held = held_broadcasts(graph, mesh, set(mesh_intervals(graph, mesh)))
    sized = [
        (h, held_bytes(graph, h, spec_of[graph.nodes[h.sized_by].outputs[0]], mesh)) for h in held
    ]
    broadcasts = sum(1 for h, b in sized if b and not h.rows)
    products = sum(1 for h, b in sized if b and h.rows)
    compiled = _compiled_broadcasts(shape)
    assert products == compiled[1] == (BLOCKS if shape[1] >= 4096 else 0)
    assert broadcasts == (0 if shape == (1, 63, 64) else 2 * BLOCKS + 1)
    if not products:
        assert compiled[0] == broadcasts
    # where the products are kept XLA:CPU's count of one-operand broadcasts of the full
    # shape is not the model's 9 (2026-11-27: 8 on jaxlib 0.10.2, 10 on 0.12; not itemised)


def test_a_broadcast_the_backward_lays_out_otherwise_is_not_held(blocks):
    """XLA:CPU shares one broadcast between the forward multiply and the backward only in
    one layout: a backward product split otherwise broadcasts its own, in the backward."""
    _, graph = blocks
    mesh = device_mesh_for((2, 4), ("data", "model"))
    spec_of = {
        t.id: ShardingSpec(((("data",),) + ((),) * (len(t.shape) - 1)) if t.shape else ())
        for t in graph.tensors
    }
    pos = program_positions(graph, mesh.memory_layout.late_updates)
    kept = set(mesh_intervals(graph, mesh))
    held = held_broadcasts(graph, mesh, kept)
    shared = sum(b for _, _, b in held_broadcast_buffers(graph, spec_of, mesh, pos, kept))
    per_buffer = BATCH * SEQ * HIDDEN * 4 / 2
    assert shared == (2 * BLOCKS + 1) * per_buffer  # rows per device below 4,096: no products
    for h in held:
        if h.forward is not None:
            out = graph.nodes[h.sized_by].outputs[0]
            spec_of[out] = ShardingSpec((("data",), (), ("model",)))
    assert sum(b for _, _, b in held_broadcast_buffers(graph, spec_of, mesh, pos, kept)) == 0


@pytest.mark.slow
def test_gpt_tiny_megatron_on_2x4_holds_a_layernorms_two_broadcasts():
    """gpt-tiny's strict megatron on 2x4 splits the activations over ``data`` alone: [4, 32,
    64] per device, 8,192 elements, whose LayerNorm broadcasts XLA:CPU keeps (10 at its live
    peak, 32 KiB each) but not the forward's product (128 rows)."""
    from autoshard.api import trace_workload

    traced = trace_workload("gpt-tiny", optimizer="sgd")
    mesh = device_mesh_for((2, 4), ("data", "model"))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=20), mesh.mesh, "megatron")
    pinned = baseline_inputs(traced.graph, mesh.mesh, "megatron")
    plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name="megatron")
    report = verify_plan(traced.program, plan, live_peak="never")
    compiled = report.compiled_peak_bytes
    spec_of = plan.specs_by_tensor(traced.graph.inputs)
    without = predicted_peak_bytes(traced.graph, spec_of, _without_rule(mesh), plan.operand_specs)
    # 2026-11-27, jax 0.10.2: 1,255,324 B compiled; 1,235,332 predicted (-1.6%), 907,652
    # without the broadcasts (-27.7%, the 32,768-element threshold of before)
    assert abs(report.predicted_peak_bytes - compiled) <= 0.05 * compiled
    assert without < 0.8 * compiled


@pytest.mark.slow
def test_the_ilp_memory_rows_count_them_as_the_prediction_does(blocks):
    """The held broadcasts are copy groups of the ILP's memory rows too: its own peak for
    the chosen plan is the plan's predicted peak, and dropping the rule lowers both. The
    data-parallel baseline on 2x4 (activations split 8 ways, 32,768 elements a device,
    forward and backward in one layout) holds them; the rows, with the layout condition,
    must count them for it as the prediction does."""
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.problem.build import build_problem, plan_from_solution

    _, graph = blocks
    mesh = device_mesh_for((2, 4), ("data", "model"))
    options = baseline_options(IntraOptions(), mesh.mesh, "dp")
    pinned = baseline_inputs(graph, mesh.mesh, "dp")
    ip = build_problem(graph, mesh, options, pinned_inputs=pinned, copy_buffers=True)
    solution = solve(ip.problem, solver="highs", time_limit_s=5.0, mip_gap=0.5)
    plan = plan_from_solution(ip, solution)
    peak = peak_memory(ip.problem, solution.strategy)
    assert peak == pytest.approx(plan.predicted_peak_bytes, rel=1e-12)
    off = build_problem(
        graph, _without_rule(mesh), options, pinned_inputs=pinned, copy_buffers=True
    )
    assert peak_memory(off.problem, solution.strategy) < peak
