"""A dot whose contracting dims are split over different mesh axes (moe-1.3b's gate
kernel gradient ``GSM,GSE->ME``, G split over model and S over data, on 2x4): XLA sums one
contracting dim's axes at a time, the last dim first (an all-reduce over data, then one
over model), as it does for a reduce; the plan predicted one all-reduce over both.
Compiled here on 8 fake CPU devices."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.hardware.mesh import uniform_mesh
from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.problem.predict import reduce_steps
from autoshard.ir.spec import Collective, Mesh, ShardingSpec
from autoshard.runtime.sharded import make_mesh
from autoshard.verify.collectives import analyze_collectives

MESH = Mesh(("data", "model"), (2, 4))
PRICED = uniform_mesh((2, 4), ("data", "model"), alpha=1e-5, beta=1e-10)
G, S, M, E = 4, 64, 32, 16
LHS = ShardingSpec((("model",), ("data",), ()))  # [G@model, S@data, M]
OUT = ShardingSpec(((), ()), partial=("data", "model"))  # [M, E] partial over both
# GSM,GSE->ME: contracting G and S of both operands
DOT = SimpleNamespace(
    primitive="dot_general", params={"dimension_numbers": (((0, 1), (0, 1)), ((), ()))}
)


def test_the_dot_is_reduced_one_contracting_dim_at_a_time_the_last_first():
    made = SimpleNamespace(input_specs=(LHS, LHS), output_specs=(OUT,))
    assert reduce_steps(DOT, made) == (("data",), ("model",))
    # one contracting dim split (over both axes): resolved like any other partial sum
    one = ShardingSpec((("data", "model"), (), ()))
    assert reduce_steps(DOT, SimpleNamespace(input_specs=(one, one), output_specs=(OUT,))) == ()


def test_the_prediction_is_what_xla_compiles():
    made = SimpleNamespace(input_specs=(LHS, LHS), output_specs=(OUT,))
    read = ShardingSpec(((), ()))
    predicted = reshard_to_consumers(
        OUT, [read], (M, E), 4, PRICED, reduce_first=reduce_steps(DOT, made)
    ).collectives
    mesh = make_mesh(MESH, jax.devices()[:8])
    split = NamedSharding(mesh, P("model", "data", None))
    step = jax.jit(
        lambda x, g: jnp.einsum("gsm,gse->me", x, g),
        in_shardings=(split, split),
        out_shardings=NamedSharding(mesh, P()),
    )
    args = [
        jax.ShapeDtypeStruct((G, S, M), jnp.float32),
        jax.ShapeDtypeStruct((G, S, E), jnp.float32),
    ]
    text = step.lower(*args).compile().as_text()
    compiled = [c.collective for c in analyze_collectives(text, MESH, range(8)).collectives]
    assert compiled == [
        Collective("all-reduce", ("data",), M * E * 4),
        Collective("all-reduce", ("model",), M * E * 4),
    ]
    assert list(predicted) == compiled
