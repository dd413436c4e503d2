"""Broadcasts XLA:CPU keeps as buffers from the forward pass to the backward (jax-free).

Part of the memory model (:mod:`autoshard.intra.memory.model`), on where the backend's
:class:`~autoshard.hardware.mesh.MemoryLayout` says ``materialized_broadcasts``.

XLA:CPU runs a reduction, and the elementwise ops fused into it, as a library fusion
(YNNPACK, ``ynn_fusion``) that reads each operand as a buffer of the fusion's full shape:
an operand the graph broadcasts implicitly (a ``[B, S, 1]`` statistic or a ``[1, 1, h]``
parameter multiplying a ``[B, S, h]`` value) is broadcast into a buffer of its own
first.  XLA makes that broadcast as soon as its operand exists and shares it (CSE)
between the forward pass and the backward, so a broadcast that a backward reduction
reads lives from the forward pass to it -- where the forward op that multiplies by the
same factor is laid out as the backward op (a broadcast in another layout is another
instruction: moe-tiny ``auto`` on 4x2, whose backward LayerNorm products are split over
``model`` too, keeps none).  A LayerNorm's backward reduces ``dy * xhat * rsqrt`` and
``dy * xhat * scale``: two broadcasts (``bitcast_broadcast_fusion``, ``wrapped_broadcast``;
gpt-tiny megatron on 2x4: 10 of ``f32[4, 32, 64]`` at XLA's live peak, its 5 LayerNorms).
The forward's ``rsqrt * scale`` (a value made of broadcasts only, read again in the
backward) is a third buffer, ``broadcast_multiply_fusion``, only where it has at least
:data:`YNN_MIN_ROWS` rows (elements over its last dim) per device: XLA:CPU's library
fusions then read it as an operand (gpt-350m megatron on 8, ``[8, 1024, 1024]``: 15 x 32
MiB at XLA's live peak); with fewer rows the backward recomputes it from the two
broadcasts.

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
    # held only where this forward node's result is laid out as ``sized_by``'s
    forward: int | None = None
    # held only with at least YNN_MIN_ROWS rows per device (a forward value kept)
    rows: bool = False


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
    their own already (:func:`~autoshard.intra.memory.intervals.mesh_intervals`), not counted again."""
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
                found[("value", out.id)] = HeldBroadcast(
                    node.index, node.index, max(later), rows=True
                )
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
                forward = _forward_reader(graph, root, out.shape)
                found[key] = HeldBroadcast(node.index, first, node.index, forward)
    return list(found.values())


def _forward_reader(graph: Graph, root: int, shape) -> int | None:
    """The first forward elementwise op that reads ``root`` (through free views) with a
    result of ``shape``: the multiply whose broadcast of ``root`` the backward shares."""
    stack, seen, found = [root], set(), []
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in graph.tensors[t].consumers:
            node = graph.nodes[c]
            if node.phase != "forward":
                continue
            if node.primitive in FREE_VIEWS:
                stack += list(node.outputs)
            elif node.elementwise and graph.tensors[node.outputs[0]].shape == shape:
                found.append(c)
    return min(found) if found else None


# XLA:CPU offloads a float32 reduction to YNNPACK from this many elements of its operand
# (per device) up; a smaller one is a loop fusion that broadcasts inside. Measured on
# jaxlib 0.10.2 and 0.12 (a LayerNorm's forward and backward, one device): [1, 64, 64]
# f32 compiles 7 ``ynn_fusion``s and the broadcasts, [1, 63, 64] 2 and none. (XLA's
# ``IsReduceOpOffloadedToYnn`` in later sources checks 32 * 1024.)
YNN_MIN_REDUCE_ELEMENTS = 4096
# ... and reads the forward's ``rsqrt * scale`` as an operand from this many rows of it
# per device up (jaxlib 0.10.2 and 0.12: [1, 4096, 64] keeps one a LayerNorm, [1, 4095,
# 64] and [4, 512, 512] none; [2, 2048, 32] and [8, 1024, 1024] one a LayerNorm).
YNN_MIN_ROWS = 4096


