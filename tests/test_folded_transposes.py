"""XLA folds a weight gradient's transpose into its dot: on XLA:CPU's layout
(``folded_dot_transposes``) the dot result and its transpose are one buffer in the memory
model, not two; on every priced mesh the transpose costs no time
(``folded_dot_transpose``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autoshard.ir.graph import build_graph
from autoshard.trace.jaxpr import trace


def _two_layer_step(w1, w2, x):
    def loss(w1, w2):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))

    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


_ARGS = (
    jax.ShapeDtypeStruct((64, 64), jnp.float32),
    jax.ShapeDtypeStruct((64, 64), jnp.float32),
    jax.ShapeDtypeStruct((32, 64), jnp.float32),
)


def _dot_transposes(graph):
    """(dot result, transpose node) where a transpose is a dot result's only reader."""
    out = []
    for node in graph.nodes:
        if node.primitive != "transpose":
            continue
        (tid,) = node.inputs
        t = graph.tensors[tid]
        if t.producer is not None and graph.nodes[t.producer].primitive == "dot_general":
            if list(t.consumers) == [node.index]:
                out.append((tid, node))
    return out


def test_xla_cpu_writes_a_weight_gradient_transposed_and_the_model_holds_one_buffer():
    """JAX's transpose rule makes each weight gradient as ``dot_general(g, x)`` and then a
    transpose; XLA:CPU's optimised step has no transpose (the dots write the gradients in
    the kernels' layout), so on its layout the dot's result ends where the transpose's
    begins; the plain layout holds both at the transpose."""
    from autoshard.api import device_mesh_for
    from autoshard.hardware.mesh import PLAIN_MEMORY
    from autoshard.intra.memory.intervals import mesh_intervals

    text = jax.jit(_two_layer_step).lower(*_ARGS).compile().as_text()
    entry = text[text.index("ENTRY") :]
    assert " transpose(" not in entry
    assert entry.count(" dot(") + entry.count("ynn_fusion") >= 4  # the four dots are there

    graph = build_graph(trace(_two_layer_step, *_ARGS).records)
    pairs = _dot_transposes(graph)
    assert len(pairs) == 2  # one per kernel
    cpu = device_mesh_for((1,), ("data",))
    assert cpu.memory_layout.folded_dot_transposes
    plain = dataclasses.replace(cpu, memory_layout=PLAIN_MEMORY)
    folded, both = mesh_intervals(graph, cpu), mesh_intervals(graph, plain)
    for dot_result, transpose in pairs:
        (result,) = transpose.outputs
        assert folded[dot_result][1] < folded[result][0]  # never live together
        assert both[dot_result][1] >= both[result][0]


def test_a_narrow_dot_result_computed_in_f32_is_not_folded():
    """A bf16 dot that XLA:CPU computes in f32 (``narrow_dots_in_f32``) is transposed
    through the convert down, not folded: both buffers are kept."""
    from autoshard.intra.memory.intervals import live_intervals

    args = tuple(jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _ARGS)
    graph = build_graph(trace(_two_layer_step, *args).records)
    pairs = _dot_transposes(graph)
    assert pairs
    folded = live_intervals(graph, folded_dot_transposes=True)
    kept = live_intervals(graph, folded_dot_transposes=True, narrow_dots_in_f32=True)
    for dot_result, transpose in pairs:
        (result,) = transpose.outputs
        assert folded[dot_result][1] < folded[result][0]
        assert kept[dot_result][1] >= kept[result][0]


def test_an_mlp_plan_on_2d_mesh_is_predicted_within_10pct_of_xla_cpu():
    """bench_exact_verify's mlp-16x256 one-axis plan on 4x2: the model held every weight
    gradient twice (the dot's result and its transpose) and predicted 20.7% over XLA:CPU's
    compiled peak; with the transposes folded it is within 10%."""
    from autoshard.api import trace_workload, xla_cpu_memory_layout
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.verify.check import verify_plan

    traced = trace_workload("mlp", optimizer="sgd", batch_size=16, hidden=256, num_layers=2)
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    plan = auto_shard_graph(
        traced.graph, mesh, IntraOptions(solver="highs", exact_search="one-axis")
    )
    cpu = dataclasses.replace(mesh, memory_layout=xla_cpu_memory_layout())
    spec_of = plan.specs_by_tensor(traced.graph.inputs)
    predicted = predicted_peak_bytes(traced.graph, spec_of, cpu, plan.operand_specs)
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    error = (predicted - report.compiled_peak_bytes) / report.compiled_peak_bytes
    assert abs(error) <= 0.10, error


