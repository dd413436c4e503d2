"""reduce_max / reduce_min split on the dim they reduce: partial results combined by a
max / min all-reduce (autoshard/intra/rules/reduce.py), predicted and compiled alike."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.rules.strategies import node_strategies
from autoshard.ir.graph import build_graph
from autoshard.ir.spec import ShardingSpec
from autoshard.runtime.sharded import abstract_args, build_sharded_step, make_mesh
from autoshard.trace.jaxpr import trace_train_step
from autoshard.verify.check import verify_plan

VOCAB, HIDDEN, BATCH = 1024, 64, 16


def _tied_log_softmax_program():
    """Alpa's tied-embedding test shape: the embedding table is also the LM head, and the
    loss is a log-softmax (with its max subtraction) over the vocabulary."""

    def loss(params, batch):
        h = params["wte"][batch["tokens"]]
        logits = h @ params["wte"].T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["labels"], VOCAB), axis=-1))

    opt = optax.sgd(1e-2)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = {"wte": jax.ShapeDtypeStruct((VOCAB, HIDDEN), jnp.float32)}
    batch = {
        "tokens": jax.ShapeDtypeStruct((BATCH,), jnp.int32),
        "labels": jax.ShapeDtypeStruct((BATCH,), jnp.int32),
    }
    return trace_train_step(step, params, jax.eval_shape(opt.init, params), batch)


def test_spec_partial_op_round_trips_and_prints():
    spec = ShardingSpec(((), ("model",)), ("data",), "max")
    assert ShardingSpec.from_json(spec.to_json()) == spec
    assert str(spec) == "[d0, d1@model]{Umax:data}"
    assert spec != spec.with_partial(("data",), "sum")
    assert "partial_op" not in ShardingSpec(((),), ("data",)).to_json()  # old files unchanged
    with pytest.raises(ValueError, match="partial_op 'prod' is not one of"):
        ShardingSpec(((),), ("data",), "prod")


def test_tied_log_softmax_splits_the_vocabulary_with_a_max_all_reduce():
    program = _tied_log_softmax_program()
    graph = build_graph(program.records)
    mesh = alpa_test_mesh((2, 2), ("data", "model"))
    plan = auto_shard_graph(graph, mesh, IntraOptions(solver="highs"))
    node = next(n for n in graph.nodes if n.primitive == "reduce_max")
    out = plan.tensor_specs[node.outputs[0]]
    assert out.partial and out.partial_op == "max", plan.node_strategies[node.index]
    logits = graph.tensors[node.inputs[0]]
    assert logits.shape[-1] == VOCAB
    # the max is resolved by an all-reduce over the axes that split the vocabulary
    assert any(c.kind == "all-reduce" and c.axes == out.partial for c in plan.predicted_collectives)
    report = verify_plan(program, plan, devices=jax.devices()[:4])
    assert report.collectives_agree, report.comparison.rows
    jmesh = make_mesh(plan.mesh, jax.devices()[:4])
    step = build_sharded_step(program, plan, jmesh, donate=True)
    hlo = step.lower(*abstract_args(program, plan, jmesh)).compile().as_text()
    max_computations = {
        block.split()[0]
        for block in hlo.split("\n}")
        if block.strip() and " maximum(" in block and "ROOT" in block
    }
    reducers = re.findall(r"all-reduce(?:-start)?\([^\n]*to_apply=(%?[\w.-]+)", hlo)
    assert max_computations & set(reducers), "no all-reduce with a max computation in the HLO"


def test_argmax_keeps_its_reduced_dim_whole():
    """XLA combines argmax partials as (value, index) pairs: not offered, so its reduced
    dim is never split."""
    program = trace_train_step(
        lambda p, s, b: (p, s, jnp.sum(jnp.argmax(b["x"] @ p["w"], axis=-1))),
        {"w": jax.ShapeDtypeStruct((8, 64), jnp.float32)},
        (),
        {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32)},
    )
    graph = build_graph(program.records)
    mesh = alpa_test_mesh((2, 2), ("data", "model"))
    node = next(n for n in graph.nodes if n.primitive == "argmax")
    for s in node_strategies(graph, node, mesh):
        assert not s.input_specs[0].dims[-1] and not s.output_specs[0].partial