def held_bytes(graph: Graph, h: HeldBroadcast, spec, mesh: DeviceMesh) -> float:
    """``h``'s bytes per device: those of its ``sized_by`` result in layout ``spec``, 0
    where its reduction is too small for XLA:CPU's library fusion or not float32, or (a
    forward value, ``h.rows``) where it has fewer than :data:`YNN_MIN_ROWS` rows."""
    out = graph.tensors[graph.nodes[h.sized_by].outputs[0]]
    fraction = spec.shard_fraction(mesh.mesh) if spec is not None else 1.0
    if str(out.dtype) != "float32" or out.size * fraction < YNN_MIN_REDUCE_ELEMENTS:
        return 0.0
    if h.rows and out.shape:
        last = out.shape[-1] / _split(spec, len(out.shape) - 1, mesh)
        if out.size * fraction / last < YNN_MIN_ROWS:
            return 0.0
    return out.nbytes * fraction


def _split(spec, dim: int, mesh: DeviceMesh) -> int:
    """How many ways ``spec`` splits dim ``dim`` on ``mesh`` (1 for None)."""
    return 1 if spec is None else mesh.mesh.size(spec.dims[dim])


def held_broadcast_buffers(
    graph: Graph, spec_of, mesh: DeviceMesh, pos, kept: set[int]
) -> list[tuple[int, int, float]]:
    """(first, last program position, per-device bytes) of :func:`held_broadcasts` under
    the plan's layouts ``spec_of`` (for :func:`autoshard.intra.memory.model.predicted_live_bytes`)."""
    out = []
    for h in held_broadcasts(graph, mesh, kept):
        spec = spec_of.get(graph.nodes[h.sized_by].outputs[0])
        if h.forward is not None and spec_of.get(graph.nodes[h.forward].outputs[0]) != spec:
            continue  # another layout than the forward's: broadcast in the backward
        out.append((pos[h.first], pos[h.last], held_bytes(graph, h, spec, mesh)))
    return out


def held_broadcast_groups(
    graph: Graph, strategies, n_in: int, mesh: DeviceMesh, pos, kept: set[int]
) -> list[CopyGroup]:
    """:func:`held_broadcasts` as :class:`CopyGroup` entries for the ILP's memory rows: per
    buffer and size, the strategies of the op it is sized by that give that size; for a
    broadcast the forward op must share (``forward``), one entry per layout: the forward
    op's strategies giving it (the source) and the sized op's (the reader)."""
    out = []
    for h in held_broadcasts(graph, mesh, kept):
        ilp = n_in + h.sized_by
        if h.forward is None:
            by_size: dict[float, list[int]] = {}
            for q, s in enumerate(strategies[ilp]):
                by_size.setdefault(held_bytes(graph, h, s.output_specs[0], mesh), []).append(q)
            every = tuple(range(len(strategies[n_in + h.last])))
            reader = ((pos[h.last], n_in + h.last, every),)
            out += [
                CopyGroup(ilp, tuple(qs), size, pos[h.first], pos[h.last], reader)
                for size, qs in by_size.items()
                if size
            ]
            continue
        fwd = n_in + h.forward
        by_spec: dict = {}
        for p, s in enumerate(strategies[fwd]):
            by_spec.setdefault(s.output_specs[0], ([], []))[0].append(p)
        for q, s in enumerate(strategies[ilp]):
            if s.output_specs[0] in by_spec:
                by_spec[s.output_specs[0]][1].append(q)
        for spec, (ps, qs) in by_spec.items():
            size = held_bytes(graph, h, spec, mesh)
            if size and qs:
                reader = ((pos[h.sized_by], ilp, tuple(qs)),)
                out.append(CopyGroup(fwd, tuple(ps), size, pos[h.first], pos[h.last], reader))
    return out
