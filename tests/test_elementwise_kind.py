"""Sharding and FLOP rules by kind, not by name: an elementwise primitive nobody wrote a
rule for (as jax 0.12's ``one_minus_square`` was) is planned split like ``tanh``; a
primitive that only keeps its operand's shape (a Cholesky factor) still gets the
replicated fallback and its warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.rules.strategies import RULES, node_strategies
from autoshard.ir.graph import FLOP_RULES, build_graph
from autoshard.ir.primitives import elementwise_shapes, is_elementwise
from autoshard.ir.records import EqnRecord, TensorRecord, TraceRecords
from autoshard.trace.jaxpr import trace

# x / (1 + |x|): an elementwise primitive with an abstract eval and an impl, and nothing
# else registered (no batching rule, no sharding rule, no FLOP rule)
softsign_p = Primitive("made_up_softsign")
softsign_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
softsign_p.def_impl(lambda x: np.asarray(x) / (1 + np.abs(np.asarray(x))))

# the same made up op with a bias operand of shape [1, F] that broadcasts over rows
biased_p = Primitive("made_up_biased")
biased_p.def_abstract_eval(lambda x, b: jax.core.ShapedArray(x.shape, x.dtype))
biased_p.def_impl(lambda x, b: np.asarray(x) + np.asarray(b))


def _step(x, w, b):
    return biased_p.bind(softsign_p.bind(x @ w), b) @ w.T


def _graph():
    args = (
        jax.ShapeDtypeStruct((64, 32), jnp.float32),
        jax.ShapeDtypeStruct((32, 256), jnp.float32),
        jax.ShapeDtypeStruct((1, 256), jnp.float32),
    )
    return build_graph(trace(_step, *args).records)


def test_made_up_primitives_have_no_rules_of_their_own():
    for name in ("made_up_softsign", "made_up_biased"):
        assert name not in RULES and name not in FLOP_RULES


def test_made_up_elementwise_primitive_is_planned_split_without_a_warning():
    graph = _graph()
    made_up = [n for n in graph.nodes if n.primitive.startswith("made_up")]
    assert [n.primitive for n in made_up] == ["made_up_softsign", "made_up_biased"]
    assert all(n.elementwise for n in made_up)
    assert graph.unknown_flops == ()
    assert [n.flops for n in made_up] == [64 * 256, 64 * 256]
    mesh = alpa_test_mesh((8,), ("x",))
    for node in made_up:
        warn: set[str] = set()
        strategies = node_strategies(graph, node, mesh, warn)
        assert not warn
        assert any(not s.output_specs[0].is_replicated for s in strategies)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no sharding rule" warning
        plan = auto_shard_graph(graph, mesh)
    for node in made_up:
        assert not plan.tensor_specs[node.outputs[0]].is_replicated, node.primitive


def test_shape_keeping_primitive_jax_batches_otherwise_stays_replicated_with_a_warning():
    def step(x):
        return jax.lax.linalg.cholesky(x) * 2.0

    graph = build_graph(trace(step, jax.ShapeDtypeStruct((8, 8), jnp.float32)).records)
    (chol,) = [n for n in graph.nodes if n.primitive == "cholesky"]
    assert not chol.elementwise
    with pytest.warns(UserWarning, match="no sharding rule for primitive 'cholesky'"):
        plan = auto_shard_graph(graph, alpa_test_mesh((4,), ("x",)))
    assert plan.tensor_specs[chol.outputs[0]].is_replicated


def _records(primitive, in_shapes, out_shape, jax_says=None):
    shapes = [*in_shapes, out_shape]
    tensors = tuple(TensorRecord(i, s, "float32", "data") for i, s in enumerate(shapes))
    tensors = tensors[:-1] + (TensorRecord(len(in_shapes), out_shape, "float32", "intermediate"),)
    n = len(in_shapes)
    eqn = EqnRecord(0, primitive, tuple(range(n)), (n,), {}, None, "forward", "", jax_says)
    return TraceRecords(tensors, (eqn,), tuple(range(n)), (n,), (), ())


@pytest.mark.parametrize(
    "in_shapes, out_shape, jax_says, expected",
    [
        (((16, 8),), (16, 8), None, True),  # unary, same shape
        (((16, 8), ()), (16, 8), None, True),  # a scalar operand
        (((16, 8), (1, 8)), (16, 8), None, True),  # a size-1 dim broadcasts
        (((16, 8), (8,)), (16, 8), None, False),  # ranks differ: not an implicit broadcast
        (((8, 16),), (16, 8), None, False),  # a transpose's shapes
        (((16, 8),), (16,), None, False),  # a reduction's shapes
        (((16, 8),), (16, 8), False, False),  # JAX batches it otherwise (cumsum, cholesky)
        (((16, 8),), (16, 8), True, True),
    ],
)
def test_records_built_by_hand_are_classified_by_shapes_unless_jax_says(
    in_shapes, out_shape, jax_says, expected
):
    assert is_elementwise("made_up", jax_says, in_shapes, (out_shape,)) is expected
    graph = build_graph(_records("made_up", in_shapes, out_shape, jax_says))
    assert graph.nodes[0].elementwise is expected
    assert (graph.unknown_flops == ()) is expected
    warn: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategies = node_strategies(graph, graph.nodes[0], alpa_test_mesh((4,), ("x",)), warn)
    assert (len(strategies) > 1) is expected
    assert (warn == {"made_up"}) is not expected
    assert any("no sharding rule" in str(w.message) for w in caught) is not expected


def test_named_elementwise_primitives_keep_their_rule_whatever_their_shapes():
    assert is_elementwise("tanh", None, ((4,),), ((4,),))
    assert elementwise_shapes(((),), ((),))
    assert not elementwise_shapes(((4,),), ((4,), (4,)))  # two results
