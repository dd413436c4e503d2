"""Tests for autoshard.intra.cost.resharding: alpha-beta collectives, the device mesh, resharding rules."""

import math
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autoshard.hardware.mesh import DeviceMesh, alpa_test_mesh, uniform_mesh
from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.cost.reshard_tiles import tile_route
from autoshard.intra.cost.reshard_xla import xla_route
from autoshard.intra.cost.resharding import (
    ALPA_TIE_BREAKERS,
    CostOptions,
    Reshard,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    collective_cost,
    compute_cost,
    gather_then_slice,
    memory_bound_cost,
    reduce_scatter_cost,
    reshard,
)
from autoshard.ir.spec import Collective, Mesh, ShardingSpec

# the cost-searching mode (group_reductions=False); XLA mode is tested further down
NO_TIES = CostOptions(tie_breakers=False, group_reductions=False)


def spec(*dims, partial=()):
    """ShardingSpec from per-dim axis strings: spec("x", "", "yx") -> [x, R, (y, x)]."""
    return ShardingSpec(tuple(tuple(d) for d in dims), tuple(partial))


# ----------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (2e-6, 1e-10), (0.0, 3.0)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_formulas_on_one_axis(alpha, beta, n):
    mesh = uniform_mesh((n,), ("d",), alpha, beta)
    b = 1e6
    assert all_reduce_cost(mesh, "d", b, NO_TIES) == pytest.approx(
        alpha + beta * 2 * (n - 1) / n * b
    )
    assert all_gather_cost(mesh, "d", b, NO_TIES) == pytest.approx(alpha + beta * (n - 1) / n * b)
    assert reduce_scatter_cost(mesh, ("d",), b, NO_TIES) == pytest.approx(
        alpha + beta * (n - 1) / n * b
    )
    assert all_to_all_cost(mesh, "d", b, NO_TIES) == pytest.approx(alpha + beta * (n - 1) / n * b)


def test_all_reduce_of_one_megabyte_on_four_devices():
    mesh = uniform_mesh((4,), ("d",), alpha=5e-6, beta=1e-9)
    assert all_reduce_cost(mesh, "d", 1e6, NO_TIES) == pytest.approx(5e-6 + 1e-9 * 2 * 3 / 4 * 1e6)


def test_tie_breakers_are_alpas_constants_and_switchable():
    mesh = uniform_mesh((4,), ("d",), 1.0, 1.0)
    fns = {
        "all-reduce": all_reduce_cost,
        "all-gather": all_gather_cost,
        "reduce-scatter": reduce_scatter_cost,
        "all-to-all": all_to_all_cost,
    }
    for kind, fn in fns.items():
        diff = fn(mesh, "d", 1000.0) - fn(mesh, "d", 1000.0, NO_TIES)
        assert diff == pytest.approx(ALPA_TIE_BREAKERS[kind])
    # the ordering Alpa relies on: gather dearest, then all-reduce, then reduce-scatter
    assert ALPA_TIE_BREAKERS["all-gather"] > ALPA_TIE_BREAKERS["all-reduce"]
    assert ALPA_TIE_BREAKERS["all-reduce"] > ALPA_TIE_BREAKERS["reduce-scatter"]


def test_all_to_all_penalty_options():
    mesh = uniform_mesh((8,), ("d",), 1.0, 1.0)
    base = all_to_all_cost(mesh, "d", 6400.0, NO_TIES) - 1.0
    tripled = CostOptions(tie_breakers=False, all_to_all_penalty=3.0)
    assert all_to_all_cost(mesh, "d", 6400.0, tripled) - 1.0 == pytest.approx(3 * base)
    alpa = CostOptions(tie_breakers=False, all_to_all_penalty_scales_with_n=True)
    assert all_to_all_cost(mesh, "d", 6400.0, alpa) - 1.0 == pytest.approx(8 / 2 * base)
    with pytest.raises(ValueError, match="all_to_all_penalty"):
        CostOptions(all_to_all_penalty=-1.0)


