"""XLA's collective-permute reshards and its other own routes, compiled and predicted (issue 31).

Each move compiles ``jax.jit`` of the identity from one spec (input sharding) to another
(output sharding) on 8 fake CPU devices as 2x2, 2x4 and 4x2 meshes, and compares what XLA
emits (collective-permutes included, groups over part of an axis read as sub-axes) with
:func:`autoshard.intra.cost.resharding.reshard`: kind, axes, count and bytes.  The moves below are one
or more of each of :mod:`autoshard.intra.cost.reshard_tiles`' routes per mesh; the ``slow`` tests
compile all 330 moves of a 2-D tensor, and all 342 per mesh of a 3-D one as the runtime runs
them, pinned where the priced route has steps (``benchmarks/studies/reshard_moves.py``
prints them).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.hardware.mesh import uniform_mesh
from autoshard.intra.cost.collectives import collective_cost
from autoshard.intra.cost.reshard_tiles import tile_route
from autoshard.intra.cost.reshard_xla import xla_route
from autoshard.intra.cost.resharding import reshard
from autoshard.ir.spec import Collective, Mesh, ShardingSpec, sub_axis
from autoshard.verify.collectives import analyze_collectives

AXES = ("data", "model")
SHAPE = (16, 32)  # f32: 2,048 bytes


def spec(text: str) -> ShardingSpec:
    """``"data;model"`` -> [d0@data, d1@model]; ``"data+model;"`` -> [d0@data+model, d1]."""
    return ShardingSpec(tuple(tuple(d.split("+")) if d else () for d in text.split(";")))


_COMPILED: dict = {}  # compiled once per session: (mesh, src, dst) -> records


def compiled(mesh_shape, src: ShardingSpec, dst: ShardingSpec, shape=SHAPE, steps=()):
    """What XLA emits for the move, through ``steps`` pinned one after the other (as the
    runtime pins a priced route) where given."""
    key = (mesh_shape, src, dst, shape, steps)
    if key not in _COMPILED:
        n = math.prod(mesh_shape)
        jmesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), AXES)

        def sharding(s):
            return NamedSharding(jmesh, P(*(d[0] if len(d) == 1 else d or None for d in s.dims)))

        def move_through(x):
            for step in steps:
                x = jax.lax.with_sharding_constraint(x, sharding(step))
            return x

        move = jax.jit(move_through, in_shardings=sharding(src), out_shardings=sharding(dst))
        text = move.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
        found = analyze_collectives(text, Mesh(AXES, mesh_shape), range(n)).compared()
        _COMPILED[key] = _records(found)
    return _COMPILED[key]


def predicted(mesh_shape, src, dst, shape=SHAPE):
    mesh = uniform_mesh(mesh_shape, AXES, alpha=1e-5, beta=1e-10)
    return _records(reshard(src, dst, shape, 4, mesh).collectives)


def _records(collectives):
    return sorted((c.kind, tuple(sorted(c.axes)), c.bytes) for c in collectives)


PERMUTE = "collective-permute"
MOVES = [
    # (mesh, from, to, what XLA emits: kind, axes, bytes)
    ((2, 2), "data;", "model;", [(PERMUTE, ("data", "model"), 1024)]),
    ((2, 2), "data+model;", "model+data;", [(PERMUTE, ("data", "model"), 512)]),
    ((2, 2), "data;", "model;data", [(PERMUTE, ("data", "model"), 512)]),  # slice, permute
    (
        (2, 2),
        "model;data",
        "data;",
        [("all-gather", ("model",), 1024), (PERMUTE, ("data", "model"), 512)],
    ),  # fmt: skip
    (
        (2, 2),
        "data;",
        ";model",
        [("all-to-all", ("data",), 1024), (PERMUTE, ("data", "model"), 1024)],
    ),  # fmt: skip
    (
        (2, 2),
        "data;model",
        ";",
        [("all-gather", ("data",), 2048), ("all-gather", ("model",), 1024)],
    ),  # fmt: skip
    (
        (2, 4),
        "model;",
        "data;",
        [("all-gather", ("model:(1)2",), 1024), (PERMUTE, ("data", "model"), 512)],
    ),  # fmt: skip
    (
        (2, 4),
        "data;model",
        "model;data",
        [("all-to-all", ("model:(2)2",), 256), (PERMUTE, ("data", "model"), 256)],
    ),  # fmt: skip
    (
        (2, 4),
        "data;model",
        "model;",
        [("all-gather", ("data",), 512), ("all-to-all", ("model",), 512)],
    ),  # fmt: skip
    (
        (2, 4),
        "data;model",
        ";data",
        [
            ("all-gather", ("model:(1)2",), 1024),
            ("all-gather", ("model:(2)2",), 512),
            (PERMUTE, ("data", "model"), 256),
        ],
    ),  # fmt: skip
    (
        (2, 4),
        "data;",
        ";data+model",
        [("all-to-all", ("data",), 256), (PERMUTE, ("data", "model"), 256)],
    ),  # fmt: skip
    ((2, 4), ";model", "model;data", [("all-to-all", ("model",), 512)]),  # all-to-all, then a slice
    (
        (4, 2),
        "data;",
        "model;",
        [("all-gather", ("data:(1)2",), 1024), (PERMUTE, ("data", "model"), 512)],
    ),  # fmt: skip
    (
        (4, 2),
        "data;",
        "model;data",
        [("all-to-all", ("data:(2)2",), 256), (PERMUTE, ("data", "model"), 256)],
    ),  # fmt: skip
    (
        (4, 2),
        "data;model",
        ";data",
        [("all-gather", ("model",), 512), ("all-to-all", ("data",), 512)],
    ),  # fmt: skip
    ((4, 2), "model;", "data;", [(PERMUTE, ("data", "model"), 512)]),
    ((4, 2), "model;", ";data", [("all-gather", ("model",), 2048)]),  # XLA replicates: no permute
]


@pytest.mark.parametrize(("mesh_shape", "src", "dst", "xla"), MOVES)
def test_each_move_is_predicted_as_xla_compiles_it(mesh_shape, src, dst, xla):
    src, dst = spec(src), spec(dst)
    assert compiled(mesh_shape, src, dst) == sorted(xla)  # what XLA does (jax 0.10.2)
    mesh = uniform_mesh(mesh_shape, AXES, alpha=1e-5, beta=1e-10)
    r = reshard(src, dst, SHAPE, 4, mesh)
    if _records(r.collectives) != sorted(xla):
        # a cheaper route of the planner's, which the runtime pins and XLA then takes
        own = sum(collective_cost(mesh, Collective(k, a, b)) for k, a, b in xla)
        assert r.steps and r.cost < own
        assert compiled(mesh_shape, src, dst, SHAPE, r.steps) == _records(r.collectives)


SHAPE_3D = (8, 16, 32)  # f32: 16,384 bytes
A2A, AG = "all-to-all", "all-gather"
MOVES_3D = [
    # (mesh, from, to, what XLA emits) -- XLA's moves without a permute of the whole
    # buffer first (autoshard.intra.cost.reshard_xla.xla_route), one or two per rule
    # counts swapped between three dims: one all-to-all per pair of dims
    ((2, 4), "data;model;", ";data;model", [(A2A, ("data",), 2048), (A2A, ("model",), 2048)]),
    # replicated source, counts shifted one dim down: the all-to-all, then a local slice
    # (the planner's route, slice first, all-to-all of 2,048 bytes, is pinned instead)
    ((2, 4), ";data;", "data;;model", [(A2A, ("data",), 8192)]),
    # replicated destination, counts shifted one dim up: all-gather the last cut dim,
    # then the all-to-all
    ((2, 2), "data;;model", ";data;", [(AG, ("model",), 8192), (A2A, ("data",), 8192)]),
    # replicated source: its replicas cut the first dim the destination cuts by a multiple
    # of them (a local slice), then all-to-alls and a permute where the devices differ
    ((2, 2), "data;;", ";model;data", [(A2A, ("data",), 4096)]),
    ((4, 2), "model;;", ";data;model", [(A2A, ("model",), 2048)]),
    # replicated destination: all-gather the dim cut as many times as it has replicas
    ((2, 4), "data;model;", ";;data", [(AG, ("model",), 8192), (A2A, ("data",), 8192)]),
    (
        (2, 2),
        "data;model;",
        ";;data",
        [(AG, ("data",), 8192), (A2A, ("model",), 8192), (PERMUTE, ("data", "model"), 8192)],
    ),  # fmt: skip
]


def xla_records(mesh_shape, src, dst, shape):
    """:func:`xla_route`'s steps as (kind, axes, bytes), sorted."""
    route = xla_route(src, dst, Mesh(AXES, mesh_shape))
    assert route is not None
    total = 4 * math.prod(shape)
    return sorted((kind, tuple(sorted(axes)), total // blocks) for kind, axes, blocks in route)


@pytest.mark.parametrize(("mesh_shape", "src", "dst", "xla"), MOVES_3D)
def test_xlas_other_moves_of_a_3d_tensor_are_predicted_as_it_compiles_them(
    mesh_shape, src, dst, xla
):
    src, dst = spec(src), spec(dst)
    assert compiled(mesh_shape, src, dst, SHAPE_3D) == sorted(xla)  # jax 0.10.2
    assert xla_records(mesh_shape, src, dst, SHAPE_3D) == sorted(xla)
    mesh = uniform_mesh(mesh_shape, AXES, alpha=1e-5, beta=1e-10)
    r = reshard(src, dst, SHAPE_3D, 4, mesh)
    if _records(r.collectives) != sorted(xla):
        # the planner's route, pinned by the runtime, only where it is cheaper
        own = sum(collective_cost(mesh, Collective(k, a, b)) for k, a, b in xla)
        assert r.steps and r.cost < own
        assert compiled(mesh_shape, src, dst, SHAPE_3D, r.steps) == _records(r.collectives)


def test_all_to_alls_of_disjoint_dims_are_one_all_to_all_over_their_axes():
    # [d0@data, d1@model, d2, d3] -> [d0, d1, d2@data, d3@model] on 2x4: the pairs (0, 2)
    # and (1, 3) share no dim, and XLA moves both with one all-to-all over data and model
    # (where they chain, as on a 3-D tensor above, it makes one per pair)
    shape = (8, 8, 16, 16)  # f32: 65,536 bytes
    src, dst = spec("data;model;;"), spec(";;data;model")
    xla = [(A2A, ("data", "model"), 8192)]
    assert compiled((2, 4), src, dst, shape) == xla
    assert xla_records((2, 4), src, dst, shape) == xla
    assert predicted((2, 4), src, dst, shape) == xla


def test_where_the_replicas_would_move_between_dims_xla_replicates():
    # [d0@data] -> [d1@model] on 2x4: the tile counts [2, 1, 1] + 4 replicas and
    # [1, 4, 1] + 2 replicas swap with the replicas; XLA gathers everything instead
    src, dst = spec("data;;"), spec(";model;")
    assert compiled((2, 4), src, dst, SHAPE_3D) == [(AG, ("data",), 16384)]
    assert xla_route(src, dst, Mesh(AXES, (2, 4))) is None
    assert predicted((2, 4), src, dst, SHAPE_3D) == [(AG, ("data",), 16384)]


def test_a_pinned_route_cheaper_than_xlas_own_stays_priced():
    # [d0@model] -> [d1@model, d2@data] on 2x4: XLA's own route is two all-to-alls (slice
    # to [d0@model, d1@data], then data and model); the planner slices to
    # [d0@model, d2@data] and moves model with one all-to-all, and the runtime pins that
    mesh = uniform_mesh((2, 4), AXES, alpha=1e-5, beta=1e-10)
    src, dst = spec("model;;"), spec(";model;data")
    assert compiled((2, 4), src, dst, SHAPE_3D) == sorted(
        [(A2A, ("data",), 2048), (A2A, ("model",), 2048)]
    )
    r = reshard(src, dst, SHAPE_3D, 4, mesh)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [(A2A, ("model",), 2048)]
    assert r.steps == (spec("model;;data"),)


def test_the_zero3_labels_move_on_4x2_is_a_permute_then_an_all_gather_over_pairs_of_data():
    # gpt-tiny zero3 on 4x2, fused cross-entropy: int32 labels [B@data, S] read [B@model, S]
    mesh = uniform_mesh((4, 2), AXES, alpha=1e-5, beta=1e-10)
    r = reshard(spec("data;"), spec("model;"), (8, 16), 4, mesh)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("collective-permute", ("data", "model"), 8 * 16 * 4 // 4),
        ("all-gather", ("data:(1)2",), 8 * 16 * 4 // 2),
    ]
    assert sub_axis("data:(1)2") == ("data", 1, 2) and mesh.mesh.size(("data:(1)2",)) == 2


def test_a_permute_costs_one_alpha_and_its_bytes_over_the_slowest_link():
    mesh = uniform_mesh((2, 4), AXES, alpha=(1e-5, 2e-5), beta=(1e-10, 3e-10))
    c = Collective(PERMUTE, ("data", "model"), 1000)
    from autoshard.intra.cost.collectives import CostOptions

    assert collective_cost(mesh, c, CostOptions(tie_breakers=False)) == pytest.approx(
        2e-5 + 3e-10 * 1000
    )
    # the permute that replaces issue 31's all-gather + all-to-all is cheaper than both
    r = reshard(spec("data;"), spec("model;data"), SHAPE, 4, mesh)
    assert [c.kind for c in r.collectives] == [PERMUTE]


def test_sub_axes_are_checked_and_priced_on_their_axis():
    mesh = uniform_mesh((4, 2), AXES, alpha=(1e-5, 2e-5), beta=(1e-10, 3e-10))
    assert mesh.link(("data:(2)2",)) == (1e-5, 1e-10)
    with pytest.raises(ValueError, match="does not divide mesh axis 'data'"):
        mesh.mesh.size(("data:(2)4",))
    with pytest.raises(ValueError, match="AXIS:\\(PRE\\)SIZE"):
        mesh.mesh.size(("data:(x)2",))
    with pytest.raises(ValueError, match="does not exist"):
        mesh.group(("batch:(1)2",))


def test_a_slice_is_never_a_permute_on_a_mesh_of_three_axes():
    # XLA orders the cuts of a replicated source to match the destination: adding a minor
    # axis is a local slice, whichever axis comes first among the replicated ones
    mesh = Mesh(("x", "y", "z"), (2, 2, 2))
    assert tile_route(spec("x;"), spec("x+z;"), mesh) is None
    assert tile_route(spec("x;"), spec("x;z"), mesh) is None
    priced = uniform_mesh((2, 2, 2), ("x", "y", "z"), alpha=1e-5, beta=1e-10)
    assert reshard(spec("x;"), spec("x+z;"), SHAPE, 4, priced).cost == 0.0


def _all_specs(rank=2):
    out = []
    for place in itertools.product(range(rank + 1), repeat=2):  # rank: the axis is unused
        dims = [[a for a, d in zip(AXES, place) if d == i] for i in range(rank)]
        for orders in itertools.product(*(itertools.permutations(d) for d in dims)):
            out.append(ShardingSpec(tuple(tuple(o) for o in orders)))
    return list(dict.fromkeys(out))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4), (4, 2)])
