"""Offload: which training state lives in host memory instead of HBM, and what it costs
(jax-free).

Takes a traced step's :class:`~autoshard.ir.graph.Graph` and an :class:`Offload` (the
tensor classes placed on the host); returns the tensors the memory model leaves out of
HBM (:func:`offload_tensors`) and, for a plan on a cluster preset with a ``host`` section
(:class:`~autoshard.hardware.clusters.HostSpec`), the host bytes and the seconds the
placement adds to a step (:func:`offload_cost`). Guarantees: a placement the program
cannot take (a class it has no tensor of, gradients on the host without the optimizer
state and master weights) is refused with a ``ValueError`` saying what would work.

Tensor classes (``OFFLOAD_CLASSES``):

* ``optimizer`` -- the optimizer's floating-point state (Adam's moments) and its update;
* ``master`` -- the f32 parameters the step converts to a narrower dtype before use (mixed
  precision's master weights); the converted copies stay on the device, where the memory
  model already counts them from their forward use to their last backward read;
* ``gradients`` -- the parameter gradients: on the host they leave the device as the
  backward makes them, and the update runs on the host (ZeRO-Offload's placement), so
  this class needs ``optimizer`` and ``master`` too.

The update runs where the state is: with ``gradients`` on the host, on the host (CPU Adam
at the preset's ``adam_params_per_s``, the node's rate shared by its GPUs in use), and its
device equations cost nothing and hold no HBM; otherwise on the device, which streams the
offloaded state in (host -> device) and the updated state out (device -> host) each step.

What is assumed about overlap (say it where a figure is quoted): each copy runs at
:meth:`HostSpec.link_bandwidth` (the GPUs sharing an uplink share it), the copies in and the
copies out one after the other (not both directions at once), and of that serial time only
the preset's ``copy_overlap`` share hides behind compute, at most the backward pass's time
(the transfers of the state for a device update, and the gradients' copies out for a host
update); the rest is exposed. The share is what XLA:GPU did on one H100 with jax 0.11.2
(:data:`~autoshard.hardware.clusters.COPY_OVERLAP`: 13%; the step's ``device_put`` copies
are not prefetched under the forward and backward), not the whole backward that an update
made as each gradient is ready would allow. A host update's CPU Adam and the copy of the
updated 16-bit weights back to the device are not overlapped: they follow the backward
(ZeRO-Offload without its delayed parameter update). A host update partitions the host state
over the plan's devices, as ZeRO-Offload does over its data-parallel ranks: each device
sends its 1/N of the reduced gradients, its CPU share updates 1/N of the parameters and
sends them back, and the devices all-gather the updated 16-bit weights; that all-gather and
the gradients' reduce-scatter are taken to cost what the plan's gradient all-reduce does (an
all-gather of 16-bit weights costs less than one of f32 gradients), so nothing is added for
them. A device update streams each device's own shard of the state. The device keeps a
staging buffer of twice the largest streamed tensor (double buffering), counted in its peak
(the one-mesh ILP, which does not yet know the split, counts the whole tensor; the stage
search its shard). Saved activations are not offloaded here: their live ranges would split
in two, which the memory model does not yet express.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.ir.graph import Graph
from autoshard.ir.spec import Mesh, ShardingSpec

OFFLOAD_CLASSES = ("optimizer", "master", "gradients")
# priced by the stage search only (autoshard.inter.stage_cost): saved activations leave
# the device after their forward use and come back before their backward use
STAGE_ONLY_CLASSES = ("activations",)
OFFLOAD_CHOICES = ("auto", "none", *OFFLOAD_CLASSES)  # what --offload takes (classes joined by ,)
HOST_USABLE_FRACTION = 0.9  # of a node's RAM; the rest for the OS, the data pipeline, pinning
_NARROW = ("bfloat16", "float16")


@dataclass(frozen=True)
class Offload:
    """The tensor classes placed in host memory (``OFFLOAD_CLASSES``, then
    ``STAGE_ONLY_CLASSES``, in that order)."""

    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        classes = tuple(self.classes)
        every = (*OFFLOAD_CLASSES, *STAGE_ONLY_CLASSES)
        unknown = [c for c in classes if c not in every]
        if unknown:
            raise ValueError(
                f"unknown offload class(es) {unknown}: use {', '.join(every)} "
                "(joined by commas), none or auto"
            )
        ordered = tuple(c for c in every if c in classes)
        if "gradients" in ordered and len(set(ordered) & set(OFFLOAD_CLASSES)) < 3:
            raise ValueError(
                "gradients on the host means the update runs on the host (ZeRO-Offload), "
                "which needs the optimizer state and master weights there too: use "
                "--offload optimizer,master,gradients"
            )
        object.__setattr__(self, "classes", ordered)

    @property
    def host_update(self) -> bool:
        """Whether the optimizer update runs on the host (gradients are offloaded)."""
        return "gradients" in self.classes

    @property
    def activations(self) -> bool:
        """Whether saved activations go to the host (priced by the stage search only)."""
        return "activations" in self.classes

    @property
    def state(self) -> Offload:
        """The training-state classes alone (without ``activations``)."""
        return Offload(tuple(c for c in self.classes if c in OFFLOAD_CLASSES))

    @property
    def label(self) -> str:
        return ",".join(self.classes) or "none"

    def __bool__(self) -> bool:
        return bool(self.classes)


NO_OFFLOAD = Offload()
# what ``auto`` tries when the plan does not fit, cheapest first (on a typical step)
AUTO_CANDIDATES = (
    Offload(("optimizer",)),
    Offload(("optimizer", "master")),
    Offload(("optimizer", "master", "gradients")),
)


def parse_offload(text: str) -> Offload | str:
    """``"auto"`` -> ``"auto"``; ``"none"`` -> :data:`NO_OFFLOAD`; ``"optimizer,master"``
    -> that :class:`Offload`; a clear ``ValueError`` otherwise."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    if value in ("none", ""):
        return NO_OFFLOAD
    return Offload(tuple(c.strip() for c in value.replace("+", ",").split(",") if c.strip()))


