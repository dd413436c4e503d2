import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.api import summarize_graph, trace_workload
from autoshard.ir.graph import build_graph
from autoshard.models import GPT_PRESETS, get_workload, make_optimizer, make_train_step
from autoshard.trace.jaxpr import TraceError, trace, trace_train_step


def megatron_matmul_flops(B, s, L, h, V):
    # 72 B s L h^2 (1 + s/6h + V/12Lh), written exactly in integers
    return 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V


@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("name", list(GPT_PRESETS))
def test_matmul_flops_equal_megatron(name, batch):
    traced = trace_workload(name, batch_size=batch, num_layers=2 if name != "gpt-tiny" else None)
    cfg = traced.workload.config
    # the matrix products' model FLOPs: the dots and the fused attention's QK^T, PV and
    # their four backward products (its recomputed scores are hardware FLOPs, not model)
    flops = traced.graph.matmul_flops()
    assert flops == megatron_matmul_flops(
        batch, cfg.seq_len, cfg.num_layers, cfg.hidden, cfg.vocab_size
    )
    # the per-token identity: 6N' + 12 L h s with N' = 12 L h^2 + V h
    N = 12 * cfg.num_layers * cfg.hidden**2 + cfg.vocab_size * cfg.hidden
    tokens = batch * cfg.seq_len
    assert flops == (6 * N + 12 * cfg.num_layers * cfg.hidden * cfg.seq_len) * tokens


# gpt-1.3b: heavy (CI's heavy step); gpt-350m checks the same count by default
@pytest.mark.parametrize("name", ["gpt-350m", pytest.param("gpt-1.3b", marks=pytest.mark.heavy)])
def test_full_depth_matmul_flops(name):
    traced = trace_workload(name, batch_size=4)
    c = traced.workload.config
    assert traced.graph.matmul_flops() == megatron_matmul_flops(
        4, c.seq_len, c.num_layers, c.hidden, c.vocab_size
    )


@pytest.fixture(scope="module")
def tiny4():
    return trace_workload("gpt-tiny", num_layers=4)


def test_layers_in_order(tiny4):
    assert tiny4.graph.layers == ("embedding", "block_0", "block_1", "block_2", "block_3", "head")


def test_block_equations_tagged_with_their_block(tiny4):
    g = tiny4.graph
    for node in g.nodes:
        if node.phase in ("forward", "backward") and "/block_" in node.module_path:
            block = node.module_path.split("/")[1]
            assert node.layer == block, node
    counts = collections.Counter(
        (n.layer, n.phase) for n in g.nodes if n.layer and n.layer.startswith("block_")
    )
    for phase in ("forward", "backward", "update"):
        per_block = {counts[(f"block_{i}", phase)] for i in range(4)}
        assert len(per_block) == 1 and per_block.pop() > 0, (phase, counts)


def test_update_equations_carry_their_parameters_layer(tiny4):
    g = tiny4.graph
    # every updated parameter/optimizer-state output is produced by an update equation of its layer
    checked = 0
    for tid in g.outputs:
        t = g.tensors[tid]
        if t.producer is None or g.nodes[t.producer].phase != "update":
            continue
        layer = next((k for k in g.layers if f"['{k}']" in t.path), None)
        if layer is not None:
            assert g.nodes[t.producer].layer == layer, t.path
            checked += 1
    assert checked > 50
    # equations that are not tied to one parameter (Adam's count) carry no layer
    untagged = [n for n in g.nodes if n.phase == "update" and n.layer is None]
    assert untagged and all(g.tensors[n.outputs[0]].size == 1 for n in untagged)


def test_phases_are_contiguous_and_ordered(tiny4):
    phases = [n.phase for n in tiny4.graph.nodes]
    first_bwd = phases.index("backward")
    first_upd = phases.index("update")
    assert "backward" not in phases[:first_bwd] and first_bwd < first_upd
    assert all(p == "forward" for p in phases[:first_bwd])
    assert all(p == "update" for p in phases[first_upd:])


def test_inputs_kinds_and_aliases(tiny4):
    g = tiny4.graph
    kinds = collections.Counter(g.tensors[t].kind for t in g.inputs)
    n_params = len(jax.tree_util.tree_leaves(tiny4.workload.abstract_params()))
    assert (
        kinds["param"] == n_params and kinds["data"] == 2 and kinds["opt_state"] == 2 * n_params + 1
    )
    assert len(g.aliases) == kinds["param"] + kinds["opt_state"]
    for src, dst in g.aliases:
        assert g.tensors[src].shape == g.tensors[dst].shape


