"""Broadcasts XLA:CPU keeps as buffers from the forward pass to the backward (jax-free).

Part of the memory model (:mod:`autoshard.intra.memory.model`), on where the backend's
:class:`~autoshard.hardware.mesh.MemoryLayout` says ``materialized_broadcasts``.

XLA:CPU runs a reduction, and the elementwise ops fused into it, as a library fusion
(YNNPACK, ``ynn_fusion``) that reads each operand as a buffer of the fusion's full shape:
an operand the graph broadcasts implicitly (a ``[B, S, 1]`` statistic or a ``[1, 1, h]``
parameter multiplying a ``[B, S, h]`` value) is broadcast into a buffer of its own
first.  XLA makes that broadcast as soon as its operand exists and shares it (CSE)
between the forward pass and the backward, so a broadcast that a backward reduction
reads lives from the forward pass to it.  A LayerNorm's backward reduces
``dy * xhat * rsqrt`` and ``dy * xhat * scale``: two broadcasts, and the forward's
``rsqrt * scale`` (a value made of broadcasts only, read again in the backward) is kept
rather than recomputed -- three ``[B, S, h]`` float32 buffers a LayerNorm, from its
forward to its backward (``bitcast_broadcast_fusion``, ``wrapped_broadcast``,
``broadcast_multiply_fusion`` at XLA's live peak of gpt-350m bf16, megatron on 8 devices,
2 blocks: 15 x 32 MiB, fused and unfused program alike; ``benchmarks/studies/live_peak_values.py``).

Each buffer is laid out and sized like the result of the op it is named after
(``sized_by``): the backward op that reads the broadcast, or the forward value kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.materialized import FREE_VIEWS, data_free_tensors
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph
from autoshard.ir.primitives import ALL_REDUCTIONS


@dataclass(frozen=True)
class HeldBroadcast:
    """A buffer from node ``first``'s position to node ``last``'s, of the size and layout
    of node ``sized_by``'s (first) result."""

    sized_by: int
    first: int
    last: int


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _root(graph: Graph, tid: int) -> int:
    """``tid`` past the free views (reshape, squeeze) it is made by."""
    t = graph.tensors[tid]
    while t.producer is not None and graph.nodes[t.producer].primitive in FREE_VIEWS:
        t = graph.tensors[graph.nodes[t.producer].inputs[0]]
    return t.id


def _normalizer(graph: Graph, tid: int) -> bool:
    """A normalisation's statistic (an ``rsqrt``: LayerNorm, RMSNorm) or a parameter (its
    scale): the broadcasts measured kept.  Others are not: the softmax's backward on the
    unfused program broadcasts its forward sums into the ``[B, H, S, S]`` gradient inside
    one reduce fusion (gpt-350m, megatron on 8 devices), and counting those over-predicted
    the batch-split plans by 4-7%."""
    t = graph.tensors[tid]
    if t.producer is None:
        return t.kind == "param"
    return graph.nodes[t.producer].primitive == "rsqrt"


def _reaches_reduction(graph: Graph, node) -> bool:
    """Whether a reduction reads ``node``'s result, directly or through elementwise ops
    of the same phase (fused with it into the reduction's fusion)."""
    stack, seen = [node.index], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for t in graph.nodes[i].outputs:
            for c in graph.tensors[t].consumers:
                reader = graph.nodes[c]
                if reader.phase != node.phase:
                    continue
                if reader.primitive in ALL_REDUCTIONS:
                    return True
                if reader.elementwise:
                    stack.append(c)
    return False


