"""The priced mesh: a logical mesh with the figures the planner prices it by (jax-free).

:class:`DeviceMesh` is a :class:`~autoshard.ir.spec.Mesh` with, per axis, the alpha-beta
figures of a collective along it and, per device, peak FLOP/s, memory, HBM bandwidth, an
optional GEMM timing, and the :class:`MemoryLayout` of the backend that compiles the plan
(read by the memory model, :mod:`autoshard.intra.memory.model`).

Every priced mesh is made here: :func:`uniform_mesh` and :func:`alpa_test_mesh` in
relative units (Alpa's intra-operator tests), :func:`relative_mesh` for any rank, and
from a cluster preset, :func:`to_device_mesh` (the one conversion: links, peaks, memory)
and :func:`preset_mesh` (a preset by name, file or :class:`Cluster`, with its device's
GEMM table).  Guarantees: every figure is a number >= 0 (finite for alpha and beta), one
alpha and one beta per mesh axis; a bad one raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autoshard.hardware.attention import AttentionTiming, load_attention_table
from autoshard.hardware.clusters import (
    Cluster,
    NodeLayout,
    cluster_mesh_costs,
    group_node_span,
    load_cluster,
)
from autoshard.hardware.gemm import GemmTable, GemmTiming
from autoshard.ir.spec import Axes, Mesh, cached_hash


@dataclass(frozen=True)
class MemoryLayout:
    """How a backend's compiler lays a step's buffers out, where XLA backends differ.

    The memory model (:mod:`autoshard.intra.memory.model`) reads these; every flag off is a
    plain model (narrow dots in their own dtype, reductions fused with their producer,
    each parameter updated as soon as its gradient is ready, a resharded input made when
    first read, transcendentals kept when shared).
    """

    # XLA:CPU up to jaxlib 0.10 computes bf16/f16 dots in f32: a narrow dot's result is an
    # f32 buffer (the convert down is fused into its readers). The memory model counts it
    # so. jaxlib 0.11's and 0.12's compute them in bf16: autoshard.api.xla_cpu_memory_layout
    # reads which from a compiled dot.
    narrow_dots_in_f32: bool = False
    # XLA:CPU runs reductions as library calls (XNNPACK) that read their operand from
    # memory, so whatever a reduction reads is a buffer (a LayerNorm's input, kept for its
    # backward); a GPU fuses the producer into the reduction. The memory model counts it so.
    reductions_read_memory: bool = False
    # XLA:CPU combines the gradient all-reduces into one at the end of the backward pass,
    # so every gradient is live until then (XLA on GPUs updates each parameter as soon as
    # its gradient is ready). The memory model counts it so.
    late_updates: bool = False
    # XLA:CPU's scheduler makes what depends on program inputs only (a weight's all-gather,
    # the labels' one-hot) at the start of the step, so such a resharded copy is live from
    # there to its last reader. The memory model counts it so.
    early_input_reshards: bool = False
    # XLA:GPU fuses a transcendental (softmax's exp) into every kernel that reads it and
    # recomputes it in the backward pass from what it is made of (the bf16 attention
    # scores), so no f32 exp(scores - max) is kept (measured on one H100,
    # docs/validation.md); XLA:CPU keeps it. The memory model counts it so.
    fused_transcendentals: bool = False
    # XLA:CPU runs every convolution in one layout (batch, spatial, feature; kernel
    # spatial, in, out): a conv whose operands or result are laid out otherwise (both
    # gradients of a conv are) reads a transposed copy of each and writes its result
    # through one. The memory model counts those copies at the conv.
    conv_layout_copies: bool = False
    # XLA:CPU's scheduler makes a backward conv's transposed copy of a forward value (a
    # weight gradient's activation) in the forward pass, as soon as the value exists, and
    # keeps it to the conv (wresnet-tiny, docs/truth.md). The memory model counts it so.
    early_conv_copies: bool = False
    # Likewise a forward value resharded for backward dots or convs only (a weight
    # gradient's activation, all-gathered) is resharded in the forward pass, right after
    # the value, and kept to them (gpt-tiny and moe-tiny, docs/truth.md).
    early_backward_operand_reshards: bool = False
    # ... and the value's own buffer is then freed after its last reader in its own layout
    # (a forward dot): the backward dots read the copy (gpt-tiny's fused ZeRO-3 step on
    # 4x2, autoshard/intra/memory/gathered_sources.py). The memory model counts it so.
    freed_gathered_sources: bool = False
    # XLA:CPU copies a split weight that a batched dot reads in a non-canonical layout
    # (the backward dots of MoE expert weights [E, h, f], contracting f) into a transposed
    # buffer of its own, made at the start of the step (measured on moe-tiny, docs/moe.md).
    batched_dot_weight_copies: bool = False
    # XLA:CPU's dot library (XNNPACK) reads an unbatched dot's lhs as [free, contracting]:
    # a lhs contracted on its leading dims (every weight gradient, x^T @ g) is copied into
    # a transposed buffer of its own (f32 for a narrow lhs) just before the dot (measured
    # on gpt-350m, docs/truth.md). The memory model counts it at the dot.
    dot_lhs_copies: bool = False
    # The fused attention operator is XLA's own body (XLA:CPU), which writes the float32
    # S x S scores, probabilities and their gradients as buffers while it runs; cuDNN's
    # flash attention (XLA:GPU) holds no S x S buffer. The memory model counts the
    # workspace at the operator (autoshard/intra/memory/attention_workspace.py).
    attention_scores_workspace: bool = False
    # cuDNN's flash attention takes 16-bit floats only, so on XLA:GPU an attention in
    # float32 runs the operator's XLA body (autoshard/models/attention.py), and XLA:GPU
    # keeps this many of its S x S float32 blocks a layer from the forward to the
    # backward: the scores and scores - lse (the exp is fused into every reader). 2 on 11
    # of the 14 float32 GPT / MoE modules of the H100 scale runs, 1 on the other 3 (XLA
    # fuses the subtraction into the backward's dS there; docs/truth_gpu.md). The memory
    # model counts them (autoshard/intra/memory/attention_workspace.py); 0: not counted.
    # (A GPU without cuDNN's flash attention, a V100, runs the XLA body in 16-bit floats
    # too: not counted, not measured.)
    wide_attention_held_blocks: float = 0.0
    # XLA:CPU's reduction fusions (YNNPACK) read a broadcast operand as a buffer, which
    # its scheduler makes in the forward pass and shares with the backward: a LayerNorm
    # keeps its rsqrt and scale broadcast to [B, S, h], and rsqrt * scale, from its
    # forward to its backward (autoshard/intra/memory/broadcast_buffers.py).
    materialized_broadcasts: bool = False
    # XLA:GPU's scheduler computes a parameter's optimizer update as soon as its gradient
    # is ready and all-gathers it to the parameter's layout right away, but adds it into
    # the donated parameter only after the backward pass, so every gathered update is live
    # from its gradient to the backward's end: gpt-39b (48 layers, 8x8 H100s, jax 0.11.2)
    # holds 190 of its 192, 19.19 GB per device, at XLA's peak (docs/truth.md). The memory
    # model counts it so (autoshard/intra/memory/reshard_copies.py, held_update_copy).
    held_update_gathers: bool = False
    # XLA:GPU's filter-gradient conv of an activation that a forward conv reads gathered
    # reads the forward's gathered copy, whatever layout the plan reads it in, so the
    # copy is held from the forward to that backward conv: wresnet-1b heuristic 2x4 (jax
    # 0.11.2, H100) holds 49 gathered activations, 17.4 GiB, to a convBackwardFilter at
    # XLA's peak (docs/truth_gpu.md). The memory model counts it so
    # (autoshard/intra/memory/reshard_copies.py, reused_gather_end).
    reused_conv_gathers: bool = False
    # cuDNN reads a conv's filter as [out, spatial..., in]: XLA:GPU copies each kernel
    # into that layout at its forward conv and reads the copy again in the conv's
    # backward-input conv (a kernel wider than 1x1, a strided conv) and in the update,
    # where the update reads the filter gradient whole in the kernel's layout (cuDNN's),
    # so the copy is held from the forward to them: wresnet-1b dp 2x4 (jax 0.11.2, H100)
    # holds all 53 kernels' copies, 3.71 GiB, at the end of its forward pass
    # (docs/truth_gpu.md). The memory model counts it so
    # (autoshard/intra/memory/filter_copies.py).
    cudnn_filter_copies: bool = False
    # XLA:CPU expands max pooling's backward (select-and-scatter) into per-dimension s32
    # iotas of the padded operand and a scatter into zeros, made at the start of the step,
    # and an index reduce-window run in the forward pass whose indices are held to the
    # backward (autoshard/intra/memory/pool_workspace.py). The memory model counts them.
    expanded_select_and_scatter: bool = False
    # XLA:CPU folds the transpose of a dot's result into the dot (the dot writes its result
    # transposed, its operands swapped) where the transpose is the dot's only reader: a
    # weight gradient, which JAX's transpose rule makes as dot_general(g, x) and then
    # transposes, is one buffer, not two (autoshard/intra/memory/model.py,
    # folded_transpose_operand). The memory model counts it so. XLA:GPU writes those
    # GEMMs transposed too (the committed H100 modules have no transpose), but its layout
    # leaves this off (not checked against a GPU peak); the compute pricing prices such a
    # transpose at 0 on every backend (intra/memory/layout_copies.py, folded_dot_transpose).
    folded_dot_transposes: bool = False


# Every flag off: the plain model, no backend's habits.
PLAIN_MEMORY = MemoryLayout()

# How XLA:CPU lays memory out: every flag but the GPU's (fused_transcendentals,
# held_update_gathers, wide_attention_held_blocks, reused_conv_gathers,
# cudnn_filter_copies) on (docs/truth.md); with jaxlib 0.11 and later narrow_dots_in_f32
# is off (autoshard.api.xla_cpu_memory_layout).
XLA_CPU_MEMORY = MemoryLayout(
    narrow_dots_in_f32=True,
    reductions_read_memory=True,
    late_updates=True,
    early_input_reshards=True,
    conv_layout_copies=True,
    early_conv_copies=True,
    early_backward_operand_reshards=True,
    freed_gathered_sources=True,
    batched_dot_weight_copies=True,
    dot_lhs_copies=True,
    attention_scores_workspace=True,
    materialized_broadcasts=True,
    expanded_select_and_scatter=True,
    folded_dot_transposes=True,
)

# How XLA:GPU lays memory out (docs/validation.md, the single-GPU check).
XLA_GPU_MEMORY = MemoryLayout(
    fused_transcendentals=True,
    held_update_gathers=True,
    wide_attention_held_blocks=2.0,
    reused_conv_gathers=True,
    cudnn_filter_copies=True,
)


def check_nonnegative(name: str, value: float, *, allow_inf: bool, positive: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a real number >= 0 (> 0 with
    ``positive``), finite unless ``allow_inf``."""
    ok = isinstance(value, numbers.Real) and not math.isnan(value)
    ok = ok and (value > 0 if positive else value >= 0) and (allow_inf or math.isfinite(value))
    if not ok:
        need = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{name} must be a number {need}{'' if allow_inf else ' and finite'}, got {value!r}"
        )


