"""Collective costs: the alpha-beta formulas per collective, compute and memory time (jax-free).

Takes a priced mesh (:class:`~autoshard.hardware.mesh.DeviceMesh`: a logical mesh with
per-axis link figures), sharding specs and global tensor shapes; returns times in seconds.

Collectives use the ring alpha-beta formulas (REFERENCE.md), ``n`` being the number of
devices in the group and ``bytes`` the per-device size with the conventions of
:class:`~autoshard.ir.spec.Collective`::

    all-reduce      alpha + beta * 2 (n-1)/n   * bytes    (the reduced buffer)
    all-gather      alpha + beta *   (n-1)/n   * bytes    (the gathered output)
    reduce-scatter  alpha + beta *   (n-1)/n   * bytes    (the input)
    all-to-all      alpha + beta *   (n-1)/n   * bytes * penalty  (the per-device buffer)
    collective-permute  alpha + beta *      bytes   (the buffer each device sends)

An all-to-all sends (n-1)/n of every device's buffer to the others, all at once: on a
switched network (NVSwitch, a non-blocking fabric) each device's link carries
(n-1)/n x bytes, which is how NCCL's tests define its bus bandwidth, and one launch
latency alpha is paid, not one per peer (the n-1 messages are in flight together).
REFERENCE.md's ``(n-1)/n^2`` is the same cost written on the whole tensor (n x bytes),
the way Alpa passes it; on the per-device buffer Collective records carry it is
``(n-1)/n``. Alpa's ``n / 2`` penalty (``all_to_all_penalty_scales_with_n``) on top
reproduces its objectives exactly (docs/moe.md).

A group of several mesh axes runs one ring over all their devices, and a ring is as slow
as its slowest link: the group uses the *largest* alpha and the *largest* beta among its
axes (axes of size 1 carry no traffic and are left out). A group of one device costs 0.
On a mesh that knows its nodes (``DeviceMesh.nodes``, set for cluster presets) an
all-reduce, all-gather or reduce-scatter whose groups span several nodes costs the cheaper
of that flat ring and the two-level (node-aware) algorithm of
:func:`autoshard.hardware.clusters.node_aware_collective_time`.
A collective-permute (XLA's move of whole blocks between devices, each device sending its
buffer to one other) is one point-to-point send per device, all at once: one alpha and the
whole buffer over the slowest link among the axes the pairs differ on.
Alpa's tie-breakers (constants added per collective so that equal plans are broken the
same way every time) are on by default and switched off with ``CostOptions``; Alpa has no
collective-permute, which gets the all-to-all's constant.

The resharding that strings collectives together is :mod:`autoshard.intra.cost.resharding`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from autoshard.hardware.clusters import node_aware_collective_time
from autoshard.hardware.mesh import DeviceMesh, check_nonnegative
from autoshard.ir.spec import Axes, Collective, cached_hash

# Alpa's constants (auto_sharding.py, LogicalDeviceMesh.*_cost).
ALPA_TIE_BREAKERS = MappingProxyType(
    {"all-gather": 0.1, "all-reduce": 0.01, "reduce-scatter": 0.001, "all-to-all": 0.001,
     "collective-permute": 0.001}  # not Alpa's: it has no permute; the all-to-all's
)  # fmt: skip


@cached_hash
@dataclass(frozen=True)
class CostOptions:
    """Knobs of the collective cost formulas.

    ``tie_breakers`` adds Alpa's per-collective constants (:data:`ALPA_TIE_BREAKERS`).
    ``all_to_all_penalty`` multiplies the beta term of an all-to-all; with
    ``all_to_all_penalty_scales_with_n`` it is further multiplied by ``n / 2``, which is
    what Alpa does to match all-to-all timings on V100 + NVLink (a hybrid cube-mesh, not a
    switch): with it, an all-to-all costs exactly what Alpa's objective charges.
    ``group_reductions`` reduces several partial axes with one all-reduce over all of
    them, as XLA's SPMD partitioner does; off, it may split them when that is cheaper.
    """

    tie_breakers: bool = True
    group_reductions: bool = True
    all_to_all_penalty: float = 1.0
    all_to_all_penalty_scales_with_n: bool = False

    def __post_init__(self) -> None:
        if not (0.0 <= self.all_to_all_penalty < math.inf):
            raise ValueError(
                f"all_to_all_penalty must be a finite number >= 0, got {self.all_to_all_penalty!r}"
            )


DEFAULT_COST_OPTIONS = CostOptions()


def ring_volume(kind: str, n: int, nbytes: float) -> float:
    """Bytes each device sends in a ring ``kind`` over ``n`` devices of a buffer of
    ``nbytes`` (an all-reduce's per-device buffer, an all-gather's gathered output, a
    reduce-scatter's input, an all-to-all's per-device buffer)."""
    if n <= 1:
        return 0.0
    if kind == "collective-permute":  # every device sends its whole buffer once
        return float(nbytes)
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * nbytes


def _ring_cost(
    kind: str, mesh: DeviceMesh, axes: str | Sequence[str], nbytes: float, options: CostOptions
) -> float:
    if not isinstance(axes, (str, tuple)):
        axes = tuple(axes)
    return _ring_seconds(kind, mesh, axes, nbytes, options)


# the resharding planner prices the same (collective, bytes) on one mesh thousands of times
@functools.lru_cache(maxsize=500_000)
def _ring_seconds(
    kind: str, mesh: DeviceMesh, axes: str | Axes, nbytes: float, options: CostOptions
) -> float:
    group = mesh.group(axes)
    check_nonnegative("nbytes", nbytes, allow_inf=False)
    n = mesh.mesh.size(group)
    if n == 1:
        return 0.0
    alpha, beta = mesh.link(group)
    volume = ring_volume(kind, n, nbytes)
    if kind == "all-to-all":
        penalty = options.all_to_all_penalty
        if options.all_to_all_penalty_scales_with_n:
            penalty *= n / 2
        volume *= penalty
    tie = ALPA_TIE_BREAKERS[kind] if options.tie_breakers else 0.0
    flat = alpha + beta * volume
    span = mesh.node_span(group) if kind not in ("all-to-all", "collective-permute") else None
    if span is not None:  # across nodes: NCCL's two-level algorithm when it is cheaper
        two_level = node_aware_collective_time(
            kind, nbytes, span[0], span[1], mesh.nodes.intra, mesh.nodes.inter
        )
        flat = min(flat, two_level)
    return flat + tie


def all_reduce_cost(
    mesh: DeviceMesh,
    axes: str | Sequence[str],
    nbytes: float,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> float:
    """Ring all-reduce of a per-device buffer of ``nbytes`` over ``axes``."""
    return _ring_cost("all-reduce", mesh, axes, nbytes, options)


def all_gather_cost(
    mesh: DeviceMesh,
    axes: str | Sequence[str],
    nbytes: float,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> float:
    """Ring all-gather over ``axes``; ``nbytes`` is the gathered (output) buffer."""
    return _ring_cost("all-gather", mesh, axes, nbytes, options)


def reduce_scatter_cost(
    mesh: DeviceMesh,
    axes: str | Sequence[str],
    nbytes: float,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> float:
    """Ring reduce-scatter over ``axes``; ``nbytes`` is the input (before scattering)."""
    return _ring_cost("reduce-scatter", mesh, axes, nbytes, options)


def all_to_all_cost(
    mesh: DeviceMesh,
    axes: str | Sequence[str],
    nbytes: float,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> float:
    """All-to-all over ``axes`` of a per-device buffer of ``nbytes``."""
    return _ring_cost("all-to-all", mesh, axes, nbytes, options)


def collective_cost(
    mesh: DeviceMesh, collective: Collective, options: CostOptions = DEFAULT_COST_OPTIONS
) -> float:
    """Cost of one :class:`~autoshard.ir.spec.Collective` record."""
    return _ring_cost(collective.kind, mesh, collective.axes, collective.bytes, options)


def compute_cost(mesh: DeviceMesh, flops: float) -> float:
    """Seconds to run ``flops`` on one device at peak."""
    check_nonnegative("flops", flops, allow_inf=False)
    return flops / mesh.peak_flops


def memory_bound_cost(mesh: DeviceMesh, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through one device's HBM."""
    check_nonnegative("nbytes", nbytes, allow_inf=False)
    return nbytes / mesh.hbm_bandwidth
