"""A gather's partial sum read split over the axis it is partial over (the vocab-parallel
embedding lookup read batch-split over the table's axis, gpt-1.3b auto 2x4): the runtime
pins it reduced in the gather's own layout before the split, so XLA does the reduce-scatter
the plan priced. Left to itself, XLA propagates the split back into the gather, whose
partitioner splits the indices over the axis the table leaves free (data), all-reduces
that part over model and moves the rows each device keeps with a collective-permute
(docs/truth.md, XLA:CPU and XLA:GPU alike)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.ir.records import EqnRecord
from autoshard.ir.spec import Mesh, ShardingSpec
from autoshard.runtime.sharded import SpecConstraints, make_mesh, named_sharding
from autoshard.verify.collectives import analyze_collectives

B, S, V, H = 8, 16, 256, 64
MESH = Mesh(("data", "model"), (2, 4))
TABLE = ShardingSpec((("model",), ()))
LOOKUP = ShardingSpec(((), (), ()), partial=("model",))  # the gather's output: partial sum
READ = ShardingSpec((("model",), (), ()))  # the add reads it split over model


def _records(producer: str) -> list[EqnRecord]:
    # tensors: 0 table, 1 tokens, 2 lookup, 3 position term, 4 sum
    return [
        EqnRecord(0, producer, (0, 1), (2,), {}, None, "forward", ""),
        EqnRecord(1, "add", (2, 3), (4,), {}, None, "forward", ""),
    ]


def _constraints(producer: str = "gather") -> SpecConstraints:
    mesh = make_mesh(MESH, jax.devices()[:8])
    return SpecConstraints.build(_records(producer), {2: LOOKUP}, {1: {0: READ}}, mesh)


def test_a_gathers_partial_sum_is_reduced_in_its_layout_before_the_split():
    (entry,) = _constraints().operands.items()
    node, ((k0, first), (k1, second)) = entry
    assert node == 1 and k0 == k1 == 0
    assert first.spec == jax.sharding.PartitionSpec(None, None, None)  # reduced, unsplit
    assert second.spec == jax.sharding.PartitionSpec("model", None, None)  # then split
    # another producer's partial sum keeps the one constraint (XLA's dot reduce-scatters)
    assert [k for k, _ in _constraints("dot_general").operands[1]] == [0]


def _compiled(cons: SpecConstraints):
    mesh = make_mesh(MESH, jax.devices()[:8])

    def f(table, tokens, pos):
        table = jax.lax.with_sharding_constraint(table, named_sharding(mesh, TABLE))
        tokens = jax.lax.with_sharding_constraint(
            tokens, named_sharding(mesh, ShardingSpec(((), ())))
        )
        (x,) = cons.outputs_hook(0, [jnp.take(table, tokens, axis=0)])
        x, p = cons.operands_hook(1, [x, pos])
        return jax.lax.with_sharding_constraint(x + p, named_sharding(mesh, READ))

    args = (
        jax.ShapeDtypeStruct((V, H), jnp.float32),
        jax.ShapeDtypeStruct((B, S), jnp.int32),
        jax.ShapeDtypeStruct((B, S, H), jnp.float32),
    )
    text = jax.jit(f).lower(*args).compile().as_text()
    return analyze_collectives(text, MESH, range(8))


@pytest.mark.parametrize("producer", ["gather", "as before"])
def test_xla_reduce_scatters_the_lookup_as_priced(producer):
    cons = _constraints("gather" if producer == "gather" else "dot_general")
    found = _compiled(cons)
    kinds = [(c.collective.kind, c.collective.axes, c.collective.bytes) for c in found.collectives]
    reduce_scatter = ("reduce-scatter", ("model",), B * S * H * 4)
    if producer == "gather":
        assert kinds == [reduce_scatter] and not found.permutes
    else:  # the one constraint: XLA's own route, the one the plan did not price
        assert kinds != [reduce_scatter] and found.permutes
        assert np.any([c.collective.kind == "all-reduce" for c in found.collectives])