def test_liveness(tiny4):
    g = tiny4.graph
    for t in g.tensors:
        if t.producer is not None:
            assert t.first_use == t.producer
            assert all(c > t.producer for c in t.consumers)
            assert t.last_use >= max(t.consumers, default=t.producer)
    for tid in g.outputs:
        assert g.tensors[tid].last_use == len(g.nodes)


def test_flattened_program_evaluates_like_the_step():
    w = get_workload("gpt-tiny")
    opt = make_optimizer("adamw")
    step = make_train_step(w.loss_fn, opt)
    program = trace_train_step(step, *w.abstract_train_args(opt))
    args = w.init_train_args(opt)
    expected = jax.jit(step)(*args)
    got = jax.jit(program.evaluate)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_flattened_program_recomputes_what_the_step_recomputes():
    """The fused GELU (jax.checkpoint, prevent_cse) recomputes its tanh in the backward
    pass; the flattened program keeps that recompute behind optimization barriers, as JAX
    lowers it, so XLA compiles it to the plain step's program: as many tanh ops and the
    same temp bytes.  Inlined bare (until 2026-11-28) XLA merged each recompute into the
    forward's tanh and kept it: 2 tanh ops against 4 on gpt-tiny and 15.7% more temp
    (3.87 MB against 3.35 MB; on gpt-350m 3.22 GB, the gap measured on gpt-1.3b on an
    H100, docs/fused.md)."""
    w = get_workload("gpt-tiny")
    opt = make_optimizer("adamw")
    step = make_train_step(w.loss_fn, opt)
    args = w.abstract_train_args(opt)
    program = trace_train_step(step, *args)

    def compiled(fn):
        c = jax.jit(fn).lower(*args).compile()
        return c.as_text().count(" tanh("), c.memory_analysis().temp_size_in_bytes

    plain_tanh, plain_temp = compiled(step)
    flat_tanh, flat_temp = compiled(program.evaluate)
    assert plain_tanh == 2 * w.config.num_layers  # forward and recompute, each block
    assert flat_tanh == plain_tanh
    assert flat_temp <= plain_temp


def test_nested_jit_custom_jvp_and_remat_are_inlined():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2.0

    @jax.checkpoint
    def body(x):
        return jnp.sin(inner(x))

    def step(x):
        return jax.grad(lambda x: body(x).sum())(x)

    program = trace(step, jax.ShapeDtypeStruct((4,), jnp.float32))
    prims = {e.primitive for e in program.records.eqns}
    assert not prims & {"jit", "pjit", "remat2", "checkpoint", "custom_jvp_call", "closed_call"}
    x = jnp.linspace(-1, 1, 4)
    np.testing.assert_allclose(program.evaluate(x), step(x), rtol=1e-6)


def test_untraceable_function_gets_a_clear_error():
    def bad(x):
        if x.sum() > 0:  # Python control flow on a traced value
            return x
        return -x

    with pytest.raises(TraceError, match="could not trace 'bad'"):
        trace(bad, jax.ShapeDtypeStruct((3,), jnp.float32))


def test_non_array_argument_is_rejected():
    with pytest.raises(TraceError, match="ShapeDtypeStruct"):
        trace(lambda x: x, object())


def test_mlp_layers_and_flops():
    traced = trace_workload("mlp", batch_size=32, hidden=64, num_layers=3, optimizer="sgd")
    g = traced.graph
    assert g.layers == ("dense_0", "dense_1", "dense_2")
    # forward 3 matmuls, backward 3 dW + 2 dX (the data input needs no gradient)
    assert g.flops_where("dot_general") == 2 * 32 * 64 * 64 * (3 + 3 + 2)


def test_summary_json_keys():
    s = summarize_graph("gpt-tiny", trace_workload("gpt-tiny").graph).to_json()
    for key in (
        "params",
        "matmul_flops_per_step",
        "flops_per_step",
        "num_eqns",
        "layers",
        "eqns_by_primitive",
    ):
        assert key in s
    assert s["num_eqns"] == sum(s["eqns_by_primitive"].values())


def test_graph_is_jax_free():
    import subprocess
    import sys

    code = "import sys, autoshard.ir.graph, autoshard.ir.spec; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_graph_is_deterministic(tiny4):
    again = build_graph(tiny4.program.records)
    assert again.nodes == tiny4.graph.nodes and again.tensors == tiny4.graph.tensors