@dataclass(frozen=True)
class OffloadTensors:
    """What an :class:`Offload` moves, as tensor ids of one graph."""

    offload: Offload
    host: frozenset[int]  # tensors not held in HBM (the memory model leaves them out)
    state_in: tuple[int, ...]  # program inputs on the host (the state at rest)
    to_device: tuple[tuple[int, float], ...]  # (tensor, its bytes per step host -> device)
    to_host: tuple[tuple[int, float], ...]  # (tensor, its bytes per step device -> host)
    host_update_params: tuple[int, ...]  # parameters the host's Adam updates
    staging_bytes: float  # the device's staging buffers (twice the largest streamed tensor, whole)


def tensor_classes(graph: Graph) -> dict[str, frozenset[int]]:
    """Tensor ids per class: ``optimizer`` and ``master`` (program inputs and the outputs
    aliased to them), ``gradients`` (backward values the update reads) and ``update`` (what
    the update equations make)."""
    aliased = dict(graph.aliases)
    optimizer = {
        t
        for t in graph.inputs
        if graph.tensors[t].kind == "opt_state"
        and graph.tensors[t].shape
        and graph.tensors[t].dtype.startswith("float")
    }
    master = {t for t in graph.inputs if graph.tensors[t].kind == "param" and _is_master(graph, t)}
    update_outs = {t for n in graph.nodes if n.phase == "update" for t in n.outputs}
    gradients = {
        t
        for n in graph.nodes
        if n.phase == "update"
        for t in n.inputs
        if graph.tensors[t].producer is not None
        and graph.nodes[graph.tensors[t].producer].phase == "backward"
    }

    def with_outputs(ids):
        return frozenset(ids) | {aliased[t] for t in ids if t in aliased}

    return {
        "optimizer": with_outputs(optimizer),
        "master": with_outputs(master),
        "gradients": frozenset(gradients),
        "update": frozenset(update_outs),
    }


def _is_master(graph: Graph, tid: int) -> bool:
    """An f32 parameter every forward/backward reader of which converts it to 16 bits."""
    t = graph.tensors[tid]
    if t.dtype != "float32":
        return False
    readers = [graph.nodes[c] for c in t.consumers if graph.nodes[c].phase != "update"]
    return bool(readers) and all(
        n.primitive == "convert_element_type" and graph.tensors[n.outputs[0]].dtype in _NARROW
        for n in readers
    )