def test_group_of_one_device_costs_nothing():
    mesh = uniform_mesh((1, 4), ("x", "y"), 1.0, 1.0)
    for fn in (all_reduce_cost, all_gather_cost, reduce_scatter_cost, all_to_all_cost):
        assert fn(mesh, "x", 1e6) == 0.0
        assert fn(mesh, (), 1e6) == 0.0
        assert fn(mesh, "y", 1e6) > 0.0


def test_axis_group_uses_slowest_link_and_product_of_sizes():
    mesh = uniform_mesh((2, 4), ("x", "y"), alpha=(3.0, 1.0), beta=(0.1, 0.5))
    n, b = 8, 4096.0
    expected = 3.0 + 0.5 * 2 * (n - 1) / n * b
    assert all_reduce_cost(mesh, ("x", "y"), b, NO_TIES) == pytest.approx(expected)
    assert all_reduce_cost(mesh, ("y", "x"), b, NO_TIES) == pytest.approx(expected)
    assert mesh.link(("x", "y")) == (3.0, 0.5)
    # a size-1 axis carries no traffic, so its (slow) link does not count
    slow_unit = uniform_mesh((1, 4), ("x", "y"), alpha=(9.0, 1.0), beta=(9.0, 0.5))
    assert slow_unit.link(("x", "y")) == (1.0, 0.5)


def test_collective_cost_dispatches_on_kind():
    mesh = alpa_test_mesh((2, 4))
    fns = {
        "all-reduce": all_reduce_cost,
        "all-gather": all_gather_cost,
        "reduce-scatter": reduce_scatter_cost,
        "all-to-all": all_to_all_cost,
    }
    for kind, fn in fns.items():
        for axes in [("x",), ("y",), ("x", "y")]:
            c = Collective(kind, axes, 12345)
            assert collective_cost(mesh, c) == fn(mesh, axes, 12345)


def test_collective_cost_rejects_unknown_axis_and_bad_bytes():
    mesh = alpa_test_mesh((2, 4))
    with pytest.raises(ValueError, match="'z'.*\\('x', 'y'\\)"):
        all_reduce_cost(mesh, "z", 10)
    with pytest.raises(ValueError, match="repeats"):
        all_gather_cost(mesh, ("x", "x"), 10)
    with pytest.raises(ValueError, match="nbytes"):
        all_gather_cost(mesh, "x", -1)


def test_compute_and_memory_bound_cost():
    mesh = uniform_mesh((8,), ("d",), 1e-6, 1e-9, peak_flops=1e12, hbm_bandwidth=2e12)
    assert compute_cost(mesh, 3e12) == pytest.approx(3.0)
    assert memory_bound_cost(mesh, 1e12) == pytest.approx(0.5)
    assert compute_cost(alpa_test_mesh((2, 4)), 1e15) == 0.0  # Alpa's tests cost no compute
    with pytest.raises(ValueError, match="flops"):
        compute_cost(mesh, -1.0)


# ----------------------------------------------------------------------------- the mesh


def test_alpa_test_mesh():
    m2 = alpa_test_mesh((2, 4))
    assert m2.axis_names == ("x", "y") and m2.shape == (2, 4) and m2.num_devices == 8
    assert m2.alpha == (1.0, 1.0) and m2.beta == (1.0, 0.1)
    # the second axis is the fast one: same group size, cheaper collective
    square = alpa_test_mesh((4, 4), ("a", "b"))
    assert all_reduce_cost(square, "b", 1e4) < all_reduce_cost(square, "a", 1e4)
    m1 = alpa_test_mesh((8,))
    assert m1.axis_names == ("x",) and m1.alpha == (1.0,) and m1.beta == (1.0,)
    with pytest.raises(ValueError, match="uniform_mesh"):
        alpa_test_mesh((2, 2, 2))


