"""A reshard of several steps runs the route the planner priced (moe-1.3b and wresnet-1b
auto on 2x4, docs/truth.md).

The planner prices a reshard XLA's way, one collective at a time
(:func:`autoshard.intra.cost.resharding.reshard`); left to itself, XLA's partitioner takes other
routes for many of them: an all-gather over part of an axis and a collective-permute for
``[8, 64@model, 16] -> [8, 64@data, 16]``, an all-to-all and a permute for
``[32@model, 64@data] -> [32@data+model, 64]``, two all-to-alls where the plan slices
first. The runtime pins every spec of the priced route (``reshard.steps``) with one
``with_sharding_constraint`` each, so that XLA moves the value one priced collective at a
time. Compiled here on 8 fake CPU devices.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from autoshard.hardware.mesh import uniform_mesh
from autoshard.intra.cost.resharding import reshard
from autoshard.ir.records import EqnRecord
from autoshard.ir.spec import Mesh, ShardingSpec
from autoshard.runtime.sharded import SpecConstraints, make_mesh, named_sharding
from autoshard.verify.collectives import analyze_collectives

MESH = Mesh(("data", "model"), (2, 4))
PRICED = uniform_mesh((2, 4), ("data", "model"), alpha=1e-5, beta=1e-10)


def spec(*dims) -> ShardingSpec:
    return ShardingSpec(tuple(tuple(d.split("+")) if d else () for d in dims))


class _Tensor(NamedTuple):
    shape: tuple
    dtype: str


# (shape, made, read): each was read so by the moe-1.3b auto 2x4 plan (smaller here)
MULTI_STEP = [
    ((8, 64, 16), spec("", "model", ""), spec("", "data", "")),
    ((32, 64), spec("model", "data"), spec("data+model", "")),
    ((8, 64, 16), spec("model", "", ""), spec("", "model", "data")),
    ((8, 64, 16), spec("data", "model", ""), spec("", "data", "")),
]


def _compile(shape, made, read, pinned: bool):
    """x (a program input held as ``made``) read as ``read`` by one equation: what XLA
    emits, collective-permutes included, as sorted (kind, axes, bytes)."""
    mesh = make_mesh(MESH, jax.devices()[:8])
    records = [EqnRecord(0, "neg", (0,), (1,), {}, None, "forward", "")]
    cons = SpecConstraints.build(
        records,
        {1: read},
        {0: {0: read}},
        mesh,
        tensors=[_Tensor(shape, "float32"), _Tensor(shape, "float32")] if pinned else None,
        input_specs={0: made},
    )

    def f(x):
        (x,) = cons.operands_hook(0, [x])
        (y,) = cons.outputs_hook(0, [-x])
        return y

    step = jax.jit(
        f, in_shardings=named_sharding(mesh, made), out_shardings=named_sharding(mesh, read)
    )
    text = step.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
    return _records(analyze_collectives(text, MESH, range(8)).compared())


def _records(collectives):
    return sorted((c.kind, tuple(sorted(c.axes)), c.bytes) for c in collectives)


@pytest.mark.parametrize("shape,made,read", MULTI_STEP)
def test_the_runtime_compiles_the_priced_route(shape, made, read):
    predicted = reshard(made, read, shape, 4, PRICED)
    assert predicted.collectives
    assert _compile(shape, made, read, pinned=True) == _records(predicted.collectives)


@pytest.mark.parametrize("shape,made,read", MULTI_STEP)
def test_a_route_is_xlas_own_or_pinned(shape, made, read):
    """Where XLA's own route has a collective-permute the planner prices that route
    (:mod:`autoshard.intra.cost.reshard_tiles`) and nothing is pinned; elsewhere the priced
    route's specs are pinned, and left to itself XLA would take another."""
    predicted = reshard(made, read, shape, 4, PRICED)
    own = _compile(shape, made, read, pinned=False)
    if predicted.steps:
        assert own != _records(predicted.collectives)
    else:
        assert any(c.kind == "collective-permute" for c in predicted.collectives)
        assert own == _records(predicted.collectives)


def test_replicating_two_split_dims_is_one_all_gather_per_dim():
    # no pin needed: XLA's own route, priced as such (it was priced as one all-gather
    # over both axes, 8x the bytes of the first one XLA makes)
    shape, made, read = (64, 128), spec("model", "data"), spec("", "")
    predicted = reshard(made, read, shape, 4, PRICED).collectives
    assert [(c.kind, c.axes) for c in predicted] == [
        ("all-gather", ("data",)),
        ("all-gather", ("model",)),
    ]
    assert _compile(shape, made, read, pinned=False) == _records(predicted)


def _compile_two_readers(memo: dict | None):
    """w (a program input held as ``[d0@model, d1@data]`` on 2x2) read replicated by two
    equations, each through the priced route's step ``[d0@model]``: the collectives XLA
    emits, as sorted (kind, axes, bytes)."""
    mesh22 = Mesh(("data", "model"), (2, 2))
    mesh = make_mesh(mesh22, jax.devices()[:4])
    shape, made, read = (128, 128), spec("model", "data"), spec("", "")
    records = [
        EqnRecord(0, "neg", (0,), (1,), {}, None, "forward", ""),
        EqnRecord(1, "exp", (0,), (2,), {}, None, "backward", ""),
    ]
    tensors = [_Tensor(shape, "float32")] * 3
    cons = SpecConstraints.build(
        records, {1: read, 2: read}, {0: {0: read}, 1: {0: read}}, mesh, tensors, {0: made}
    )
    assert len(cons.operands[0]) == 2  # the route's step, then the spec read

    def f(w):
        (a,) = cons.operands_hook(0, [w], memo)
        (b,) = cons.operands_hook(1, [w], memo)
        return cons.outputs_hook(0, [-a])[0] + cons.outputs_hook(1, [jnp.exp(b)])[0]

    step = jax.jit(f, in_shardings=named_sharding(mesh, made))
    text = step.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
    return _records(analyze_collectives(text, mesh22, range(4)).compared())


def test_a_value_read_twice_through_a_route_is_resharded_once():
    """Two readers of one value in one spec share its reshard, as the planner prices it
    (once per value and spec) and the memory model holds it (one copy). Constrained per
    reader, XLA's partitioner shares the route's first step (it reshards one instruction
    to one sharding once) but not the next, whose source is each reader's own constraint:
    test_intra's MLP on 2x2 compiled five all-gathers over ``model`` where four were
    predicted. The runtime's memo (one per trace) makes it one."""
    once = [("all-gather", ("data",), 32768), ("all-gather", ("model",), 65536)]
    assert _compile_two_readers({}) == once
    assert _compile_two_readers(None) == sorted([*once, ("all-gather", ("model",), 65536)])
