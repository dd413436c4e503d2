"""The sharding rules of intra/rules/moe.py: each primitive planned on 8 fake devices runs like
one device, and the collectives the plan predicts are the ones XLA compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.rules.strategies import RULES
from autoshard.ir.graph import build_graph
from autoshard.ir.spec import ShardingSpec
from autoshard.runtime.sharded import build_sharded_step, make_mesh
from autoshard.trace.jaxpr import trace
from autoshard.verify.check import verify_plan

HIGHS = IntraOptions(solver="highs")
X = jax.ShapeDtypeStruct((8, 16, 8), jnp.float32)


def _scatter_set(x):
    rows = jnp.array([3, 0, 5, 1], jnp.int32)
    return x.at[:, rows, :].set(jnp.split(x, 4, axis=1)[0] * 2.0)


def _scatter_add(x):
    rows = jnp.array([3, 0, 3, 1], jnp.int32)  # a repeated row adds up
    return x.at[:, rows, :].add(jnp.split(x, 4, axis=1)[0] * 2.0)


def _gather_rows(x):  # index-based dispatch: tokens picked by position
    return jnp.take(x, jnp.array([3, 0, 5, 1, 7, 2], jnp.int32), axis=1) * 2.0


# (name, function of x [8, 16, 8], the primitive under test)
CASES = [
    ("cumsum", lambda x: jnp.cumsum(x, axis=1) * 2.0, "cumsum"),
    ("cumsum_reverse", lambda x: jax.lax.cumsum(x, axis=2, reverse=True) + 1.0, "cumsum"),
    ("cummax", lambda x: jax.lax.cummax(x, axis=1) - x, "cummax"),
    ("sort", lambda x: jnp.sort(x, axis=1) * 3.0, "sort"),
    ("argsort", lambda x: jnp.argsort(x, axis=2).astype(jnp.float32), "sort"),
    ("rev", lambda x: jnp.flip(x, axis=1) + x, "rev"),
    ("top_k", lambda x: jax.lax.top_k(x, 2)[0] * 2.0, "top_k"),
    ("scatter", _scatter_set, "scatter"),
    ("scatter_add", _scatter_add, "scatter-add"),
    ("gather", _gather_rows, "gather"),
]


def _plan(fn, split_dim: int):
    """Plan ``fn(x)`` on 8 devices with ``x`` split on ``split_dim``."""
    program = trace(fn, X, arg_kinds=("data",))
    graph = build_graph(program.records)
    mesh = alpa_test_mesh((8,), ("x",))
    dims = [()] * 3
    dims[split_dim] = ("x",)
    pinned = {graph.inputs[0]: ShardingSpec(tuple(dims))}
    return program, graph, auto_shard_graph(graph, mesh, HIGHS, pinned_inputs=pinned)


def _node(graph, primitive):
    return next(n for n in graph.nodes if n.primitive == primitive)


@pytest.mark.parametrize("name, fn, primitive", CASES, ids=[c[0] for c in CASES])
def test_rule_runs_like_one_device_and_predicts_xlas_collectives(name, fn, primitive):
    assert primitive in RULES  # a rule of its own, not the replicated fallback
    program, graph, plan = _plan(fn, split_dim=0)
    devices = jax.devices()[:8]
    report = verify_plan(program, plan, devices=devices)
    assert report.collectives_agree, report.comparison.format()
    x = np.asarray(jax.random.normal(jax.random.key(0), X.shape, X.dtype))
    step = build_sharded_step(program, plan, make_mesh(plan.mesh, devices))
    got = jax.tree_util.tree_leaves(step(x))
    want = jax.tree_util.tree_leaves(jax.jit(fn)(x))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


@pytest.mark.parametrize(
    "name, fn, primitive",
    [c for c in CASES if c[0] != "top_k"],
    ids=[c[0] for c in CASES if c[0] != "top_k"],
)
def test_split_off_the_working_dim_stays_split_with_no_collective(name, fn, primitive):
    """x split on dim 0, which none of these ops works along: the op runs on its shard."""
    _, graph, plan = _plan(fn, split_dim=0)
    node = _node(graph, primitive)
    assert plan.tensor_specs[node.outputs[0]].dims[0] == ("x",)
    assert plan.predicted_collectives == ()


def test_a_scan_never_splits_its_scanned_dim():
    """x split on the scanned dim: the plan reshards before the cumsum (an all-to-all to
    another dim is the cheapest), and XLA compiles the same exchange."""
    program, graph, plan = _plan(lambda x: jnp.cumsum(x, axis=1) * 2.0, split_dim=1)
    node = _node(graph, "cumsum")
    assert plan.tensor_specs[node.outputs[0]].dims[1] == ()
    assert [c.kind for c in plan.predicted_collectives] == ["all-to-all"]
    report = verify_plan(program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()


def test_top_k_runs_whole_as_xla_does():
    """XLA's partitioner gathers a TopK's operand whatever its sharding: the rule offers
    only the replicated strategy, so the plan predicts that all-gather."""
    program, graph, plan = _plan(lambda x: jax.lax.top_k(x, 2)[0] * 2.0, split_dim=0)
    assert plan.tensor_specs[_node(graph, "top_k").outputs[0]].is_replicated
    assert [c.kind for c in plan.predicted_collectives] == ["all-gather"]


def _collective_kinds(fn, *args) -> list[str]:
    """The kind of each collective in XLA's compiled text of ``fn``, in order."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)\(", text)


