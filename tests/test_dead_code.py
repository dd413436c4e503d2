"""Equations whose results nothing reads: XLA's dead-code elimination drops them before
its partitioner runs, so the planner predicts no resharding for their operands and
prices them at no compute (``Graph.dead_nodes``; ``autoshard.intra.problem.build``).

``jax.nn.logsumexp`` makes ``sign(sum(exp(x - max)))``, which only ``return_sign=True``
reads: the fused cross-entropy's log-sum-exp has it (gpt-tiny fused, auto on 4x2: the
plan predicted a reduce-scatter and an all-gather of the sum over ``model`` for it where
XLA all-reduces once, bench_truth 2026-11-27)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.ilp.solve import Solution
from autoshard.intra.problem.build import auto_shard_graph, build_problem
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.problem.predict import plan_from_solution, predicted_collectives
from autoshard.ir.graph import build_graph
from autoshard.trace.jaxpr import trace_train_step
from autoshard.verify.check import verify_plan

BATCH, HIDDEN, VOCAB = 8, 32, 64


def _logsumexp_program():
    """A linear layer into a per-row log-sum-exp, its mean the loss, an SGD step."""

    def loss(params, batch):
        logits = batch["x"] @ params["w"]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    opt = optax.sgd(1e-2)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = {"w": jax.ShapeDtypeStruct((HIDDEN, VOCAB), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((BATCH, HIDDEN), jnp.float32)}
    return trace_train_step(step, params, jax.eval_shape(opt.init, params), batch)


@pytest.fixture(scope="module")
def lse():
    program = _logsumexp_program()
    return program, build_graph(program.records)


def test_logsumexp_sign_is_dead_and_so_is_what_only_dead_nodes_read(lse):
    _, graph = lse
    dead = graph.dead_nodes()
    by_name = {graph.nodes[i].primitive for i in dead}
    # the sign, and the forward's unused jvp of the max (its ties' mask and count)
    assert {"sign", "eq", "select_n", "reduce_sum"} <= by_name
    assert not any(graph.nodes[i].phase == "backward" for i in dead)
    # nothing live reads a dead result, and every node reading only dead ones is dead
    read = set(graph.outputs)
    for n in graph.nodes:
        if n.index not in dead:
            read.update(n.inputs)
    assert all(not (set(graph.nodes[i].outputs) & read) for i in dead)


def _sign_choices(graph, ip, base):
    """``base`` with the dead ``sign`` node set to each of its strategies in turn."""
    (sign,) = [n for n in graph.nodes if n.primitive == "sign"]
    i = ip.num_inputs + sign.index
    for p in range(len(ip.strategies[i])):
        choice = list(base)
        choice[i] = p
        yield i, p, tuple(choice)


def test_a_dead_node_asks_for_no_resharding_and_costs_nothing(lse):
    _, graph = lse
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    ip = build_problem(graph, mesh, IntraOptions(solver="highs", time_limit_s=20))
    base = auto_shard_graph(graph, mesh, IntraOptions(solver="highs", time_limit_s=20))
    base = base.solver["strategy"]
    seen = set()
    for i, p, choice in _sign_choices(graph, ip, base):
        assert ip.problem.node_costs[i][p] == 0.0
        seen.add(predicted_collectives(ip, choice))
    assert len(ip.strategies[i]) > 1 and len(seen) == 1


def test_the_plan_with_any_strategy_on_the_dead_sign_matches_xla(lse):
    """Before dead nodes were skipped, a sum split over ``model`` by its producer and read
    as ``[d0@data+model]`` by the dead ``sign`` was predicted as a reduce-scatter plus an
    all-gather where XLA all-reduces it once."""
    program, graph = lse
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    options = IntraOptions(solver="highs", time_limit_s=20)
    ip = build_problem(graph, mesh, options)
    base = auto_shard_graph(graph, mesh, options)
    keep = {f.name for f in dataclasses.fields(Solution)}
    solution = Solution(**{k: v for k, v in base.solver.items() if k in keep})
    # the sign asking for the sum split over model (the gpt-tiny row's shape)
    choices = [
        choice
        for i, p, choice in _sign_choices(graph, ip, base.solver["strategy"])
        if "model" in ip.strategies[i][p].input_specs[0].dims[0]
    ]
    assert choices
    plan = plan_from_solution(ip, dataclasses.replace(solution, strategy=choices[0]))
    report = verify_plan(program, plan, live_peak="never")
    assert report.collectives_agree, report.comparison
