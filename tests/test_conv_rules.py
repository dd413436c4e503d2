"""Convolution, pooling and max-pool-gradient sharding rules (autoshard/intra/rules/conv.py):
the strategies offered, and for each split kind a step on 8 fake devices that trains like
one device and whose predicted collectives are the ones XLA compiled."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.rules.strategies import RULES, node_strategies
from autoshard.ir.graph import build_graph
from autoshard.ir.spec import ShardingSpec
from autoshard.models import make_train_step
from autoshard.runtime.reference_check import check_against_single_device
from autoshard.runtime.sharded import make_mesh
from autoshard.trace.jaxpr import trace_train_step
from autoshard.verify.check import verify_plan

HIGHS = IntraOptions(solver="highs")
N, H, C, F = 8, 8, 8, 16  # batch, image side, input channels, conv features


def _conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _loss(params, batch):
    """3x3 conv -> relu -> 3x3/2 max pool -> 1x1 conv -> squared error."""
    y = jax.nn.relu(_conv(batch["x"], params["w1"]))
    y = nn.max_pool(y, (3, 3), (2, 2), "SAME")
    y = _conv(y, params["w2"])
    return jnp.mean((y - batch["t"]) ** 2)


def _args(n: int = N, c: int = C, f: int = F):
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (3, 3, c, f)) * 0.2,
        "w2": jax.random.normal(k[1], (1, 1, f, c)) * 0.2,
    }
    batch = {
        "x": jax.random.normal(k[2], (n, H, H, c)),
        "t": jax.random.normal(k[3], (n, H // 2, H // 2, c)),
    }
    return params, batch


@functools.cache
def _traced(n: int = N, c: int = C, f: int = F):
    opt = optax.sgd(0.1)
    params, batch = _args(n, c, f)
    step = make_train_step(_loss, opt)
    program = trace_train_step(step, params, opt.init(params), batch)
    return program, build_graph(program.records), opt


def _input_pos(graph, path: str) -> int:
    for pos, tid in enumerate(graph.inputs):
        if graph.tensors[tid].path == path:
            return pos
    raise KeyError(path)


def _conv_nodes(graph):
    return [n for n in graph.nodes if n.primitive == "conv_general_dilated"]


def test_every_conv_pool_and_pool_gradient_has_a_rule_and_no_warning():
    _, graph, _ = _traced()
    prims = {n.primitive for n in graph.nodes}
    assert {"conv_general_dilated", "reduce_window_max", "select_and_scatter_add"} <= prims
    assert prims <= set(RULES) | {"pjit"}
    mesh = alpa_test_mesh((8,), ("x",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replicated fallback would warn
        auto_shard_graph(graph, mesh, HIGHS)


def test_conv_flops_count_one_multiply_add_per_kernel_tap():
    _, graph, _ = _traced()
    forward = _conv_nodes(graph)[0]
    assert forward.phase == "forward"
    assert forward.flops == 2 * N * H * H * F * (3 * 3 * C)
    assert "conv_general_dilated" not in graph.unknown_flops
    assert "reduce_window_max" not in graph.unknown_flops


def test_forward_conv_offers_batch_output_and_input_channel_splits():
    _, graph, _ = _traced()
    mesh = alpa_test_mesh((8,), ("x",))
    forward = _conv_nodes(graph)[0]
    by_out = {
        (s.input_specs[0], s.input_specs[1], s.output_specs[0])
        for s in node_strategies(graph, forward, mesh)
    }
    x = ("x",)
    batch = (
        ShardingSpec((x, (), (), ())),
        ShardingSpec.replicated(4),
        ShardingSpec((x, (), (), ())),
    )
    out_ch = (
        ShardingSpec.replicated(4),
        ShardingSpec(((), (), (), x)),
        ShardingSpec(((), (), (), x)),
    )
    in_ch = (
        ShardingSpec(((), (), (), x)),
        ShardingSpec(((), (), x, ())),
        ShardingSpec(((), (), (), ()), x),
    )
    assert {batch, out_ch, in_ch} == by_out  # 3x3 window: no spatial split offered


def test_a_1x1_conv_may_split_a_spatial_dim_and_a_3x3_may_not():
    _, graph, _ = _traced()
    mesh = alpa_test_mesh((8,), ("x",))
    forward = [n for n in _conv_nodes(graph) if n.phase == "forward"]
    spatial = ShardingSpec(((), ("x",), (), ()))
    first = {s.output_specs[0] for s in node_strategies(graph, forward[0], mesh)}
    assert spatial not in first
    # the 1x1 conv's 4x4 image does not divide by 8; on 4 devices its rows do
    mesh4 = alpa_test_mesh((4,), ("x",))
    second = {s.output_specs[0] for s in node_strategies(graph, forward[1], mesh4)}
    assert spatial in second


def test_pool_and_its_gradient_split_batch_and_channels_only():
    _, graph, _ = _traced()
    mesh = alpa_test_mesh((8,), ("x",))
    for prim in ("reduce_window_max", "select_and_scatter_add"):
        node = next(n for n in graph.nodes if n.primitive == prim)
        split_dims = {
            d
            for s in node_strategies(graph, node, mesh)
            for d, axes in enumerate(s.output_specs[0].dims)
            if axes
        }
        assert split_dims == {0, 3}, prim


# --- each split kind on 8 fake devices --------------------------------------------------------

X1 = ("x",)
# name: (mesh shape, (batch, channels, features), {input path: pinned spec}, the forward
# 3x3 conv's strategy)
SPLITS = {
    "batch": (
        (8,),
        (N, C, F),
        {"[2]['x']": ShardingSpec((X1, (), (), ()))},
        "[d0@x, d1, d2, d3] <- [d0@x, d1, d2, d3] x [d0, d1, d2, d3]",
    ),
    "out_channel": (
        (8,),
        (N, C, F),
        {"[0]['w1']": ShardingSpec(((), (), (), X1))},
        "[d0, d1, d2, d3@x] <- [d0, d1, d2, d3] x [d0, d1, d2, d3@x]",
    ),
    # a batch of 2 cannot split 8 ways, and with 64 channels in and 8 out the partial
    # sum (an all-reduce of the small output) is cheaper than gathering the input
    "in_channel": (
        (8,),
        (2, 64, 8),
        {
            "[2]['x']": ShardingSpec(((), (), (), X1)),
            "[0]['w1']": ShardingSpec(((), (), X1, ())),
        },
        "[d0, d1, d2, d3]{U:x} <- [d0, d1, d2, d3@x] x [d0, d1, d2@x, d3]",
    ),
    "batch_x_out_channel": (
        (2, 4),
        (N, C, F),
        {
            "[2]['x']": ShardingSpec((("data",), (), (), ())),
            "[0]['w1']": ShardingSpec(((), (), (), ("model",))),
        },
        "[d0@data, d1, d2, d3@model] <- [d0@data, d1, d2, d3] x [d0, d1, d2, d3@model]",
    ),
}


def _split_plan(name):
    shape, sizes, pins, _ = SPLITS[name]
    _, graph, _ = _traced(*sizes)
    mesh = alpa_test_mesh(shape, ("x",) if len(shape) == 1 else ("data", "model"))
    pinned = {_input_pos(graph, path): spec for path, spec in pins.items()}
    return auto_shard_graph(graph, mesh, HIGHS, pinned_inputs=pinned, name=name)


@pytest.mark.parametrize("name", list(SPLITS))
def test_each_conv_split_trains_like_one_device_and_matches_xla(name):
    _, sizes, _, expected = SPLITS[name]
    program, graph, opt = _traced(*sizes)
    plan = _split_plan(name)
    forward = _conv_nodes(graph)[0]
    assert plan.node_strategies[graph.nodes.index(forward)] == expected

    devices = jax.devices()[: plan.mesh.num_devices]
    params, batch = _args(*sizes)
    report = check_against_single_device(
        program, plan, make_mesh(plan.mesh, devices), (params, opt.init(params), batch), rtol=1e-5
    )
    assert report.ok, report
    verified = verify_plan(program, plan, devices=devices)
    assert verified.collectives_agree, verified.comparison.format()


def test_a_strided_conv_gradients_cost_what_the_forward_costs():
    """The input gradient of a stride-2 conv dilates its input with zeros; FLOPs count
    the taps that meet real elements, so each gradient costs the forward's FLOPs."""

    def loss(params, batch):
        return jnp.sum((_conv(params["x"], params["w"], stride=2) * batch["t"]) ** 2)

    params = {"w": jnp.ones((3, 3, C, F)), "x": jnp.ones((N, H, H, C))}
    batch = {"t": jnp.ones((N, H // 2, H // 2, F))}
    opt = optax.sgd(0.1)
    program = trace_train_step(make_train_step(loss, opt), params, opt.init(params), batch)
    convs = _conv_nodes(build_graph(program.records))
    assert [n.phase for n in convs] == ["forward", "backward", "backward"]
    assert convs[0].flops == 2 * N * (H // 2) ** 2 * F * 9 * C
    assert [n.flops for n in convs[1:]] == [convs[0].flops] * 2


# --- grouped and depthwise convolutions (issue #31) -------------------------------------------

CB, EXPAND = 64, 4  # block channels, expansion of the MobileNet-style block


def _block_loss(groups: int):
    """1x1 expand -> relu -> 3x3 grouped conv (``groups`` 0: depthwise) -> relu -> 1x1
    project, residual, squared error: a MobileNet (depthwise) or ResNeXt (grouped) block."""

    def conv(x, w, g=1):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=g
        )

    def loss(params, batch):
        y = jax.nn.relu(conv(batch["x"], params["expand"]))
        y = jax.nn.relu(conv(y, params["group"], groups or CB * EXPAND))
        return jnp.mean((conv(y, params["project"]) + batch["x"] - batch["t"]) ** 2)

    return loss


def _block_args(groups: int, n: int = 4):
    k = jax.random.split(jax.random.key(1), 5)
    wide = CB * EXPAND
    params = {
        "expand": jax.random.normal(k[0], (1, 1, CB, wide)) * 0.1,
        "group": jax.random.normal(k[1], (3, 3, wide // groups if groups else 1, wide)) * 0.1,
        "project": jax.random.normal(k[2], (1, 1, wide, CB)) * 0.1,
    }
    batch = {
        "x": jax.random.normal(k[3], (n, H, H, CB)),
        "t": jax.random.normal(k[4], (n, H, H, CB)),
    }
    return params, batch


@functools.cache
def _block(groups: int):
    opt = optax.sgd(0.1)
    params, batch = _block_args(groups)
    program = trace_train_step(
        make_train_step(_block_loss(groups), opt), params, opt.init(params), batch
    )
    return program, build_graph(program.records), opt


def _grouped(graph):
    return [
        n
        for n in _conv_nodes(graph)
        if (n.params.get("feature_group_count") or 1) > 1
        or (n.params.get("batch_group_count") or 1) > 1
    ]


def test_depthwise_convs_split_their_channels_and_match_xla():
    """A depthwise conv (and its input gradient, and its weight gradient: a conv with
    batch_group_count) splits its channels with their groups: on 4 devices the plan splits them (it had only the
    batch split, and no split of the weight gradient), trains like one device and
    predicts the collectives XLA compiles."""
    program, graph, opt = _block(0)
    mesh = alpa_test_mesh((4,), ("x",))
    grouped = _grouped(graph)
    assert len(grouped) == 3  # the forward conv, its input and its weight gradient
    for node in grouped:
        split = {
            d
            for s in node_strategies(graph, node, mesh)
            for d, axes in enumerate(s.output_specs[0].dims)
            if axes
        }
        assert 3 in split, node  # the channel (feature) dim of both outputs
    plan = auto_shard_graph(graph, mesh, HIGHS)
    for node in grouped:
        assert plan.tensor_specs[node.outputs[0]].dims[3] == ("x",)
    devices = jax.devices()[:4]
    params, batch = _block_args(0)
    report = check_against_single_device(
        program, plan, make_mesh(plan.mesh, devices), (params, opt.init(params), batch), rtol=1e-5
    )
    assert report.ok, report
    verified = verify_plan(program, plan, devices=devices)
    assert verified.collectives_agree, verified.comparison.format()


def test_grouped_convs_with_several_channels_per_group_keep_whole_groups():
    """A ResNeXt-style conv (8 groups of 32 channels) is offered no group split (XLA's
    partitioner gathers it instead of partitioning 2 groups per device, and its weight
    gradient's image split), and its plan trains like one device."""
    program, graph, opt = _block(8)
    mesh = alpa_test_mesh((4,), ("x",))
    grouped = _grouped(graph)
    forward = grouped[0]
    weight_grad = next(n for n in grouped if (n.params.get("batch_group_count") or 1) > 1)
    assert forward.params["feature_group_count"] == 8
    assert weight_grad.params["batch_group_count"] == 8
    for node in grouped:
        for s in node_strategies(graph, node, mesh):
            assert not s.output_specs[0].dims[3] and not s.output_specs[0].partial
    plan = auto_shard_graph(graph, mesh, HIGHS)
    devices = jax.devices()[:4]
    params, batch = _block_args(8)
    report = check_against_single_device(
        program, plan, make_mesh(plan.mesh, devices), (params, opt.init(params), batch), rtol=1e-5
    )
    assert report.ok, report


def test_grouped_conv_plan_collectives_match_xla():
    """XLA gathers the batch of a batch-split grouped conv with several channels per
    group: the plan computes those convs whole and predicts the all-gathers XLA makes (it
    had the batch split, and XLA made one more [4, 8, 8, 256] all-gather than predicted)."""
    program, graph, _ = _block(8)
    plan = auto_shard_graph(graph, alpa_test_mesh((4,), ("x",)), HIGHS)
    verified = verify_plan(program, plan, devices=jax.devices()[:4])
    assert verified.collectives_agree, verified.comparison.format()
