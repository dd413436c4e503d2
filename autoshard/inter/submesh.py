"""Logical meshes for sub-meshes: the cost-model mesh of each ``(dp, tp)`` view.

:func:`cluster_for` gives the cluster the stage search prices (a preset, or an abstract
one with round link figures); :func:`logical_mesh_costs` turns it into
``logical (dp, tp) -> DeviceMesh`` with the axes :data:`~autoshard.inter.plan.LOGICAL_AXES`,
the meshes the stage costs' intra-op ILPs run on.  Jax-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
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


# ----------------------------------------------------------------------------- Alpa's sub-meshes


def check_cluster(num_hosts: int, devices_per_host: int) -> None:
    """ValueError unless both are positive ints."""
    for name, v in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[Shape2, ...]:
    """Alpa's candidate sub-meshes: ``(1, 2^j)`` for powers of two dividing ``M``,
    ``(1, M)``, and ``(k, M)`` for ``k = 2..N``.

    Single-host sizes divide each other and ``M``; multi-host ones are whole hosts.  That
    is what lets any multiset of them with total ``N * M`` tile the cluster.  For ``M`` a
    power of two this is exactly Alpa's list.
    """
    check_cluster(num_hosts, devices_per_host)
    shapes = []
    width = 1
    while width < devices_per_host and devices_per_host % width == 0:
        shapes.append((1, width))
        width *= 2
    shapes.append((1, devices_per_host))
    shapes += [(k, devices_per_host) for k in range(2, num_hosts + 1)]
    return tuple(shapes)


def logical_mesh_shapes(submesh_shape: Shape2) -> tuple[Shape2, ...]:
    """Every ``(dp, tp)`` with ``dp * tp`` = the sub-mesh's device count, ``dp`` ascending."""
    n = submesh_shape[0] * submesh_shape[1]
    if n < 1:
        raise ValueError(f"sub-mesh shape {submesh_shape} has no devices")
    return tuple((dp, n // dp) for dp in range(1, n + 1) if n % dp == 0)


def place_submeshes(
    shapes: Sequence[Shape2], num_hosts: int, devices_per_host: int
) -> tuple[tuple[int, ...], ...]:
    """Device ids (``host * M + local``) for each sub-mesh, tiling the cluster exactly.

    Multi-host shapes ``(k, M)`` take whole hosts in order; single-host shapes are packed
    largest first into the hosts left.  Raises if the shapes do not tile the cluster.
    """
    check_cluster(num_hosts, devices_per_host)
    total = sum(r * c for r, c in shapes)
    if total != num_hosts * devices_per_host:
        raise ValueError(
            f"sub-meshes {list(shapes)} use {total} devices; the {num_hosts}x{devices_per_host} "
            f"cluster has {num_hosts * devices_per_host} and all must be used exactly once"
        )
    placed: list[tuple[int, ...] | None] = [None] * len(shapes)
    host = 0
    for idx, (rows, cols) in enumerate(shapes):
        if rows > 1:
            if cols != devices_per_host:
                raise ValueError(f"multi-host sub-mesh {(rows, cols)} must span whole hosts")
            ids = range(host * devices_per_host, (host + rows) * devices_per_host)
            placed[idx] = tuple(ids)
            host += rows
    used = [0] * num_hosts  # devices taken on each remaining host, filled left to right
    for idx in sorted((i for i, s in enumerate(shapes) if s[0] == 1), key=lambda i: -shapes[i][1]):
        width = shapes[idx][1]
        for h in range(host, num_hosts):
            if used[h] + width <= devices_per_host:
                start = h * devices_per_host + used[h]
                placed[idx] = tuple(range(start, start + width))
                used[h] += width
                break
        else:
            raise ValueError(f"sub-meshes {list(shapes)} cannot be packed onto whole hosts")
    return tuple(p for p in placed if p is not None)