def held_broadcasts(graph: Graph, mesh: DeviceMesh, kept: set[int]) -> list[HeldBroadcast]:
    """The broadcasts XLA:CPU keeps from the forward pass to a backward reduction, and the
    forward values made of broadcasts only that the backward reads (none unless ``mesh``'s
    layout has ``materialized_broadcasts``).  ``kept``: the tensors that have a buffer of
    their own already (:func:`~autoshard.intra.memory.model.mesh_intervals`), not counted again."""
    if not mesh.memory_layout.materialized_broadcasts:
        return []
    data_free = data_free_tensors(graph)  # folded or made inside each reader's fusion
    found: dict[tuple, HeldBroadcast] = {}
    for node in graph.nodes:
        if not node.elementwise or len(node.outputs) != 1:
            continue
        out = graph.tensors[node.outputs[0]]
        if out.id in data_free:
            continue
        size = _numel(out.shape)
        small = [
            t
            for t in node.inputs
            if graph.tensors[t].shape and _numel(graph.tensors[t].shape) < size
        ]
        if not small:
            continue
        if node.phase == "forward":
            # made of broadcasts only and read in the backward: kept, not recomputed
            full = [t for t in node.inputs if graph.tensors[t].shape and t not in small]
            later = [c for c in out.consumers if graph.nodes[c].phase == "backward"]
            normal = all(_normalizer(graph, _root(graph, t)) for t in small)
            if not full and normal and later and out.id not in kept:
                found[("value", out.id)] = HeldBroadcast(node.index, node.index, max(later))
            continue
        if node.phase != "backward" or not _reaches_reduction(graph, node):
            continue
        for t in small:
            root = _root(graph, t)
            src = graph.tensors[root]
            if root in data_free:
                continue
            if not _normalizer(graph, root) or (
                src.producer is not None and graph.nodes[src.producer].phase != "forward"
            ):
                continue  # a backward value's broadcast lives in the backward only
            key = ("broadcast", root, out.shape)
            had = found.get(key)
            # made as soon as what it broadcasts exists: at the start of the step for a
            # parameter (the scheduler's habit with input-only values, early_input_reshards)
            first = src.producer if src.producer is not None else 0
            if had is None or had.last < node.index:
                found[key] = HeldBroadcast(node.index, first, node.index)
    return list(found.values())


# XLA:CPU offloads a float32 reduction to YNNPACK only from this many elements of its
# operand (per device) up (``IsReduceOpOffloadedToYnn``, xla/backends/cpu/ynn_support.cc);
# a smaller one is a loop fusion that broadcasts inside (gpt-tiny: no such buffers).
YNN_MIN_REDUCE_ELEMENTS = 32 * 1024


def _bytes(graph: Graph, sized_by: int, spec, mesh: DeviceMesh) -> float:
    """The buffer's bytes per device: those of ``sized_by``'s result in layout ``spec``,
    0 where its reduction is too small for XLA:CPU's library fusion or not float32."""
    out = graph.tensors[graph.nodes[sized_by].outputs[0]]
    fraction = spec.shard_fraction(mesh.mesh) if spec is not None else 1.0
    if str(out.dtype) != "float32" or out.size * fraction < YNN_MIN_REDUCE_ELEMENTS:
        return 0.0
    return out.nbytes * fraction


def held_broadcast_buffers(
    graph: Graph, spec_of, mesh: DeviceMesh, pos, kept: set[int]
) -> list[tuple[int, int, float]]:
    """(first, last program position, per-device bytes) of :func:`held_broadcasts` under
    the plan's layouts ``spec_of`` (for :func:`autoshard.intra.memory.model.predicted_live_bytes`)."""
    return [
        (
            pos[h.first],
            pos[h.last],
            _bytes(graph, h.sized_by, spec_of.get(graph.nodes[h.sized_by].outputs[0]), mesh),
        )
        for h in held_broadcasts(graph, mesh, kept)
    ]


def held_broadcast_groups(
    graph: Graph, strategies, n_in: int, mesh: DeviceMesh, pos, kept: set[int]
) -> list[CopyGroup]:
    """:func:`held_broadcasts` as :class:`CopyGroup` entries for the ILP's memory rows: per
    buffer and size, the strategies of the op it is sized by that give that size."""
    out = []
    for h in held_broadcasts(graph, mesh, kept):
        ilp = n_in + h.sized_by
        by_size: dict[float, list[int]] = {}
        for q, s in enumerate(strategies[ilp]):
            by_size.setdefault(_bytes(graph, h.sized_by, s.output_specs[0], mesh), []).append(q)
        reader = ((pos[h.last], n_in + h.last, tuple(range(len(strategies[n_in + h.last])))),)
        out += [
            CopyGroup(ilp, tuple(qs), size, pos[h.first], pos[h.last], reader)
            for size, qs in by_size.items()
            if size
        ]
    return out
