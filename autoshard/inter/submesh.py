"""Logical meshes for sub-meshes: the cost-model mesh of each ``(dp, tp)`` view.

:func:`cluster_for` gives the cluster the stage search prices (a preset, or an abstract
one with round link figures); :func:`logical_mesh_costs` turns it into
``logical (dp, tp) -> DeviceMesh`` with the axes :data:`~autoshard.inter.plan.LOGICAL_AXES`,
the meshes the stage costs' intra-op ILPs run on.  Jax-free.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from autoshard.hardware.clusters import (
    Cluster,
    DeviceSpec,
    LinkSpec,
    cluster_mesh_costs,
    load_cluster,
)
from autoshard.hardware.gemm import GemmTable
from autoshard.hardware.mesh import DeviceMesh, to_device_mesh, uniform_mesh
from autoshard.inter.plan import LOGICAL_AXES, Shape2

DEFAULT_PEAK_FLOPS = 100e12  # FLOP/s per device when the mesh has no finite peak
# Without a cluster preset: an abstract cluster with round link figures (bytes/s, s).
DEFAULT_INTRA_HOST = (100e9, 5e-6)
DEFAULT_INTER_HOST = (12.5e9, 10e-6)


def cluster_for(cluster, num_hosts: int, devices_per_host: int):
    """A :class:`~autoshard.hardware.clusters.Cluster` of ``num_hosts x devices_per_host``.

    ``cluster``: a preset name, a preset file path, a Cluster, or None for an abstract
    cluster (:data:`DEFAULT_INTRA_HOST` / :data:`DEFAULT_INTER_HOST` links,
    :data:`DEFAULT_PEAK_FLOPS`, unbounded memory).
    """
    if cluster is None:
        return Cluster(
            "abstract",
            DeviceSpec(
                "abstract",
                MappingProxyType({"fp32": DEFAULT_PEAK_FLOPS}),
                math.inf,
                math.inf,
                "fp32",
            ),
            devices_per_host,
            num_hosts,
            LinkSpec("intra-host", *DEFAULT_INTRA_HOST),
            LinkSpec("inter-host", *DEFAULT_INTER_HOST),
        )
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    return dataclasses.replace(
        cluster, devices_per_node=devices_per_host, num_nodes=num_hosts, max_nodes=None
    )


def logical_mesh_costs(cluster, dtype: str | None = None):
    """``logical (dp, tp) -> DeviceMesh`` on ``cluster`` (memoised; a frozen mesh per shape).

    On a preset whose device names a GEMM table the meshes time GEMMs with it and charge
    memory-bound operations their bytes over HBM bandwidth: the compute model of
    :mod:`autoshard.sim.megatron`.  The abstract cluster keeps FLOPs at peak.
    """
    cache: dict[Shape2, DeviceMesh] = {}
    table = None
    if cluster.name != "abstract" and cluster.device.gemm_table is not None:
        table = GemmTable.load(cluster.device.gemm_table)

    def mesh_for(logical: Shape2) -> DeviceMesh:
        if logical not in cache:
            if cluster.name == "abstract":
                alpha, beta = cluster_mesh_costs(cluster, logical, LOGICAL_AXES)
                cache[logical] = uniform_mesh(logical, LOGICAL_AXES, alpha, beta)
            else:
                cache[logical] = to_device_mesh(cluster, logical, LOGICAL_AXES, dtype, table)
        return cache[logical]

    return mesh_for