def test_uniform_mesh_broadcasts_scalars():
    m = uniform_mesh((2, 2, 2), ("a", "b", "c"), 2.0, 0.5, 1e15, 8e10, 3e12)
    assert m.alpha == (2.0, 2.0, 2.0) and m.beta == (0.5, 0.5, 0.5)
    assert (m.peak_flops, m.memory_bytes, m.hbm_bandwidth) == (1e15, 8e10, 3e12)
    assert uniform_mesh((2, 2), ("a", "b"), [1, 2], [3, 4]).beta == (3, 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha": (1.0,)}, "alpha has 1 entries"),
        ({"beta": (1.0, 1.0, 1.0)}, "beta has 3 entries"),
        ({"alpha": (1.0, -1.0)}, "alpha of mesh axis 'y'"),
        ({"beta": (float("nan"), 1.0)}, "beta of mesh axis 'x'"),
        ({"beta": (math.inf, 1.0)}, "finite"),
        ({"peak_flops": 0.0}, "peak_flops"),
        ({"memory_bytes": -5.0}, "memory_bytes"),
        ({"hbm_bandwidth": -1.0}, "hbm_bandwidth"),
    ],
)
def test_device_mesh_validation(kwargs, message):
    args = {"mesh": Mesh(("x", "y"), (2, 4)), "alpha": (1.0, 1.0), "beta": (1.0, 0.1)}
    with pytest.raises(ValueError, match=message):
        DeviceMesh(**{**args, **kwargs})


def test_cost_module_does_not_import_jax():
    code = "import sys, autoshard.intra.cost.resharding; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- resharding

MESH = alpa_test_mesh((2, 4))  # x: 2 devices (slow), y: 4 devices (fast)
SHAPE = (64, 128)
ITEM = 4
FULL = 64 * 128 * ITEM


def rs(src, dst, shape=SHAPE, mesh=MESH, options=NO_TIES):
    return reshard(src, dst, shape, ITEM, mesh, options)


def kinds(result: Reshard):
    return [(c.kind, c.axes) for c in result.collectives]


def test_identical_specs_are_free():
    for s in [spec("", ""), spec("x", "y"), spec("", "y", partial="x"), spec("yx", "")]:
        assert rs(s, s) == Reshard((), 0.0)
        assert reshard(s, s, SHAPE, ITEM, MESH).cost == 0.0  # tie-breakers on: still free
    # the order of the partial axes is not part of the layout
    assert rs(spec("", "", partial="xy"), spec("", "", partial="yx")).cost == 0.0


@pytest.mark.parametrize("dst", [spec("x", ""), spec("", "y"), spec("x", "y"), spec("yx", "")])
def test_adding_sharding_is_a_free_local_slice(dst):
    assert rs(spec("", ""), dst) == Reshard((), 0.0)


def test_all_gather_on_one_dim():
    r = rs(spec("x", ""), spec("", ""))
    assert r.collectives == (Collective("all-gather", ("x",), FULL),)
    assert r.cost == pytest.approx(all_gather_cost(MESH, "x", FULL, NO_TIES))