def test_every_move_of_a_2d_tensor_is_predicted_as_xla_compiles_it(mesh_shape):
    # each move compiled as the runtime runs it: XLA's own route, or the planner's pinned
    # step by step where it is cheaper (since 857502f; e.g. 2x4 [d0@model, d1] ->
    # [d0@data, d1@model] through [d0, d1@model]: one all-to-all over model, where XLA's
    # own route is an all-to-all over half of model and a collective-permute)
    mesh = uniform_mesh(mesh_shape, AXES, alpha=1e-5, beta=1e-10)
    wrong = []
    for src, dst in itertools.permutations(_all_specs(), 2):
        r = reshard(src, dst, SHAPE, 4, mesh)
        got = compiled(mesh_shape, src, dst, SHAPE, r.steps)
        if got != _records(r.collectives):
            wrong.append((str(src), str(dst), got, _records(r.collectives)))
    assert not wrong


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4), (4, 2)])
def test_every_move_of_a_3d_tensor_runs_as_priced(mesh_shape):
    # 342 moves per mesh, each compiled as the runtime runs it: XLA's own route, or the
    # planner's pinned step by step where it is cheaper (reshard_moves.py --pin-steps)
    mesh = uniform_mesh(mesh_shape, AXES, alpha=1e-5, beta=1e-10)
    wrong = []
    for src, dst in itertools.permutations(_all_specs(3), 2):
        r = reshard(src, dst, SHAPE_3D, 4, mesh)
        got = compiled(mesh_shape, src, dst, SHAPE_3D, r.steps)
        if got != _records(r.collectives):
            wrong.append((str(src), str(dst), got, _records(r.collectives)))
    assert not wrong