# ----------------------------------------------------------------------------- compute time


def _gradient_and_its_transpose(w, x, y, g):
    """Weight gradients as JAX's transpose rule makes them -- ``dot_general(g, x)`` then a
    transpose into the kernel's layout -- one with the transpose its result's only reader,
    one (of other activations, so XLA's CSE keeps both) whose untransposed result a second
    op reads too."""
    folded = jnp.transpose(jax.lax.dot_general(g, x, (((0,), (0,)), ((), ()))))
    dot = jax.lax.dot_general(g, y, (((0,), (0,)), ((), ())))
    return w - folded, w - jnp.transpose(dot), dot * 2.0


_GRAD_ARGS = (
    jax.ShapeDtypeStruct((512, 1024), jnp.float32),  # w: [in, out]
    jax.ShapeDtypeStruct((256, 512), jnp.float32),  # x: [tokens, in]
    jax.ShapeDtypeStruct((256, 512), jnp.float32),  # y: [tokens, in]
    jax.ShapeDtypeStruct((256, 1024), jnp.float32),  # g: [tokens, out]
)


def _transpose_seconds(graph, mesh):
    """transpose node index -> its cheapest strategy's compute seconds, as the ILP prices."""
    from autoshard.intra.problem.build import build_problem

    ip = build_problem(graph, mesh)
    return {
        node.index: min(s.compute_cost for s in ip.strategies[ip.node_of(node.index)])
        for node in graph.nodes
        if node.primitive == "transpose"
    }


def test_a_transpose_folded_into_its_dot_costs_no_time_and_one_read_beside_it_does():
    """On a priced mesh (finite HBM bandwidth) a memory-bound op costs the bytes it streams;
    a transpose that is its dot result's only reader is written by the dot itself
    (XLA:GPU, XLA:CPU: ``folded_dot_transpose``), so it costs 0. The same transpose of a
    result that another op reads too is a pass: its 2 x 2 MiB over the bandwidth."""
    from autoshard.api import device_mesh_for
    from autoshard.intra.memory.layout_copies import folded_dot_transpose

    graph = build_graph(trace(_gradient_and_its_transpose, *_GRAD_ARGS).records)
    transposes = [n for n in graph.nodes if n.primitive == "transpose"]
    assert len(transposes) == 2
    folded = [n.index for n in transposes if folded_dot_transpose(graph, n) is not None]
    assert len(folded) == 1
    (kept,) = [n.index for n in transposes if n.index not in folded]

    mesh = device_mesh_for((1,), ("data",), cluster="dgx-h100")
    seconds = _transpose_seconds(graph, mesh)
    assert seconds[folded[0]] == 0.0
    assert seconds[kept] == pytest.approx(2 * 512 * 1024 * 4 / mesh.hbm_bandwidth)


def test_only_a_block_swap_of_a_batched_dots_free_dims_folds():
    """A GEMM writes each batch row's ``[M, N]`` either way round: a transpose that swaps
    the lhs and rhs free dims of a batched dot's result folds; one that moves the batch
    dim does not (it is a pass)."""
    from autoshard.intra.memory.layout_copies import folded_dot_transpose

    def batched(a, b):
        r = jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))))  # [e, m, n]
        s = jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))))
        return jnp.transpose(r, (0, 2, 1)), jnp.transpose(s, (1, 0, 2))

    args = (
        jax.ShapeDtypeStruct((4, 32, 16), jnp.float32),
        jax.ShapeDtypeStruct((4, 16, 8), jnp.float32),
    )
    graph = build_graph(trace(batched, *args).records)
    perms = {
        tuple(n.params["permutation"]): folded_dot_transpose(graph, n) is not None
        for n in graph.nodes
        if n.primitive == "transpose"
    }
    assert perms == {(0, 2, 1): True, (1, 0, 2): False}