def test_all_gather_of_the_shard_left_by_the_other_axis():
    # S(x)·S(y) -> S(x)·R: all-gather on y of the 1/n_x shard
    r = rs(spec("x", "y"), spec("x", ""))
    assert r.collectives == (Collective("all-gather", ("y",), FULL // 2),)
    assert r.cost == pytest.approx(1.0 + 0.1 * 3 / 4 * FULL / 2)


def test_axis_moving_between_dims_is_an_all_to_all():
    r = rs(spec("x", ""), spec("", "x"))
    assert r.collectives == (Collective("all-to-all", ("x",), FULL // 2),)
    assert r.cost == pytest.approx(1.0 + 1.0 * 1 / 2 * FULL / 2)  # (n-1)/n of the local block
    # with other sharding around, the exchanged buffer is the local block
    r = rs(spec("y", "x"), spec("", "xy"))
    assert r.collectives == (Collective("all-to-all", ("y",), FULL // 8),)


def test_gathering_the_blocking_axis_unlocks_an_all_to_all():
    # [y, x] -> [R, (y, x)]: x sits where y must go first. Gathering y (the cheaper gather on
    # its own) leaves nothing to move; gathering x lets y move by all-to-all, then x slices.
    r = rs(spec("y", "x"), spec("", "yx"))
    assert r.collectives == (
        Collective("all-gather", ("x",), FULL // 4),
        Collective("all-to-all", ("y",), FULL // 4),
    )
    greedy = all_gather_cost(MESH, "y", FULL // 2, NO_TIES) + all_gather_cost(
        MESH, "x", FULL, NO_TIES
    )
    assert r.cost < greedy


def test_all_to_all_gives_way_to_gather_when_its_penalty_makes_it_dearer():
    harsh = CostOptions(tie_breakers=False, all_to_all_penalty=100.0)
    r = rs(spec("x", ""), spec("", "x"), options=harsh)
    assert kinds(r) == [("all-gather", ("x",))]
    assert r.cost == pytest.approx(all_gather_cost(MESH, "x", FULL, harsh))


def test_partial_to_replicated_is_an_all_reduce():
    r = rs(spec("", "", partial="x"), spec("", ""))
    assert r.collectives == (Collective("all-reduce", ("x",), FULL),)
    assert r.cost == pytest.approx(1.0 + 1.0 * 2 * 1 / 2 * FULL)
    # sharded on y meanwhile: the reduced buffer is the y-shard
    r = rs(spec("y", "", partial="x"), spec("y", ""))
    assert r.collectives == (Collective("all-reduce", ("x",), FULL // 4),)


def test_partial_to_sharded_is_a_reduce_scatter():
    r = rs(spec("", "", partial="x"), spec("", "x"))
    assert r.collectives == (Collective("reduce-scatter", ("x",), FULL),)
    assert r.cost == pytest.approx(1.0 + 1.0 * 1 / 2 * FULL)
    # ZeRO-style: gradient partial over the data axis, reduce-scattered under a model split
    r = rs(spec("", "y", partial="x"), spec("x", "y"))
    assert r.collectives == (Collective("reduce-scatter", ("x",), FULL // 4),)


def test_reduce_first_then_free_slice():
    # partial(x) -> S(y): all-reduce on x, then y is a free slice; slicing first is cheaper
    r = rs(spec("", "", partial="x"), spec("y", ""))
    assert r.collectives == (Collective("all-reduce", ("x",), FULL // 4),)


def test_new_partial_axis_is_impossible():
    for src, dst in [
        (spec("", ""), spec("", "", partial="x")),
        (spec("x", ""), spec("", "", partial="y")),
        (spec("", "", partial="x"), spec("", "", partial="y")),
    ]:
        r = rs(src, dst)
        assert r.cost == math.inf and r.collectives == () and not r.is_possible
        assert gather_then_slice(src, dst, SHAPE, ITEM, MESH).cost == math.inf


def test_kept_partial_axis_stays_unreduced():
    r = rs(spec("y", "", partial="x"), spec("", "", partial="x"))
    assert r.collectives == (Collective("all-gather", ("y",), FULL),)


def test_two_partial_axes_take_the_cheaper_of_grouped_and_one_by_one():
    r = rs(spec("", "", partial="xy"), spec("", ""))
    grouped = all_reduce_cost(MESH, ("x", "y"), FULL, NO_TIES)
    one_by_one = all_reduce_cost(MESH, "x", FULL, NO_TIES) + all_reduce_cost(
        MESH, "y", FULL, NO_TIES
    )
    assert r.cost == pytest.approx(min(grouped, one_by_one))
    assert {a for c in r.collectives for a in c.axes} == {"x", "y"}
    assert all(c.kind == "all-reduce" and c.bytes == FULL for c in r.collectives)
    # with a uniform mesh one ring over 8 devices beats two rings (one latency, less volume)
    flat = uniform_mesh((2, 4), ("x", "y"), 1.0, 1.0)
    r = rs(spec("", "", partial="xy"), spec("", ""), mesh=flat)
    assert r.collectives == (Collective("all-reduce", ("x", "y"), FULL),)


def test_reduce_scatter_then_all_reduce_on_the_smaller_buffer():
    r = rs(spec("", "", partial="xy"), spec("", "x"))
    assert r.collectives == (
        Collective("reduce-scatter", ("x",), FULL),
        Collective("all-reduce", ("y",), FULL // 2),
    )


def test_swapping_two_axes_gathers_one_and_moves_the_other():
    r = rs(spec("x", "y"), spec("y", "x"))
    assert sorted(c.kind for c in r.collectives) == ["all-gather", "all-to-all"]
    assert (
        r.cost < gather_then_slice(spec("x", "y"), spec("y", "x"), SHAPE, ITEM, MESH, NO_TIES).cost
    )


def test_two_axes_moving_together_is_one_all_to_all():
    r = rs(spec("xy", ""), spec("", "xy"))
    assert r.collectives == (Collective("all-to-all", ("x", "y"), FULL // 8),)


def test_tangled_case_is_never_dearer_than_gather_then_slice():
    # both axes on one dim in the wrong order: no all-to-all applies
    src, dst = spec("xy", ""), spec("yx", "")
    r = rs(src, dst)
    fallback = gather_then_slice(src, dst, SHAPE, ITEM, MESH, NO_TIES)
    assert math.isfinite(r.cost) and r.cost <= fallback.cost
    assert all(c.kind == "all-gather" for c in r.collectives)


def test_gather_then_slice_is_reduce_then_gather_everything():
    src, dst = spec("x", "", partial="y"), spec("", "x")
    fb = gather_then_slice(src, dst, SHAPE, ITEM, MESH, NO_TIES)
    assert fb.collectives == (
        Collective("all-reduce", ("y",), FULL // 2),
        Collective("all-gather", ("x",), FULL),
    )


def test_reshard_cost_includes_tie_breakers_once_per_collective():
    src, dst = spec("x", "y"), spec("", "")
    with_ties = reshard(src, dst, SHAPE, ITEM, MESH, CostOptions(group_reductions=False))
    without = reshard(src, dst, SHAPE, ITEM, MESH, NO_TIES)
    assert with_ties.collectives == without.collectives
    extra = sum(ALPA_TIE_BREAKERS[c.kind] for c in without.collectives)
    assert with_ties.cost == pytest.approx(without.cost + extra)


def test_size_one_axes_emit_no_collectives():
    mesh = uniform_mesh((1, 8), ("x", "y"), 1.0, 1.0)
    r = rs(spec("x", "y", partial=()), spec("", "y"), mesh=mesh)
    assert r == Reshard((), 0.0)


def test_bytes_use_itemsize_and_global_shape():
    r2 = reshard(spec("x", ""), spec("", ""), SHAPE, 2, MESH, NO_TIES)
    r8 = reshard(spec("x", ""), spec("", ""), SHAPE, 8, MESH, NO_TIES)
    assert r2.collectives[0].bytes == 64 * 128 * 2
    assert r8.collectives[0].bytes == 64 * 128 * 8


@pytest.mark.parametrize(
    "src, dst, shape, message",
    [
        (spec("z", ""), spec("", ""), SHAPE, "'z'.*\\('x', 'y'\\)"),
        (spec("", ""), spec("", "", partial="w"), SHAPE, "'w'"),
        (spec("x", ""), spec("", ""), (63, 128), "63"),
        (spec("x", "x"), spec("", ""), SHAPE, "twice"),
        (spec("x"), spec("", ""), SHAPE, "rank"),
    ],
)
def test_reshard_rejects_bad_specs(src, dst, shape, message):
    with pytest.raises(ValueError, match=message):
        reshard(src, dst, shape, ITEM, MESH)


def test_reshard_rejects_bad_itemsize():
    with pytest.raises(ValueError, match="itemsize"):
        reshard(spec("", ""), spec("", ""), SHAPE, 0, MESH)


# ----------------------------------------------------------------------------- properties


@st.composite
def specs_on_2x4(draw, rank):
    """Every axis is unused, a partial sum, or on some dim, in a random order per dim."""
    dims = [[] for _ in range(rank)]
    partial = []
    for axis in draw(st.permutations(["x", "y"])):
        slot = draw(st.sampled_from(["unused", "partial", *range(rank)]))
        if slot == "partial":
            partial.append(axis)
        elif slot != "unused":
            dims[slot].append(axis)
    return ShardingSpec(tuple(tuple(d) for d in dims), tuple(partial))


@st.composite
def reshard_cases(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(8 * draw(st.integers(1, 6)) for _ in range(rank))
    return draw(specs_on_2x4(rank)), draw(specs_on_2x4(rank)), shape


def independent_fallback_cost(src, dst, shape, itemsize, mesh, options):
    """All-reduce every dropped partial axis, then all-gather every sharded axis."""
    full = math.prod(shape) * itemsize
    local = full * src.shard_fraction(mesh.mesh)
    dropped = [a for a in src.partial if a not in dst.partial]
    sharded = [a for d in src.dims for a in d]
    return all_reduce_cost(mesh, dropped, local, options) + all_gather_cost(
        mesh, sharded, full, options
    )


@settings(max_examples=300, deadline=None)
@given(reshard_cases(), st.sampled_from([NO_TIES, CostOptions()]), st.sampled_from([1, 2, 4]))
@example(  # found by hypothesis on 2026-11-28: a pinned route of XLA's own route's kinds
    (ShardingSpec(((), ("x",), ())), ShardingSpec((("x",), (), ("y",))), (8, 8, 8)),
    CostOptions(),
    1,
)
def test_reshard_properties_on_2x4(case, options, itemsize):
    src, dst, shape = case
    assert reshard(src, src, shape, itemsize, MESH, options) == Reshard((), 0.0)
    r = reshard(src, dst, shape, itemsize, MESH, options)
    if not set(dst.partial) <= set(src.partial):
        assert r.cost == math.inf
        return
    assert math.isfinite(r.cost)
    plain = not src.partial and not dst.partial and options.group_reductions
    route = tile_route(src, dst, MESH.mesh) if plain else None
    own = xla_route(src, dst, MESH.mesh) if plain else None
    kinds = [(c.kind, c.axes) for c in r.collectives]
    if route is not None:  # XLA's collective-permute moves, priced as XLA makes them
        assert kinds == [(k, a) for k, a, _ in route]
    elif own is None or kinds != [(k, a) for k, a, _ in own]:
        assert r.cost <= independent_fallback_cost(src, dst, shape, itemsize, MESH, options) + 1e-9
    else:  # XLA's own route's kinds: taken where the planner's cannot be pinned or costs
        # more; a pinned route (steps) of the same kinds only where its messages are
        # cheaper (2x4 [d0, d1@x, d2] -> [d0@x, d1, d2@y] through [d0, d1@x, d2@y]: the
        # all-to-all moves half the bytes of XLA's own)
        total = itemsize * math.prod(shape)
        theirs = sum(
            collective_cost(MESH, Collective(k, a, total // blocks), options)
            for k, a, blocks in own
        )
        assert not r.steps or r.cost < theirs
    # the cost is the sum of the listed collectives, each a real message
    assert r.cost == pytest.approx(sum(collective_cost(MESH, c, options) for c in r.collectives))
    full = math.prod(shape) * itemsize
    for c in r.collectives:
        assert 0 < c.bytes <= full
    # every partial sum the destination drops is reduced by some collective over its axis
    reducing = {
        a for c in r.collectives if c.kind in ("all-reduce", "reduce-scatter") for a in c.axes
    }
    assert {a for a in src.partial if a not in dst.partial} <= reducing
    # adding sharding alone is free; removing any is not
    only_adds = set(src.partial) == set(dst.partial) and all(
        d[: len(s)] == s for s, d in zip(src.dims, dst.dims, strict=True)
    )
    assert (r.cost == 0.0) == only_adds


# --- XLA mode (the default): what XLA's SPMD partitioner emits -----------------------------

XLA = CostOptions(tie_breakers=False)


def test_xla_mode_reduces_all_partial_axes_in_one_all_reduce():
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec(((), ()), ("data", "model"))
    r = reshard(src, ShardingSpec(((), ())), (64, 64), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("all-reduce", ("data", "model"), 64 * 64 * 4)
    ]


def test_xla_mode_gathers_several_dims_one_dim_at_a_time_the_last_first():
    # XLA replicates [8@data, 32@model] with an all-gather over model (into [8@data, 32]),
    # then one over data: never one all-gather over both (tests/test_reshard_route.py and
    # tests/test_reshard_permute.py compile it); one dim split over both axes is one
    # all-gather
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec((("data",), ("model",)))
    r = reshard(src, ShardingSpec(((), ())), (8, 32), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("all-gather", ("model",), 8 * 32 * 4 // 2),
        ("all-gather", ("data",), 8 * 32 * 4),
    ]
    assert r.steps == (ShardingSpec((("data",), ())),)
    one_dim = reshard(
        ShardingSpec((("data", "model"), ())), ShardingSpec(((), ())), (8, 32), 4, mesh, XLA
    )
    assert [(c.kind, c.axes) for c in one_dim.collectives] == [("all-gather", ("data", "model"))]


def test_xla_mode_moves_one_axis_with_an_all_to_all():
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec((("model",), ()))
    r = reshard(src, ShardingSpec(((), ("model",))), (16, 16), 4, mesh, XLA)
    assert [(c.kind, c.axes) for c in r.collectives] == [("all-to-all", ("model",))]


def test_xla_mode_reduce_scatters_onto_a_ready_dim():
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec((("data",), ()), ("model",))
    r = reshard(src, ShardingSpec((("data", "model"), ())), (64, 8), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("reduce-scatter", ("model",), 32 * 8 * 4)
    ]


def test_xla_mode_reduces_a_partial_sum_once_for_all_its_consumers():
    # XLA: a partial sum cannot be constrained, so propagation gives the producer one
    # sharding -- the consumer spec splitting the most devices -- and the partitioner
    # reduces once into it; the other consumer reshards from there.  Evidence: gpt-tiny
    # megatron on 4x2, a (8,32,64) layer-norm gradient partial over model, read as
    # [8@data, 32, 64@model] and [8@data, 32, 64]: one all-reduce + dynamic-slice
    # (a reduce-scatter, 16 KiB), then an all-gather over model, and no all-reduce.
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    src = ShardingSpec((("data",), (), ()), ("model",))
    split = ShardingSpec((("data",), (), ("model",)))
    whole = ShardingSpec((("data",), (), ()))
    r = reshard_to_consumers(src, [whole, split], (8, 32, 64), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("reduce-scatter", ("model",), 2 * 32 * 64 * 4),
        ("all-gather", ("model",), 2 * 32 * 64 * 4),
    ]


def test_xla_mode_partial_sum_consumers_tie_goes_to_the_lower_dim():
    # Two consumers that split the same number of devices, over model on dim 0 or dim 2:
    # XLA reduce-scatters onto dim 0, then one all-to-all moves model to dim 2 (gpt-tiny
    # megatron on 4x2: all-reduce + dynamic-slice of dim 0, then an all-to-all of 8 KiB).
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    src = ShardingSpec((("data",), (), ()), ("model",))
    on_dim2 = ShardingSpec((("data",), (), ("model",)))
    on_dim0 = ShardingSpec((("data", "model"), (), ()))
    r = reshard_to_consumers(src, [on_dim2, on_dim0], (8, 32, 64), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("reduce-scatter", ("model",), 2 * 32 * 64 * 4),
        ("all-to-all", ("model",), 32 * 64 * 4),
    ]


def test_reshard_to_consumers_is_one_reshard_per_target_otherwise():
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec((("data",), ("model",)))
    dsts = [ShardingSpec(((), ("model",))), ShardingSpec((("data",), ()))]
    r = reshard_to_consumers(src, dsts + dsts[:1], (8, 32), 4, mesh, XLA)
    parts = [reshard(src, d, (8, 32), 4, mesh, XLA) for d in dsts]
    assert r.collectives == parts[0].collectives + parts[1].collectives
    assert r.cost == pytest.approx(sum(p.cost for p in parts))


def test_xla_mode_reduce_over_dims_split_on_different_axes_all_reduces_per_dim():
    # XLA (jax 0.10, Shardy): a reduce whose summed dims are split over different mesh
    # axes all-reduces one dim at a time, last dim first -- a compiled sum of an
    # [8@data, 32@model] array is all-reduce over model, then over data (gpt-tiny auto on
    # 4x2: the scalar loss), never one all-reduce over both.
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    src = ShardingSpec((), ("data", "model"))
    r = reshard_to_consumers(
        src, [ShardingSpec(())], (), 4, mesh, XLA, reduce_first=(("model",), ("data",))
    )
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [
        ("all-reduce", ("model",), 4),
        ("all-reduce", ("data",), 4),
    ]
    # one dim split over both axes is one all-reduce (gpt-tiny megatron on 2x4)
    one = reshard_to_consumers(
        src, [ShardingSpec(())], (), 4, mesh, XLA, reduce_first=(("data", "model"),)
    )
    assert [(c.kind, c.axes) for c in one.collectives] == [("all-reduce", ("data", "model"))]


def test_xla_mode_reduction_is_reduced_where_it_is_made_before_new_splits():
    # A reduce (a bias gradient summed over a batch split on data) leaves a partial sum
    # that XLA reduces at the reduce, on its own layout, and only then slices: a [64]
    # vector wanted as [64@model] is an all-reduce of all 64 values over data (gpt-tiny
    # megatron with 4 blocks on 2x4: all-reduce of 256 B + dynamic-slice keeping 16 of 64).
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    src = ShardingSpec(((),), ("data",))
    on_model = ShardingSpec((("model",),))
    r = reshard_to_consumers(src, [on_model], (64,), 4, mesh, XLA, reduce_first=(("data",),))
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [("all-reduce", ("data",), 256)]
    # a partial sum from any other op keeps the cheaper order: slice, then reduce
    other = reshard_to_consumers(src, [on_model], (64,), 4, mesh, XLA)
    assert [(c.kind, c.axes, c.bytes) for c in other.collectives] == [("all-reduce", ("data",), 64)]
    # into exactly the reduced axis: XLA's all-reduce + dynamic-slice is a reduce-scatter
    on_data = ShardingSpec((("data",),))
    rs = reshard_to_consumers(src, [on_data], (64,), 4, mesh, XLA, reduce_first=(("data",),))
    assert [(c.kind, c.axes, c.bytes) for c in rs.collectives] == [
        ("reduce-scatter", ("data",), 256)
    ]


def test_xla_mode_reduction_scattered_with_more_axes_is_an_all_reduce():
    # [64] partial over data wanted as [64@(data, model)]: XLA all-reduces over data and
    # keeps 8 of 64 with one dynamic-slice -- not a reduce-scatter over data, whose slice
    # would keep 1/2 (gpt-tiny zero3 on 4x2, the layer-norm and bias gradients).
    mesh = alpa_test_mesh((4, 2), ("data", "model"))
    src = ShardingSpec(((),), ("data",))
    both = ShardingSpec((("data", "model"),))
    r = reshard_to_consumers(src, [both], (64,), 4, mesh, XLA, reduce_first=(("data",),))
    assert [(c.kind, c.axes, c.bytes) for c in r.collectives] == [("all-reduce", ("data",), 256)]
