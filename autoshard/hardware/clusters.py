"""Cluster presets as data, and the map from mesh axes to links (jax-free).

Takes a preset name (``alpa-v100``, ``dgx-a100``, ``dgx-h100``; see :func:`available_presets`)
or the path of a JSON file, returns a frozen :class:`Cluster`. Guarantees: every number in a
loaded cluster is present, finite and non-negative (bandwidths, peaks and memory strictly
positive); a bad file raises ``ValueError`` naming the field and the file.

Preset file format (one JSON object; write your own and pass its path)::

    {
      "name": "my-cluster",
      "description": "free text",
      "device": {
        "name": "A100-SXM4-80GB",
        "gemm_table": "a100",            # a table in autoshard/hardware/gemm_tables (optional)
        "attention_table": "a100",       # autoshard/hardware/attention_tables (optional: a
                                         # device without one runs attention unfused)
        "default_dtype": "bf16",         # the 16-bit training dtype of this device
        "peak_flops": {"bf16": 312e12, "fp32": 19.5e12},   # dense FLOP/s per dtype
        "hbm_bytes": 85899345920,        # device memory, bytes
        "hbm_bandwidth": 2.0e12          # bytes/s
      },
      "devices_per_node": 8,
      "num_nodes": 1,                    # default node count
      "max_nodes": null,                 # or an int: the largest cluster that exists
      "intra_node_link": {"name": "NVLink", "bandwidth": 300e9, "latency": 5e-6},
      "inter_node_link": {"name": "IB", "bandwidth": 25e9, "latency": 10e-6},
      "host": {                          # optional: what offload (docs/offload.md) needs
        "memory_bytes": 2e12,            # host RAM per node, bytes
        "link": {"name": "PCIe 4.0 x16", "bandwidth": 25e9, "latency": 10e-6},
        "gpus_per_link": 2,              # GPUs sharing one host link's uplink
        "adam_params_per_s": 2.7e9,      # the node's CPU Adam, parameters per second
        "copy_overlap": 0.13             # optional: share of a step's host copies hidden
                                         # behind compute (default COPY_OVERLAP)
      },
      "notes": "where the figures come from"
    }

Link ``bandwidth`` is bytes/s *per GPU in one direction*, which is what a ring collective
moves (vendor NVLink figures are both directions added: 600 GB/s on A100 -> 300e9 here).
The inter-node figure is the node's NIC bandwidth divided by ``devices_per_node``: we assume
that when one mesh axis crosses nodes, every GPU of a node runs its own collective along that
axis at the same time (true of row-major meshes, where all inner-axis groups are busy in
parallel), so the GPUs share the NICs evenly. The host ``link`` (PCIe) bandwidth is per GPU in
one direction when it copies alone; ``gpus_per_link`` GPUs share one uplink to the CPU, so
with that many in use on a node each gets its share (:meth:`HostSpec.link_bandwidth`).
``copy_overlap`` is what the runtime makes of the copies inside a step, not the link's: the
share of their serial time (in, then out) that runs under compute (:data:`COPY_OVERLAP`,
measured on one H100 with XLA:GPU, is the default).
Latencies are assumptions (about 5 us for
NVLink, 10-20 us for the network), not measurements.

Mesh axes map to links (:func:`cluster_mesh_costs`): devices are numbered row-major over the
mesh and filled node by node, so the last axes vary fastest. Going from the last axis to the
first, an axis stays on NVLink while the product of its size and the sizes of all axes after
it divides ``devices_per_node``; any other axis has groups that cross nodes, and a ring is as
slow as its slowest hop, so it gets the network's alpha and beta.

Collectives that cross nodes (:func:`node_aware_collective_time`): the per-axis alpha and
beta above price a *flat* ring over the slowest link, at one GPU's share of the node's NICs.
NCCL does better when a group has several GPUs in each node: a two-level all-reduce
reduce-scatters inside the node over NVLink, all-reduces ``1/g`` of the data between nodes
(each of the group's ``g`` GPUs in a node carries its own ``1/g`` through its share of the
node's adapters, so the node's whole network bandwidth is used) and all-gathers inside the
node again; all-gather and reduce-scatter are the two halves. A mesh made by
:func:`~autoshard.hardware.mesh.to_device_mesh` carries a :class:`NodeLayout`, and the
collective costs (:mod:`autoshard.intra.cost.resharding`, which the search and the simulator both use)
take the cheaper of the flat ring and the two-level algorithm, as NCCL's tuner picks its
algorithm. The phases are added, not overlapped (NCCL pipelines them: a slight
overestimate).
"""

