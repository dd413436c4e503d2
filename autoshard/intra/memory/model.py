"""The memory model: which buffers a compiled step holds, when, and how large (jax-free).

One model of XLA's buffers, used alike by the sharding ILP's memory rows
(:func:`memory_rows`, for :mod:`autoshard.intra.problem.build`) and by the plan's prediction
(:func:`predicted_peak_bytes`), so that a plan's predicted peak is the peak its memory
rows constrain.  It takes an op :class:`~autoshard.ir.graph.Graph` and a priced mesh
(:class:`~autoshard.hardware.mesh.DeviceMesh`, whose
:class:`~autoshard.hardware.mesh.MemoryLayout` says how the backend lays memory out):

* fusion -- which values are materialised (:func:`materialized_tensors`);
* schedule -- each buffer's live interval in program order (:func:`live_intervals`);
* sizes -- a buffer's bytes, f32 copies of narrow dot operands (:func:`tensor_buffers`),
  one buffer per value and resharded layout
  (:mod:`autoshard.intra.memory.reshard_copies`), and XLA:CPU's transposed copies for
  convs and dots (:mod:`autoshard.intra.memory.transposed_copies`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.ilp import CopyBuffer
from autoshard.intra.memory.attention_workspace import held_buffers, workspace_groups
from autoshard.intra.memory.broadcast_buffers import held_broadcast_buffers, held_broadcast_groups
from autoshard.intra.memory.common_values import common_values, merged_consumers
from autoshard.intra.memory.filter_copies import filter_copy_groups, filter_copy_intervals
from autoshard.intra.memory.gathered_sources import gathered_tails, own_buffer_end, tail_groups
from autoshard.intra.memory.intervals import (
    buffer_readers,
    graph_update_zeros,
    live_intervals,
    mesh_intervals,
    program_positions,
)
from autoshard.intra.memory.layout_copies import (
    NARROW_FLOATS,
    conv_copy_reads,
    copied_kernel_values,
)
from autoshard.intra.memory.materialized import (  # noqa: F401 - re-exported: the model's fusion part
    CONV_AND_WINDOW,
    EXPENSIVE,
    FREE_VIEWS,
    MATERIALIZING,
    UNFUSED_CONSUMERS,
    copied_lhs_sources,
    data_free_tensors,
    materialized_tensors,
)
from autoshard.intra.memory.pool_workspace import (
    pool_buffer_intervals,
    pool_groups,
)
from autoshard.intra.memory.reshard_copies import copy_groups, reshard_buffers
from autoshard.intra.memory.transposed_copies import (
    conv_copy_buffers,
    conv_copy_groups,
    conv_copy_intervals,
    dot_lhs_copy_groups,
    dot_lhs_copy_intervals,
    transposed_weight_groups,
    transposed_weight_intervals,
)
from autoshard.intra.memory.update_zeros import (
    foldable_zeros,
    zeros_bytes,
    zeros_groups,
)
from autoshard.intra.rules.strategies import Strategy
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec


def streamed_tensors(graph: Graph, mesh: DeviceMesh) -> set[int]:
    """The buffers memory-bound ops are charged for streaming: :func:`materialized_tensors`
    under XLA:CPU's fusion model on every backend (with the mesh's
    ``reductions_read_memory``): on one H100 the attention's softmax kernels took 18.5 ms a
    step, where the values XLA:GPU keeps (``fused_transcendentals``) would price 7.7 ms and
    these 27.0 ms (docs/validation.md)."""
    return materialized_tensors(graph, mesh.memory_layout.reductions_read_memory)


def buffer_bytes(graph: Graph, tid: int, mesh: DeviceMesh) -> int:
    """Bytes of tensor ``tid``'s whole (unsharded) buffer on ``mesh``'s devices: its own
    size, except a bf16/f16 dot result on a device that computes narrow dots in f32
    (XLA:CPU, ``narrow_dots_in_f32``), whose buffer is f32."""
    t = graph.tensors[tid]
    if (
        mesh.memory_layout.narrow_dots_in_f32
        and t.dtype in NARROW_FLOATS
        and t.producer is not None
        and graph.nodes[t.producer].primitive == "dot_general"
    ):
        return 2 * t.nbytes
    return t.nbytes


def widened_dot_operands(graph: Graph, mesh: DeviceMesh) -> dict[int, tuple[int, int]]:
    """bf16/f16 tensors that dots read, on a device that computes narrow dots in f32
    (``narrow_dots_in_f32``) -> the (first, last) program position of their f32 copy.

    XLA:CPU converts each narrow dot operand to an f32 buffer of its own and shares the
    copy between every dot that reads the same value (a weight's copy serves its forward
    and backward dots, so it lives across the step): in the compiled gpt-350m bf16 dp
    step, 45 of the 39 dot fusions' operands are such converts, among them an f32 copy
    of the 51200 x 1024 embedding read by the logits dot and its gradient (made straight
    from the f32 parameter: see :func:`_replaced_by_copies`)."""
    if not mesh.memory_layout.narrow_dots_in_f32:
        return {}
    out = {}
    for t in graph.tensors:
        if t.dtype not in NARROW_FLOATS or not t.shape or t.kind in ("literal", "const"):
            continue
        dots = [c for c in t.consumers if graph.nodes[c].primitive == "dot_general"]
        if dots:
            out[t.id] = (min(dots), max(dots))
    return out


def _replaced_by_copies(graph: Graph, widened) -> set[int]:
    """Narrow tensors that only dots read, made by anything but a dot: XLA fuses their
    producer into the convert that makes the f32 copy (an f32 weight converted to bf16
    for its dots is one f32 buffer, not a bf16 one and an f32 one)."""
    boundary = set(graph.inputs) | set(graph.outputs)
    out = set()
    for tid in widened:
        t = graph.tensors[tid]
        if tid in boundary or t.producer is None:
            continue
        if graph.nodes[t.producer].primitive == "dot_general":
            continue
        if all(graph.nodes[c].primitive == "dot_general" for c in t.consumers):
            out.add(tid)
    return out


def value_buffers(
    graph: Graph, mesh: DeviceMesh, host: frozenset[int] = frozenset()
) -> list[tuple[int, int, int, int]]:
    """(tensor, first, last, whole bytes) of every buffer that holds a value as it is made:
    the live buffers of :func:`mesh_intervals` (but those an f32 copy replaces) and the f32
    copies of :func:`widened_dot_operands`.  ``host``: tensors offloaded to host memory
    (:mod:`autoshard.intra.offload.placement`), left out."""
    widened = widened_dot_operands(graph, mesh)
    # a reversed kernel fused into its transposed conv copy has no buffer of its own
    replaced = _replaced_by_copies(graph, widened) | copied_kernel_values(graph, mesh)
    out = [
        (tid, first, last, buffer_bytes(graph, tid, mesh))
        for tid, (first, last) in mesh_intervals(graph, mesh).items()
        if tid not in replaced
    ]
    out += [
        (tid, first, last, 2 * graph.tensors[tid].nbytes) for tid, (first, last) in widened.items()
    ]
    return [b for b in out if b[0] not in host] if host else out


def tensor_buffers(
    graph: Graph, mesh: DeviceMesh, host: frozenset[int] = frozenset()
) -> list[tuple[int, int, int, int]]:
    """(tensor, first, last, whole bytes) of every buffer that holds a value in its own
    layout: :func:`value_buffers`, then the transposed copies of
    :func:`transposed_conv_values` (one where XLA shares one: :func:`conv_copy_buffers`).
    The ILP's memory rows and :func:`predicted_peak_bytes` both count these.  ``host``:
    tensors offloaded to host memory (:mod:`autoshard.intra.offload.placement`), left
    out."""
    copies = conv_copy_buffers(graph, mesh, host)
    return value_buffers(graph, mesh, host) + [c[:4] for c in copies]


def predicted_live_bytes(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]] | None = None,
    host: frozenset[int] = frozenset(),
) -> tuple[float, ...]:
    """Per-device bytes of live buffers at each program position (index ``p + 1`` for
    position ``p``, from -1, the program inputs alone, to the end): :func:`live_intervals`,
    the f32 copies of :func:`widened_dot_operands`, and, given the plan's
    ``operand_specs`` (node -> operand slot -> the spec it is resharded to), one buffer
    per value and resharded layout, from its first reader in that layout to its last
    (XLA gathers a weight once for its forward and backward dots and keeps the gathered
    copy; a reduced partial sum is a buffer of its own). ``host``: offloaded tensors, not
    counted (:func:`tensor_buffers`)."""
    n = len(graph.nodes)
    delta = [0.0] * (n + 3)
    operand_specs = operand_specs or {}
    own = value_buffers(graph, mesh, host)
    pos = program_positions(graph, mesh.memory_layout.late_updates)
    # a forward value gathered for its backward dots is freed after its own-layout readers
    tails = _gathered_tails(graph, mesh, own, pos)
    buffers = [
        (
            first,
            own_buffer_end(tails[tid], spec_of[tid], operand_specs) if tid in tails else last,
            nbytes * spec_of[tid].shard_fraction(mesh.mesh),
        )
        for tid, first, last, nbytes in own
        if tid in spec_of
    ]
    buffers += conv_copy_intervals(graph, spec_of, mesh, operand_specs, host)
    # a conv that reads a transposed copy made before it (conv_copy_reads) reads neither the
    # value nor its resharded copy: that copy is read where the transposed one is made
    read_at = conv_copy_reads(graph, mesh)
    buffers += reshard_buffers(
        graph, operand_specs, spec_of, mesh, pos, _union_intervals(own), read_at
    )
    # transposed weight copies: made at the start, live to their last reader
    buffers += transposed_weight_intervals(graph, spec_of, mesh, operand_specs, pos)
    buffers += [  # zeros an add would absorb, but for a collective in between
        (0, max(0, pos[z.update] - 1), zeros_bytes(graph, z, spec_of[result], mesh))
        for z in foldable_zeros(graph_update_zeros(graph), mesh)
        for result in graph.nodes[z.update].outputs
        if result in spec_of and operand_specs.get(z.add, {}).get(z.slot) is not None
    ]
    # transposed dot lhs: made from the lhs as the dot reads it, at the dot
    buffers += dot_lhs_copy_intervals(graph, spec_of, mesh, operand_specs, pos)
    # kernels copied into cuDNN's filter layout, held to the backward (filter_copies)
    buffers += filter_copy_intervals(graph, spec_of, mesh, operand_specs, pos, host)
    # a fused attention's S x S temporaries where XLA's body runs it (attention_workspace)
    buffers += held_buffers(graph, spec_of, mesh, pos)
    # broadcasts XLA:CPU keeps from the forward pass to the backward (broadcast_buffers)
    buffers += held_broadcast_buffers(graph, spec_of, mesh, pos, {b[0] for b in own})
    # max pooling's backward as XLA:CPU expands it (pool_workspace)
    buffers += pool_buffer_intervals(graph, spec_of, mesh, pos)
    for first, last, size in buffers:
        delta[first + 1] += size
        delta[min(last, n) + 2] -= size
    return tuple(itertools.accumulate(delta))


def _gathered_tails(graph: Graph, mesh: DeviceMesh, own, pos) -> dict:
    """:func:`~autoshard.intra.memory.gathered_sources.gathered_tails` of the buffers ``own``
    (:func:`value_buffers`: a transposed conv copy beside a value is a buffer of its own,
    which its convs read instead), the readers of each as :func:`live_intervals` finds
    them."""
    if not mesh.memory_layout.freed_gathered_sources:
        return {}
    keep = {b[0] for b in own}
    consumers = merged_consumers(graph, common_values(graph))
    return gathered_tails(
        graph, mesh, own, pos, lambda tid: buffer_readers(graph, tid, keep, consumers)
    )


def predicted_peak_bytes(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]] | None = None,
    host: frozenset[int] = frozenset(),
) -> float:
    """Peak per-device bytes of live buffers over the program: the most of
    :func:`predicted_live_bytes` (``host``: offloaded tensors, not counted)."""
    return max(0.0, *predicted_live_bytes(graph, spec_of, mesh, operand_specs, host))


# ----------------------------------------------------------------------------- ILP rows


@dataclass(frozen=True)
class MemoryRows:
    """What the sharding ILP's memory rows are made of (the memory fields of
    :class:`~autoshard.intra.ilp.ShardingProblem`)."""

    node_memory: tuple[tuple[float, ...], ...]  # ILP node -> bytes per device per strategy
    live_sets: tuple[tuple[int, ...], ...]  # ILP nodes live where a buffer may be born
    copies: tuple[CopyBuffer, ...]  # the resharded copies


def memory_rows(
    graph: Graph,
    strategies: Sequence[Sequence[Strategy]],
    producer: Mapping[int, tuple[int, int]],
    n_in: int,
    mesh: DeviceMesh,
    operands: Sequence,
    host: frozenset[int] = frozenset(),
) -> MemoryRows:
    """Per-strategy bytes of each ILP node's live buffers, the live sets at every position
    where a buffer may be born, and the resharded copies as :class:`CopyBuffer` -- the
    same model as :func:`predicted_peak_bytes`.  ``strategies``: ILP node -> its
    strategies (inputs first); ``producer``: tensor -> (ILP node, output index);
    ``operands``: the problem's operand edges (:class:`autoshard.intra.problem.build.Operand`);
    ``host``: offloaded tensors, not counted."""
    # a tensor's buffers (itself, its f32 copy) count together, over the union of their
    # intervals (the tensor's holds the copy's unless the tensor is fused away); its
    # transposed conv copies are copy groups of their own (conv_copy_groups)
    own = value_buffers(graph, mesh, host)
    intervals = _union_intervals(own)
    sizes: dict[int, float] = {}
    for tid, _, _, nbytes in own:
        sizes[tid] = sizes.get(tid, 0.0) + nbytes

    node_memory = []
    for i, strats in enumerate(strategies):
        tids = (graph.inputs[i],) if i < n_in else graph.nodes[i - n_in].outputs
        row = []
        for s in strats:
            row.append(
                float(
                    sum(
                        sizes[t] * spec.shard_fraction(mesh.mesh)
                        for t, spec in zip(tids, s.output_specs)
                        if t in intervals
                    )
                )
            )
        node_memory.append(tuple(row))
    owner = {}
    for tid in intervals:
        node, _ = producer[tid]
        owner[tid] = node
    pos = program_positions(graph, mesh.memory_layout.late_updates)
    read_at = conv_copy_reads(graph, mesh)  # as predicted_live_bytes
    groups = copy_groups(graph, strategies, producer, n_in, mesh, operands, pos, intervals, read_at)
    groups += conv_copy_groups(graph, strategies, producer, n_in, mesh, pos, host)
    groups += filter_copy_groups(graph, strategies, producer, n_in, mesh, pos, host)
    # an own buffer past its last fixed reader lives while a backward dot reads it as it is
    tails = _gathered_tails(graph, mesh, own, pos) if operands else {}
    groups += tail_groups(graph, tails, strategies, producer, n_in, mesh)
    if operands:  # copies are listed when asked for, the transposed weights' with the rest
        groups += transposed_weight_groups(graph, strategies, producer, n_in, mesh, pos)
        groups += dot_lhs_copy_groups(graph, strategies, n_in, mesh, pos)
        zeros = foldable_zeros(graph_update_zeros(graph), mesh)
        groups += zeros_groups(graph, zeros, strategies, producer, n_in, mesh, pos)
    groups += workspace_groups(graph, strategies, n_in, mesh, pos)
    groups += held_broadcast_groups(graph, strategies, n_in, mesh, pos, set(intervals))
    groups += pool_groups(graph, strategies, n_in, mesh, pos)
    # one sweep over program order: the live set at each position where a buffer is born
    # (a copy is born at one of its readers, or at the start)
    intervals = {t: (a, tails[t].fixed if t in tails else b) for t, (a, b) in intervals.items()}
    born: dict[int, list[int]] = {}
    for t, (first, _) in intervals.items():
        born.setdefault(first, []).append(t)
    checkpoints = set(born)
    for g in groups:
        checkpoints.update([r[0] for r in g.readers] if g.start is None else [g.start])
    by_end = sorted(intervals, key=lambda t: intervals[t][1])
    active: dict[int, int] = {}  # ILP node -> number of its live buffers
    live_sets, at, done = [], [], 0
    for c in sorted(checkpoints):
        for t in born.get(c, ()):
            active[owner[t]] = active.get(owner[t], 0) + 1
        while done < len(by_end) and intervals[by_end[done]][1] < c:
            t = by_end[done]
            done += 1
            if intervals[t][0] <= c:
                active[owner[t]] -= 1
                if not active[owner[t]]:
                    del active[owner[t]]
        if c >= 0:
            live_sets.append(tuple(sorted(active)))
            at.append(c)
    copies = []
    for g in groups:
        where = [r[0] for r in g.readers]
        lo = bisect.bisect_left(at, where[0] if g.start is None else g.start)
        hi = bisect.bisect_right(at, where[-1] if g.end is None else g.end)
        windows = []
        for i in range(lo, hi):
            # made at its start: no reader needed before; live to a fixed end: any reader
            b = 0 if g.end is not None else bisect.bisect_left(where, at[i])
            early = g.start is not None and g.early_unless is None
            a = -1 if early else bisect.bisect_right(where, at[i]) - 1
            windows.append((i, a, b))
        copies.append(
            CopyBuffer(
                g.bytes,
                g.source,
                g.source_strategies,
                tuple(r[1:] for r in g.readers),
                windows,
                g.early_unless,
            )
        )
    return MemoryRows(tuple(node_memory), tuple(live_sets), tuple(copies))


def _union_intervals(buffers) -> dict[int, tuple[int, int]]:
    """Tensor -> the union of its buffers' intervals (itself, its f32 copy)."""
    out: dict[int, tuple[int, int]] = {}
    for tid, first, last, _ in buffers:
        a, b = out.get(tid, (first, last))
        out[tid] = (min(a, first), max(b, last))
    return out


__all__ = [
    "MemoryRows",
    "buffer_bytes",
    "live_intervals",
    "materialized_tensors",
    "memory_rows",
    "mesh_intervals",
    "graph_update_zeros",
    "predicted_live_bytes",
    "predicted_peak_bytes",
    "program_positions",
    "streamed_tensors",
    "tensor_buffers",
    "value_buffers",
    "widened_dot_operands",
]