def test_xla_cpu_gathers_a_batched_dot_partial_sum_wanted_split_finer_on_its_batch_dim():
    """What XLA:CPU compiles for the MoE's open 2-D disagreement (docs/truth.md, GPT-MoE):
    a batched dot ``[G, S, E, C] x [G, S, C] -> [G, S, E]`` with G split over ``data`` and
    C over ``model`` is a partial sum over ``model``; wanted as G split over
    (``data``, ``model``) the plan predicts one reduce-scatter over ``model``, XLA
    all-reduces over ``model``, all-gathers G over ``data`` and slices. The same partial
    sum from an unbatched dot is all-reduced and sliced, with no all-gather."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def sds(shape, *spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*spec)))

    want = NamedSharding(mesh, P(("data", "model")))
    lhs = sds((8, 64, 8, 16), "data", None, None, "model")

    def batched(a, b):
        return jax.lax.with_sharding_constraint(jnp.einsum("gsec,gsc->gse", a, b), want) * 2.0

    def unbatched(a, b):
        return jax.lax.with_sharding_constraint(jnp.einsum("gsec,c->gse", a, b), want) * 2.0

    kinds = _collective_kinds(batched, lhs, sds((8, 64, 16), "data", None, "model"))
    assert kinds == ["all-reduce", "all-gather"]
    kinds = _collective_kinds(unbatched, lhs, sds((16,), "model"))
    assert kinds == ["all-reduce"]


def test_reshard_predicts_xla_cpus_detour_for_a_batched_dots_partial_sum():
    """The resharding model follows the compiled behaviour above: with the producer's
    batch dims given, ``[G@data]`` partial over ``model`` into ``[G@data+model]`` is an
    all-reduce of the local buffer over ``model`` and an all-gather of G over ``data``
    (then a free slice); without them (any other producer), one reduce-scatter."""
    from autoshard.intra.cost.resharding import reshard

    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec((("data",), (), ()), ("model",))
    dst = ShardingSpec((("data", "model"), (), ()))
    local = 4 * 64 * 8 * 4  # [G/2, S, E] f32
    detour = reshard(src, dst, (8, 64, 8), 4, mesh, batch_dims=(0, 1))
    assert [(c.kind, c.axes, c.bytes) for c in detour.collectives] == [
        ("all-reduce", ("model",), local),
        ("all-gather", ("data",), 2 * local),
    ]
    plain = reshard(src, dst, (8, 64, 8), 4, mesh)
    assert [(c.kind, c.axes) for c in plain.collectives] == [("reduce-scatter", ("model",))]
    assert detour.cost > plain.cost
    # a batch dim the source does not split, or a split onto a free dim: no detour
    other = ShardingSpec(((), (), ("model",)))
    assert reshard(src, other, (8, 64, 8), 4, mesh, batch_dims=(0, 1)) == reshard(
        src, other, (8, 64, 8), 4, mesh
    )
