"""Which layout XLA reduces a partial sum into when one consumer reads it in the
producer's own layout and another splits it further (wresnet-1b auto 2x4: a conv's output
``[.., 2560@data]`` partial over model, read ``[.., 2560@data+model]`` and
``[.., 2560@data]``). A dot or a convolution: an all-reduce into its own layout (the split
is a slice of it) where the split target only splits further a dim it already splits;
a reduce-scatter into the split target and an all-gather back where it splits a new dim.
Compiled here on 8 fake CPU devices, both orders of the readers."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.hardware.mesh import uniform_mesh
from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.ir.spec import Mesh, ShardingSpec
from autoshard.runtime.sharded import make_mesh
from autoshard.verify.collectives import analyze_collectives

MESH = Mesh(("data", "model"), (2, 4))
PRICED = uniform_mesh((2, 4), ("data", "model"), alpha=1e-5, beta=1e-10)
SHAPE = (16, 8, 8, 128)  # NHWC, the conv's (or dot's) output
OWN = ShardingSpec(((), (), (), ("data",)))
MADE = ShardingSpec(OWN.dims, partial=("model",))
FURTHER = ShardingSpec(((), (), (), ("data", "model")))  # splits d3 further
NEW_DIM = ShardingSpec((("model",), (), (), ("data",)))  # splits d0, unsplit in OWN


def _compiled(producer: str, split: ShardingSpec, split_first: bool):
    mesh = make_mesh(MESH, jax.devices()[:8])

    def named(spec):
        return NamedSharding(mesh, P(*[a if a else None for a in spec.dims]))

    def f(x, k):
        if producer == "conv":
            o = jax.lax.conv_general_dilated(
                x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
        else:
            o = jnp.einsum("bhwc,ijcd->bhwd", x, k)
        a = jax.lax.with_sharding_constraint(o, named(split)) * 2
        b = jax.lax.with_sharding_constraint(o, named(OWN)) + 1
        return (a, b) if split_first else (b, a)

    outs = (named(split), named(OWN)) if split_first else (named(OWN), named(split))
    ins = (
        NamedSharding(mesh, P(None, None, None, "model")),
        NamedSharding(mesh, P(None, None, "model", "data")),
    )
    step = jax.jit(f, in_shardings=ins, out_shardings=outs)
    args = [
        jax.ShapeDtypeStruct((16, 8, 8, 64), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 64, 128), jnp.float32),
    ]
    text = step.lower(*args).compile().as_text()
    return [c.collective for c in analyze_collectives(text, MESH, range(8)).collectives]


@pytest.mark.parametrize("producer", ["conv", "dot"])
@pytest.mark.parametrize("split", [FURTHER, NEW_DIM], ids=["further", "new-dim"])
def test_the_resolution_is_what_xla_compiles(producer, split):
    predicted = reshard_to_consumers(MADE, [split, OWN], SHAPE, 4, PRICED).collectives
    reversed_ = reshard_to_consumers(MADE, [OWN, split], SHAPE, 4, PRICED).collectives
    assert sorted(map(str, predicted)) == sorted(map(str, reversed_))
    kinds = [c.kind for c in predicted]
    assert kinds == (["all-reduce"] if split == FURTHER else ["reduce-scatter", "all-gather"])
    for split_first in (True, False):
        compiled = _compiled(producer, split, split_first)
        assert sorted(map(str, compiled)) == sorted(map(str, predicted))


def test_a_reduce_is_all_reduced_into_its_own_layout():
    # gpt-1.3b auto 2x4's cross-entropy sum [8, 1024@data] partial over model, read split
    # over model on dim 0 and whole: one all-reduce, the split a slice of it
    # (benchmarks/studies/xla_partial_choice.py), in either order of the readers
    own = ShardingSpec(((), ("data",)))
    made, split = ShardingSpec(own.dims, partial=("model",)), ShardingSpec((("model",), ("data",)))
    for dsts in ([split, own], [own, split]):
        r = reshard_to_consumers(made, dsts, (8, 1024), 4, PRICED, reduce_first=(("model",),))
        assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
            ("all-reduce", ("model",), 8 * 1024 * 4 // 2)
        ]
    mesh = make_mesh(MESH, jax.devices()[:8])

    def f(x):
        s = x.sum(-1)
        a = jax.lax.with_sharding_constraint(s, NamedSharding(mesh, P("model", "data"))) * 2
        return a, jax.lax.with_sharding_constraint(s, NamedSharding(mesh, P(None, "data"))) + 1

    step = jax.jit(f, in_shardings=NamedSharding(mesh, P(None, "data", "model")))
    text = step.lower(jax.ShapeDtypeStruct((8, 1024, 64), jnp.float32)).compile().as_text()
    compiled = [c.collective for c in analyze_collectives(text, MESH, range(8)).collectives]
    assert [(c.kind, c.axes, c.bytes) for c in compiled] == [
        ("all-reduce", ("model",), 8 * 1024 * 4 // 2)
    ]
