"""Node-aware collectives: groups that span nodes, the two-level algorithm, and the costs
the search and the simulator both read (autoshard.intra.cost.resharding on a preset's mesh)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.hardware.clusters import (
    LinkSpec,
    group_node_span,
    load_cluster,
    node_aware_collective_time,
)
from autoshard.hardware.mesh import preset_mesh, to_device_mesh, uniform_mesh
from autoshard.intra.cost.resharding import (
    CostOptions,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    reduce_scatter_cost,
)

NVLINK = LinkSpec("nvlink", 100e9, 5e-6)
NET = LinkSpec("net", 10e9, 10e-6)
RAW = CostOptions(tie_breakers=False)


@pytest.mark.parametrize(
    "shape, group, per_node, span",
    [
        ((64,), (0,), 16, (16, 4)),  # data parallel over 4 full nodes
        ((1, 64, 1), (1,), 16, (16, 4)),
        ((64, 8), (0,), 16, (2, 32)),  # TP 8 inside, DP 64: 2 of a DP group per node
        ((16, 4), (0,), 16, (4, 4)),  # 64 devices, 4 nodes
        ((8, 8), (0,), 8, (1, 8)),  # one device per node
        ((8, 8), (1,), 8, (8, 1)),  # inside one node
        ((8, 8), (0, 1), 8, (8, 8)),
        ((4, 4, 2), (0, 2), 8, (2, 4)),
    ],
)
def test_group_node_span(shape, group, per_node, span):
    assert group_node_span(shape, group, per_node) == span


def test_uneven_groups_have_no_span():
    # mesh (3, 8) on 16-GPU nodes: the group {0, 8, 16} has 2 devices in node 0, 1 in node 1
    assert group_node_span((3, 8), (0,), 16) is None


@given(
    shape=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3),
    per_node=st.sampled_from([1, 2, 4, 8, 16]),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_span_accounts_for_every_device(shape, per_node, data):
    shape = tuple(shape)
    group = tuple(
        sorted(set(data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=3))))
    )
    span = group_node_span(shape, group, per_node)
    if span is not None:
        local, nodes = span
        assert local * nodes == math.prod(shape[i] for i in group)


def test_two_level_reduces_to_flat_rings_at_the_ends():
    nbytes = 1e9
    # one device per node: a flat ring over the network
    flat_net = NET.alpha + NET.beta * 2 * 7 / 8 * nbytes
    assert node_aware_collective_time("all-reduce", nbytes, 1, 8, NVLINK, NET) == pytest.approx(
        flat_net
    )
    # g devices in each of N nodes, written out by hand
    g, n = 4, 3
    want = 2 * NVLINK.alpha + NET.alpha
    want += 2 * (3 / 4 * nbytes * NVLINK.beta + 2 / 3 * nbytes / 4 * NET.beta)
    assert node_aware_collective_time("all-reduce", nbytes, g, n, NVLINK, NET) == pytest.approx(
        want
    )
    half = NVLINK.alpha + NET.alpha + 3 / 4 * nbytes * NVLINK.beta + 2 / 3 * nbytes / 4 * NET.beta
    for kind in ("all-gather", "reduce-scatter"):
        got = node_aware_collective_time(kind, nbytes, g, n, NVLINK, NET)
        assert got == pytest.approx(half)


def test_two_level_refuses_all_to_all():
    with pytest.raises(ValueError, match="all-to-all"):
        node_aware_collective_time("all-to-all", 1.0, 2, 2, NVLINK, NET)


def test_data_parallel_across_full_nodes_uses_every_nic():
    """DP 64 on four 16-GPU DGX-2H nodes: the gradient all-reduce moves 1/16 of the buffer
    between nodes per GPU, far less than the flat ring at one GPU's NIC share."""
    cluster = load_cluster("dgx2h-v100", num_gpus=64)
    mesh = to_device_mesh(cluster, (1, 64, 1), ("pipe", "data", "model"))
    nbytes = 2.4e9
    alpha, beta = mesh.link("data")
    flat = alpha + beta * 2 * 63 / 64 * nbytes
    got = all_reduce_cost(mesh, "data", nbytes, RAW)
    two_level = node_aware_collective_time(
        "all-reduce", nbytes, 16, 4, cluster.intra_node, cluster.inter_node
    )
    assert got == pytest.approx(two_level)
    assert got < flat / 5
    assert reduce_scatter_cost(mesh, "data", nbytes, RAW) < alpha + beta * 63 / 64 * nbytes
    assert all_gather_cost(mesh, "data", nbytes, RAW) < alpha + beta * 63 / 64 * nbytes
    # all-to-all has no two-level form: still the flat figure
    assert all_to_all_cost(mesh, "data", nbytes, RAW) == pytest.approx(
        alpha + beta * 63 / 64 * nbytes
    )


def test_one_gpu_per_node_and_inside_a_node_are_unchanged():
    """TP 8 fills each DGX A100, so a DP group has one GPU per node: the flat ring is the
    two-level algorithm; inside a node nothing changes either."""
    mesh = preset_mesh("dgx-a100", (4, 8), ("data", "model"))
    for axis in ("data", "model"):
        alpha, beta = mesh.link(axis)
        n = mesh.mesh.size(axis)
        assert all_reduce_cost(mesh, axis, 1e8, RAW) == pytest.approx(
            alpha + beta * 2 * (n - 1) / n * 1e8
        )


def test_meshes_without_nodes_keep_the_flat_ring():
    mesh = uniform_mesh((16,), ("x",), 1.0, 1.0)
    assert mesh.nodes is None
    assert all_reduce_cost(mesh, "x", 16.0, RAW) == pytest.approx(1.0 + 2 * 15 / 16 * 16.0)


def test_the_search_mesh_knows_its_nodes():
    """preset_mesh (what the planner prices on) carries the node layout, so the ILP sees the
    same cheaper cross-node collectives as the simulator."""
    mesh = preset_mesh("dgx-a100", (16,), ("data",))
    assert mesh.nodes is not None and mesh.nodes.devices_per_node == 8
    assert mesh.node_span("data") == (8, 2)
    alpha, beta = mesh.link("data")
    assert all_reduce_cost(mesh, "data", 1e9, RAW) < alpha + beta * 2 * 15 / 16 * 1e9


def test_the_stage_search_meshes_know_their_nodes():
    """The stage DP prices each sub-mesh through inter.submesh.logical_mesh_costs: a 16-GPU
    data-parallel view of two 8-GPU p3.16xlarge nodes gets the two-level all-reduce."""
    from autoshard.inter.submesh import logical_mesh_costs

    cluster = load_cluster("alpa-v100", num_gpus=16)
    mesh = logical_mesh_costs(cluster)((16, 1))
    axis = mesh.axis_names[0]
    assert mesh.node_span(axis) == (8, 2)
    want = node_aware_collective_time(
        "all-reduce", 1e9, 8, 2, cluster.intra_node, cluster.inter_node
    )
    assert all_reduce_cost(mesh, axis, 1e9, RAW) == pytest.approx(want)