@cached_hash
@dataclass(frozen=True)
class DeviceMesh:
    """A logical mesh plus the figures the cost model needs, per axis and per device.

    ``alpha[i]`` is the latency (seconds) and ``beta[i]`` the inverse bandwidth
    (seconds per byte) of a collective along mesh axis ``i``; ``peak_flops`` (FLOP/s),
    ``memory_bytes`` and ``hbm_bandwidth`` (bytes/s) are per device. The defaults
    (``inf``) make compute and memory-bound time free and memory unbounded, as in
    Alpa's intra-operator tests, which cost communication only.

    ``gemm`` (a :class:`~autoshard.hardware.gemm.GemmTiming`, or None) times every
    ``dot_general`` shard from a GEMM efficiency table instead of at ``peak_flops``; a
    finite ``hbm_bandwidth`` charges the other operations the bytes they stream (see
    :func:`autoshard.intra.rules.strategies.strategy_seconds`). ``memory_layout``: how the
    backend lays buffers out (:class:`MemoryLayout`; default all flags off).
    ``attention`` (an :class:`~autoshard.hardware.attention.AttentionTiming`, or None):
    the fused attention kernel's timing on this device (see
    :func:`autoshard.intra.rules.strategies.strategy_seconds`).
    ``nodes`` (a :class:`~autoshard.hardware.clusters.NodeLayout`, or None): how the
    devices sit in nodes, so that collectives across nodes may be priced node-aware
    (:meth:`node_span`); None prices every collective as one flat ring.
    """

    mesh: Mesh
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    peak_flops: float = math.inf
    memory_bytes: float = math.inf
    hbm_bandwidth: float = math.inf
    gemm: GemmTiming | None = None
    memory_layout: MemoryLayout = field(default_factory=MemoryLayout)
    nodes: NodeLayout | None = None
    # times each fused attention shard from the device's attention table
    # (autoshard.hardware.attention); None on a priced mesh (``gemm`` set) means the device
    # has no fused kernel, and the operator is priced as XLA's unfused attention
    attention: AttentionTiming | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", tuple(self.alpha))
        object.__setattr__(self, "beta", tuple(self.beta))
        rank = len(self.mesh.shape)
        for name in ("alpha", "beta"):
            values = getattr(self, name)
            if len(values) != rank:
                raise ValueError(
                    f"{name} has {len(values)} entries {values} but mesh {self.mesh} has "
                    f"{rank} axes {self.mesh.axis_names}; give one value per axis"
                )
            for axis, v in zip(self.mesh.axis_names, values, strict=True):
                check_nonnegative(f"{name} of mesh axis {axis!r}", v, allow_inf=False)
        check_nonnegative("peak_flops", self.peak_flops, allow_inf=True, positive=True)
        check_nonnegative("memory_bytes", self.memory_bytes, allow_inf=True)
        check_nonnegative("hbm_bandwidth", self.hbm_bandwidth, allow_inf=True, positive=True)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.mesh.axis_names

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    @property
    def num_devices(self) -> int:
        return self.mesh.num_devices

    def group(self, axes: str | Sequence[str]) -> Axes:
        """``axes`` as a collective group: a tuple of distinct axes (or sub-axes,
        :func:`~autoshard.ir.spec.sub_axis`) of this mesh."""
        key = axes if isinstance(axes, (str, tuple)) else tuple(axes)
        memo = self.__dict__.setdefault("_groups_", {})  # not a field, not pickled
        if key in memo:
            return memo[key]
        group = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in group:
            self.mesh.axis_size(a)  # raises ValueError naming the axis and the mesh's axes
        if len(set(group)) != len(group):
            raise ValueError(f"collective group {group} repeats a mesh axis")
        memo[key] = group
        return group

    def link(self, axes: str | Sequence[str]) -> tuple[float, float]:
        """(alpha, beta) of a ring over ``axes``: the slowest link among axes of size > 1."""
        group = self.group(axes)
        memo = self.__dict__.setdefault("_links_", {})  # not a field, not pickled
        if group not in memo:
            idx = [self.mesh.parent_index(a) for a in group if self.mesh.size(a) > 1]
            memo[group] = (
                (max(self.alpha[i] for i in idx), max(self.beta[i] for i in idx))
                if idx
                else (0.0, 0.0)
            )
        return memo[group]

    def node_span(self, axes: str | Sequence[str]) -> tuple[int, int] | None:
        """``(devices per node, nodes)`` of every group over ``axes`` when the mesh knows its
        nodes and those groups span several nodes evenly with more than one device in each
        (where a two-level collective can beat the flat ring); else None."""
        if self.nodes is None:
            return None
        memo = self.__dict__.setdefault("_node_spans", {})  # not a field: eq/hash ignore it
        if axes not in memo:
            if any(":(" in a for a in self.group(axes)):  # a sub-axis: priced as a flat ring
                memo[axes] = None
                return None
            idx = tuple(self.mesh.index(a) for a in self.group(axes) if self.mesh.size(a) > 1)
            span = group_node_span(self.shape, idx, self.nodes.devices_per_node) if idx else None
            # one device per node is the flat ring over the network: nothing to gain
            memo[axes] = span if span is not None and span[1] > 1 and span[0] > 1 else None
        return memo[axes]