def cast_once_params(graph: Graph) -> dict[int, int]:
    """Parameter id -> the node that converts it, for each f32 parameter (a program input)
    whose one forward/backward reader converts it to 16 bits: the weights the pipeline
    runtime casts once a step (:func:`autoshard.runtime.offload_stream.cast_once_params`,
    which applies the same rule to a stage's equations), so that convert runs once a step,
    not once per microbatch, and the 16-bit copy is held all step."""
    out: dict[int, int] = {}
    for tid in graph.inputs:
        t = graph.tensors[tid]
        if t.kind != "param" or t.dtype != "float32":
            continue
        readers = [c for c in set(t.consumers) if graph.nodes[c].phase != "update"]
        if len(readers) == 1 and _is_master(graph, tid):
            out[tid] = readers[0]
    return out


def offload_tensors(graph: Graph, offload: Offload, strict: bool = True) -> OffloadTensors:
    """The tensors ``offload`` places on the host and what moves each step; raises when the
    program has nothing of a class asked for (unless not ``strict``: a part of a program,
    such as one layer of a stage search, may have none)."""
    if offload.activations:
        if strict:
            raise ValueError(
                "saved activations are not offloaded on one mesh (their live ranges split in "
                "two, which the one-mesh memory model does not express, and the one-mesh step "
                "is one program after autodiff, with no forward/backward boundary to copy "
                "them across); the stage search prices them and the pipeline runtime places "
                "them: plan --pipeline, simulate --plan auto or run --pipeline"
            )
        offload = offload.state
    classes = tensor_classes(graph)
    inputs = set(graph.inputs)
    for c in offload.classes if strict else ():
        if not classes[c] & inputs and c != "gradients":
            why = {
                "optimizer": "its optimizer keeps no floating-point state (plain SGD?)",
                "master": "its parameters are read in their own dtype (no f32 master copy "
                "converted to 16 bits: train in bf16/fp16 to have one)",
            }[c]
            raise ValueError(f"cannot offload {c}: {why}; offload another class or none")
    host: set[int] = set()
    for c in offload.classes:
        host |= classes[c]
    if offload.host_update:
        host |= classes["update"]
    state_in = tuple(t for t in graph.inputs if t in host)
    nbytes = {t: float(graph.tensors[t].nbytes) for t in range(len(graph.tensors))}
    if offload.host_update:
        to_host = tuple((t, nbytes[t]) for t in sorted(classes["gradients"]))
        # the host updates every parameter; the updated weights come back in the dtype the
        # step reads them in (16 bits for master weights, their own for the rest)
        params = tuple(t for t in graph.inputs if graph.tensors[t].kind == "param")
        to_device = tuple(
            (t, narrow_copy_bytes(graph, t) if t in classes["master"] else nbytes[t])
            for t in params
        )
    else:
        to_device = tuple((t, nbytes[t]) for t in state_in)
        aliased = dict(graph.aliases)
        to_host = tuple((aliased[t], nbytes[aliased[t]]) for t in state_in if t in aliased)
        params = ()
    streamed = [b for _, b in to_device] + [b for _, b in to_host]
    return OffloadTensors(
        offload,
        frozenset(host),
        state_in,
        to_device,
        to_host,
        params,
        2.0 * max(streamed, default=0.0),
    )


def narrow_copy_bytes(graph: Graph, tid: int) -> float:
    """Bytes of the 16-bit copy the step converts parameter ``tid`` to (its own bytes when
    it reads it unconverted)."""
    t = graph.tensors[tid]
    outs = [
        graph.tensors[graph.nodes[c].outputs[0]]
        for c in t.consumers
        if graph.nodes[c].primitive == "convert_element_type"
    ]
    return float(outs[0].nbytes) if outs else float(t.nbytes)


def hidden_s(copy_s: float, compute_s: float, host) -> float:
    """Seconds of ``copy_s`` (copies made one after the other) hidden behind ``compute_s``
    of the step's compute: the preset's ``copy_overlap`` share of them, at most
    ``compute_s``."""
    return min(host.copy_overlap * copy_s, max(compute_s, 0.0))


