"""Cluster presets: loading, validation, resizing and the mesh-axis -> link map."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.hardware.clusters import (
    Cluster,
    available_presets,
    axis_links,
    cluster_mesh_costs,
    load_cluster,
)
from autoshard.hardware.mesh import to_device_mesh

PRESETS = ("alpa-v100", "dgx-a100", "dgx-h100")


def _preset_json(name: str) -> dict:
    text = (resources.files("autoshard.hardware") / "presets" / f"{name}.json").read_text()
    return json.loads(text)


def test_presets_are_package_data():
    assert set(PRESETS) <= set(available_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_with_positive_figures(name):
    cluster = load_cluster(name)
    assert isinstance(cluster, Cluster)
    assert cluster.name == name
    assert cluster.num_gpus == cluster.devices_per_node * cluster.num_nodes
    assert cluster.device.hbm_bytes > 0 and cluster.device.hbm_bandwidth > 0
    assert all(v > 0 for v in cluster.device.peak_flops.values())
    assert cluster.intra_node.bandwidth > cluster.inter_node.bandwidth
    assert (
        cluster.device.peak_flops_for() == cluster.device.peak_flops[cluster.device.default_dtype]
    )


def test_alpa_cluster_matches_reference():
    cluster = load_cluster("alpa-v100")
    assert (cluster.num_nodes, cluster.devices_per_node) == (8, 8)
    assert cluster.device.hbm_bytes == 16 * 2**30
    # 25 Gbit/s per node shared by 8 GPUs
    assert math.isclose(cluster.inter_node.bandwidth, 25e9 / 8 / 8)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown cluster preset") as err:
        load_cluster("tpu-v9")
    for name in PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "path",
    [
        ("device", "hbm_bandwidth"),
        ("device", "peak_flops"),
        ("intra_node_link", "latency"),
        ("inter_node_link", "bandwidth"),
        ("devices_per_node",),
    ],
)
def test_missing_field_names_field_and_file(tmp_path, path):
    obj = _preset_json("dgx-a100")
    target = obj
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    file = tmp_path / "broken.json"
    file.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="missing field") as err:
        load_cluster(file)
    assert ".".join(path) in str(err.value)
    assert str(file) in str(err.value)


@pytest.mark.parametrize(
    "path",
    [
        ("device", "hbm_bytes"),
        ("device", "peak_flops", "bf16"),
        ("intra_node_link", "bandwidth"),
        ("inter_node_link", "latency"),
        ("num_nodes",),
    ],
)
def test_negative_field_names_field_and_file(tmp_path, path):
    obj = _preset_json("dgx-h100")
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = -1
    file = tmp_path / "negative.json"
    file.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="must be") as err:
        load_cluster(file)
    assert ".".join(path) in str(err.value)
    assert str(file) in str(err.value)


def test_user_preset_file_loads(tmp_path):
    obj = _preset_json("dgx-a100")
    obj["name"] = "my-cluster"
    obj["num_nodes"] = 3
    file = tmp_path / "mine.json"
    file.write_text(json.dumps(obj))
    cluster = load_cluster(file)
    assert cluster.name == "my-cluster" and cluster.num_gpus == 24


def test_resize_to_num_gpus():
    assert load_cluster("dgx-a100", num_gpus=64).num_nodes == 8
    small = load_cluster("alpa-v100", num_gpus=4)
    assert (small.num_nodes, small.devices_per_node, small.num_gpus) == (1, 4, 4)


def test_too_many_gpus_for_preset_with_max_nodes():
    with pytest.raises(ValueError, match="at most 8 nodes"):
        load_cluster("alpa-v100", num_gpus=128)


def test_partial_node_count_is_rejected_with_alternatives():
    with pytest.raises(ValueError, match="use 8 or 16"):
        load_cluster("dgx-a100", num_gpus=12)


def test_alpa_8x8_mesh_axis1_nvlink_axis0_network():
    cluster = load_cluster("alpa-v100")
    alpha, beta = cluster_mesh_costs(cluster, (8, 8), ("x", "y"), 64)
    assert (alpha[1], beta[1]) == (cluster.intra_node.latency, 1 / cluster.intra_node.bandwidth)
    assert (alpha[0], beta[0]) == (cluster.inter_node.latency, 1 / cluster.inter_node.bandwidth)


def test_axis_that_straddles_nodes_gets_network():
    cluster = load_cluster("dgx-a100", num_gpus=16)
    links = axis_links(cluster, (4, 4))
    assert links == (cluster.inter_node, cluster.intra_node)
    assert axis_links(cluster, (16,)) == (cluster.inter_node,)
    assert axis_links(cluster, (2, 2, 4)) == (
        cluster.inter_node,
        cluster.intra_node,
        cluster.intra_node,
    )


def test_mesh_larger_than_cluster_is_rejected():
    cluster = load_cluster("dgx-a100")  # one node
    with pytest.raises(ValueError, match="num_gpus=16"):
        cluster_mesh_costs(cluster, (2, 8), ("a", "b"))
    with pytest.raises(ValueError, match="num_gpus"):
        cluster_mesh_costs(cluster, (2, 4), ("a", "b"), num_gpus=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4))
def test_nvlink_axes_form_a_suffix(shape):
    """Once an axis (of size > 1) crosses nodes, every outer axis of size > 1 does too."""
    shape = tuple(shape)
    cluster = load_cluster("dgx-h100", num_gpus=max(8, math.prod(shape)))
    links = axis_links(cluster, shape)
    crossed = False
    for size, link in reversed(list(zip(shape, links, strict=True))):
        if size == 1:
            assert link == cluster.intra_node
            continue
        crossed = crossed or link == cluster.inter_node
        assert link == (cluster.inter_node if crossed else cluster.intra_node)
    inner = [s for s in shape if s > 1]
    if math.prod(inner) <= 8:
        assert all(link == cluster.intra_node for link in links)


def test_to_device_mesh_carries_device_figures():
    pytest.importorskip("autoshard.intra.cost.resharding")
    cluster = load_cluster("dgx-a100", num_gpus=16)
    mesh = to_device_mesh(cluster, (2, 8), ("data", "model"))
    assert mesh.mesh.axis_names == ("data", "model") and mesh.mesh.shape == (2, 8)
    assert mesh.alpha == cluster_mesh_costs(cluster, (2, 8), ("data", "model"))[0]
    assert mesh.peak_flops == cluster.device.peak_flops["bf16"]
    assert mesh.memory_bytes == cluster.device.hbm_bytes
    assert mesh.hbm_bandwidth == cluster.device.hbm_bandwidth
    assert to_device_mesh(cluster, (16,), ("d",), "fp32").peak_flops == 19.5e12


def test_v100_has_no_bf16():
    cluster = load_cluster("alpa-v100")
    with pytest.raises(ValueError, match="fp16"):
        cluster.device.peak_flops_for("bf16")