def uniform_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    alpha: float | Sequence[float],
    beta: float | Sequence[float],
    peak_flops: float = math.inf,
    memory_bytes: float = math.inf,
    hbm_bandwidth: float = math.inf,
    memory_layout: MemoryLayout = PLAIN_MEMORY,
) -> DeviceMesh:
    """A :class:`DeviceMesh`; a scalar ``alpha`` or ``beta`` applies to every axis."""
    rank = len(shape)
    alphas = (alpha,) * rank if isinstance(alpha, int | float) else tuple(alpha)
    betas = (beta,) * rank if isinstance(beta, int | float) else tuple(beta)
    return DeviceMesh(
        Mesh(tuple(axis_names), tuple(shape)),
        alphas,
        betas,
        peak_flops,
        memory_bytes,
        hbm_bandwidth,
        memory_layout=memory_layout,
    )


def alpa_test_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str] | None = None,
    memory_layout: MemoryLayout = PLAIN_MEMORY,
) -> DeviceMesh:
    """The logical mesh of Alpa's intra-operator tests: alpha = (1, 1), beta = (1, 0.1).

    Axis 1 is the fast (intra-node) axis. For a 1-D mesh we use alpha = 1, beta = 1:
    Alpa's 1-D cases are meshes of shape (1, n) whose only real axis is the fast one, but
    a lone axis has nothing to be fast relative to, and unit costs keep the arithmetic of
    tests obvious. Compute, HBM time and memory are left free/unbounded (see DeviceMesh).
    ``memory_layout``: e.g. ``XLA_CPU_MEMORY`` to predict memory as XLA:CPU lays it out.
    """
    shape = tuple(shape)
    if len(shape) not in (1, 2):
        raise ValueError(
            f"alpa_test_mesh takes a 1-D or 2-D shape, got {shape}; use uniform_mesh for others"
        )
    names = tuple(axis_names) if axis_names is not None else ("x", "y")[: len(shape)]
    if len(shape) == 1:
        return uniform_mesh(shape, names, (1.0,), (1.0,), memory_layout=memory_layout)
    return uniform_mesh(shape, names, (1.0, 1.0), (1.0, 0.1), memory_layout=memory_layout)