@dataclass(frozen=True)
class OffloadCost:
    """What an offload placement costs one step of a plan, per device (bytes, seconds)."""

    offload: str  # the label: none, optimizer, optimizer,master, ...
    host_update: bool
    host_bytes_per_device: float  # the state held in host memory
    host_bytes_per_node: float  # the same, times the node's GPUs in use
    host_memory_bytes: float  # the node's RAM usable for it (HOST_USABLE_FRACTION)
    to_device_bytes: float  # per step
    to_host_bytes: float  # per step
    link_bandwidth: float  # bytes/s per GPU per direction
    transfer_s: float  # the copies in and out, one after the other
    overlapped_s: float  # of which hidden behind the backward pass (copy_overlap of it)
    host_update_s: float  # CPU Adam (host update only)
    exposed_s: float  # what the step pays: added to the device's step time
    staging_bytes: float  # device staging buffers: twice the largest streamed shard
    where: Mapping[str, str]  # class -> "host" / "device"

    @property
    def fits_host(self) -> bool:
        return self.host_bytes_per_node <= self.host_memory_bytes

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "where"}
        out["where"] = dict(self.where)
        out["fits_host"] = self.fits_host
        return out


def offload_cost(
    graph: Graph,
    tensors: OffloadTensors,
    spec_of: Mapping[int, ShardingSpec],
    mesh: Mesh,
    cluster,
    backward_s: float,
    gpus_per_node: int | None = None,
) -> OffloadCost:
    """The host bytes and exposed seconds of ``tensors`` (:func:`offload_tensors`) under a
    plan's specs (``spec_of``: tensor id -> spec, inputs and node outputs) on ``mesh``, on
    ``cluster`` (a :class:`~autoshard.hardware.clusters.Cluster` with a ``host`` section);
    ``backward_s``: the device's backward compute time, which transfers may hide behind;
    ``gpus_per_node``: the node's GPUs copying at once (default: the mesh's, at most a
    node's). Overlap as in the module docstring."""
    host = getattr(cluster, "host", None)
    if host is None:
        raise ValueError(
            f"cluster {getattr(cluster, 'name', cluster)} has no 'host' section (RAM, PCIe, "
            "CPU Adam): offload needs one; use a preset that has it (alpa-v100, dgx-a100, "
            "dgx-h100, dgx2h-v100) or add it to your preset file"
        )

    devices = math.prod(mesh.shape)

    def per_device(tid: int, nbytes: float) -> float:
        if tensors.offload.host_update:  # ZeRO-Offload: each device owns 1/N of the state
            return nbytes / devices
        spec = spec_of.get(tid)
        return nbytes * (spec.shard_fraction(mesh) if spec is not None else 1.0)

    on_host = sum(per_device(t, graph.tensors[t].nbytes) for t in tensors.state_in)
    if tensors.offload.host_update:  # the gradients land in host memory too
        on_host += sum(per_device(t, b) for t, b in tensors.to_host)
    if gpus_per_node is None:
        gpus_per_node = min(devices, cluster.devices_per_node)
    bandwidth = host.link_bandwidth(gpus_per_node)
    h2d = sum(per_device(t, b) for t, b in tensors.to_device)
    d2h = sum(per_device(t, b) for t, b in tensors.to_host)
    streamed = [per_device(t, b) for t, b in (*tensors.to_device, *tensors.to_host)]
    in_s = h2d / bandwidth + host.link.latency * len(tensors.to_device)
    out_s = d2h / bandwidth + host.link.latency * len(tensors.to_host)
    if tensors.offload.host_update:
        hidden = hidden_s(out_s, backward_s, host)
        params = sum(graph.tensors[t].size for t in tensors.host_update_params) / devices
        adam_s = params / (host.adam_params_per_s / gpus_per_node)
        transfer_s, exposed = out_s + in_s, (out_s - hidden) + adam_s + in_s
    else:
        transfer_s = in_s + out_s if tensors.state_in else 0.0
        hidden, adam_s = hidden_s(transfer_s, backward_s, host), 0.0
        exposed = transfer_s - hidden
    where = {c: ("host" if c in tensors.offload.classes else "device") for c in OFFLOAD_CLASSES}
    where["update"] = "host" if tensors.offload.host_update else "device"
    return OffloadCost(
        tensors.offload.label,
        tensors.offload.host_update,
        on_host,
        on_host * gpus_per_node,
        host.memory_bytes * HOST_USABLE_FRACTION,
        h2d,
        d2h,
        bandwidth,
        transfer_s,
        hidden,
        adam_s,
        exposed,
        2.0 * max(streamed, default=0.0),
        where,
    )