from __future__ import annotations

import json
import math
import numbers
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

PRESET_PACKAGE = "autoshard.hardware"
PRESET_DIR = "presets"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak FLOP/s per dtype, HBM capacity and bandwidth."""

    name: str
    peak_flops: MappingProxyType  # dtype name -> FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float
    default_dtype: str
    gemm_table: str | None = None
    # a table in autoshard/hardware/attention_tables: the device runs a fused (flash)
    # attention kernel (cuDNN's, Ampere and later); None: attention runs unfused
    attention_table: str | None = None

    def peak_flops_for(self, dtype: str | None = None) -> float:
        """Peak FLOP/s for ``dtype`` (None: the device's default 16-bit dtype)."""
        dtype = dtype or self.default_dtype
        if dtype not in self.peak_flops:
            raise ValueError(
                f"device {self.name} has no peak for dtype {dtype!r}; "
                f"it has {sorted(self.peak_flops)}"
            )
        return float(self.peak_flops[dtype])


@dataclass(frozen=True)
class LinkSpec:
    """A link class: one-direction bandwidth per GPU (bytes/s) and latency (s)."""

    name: str
    bandwidth: float
    latency: float

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


# The share of a step's host <-> device copies (their serial time, one direction after the
# other) that XLA:GPU hides behind the step's compute, as measured on one H100 with jax
# 0.11.2 (2026-11-27 22:18 UTC, benchmarks/results/gpu_offload_h100_2026-11-27.json, third
# call): gpt-1.3b, batch 8, bf16, AdamW with its moments in pinned_host took 516.6 ms a step
# against 165.9 ms without offload; the 350.7 ms more are 86.7% of the moments' 10.52 GB in
# and out one after the other at the link's measured 53.1 / 51.1 GB/s (404.5 ms), so 13%
# was hidden (and the two directions did not run at once: both together would take at
# most 206 ms). tests/test_offload.py derives it from that file.
COPY_OVERLAP = 0.13


@dataclass(frozen=True)
class HostSpec:
    """A node's host side, what offloading state to host memory pays for: RAM per node,
    the host link (PCIe) per GPU, how many GPUs share one uplink, the node's CPU Adam
    throughput (parameters per second, all its cores), and the share of a step's copies
    that run hidden under its compute (``copy_overlap``, :data:`COPY_OVERLAP`)."""

    memory_bytes: float
    link: LinkSpec
    gpus_per_link: int
    adam_params_per_s: float
    copy_overlap: float = COPY_OVERLAP

    def link_bandwidth(self, gpus_in_use: int) -> float:
        """Bytes/s per GPU in one direction when ``gpus_in_use`` GPUs of the node copy at
        once: the link's, divided among the GPUs that share an uplink."""
        return self.link.bandwidth / max(1, min(self.gpus_per_link, int(gpus_in_use)))


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` nodes of ``devices_per_node`` identical devices.

    ``devices_per_node`` is the number of GPUs *in use* per node: a 4-GPU slice of an
    8-GPU node has ``devices_per_node=4, num_nodes=1``.
    """

    name: str
    device: DeviceSpec
    devices_per_node: int
    num_nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    max_nodes: int | None = None
    description: str = ""
    host: HostSpec | None = None  # None: the preset says nothing of its host (no offload)

    @property
    def num_gpus(self) -> int:
        return self.devices_per_node * self.num_nodes


def available_presets() -> tuple[str, ...]:
    """Names of the presets shipped in ``autoshard/hardware/presets``."""
    folder = resources.files(PRESET_PACKAGE) / PRESET_DIR
    return tuple(
        sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))
    )


def load_cluster(name_or_path: str | Path, num_gpus: int | None = None) -> Cluster:
    """Load a preset by name or a preset file by path, optionally resized to ``num_gpus``.

    ``num_gpus`` must be at most ``devices_per_node`` (one partly used node) or a multiple of
    it; with a preset that has ``max_nodes`` it may not exceed ``max_nodes`` nodes.
    """
    text, origin = _read_preset(name_or_path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"preset file {origin} is not valid JSON: {err}") from None
    cluster = cluster_from_json(obj, origin)
    return cluster if num_gpus is None else resize_cluster(cluster, num_gpus)


def _read_preset(name_or_path: str | Path) -> tuple[str, str]:
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"preset file {path} does not exist")
        return path.read_text(), str(path)
    name = str(name_or_path)
    if name not in available_presets():
        raise ValueError(
            f"unknown cluster preset {name!r}; available presets: "
            f"{', '.join(available_presets())} (or pass the path of a preset .json file)"
        )
    res = resources.files(PRESET_PACKAGE) / PRESET_DIR / f"{name}.json"
    return res.read_text(), f"preset {name} ({PRESET_DIR}/{name}.json)"


def _field(obj: dict, key: str, origin: str, prefix: str = "") -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{origin}: missing field {prefix + key!r}")
    return obj[key]


def _number(
    obj: dict, key: str, origin: str, prefix: str = "", positive: bool = True, integer=False
) -> float:
    value = _field(obj, key, origin, prefix)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        need = ("a positive" if positive else "a non-negative") + (" integer" if integer else "")
        raise ValueError(f"{origin}: field {prefix + key!r} must be {need} number, got {value!r}")
    return int(value) if integer else float(value)


def _link(obj: dict, key: str, origin: str, outer: str = "") -> LinkSpec:
    link = _field(obj, key, origin, outer)
    prefix = outer + key + "."
    return LinkSpec(
        name=str(link.get("name", key)) if isinstance(link, dict) else key,
        bandwidth=_number(link, "bandwidth", origin, prefix),
        latency=_number(link, "latency", origin, prefix, positive=False),
    )


def _host(obj: dict, origin: str) -> HostSpec | None:
    host = obj.get("host")
    if host is None:
        return None
    if not isinstance(host, dict):
        raise ValueError(
            f"{origin}: field 'host' must be an object (see clusters.py), got {host!r}"
        )
    return HostSpec(
        memory_bytes=_number(host, "memory_bytes", origin, "host."),
        link=_link(host, "link", origin, "host."),
        gpus_per_link=_number(host, "gpus_per_link", origin, "host.", integer=True),
        adam_params_per_s=_number(host, "adam_params_per_s", origin, "host."),
        copy_overlap=_fraction(host, "copy_overlap", origin, "host.", COPY_OVERLAP),
    )


def _fraction(obj: dict, key: str, origin: str, prefix: str, default: float) -> float:
    """An optional number in [0, 1] (``default`` where the field is absent)."""
    if key not in obj:
        return default
    value = _number(obj, key, origin, prefix, positive=False)
    if value > 1:
        raise ValueError(f"{origin}: field {prefix + key!r} must be in [0, 1], got {value!r}")
    return value


def cluster_from_json(obj: dict, origin: str = "preset") -> Cluster:
    """Build and validate a :class:`Cluster` from a parsed preset file."""
    dev = _field(obj, "device", origin)
    peaks = _field(dev, "peak_flops", origin, "device.")
    if not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"{origin}: field 'device.peak_flops' must map dtype names to FLOP/s")
    peak_flops = {k: _number(peaks, k, origin, "device.peak_flops.") for k in peaks}
    default_dtype = str(_field(dev, "default_dtype", origin, "device."))
    if default_dtype not in peak_flops:
        raise ValueError(
            f"{origin}: field 'device.default_dtype' is {default_dtype!r}, which has no entry "
            f"in device.peak_flops ({sorted(peak_flops)})"
        )
    device = DeviceSpec(
        name=str(_field(dev, "name", origin, "device.")),
        peak_flops=MappingProxyType(peak_flops),
        hbm_bytes=_number(dev, "hbm_bytes", origin, "device."),
        hbm_bandwidth=_number(dev, "hbm_bandwidth", origin, "device."),
        default_dtype=default_dtype,
        gemm_table=dev.get("gemm_table"),
        attention_table=dev.get("attention_table"),
    )
    max_nodes = obj.get("max_nodes")
    if max_nodes is not None:
        max_nodes = _number(obj, "max_nodes", origin, integer=True)
    cluster = Cluster(
        name=str(_field(obj, "name", origin)),
        device=device,
        devices_per_node=_number(obj, "devices_per_node", origin, integer=True),
        num_nodes=_number(obj, "num_nodes", origin, integer=True),
        intra_node=_link(obj, "intra_node_link", origin),
        inter_node=_link(obj, "inter_node_link", origin),
        max_nodes=max_nodes,
        description=str(obj.get("description", "")),
        host=_host(obj, origin),
    )
    if max_nodes is not None and cluster.num_nodes > max_nodes:
        raise ValueError(f"{origin}: num_nodes {cluster.num_nodes} exceeds max_nodes {max_nodes}")
    return cluster


def resize_cluster(cluster: Cluster, num_gpus: int) -> Cluster:
    """The same cluster with ``num_gpus`` GPUs in use (whole nodes, or part of one node)."""
    per_node = cluster.devices_per_node
    if not isinstance(num_gpus, numbers.Integral) or num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive int, got {num_gpus!r}")
    if num_gpus <= per_node:
        return replace(cluster, devices_per_node=int(num_gpus), num_nodes=1)
    if num_gpus % per_node:
        lo = num_gpus // per_node * per_node
        raise ValueError(
            f"{cluster.name}: num_gpus={num_gpus} is not a multiple of the {per_node} GPUs per "
            f"node; use {lo} or {lo + per_node} (or at most {per_node} on one node)"
        )
    nodes = num_gpus // per_node
    if cluster.max_nodes is not None and nodes > cluster.max_nodes:
        raise ValueError(
            f"{cluster.name} has at most {cluster.max_nodes} nodes = "
            f"{cluster.max_nodes * per_node} GPUs; asked for {num_gpus} GPUs ({nodes} nodes)"
        )
    return replace(cluster, num_nodes=int(nodes))


def axis_links(cluster: Cluster, mesh_shape: tuple[int, ...]) -> tuple[LinkSpec, ...]:
    """The link class of every mesh axis (see the module docstring for the rule)."""
    links: list[LinkSpec] = []
    inner = 1  # devices spanned by the axes after this one
    for size in reversed(tuple(mesh_shape)):
        span = inner * size
        inside = size == 1 or (
            span <= cluster.devices_per_node and cluster.devices_per_node % span == 0
        )
        links.append(cluster.intra_node if inside else cluster.inter_node)
        inner = span
    return tuple(reversed(links))


def cluster_mesh_costs(
    cluster: Cluster,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    num_gpus: int | None = None,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(alpha per axis in seconds, beta per axis in seconds/byte) of a mesh on ``cluster``.

    ``num_gpus`` (default: the product of ``mesh_shape``) must equal that product and fit in
    the cluster.
    """
    mesh_shape, axis_names = tuple(mesh_shape), tuple(axis_names)
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"mesh shape {mesh_shape} and axis names {axis_names} differ in length")
    if any(not isinstance(s, numbers.Integral) or s < 1 for s in mesh_shape):
        raise ValueError(f"mesh shape must hold positive ints, got {mesh_shape}")
    devices = math.prod(mesh_shape)
    if num_gpus is not None and num_gpus != devices:
        raise ValueError(f"mesh {mesh_shape} has {devices} devices but num_gpus={num_gpus}")
    if devices > cluster.num_gpus:
        raise ValueError(
            f"mesh {mesh_shape} needs {devices} GPUs but cluster {cluster.name} has "
            f"{cluster.num_gpus} ({cluster.num_nodes} x {cluster.devices_per_node}); load it "
            f"with num_gpus={devices}"
        )
    links = axis_links(cluster, mesh_shape)
    return tuple(link.alpha for link in links), tuple(link.beta for link in links)


@dataclass(frozen=True)
class NodeLayout:
    """Where a mesh's devices sit: ``devices_per_node`` consecutive devices (row-major over
    the mesh) per node, joined by ``intra`` inside a node and ``inter`` between nodes (per-GPU
    figures, as in the preset)."""

    devices_per_node: int
    intra: LinkSpec
    inter: LinkSpec

    @classmethod
    def of(cls, cluster: Cluster) -> NodeLayout:
        return cls(cluster.devices_per_node, cluster.intra_node, cluster.inter_node)


@lru_cache(maxsize=4096)
def group_node_span(
    mesh_shape: tuple[int, ...], group: tuple[int, ...], devices_per_node: int
) -> tuple[int, int] | None:
    """``(g, nodes)`` when every collective group over the mesh axes ``group`` (indices)
    has exactly ``g`` devices in each of the ``nodes`` nodes it touches; None when groups
    are spread unevenly (then only the flat ring is priced).

    Devices are numbered row-major over ``mesh_shape`` and node ``d // devices_per_node``
    holds device ``d``.
    """
    mesh_shape, group = tuple(mesh_shape), tuple(sorted(set(group)))
    if devices_per_node < 1 or any(i < 0 or i >= len(mesh_shape) for i in group):
        raise ValueError(
            f"bad group {group} of mesh {mesh_shape} or devices_per_node {devices_per_node}"
        )
    others = [i for i in range(len(mesh_shape)) if i not in group]
    pairs: Counter = Counter()
    for device in range(math.prod(mesh_shape)):
        index, rest = [], device
        for size in reversed(mesh_shape):
            index.append(rest % size)
            rest //= size
        index.reverse()
        key = tuple(index[i] for i in others)
        pairs[key, device // devices_per_node] += 1
    counts = set(pairs.values())
    if len(counts) != 1:
        return None
    per_group = Counter(key for key, _node in pairs)
    nodes = set(per_group.values())
    if len(nodes) != 1:
        return None
    return counts.pop(), nodes.pop()


def node_aware_collective_time(
    kind: str, nbytes: float, local: int, nodes: int, intra: LinkSpec, inter: LinkSpec
) -> float:
    """Seconds of the two-level (node-aware) ``kind`` over ``local x nodes`` devices.

    ``kind``: ``all-reduce`` (``nbytes``: the reduced buffer), ``all-gather`` (the gathered
    output) or ``reduce-scatter`` (the input), with the ring conventions of
    :mod:`autoshard.intra.cost.resharding`. ``local``: the group's devices in each node; ``nodes``:
    the nodes it spans. Inside a node the ring moves ``(g-1)/g`` of the buffer over
    ``intra``; between nodes each device moves its ``1/g`` share over ``inter``::

        all-reduce      2 a_intra + a_inter + b_intra 2 (g-1)/g B + b_inter 2 (N-1)/N B/g
        all-gather        a_intra + a_inter + b_intra   (g-1)/g B + b_inter   (N-1)/N B/g
        reduce-scatter    a_intra + a_inter + b_intra   (g-1)/g B + b_inter   (N-1)/N B/g

    With ``local == 1`` it is the flat ring over ``inter``; with ``nodes == 1`` the ring over
    ``intra`` in two phases (an all-reduce pays two latencies). Callers use it across nodes.
    """
    if kind not in ("all-reduce", "all-gather", "reduce-scatter"):
        raise ValueError(
            f"no node-aware cost for {kind!r}; use all-reduce, all-gather or reduce-scatter"
        )
    if local < 1 or nodes < 1 or nbytes < 0 or not math.isfinite(nbytes):
        raise ValueError(
            f"need local, nodes >= 1 and finite nbytes >= 0, got {local}, {nodes}, {nbytes}"
        )
    phases = 2 if kind == "all-reduce" else 1
    inside = (local - 1) / local * nbytes
    across = (nodes - 1) / nodes * nbytes / local
    alpha = (phases * intra.alpha if local > 1 else 0.0) + (inter.alpha if nodes > 1 else 0.0)
    return alpha + phases * (inside * intra.beta + across * inter.beta)