def relative_mesh(
    shape: Sequence[int], axis_names: Sequence[str], memory_layout: MemoryLayout = PLAIN_MEMORY
) -> DeviceMesh:
    """Alpa's test costs on a mesh of any rank, in relative units: alpha 1 on every axis,
    beta 1 on every axis but the last, fast one of a multi-axis mesh (0.1)."""
    shape = tuple(shape)
    betas = tuple(0.1 if i == len(shape) - 1 and len(shape) > 1 else 1.0 for i in range(len(shape)))
    return uniform_mesh(shape, axis_names, 1.0, betas, memory_layout=memory_layout)


def to_device_mesh(
    cluster: Cluster,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    dtype: str | None = None,
    gemm_table: GemmTable | None = None,
) -> DeviceMesh:
    """A :class:`DeviceMesh` for ``mesh_shape`` on ``cluster``: its links per axis
    (:func:`~autoshard.hardware.clusters.cluster_mesh_costs`), its device's peak, memory
    and HBM bandwidth, and XLA:GPU's memory layout (the presets are GPU clusters).

    ``dtype`` picks the peak FLOP/s (None: the device's default 16-bit dtype, bf16 on A100
    and H100, fp16 on V100, which has no bf16 tensor cores). ``gemm_table`` (a loaded
    :class:`~autoshard.hardware.gemm.GemmTable`) makes the mesh time GEMMs with it at the
    device's peaks (``DeviceMesh.gemm``); without it GEMMs are priced at peak. With a GEMM
    table, a device whose preset names an attention table (``device.attention_table``:
    cuDNN's flash attention, Ampere and later) times fused attention with it
    (``DeviceMesh.attention``); one that names none is priced as XLA's unfused attention.
    """
    alpha, beta = cluster_mesh_costs(cluster, mesh_shape, axis_names)
    return DeviceMesh(
        mesh=Mesh(tuple(axis_names), tuple(int(s) for s in mesh_shape)),
        alpha=alpha,
        beta=beta,
        peak_flops=cluster.device.peak_flops_for(dtype),
        memory_bytes=cluster.device.hbm_bytes,
        hbm_bandwidth=cluster.device.hbm_bandwidth,
        gemm=None
        if gemm_table is None
        else GemmTiming.for_device(
            gemm_table, dtype or cluster.device.default_dtype, cluster.device.peak_flops
        ),
        memory_layout=XLA_GPU_MEMORY,
        nodes=NodeLayout.of(cluster),
        attention=None
        if gemm_table is None or cluster.device.attention_table is None
        else AttentionTiming.for_device(
            load_attention_table(cluster.device.attention_table), cluster.device.peak_flops
        ),
    )


def preset_mesh(
    cluster: Cluster | str | Path,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    dtype: str | None = None,
) -> DeviceMesh:
    """:func:`to_device_mesh` timing GEMMs with the device's own GEMM table, if its preset
    names one. ``cluster``: a :class:`Cluster`, or a preset name or file, loaded for the
    mesh's number of GPUs."""
    mesh_shape, axis_names = tuple(int(s) for s in mesh_shape), tuple(axis_names)
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, num_gpus=math.prod(mesh_shape))
    table = cluster.device.gemm_table
    return to_device_mesh(
        cluster,
        mesh_shape,
        axis_names,
        dtype,
        gemm_table=None if table is None else GemmTable.load(table),
    )


__all__ = [
    "DeviceMesh",
    "MemoryLayout",
    "XLA_CPU_MEMORY",
    "XLA_GPU_MEMORY",
    "alpa_test_mesh",
    "preset_mesh",
    "relative_mesh",
    "to_device_mesh",
    "uniform_mesh",
]


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> (2, 4); ``"8"`` -> (8,). Clear error for anything else."""
    try:
        shape = tuple(int(p) for p in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh {text!r} is not a shape like 8, 2x4 or 1x8") from None
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"mesh {text!r} must have positive sizes, like 8, 2x4 or 1x8")
    return shape
