"""The memory model's resharded copies: one buffer per value and layout it is resharded
to, and where XLA makes it (jax-free).

A value read in a layout its producer does not give is copied into that layout once, and
the copy is shared by every reader that wants it (:func:`resharded_copy`).  Where the copy
is made decides what it overlaps:

* at its first reader (the default);
* at the start of the step: a program input's copy on XLA:CPU (``early_input_reshards``:
  a weight's all-gather, the labels' one-hot need nothing computed);
* at the combined gradient reduction (``late_updates``, XLA:CPU): XLA combines the
  reductions of every gradient that feeds only the optimizer into one collective after
  the backward pass (gpt-tiny under data parallelism: one all-reduce of a 30-tuple, at
  XLA's live peak), where every gradient is held twice: the partial sum it is made from
  and the reduced copy (:func:`combined_reduction`).  The model's own buffers hold one
  of the two from the gradient's op to its update -- the partial sum, read through free
  views, or the materialised op after the copy (a transpose) -- so the copy is one
  buffer at the reduction, the partial sum kept until it where it died before, and the
  copy not counted where a materialised op after it stands for it.

:func:`reshard_buffers` lists these buffers for a plan's prediction; :func:`copy_groups`
lists them for the ILP's memory rows, per strategy choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec

# Ops between a weight's gradient and the optimizer's update: layout changes, dtype
# casts, and the sums of a weight's gradient terms (a tied embedding's two).
GRADIENT_TAIL = frozenset(
    "reshape transpose squeeze expand_dims copy convert_element_type add add_any".split()
)
_TAIL_LIMIT = 16  # ops followed from one reader before it counts as the backward's own


def combined_reduction(graph: Graph, tid: int, readers: Sequence[int], pos: Sequence[int]):
    """Program position where XLA:CPU's combined gradient reduction makes ``tid``'s copy
    read by ``readers``, or None where it is not a gradient's: ``tid`` is computed before
    the optimizer and every reader leads, through :data:`GRADIENT_TAIL` ops only, to
    optimizer updates.  The position is the first update's (``late_updates`` schedules
    the updates in program order, after the backward pass)."""
    t = graph.tensors[tid]
    if t.producer is None or graph.nodes[t.producer].phase == "update" or not readers:
        return None
    first_update = _first_update(graph)
    if first_update is None:
        return None
    for r in readers:
        if not _leads_to_updates(graph, r):
            return None
    return pos[first_update]


def _first_update(graph: Graph) -> int | None:
    return next((n.index for n in graph.nodes if n.phase == "update"), None)


def _leads_to_updates(graph: Graph, node_index: int) -> bool:
    """Whether ``node_index`` is an update, or a :data:`GRADIENT_TAIL` op whose outputs
    reach only updates through such ops (and are not the step's outputs)."""
    stack, seen = [node_index], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if len(seen) > _TAIL_LIMIT:
            return False
        node = graph.nodes[i]
        if node.phase == "update":
            continue
        if node.primitive not in GRADIENT_TAIL:
            return False
        for o in node.outputs:
            out = graph.tensors[o]
            if out.last_use >= len(graph.nodes) or not out.consumers:
                return False
            stack.extend(out.consumers)
    return True


def resharded_copy(
    graph: Graph,
    tid: int,
    spec: ShardingSpec,
    mesh: DeviceMesh,
    readers: Sequence[int],
    pos: Sequence[int],
    intervals: Mapping[int, tuple[int, int]],
):
    """Where and how large ``tid``'s copy in layout ``spec`` read by the nodes
    ``readers`` is: ``(bytes per device, start, end, kept, tail)``, or None where no copy
    is a buffer (literals, constants, scalars).  ``tail`` is None unless the copy is made
    at the combined gradient reduction; then its bytes there are
    :func:`combined_copy_bytes` of the source's layout, ``tail`` saying whether a
    materialised op after it holds the copy's own.  ``start``/``end``: program positions, or None for its first/last
    reader.  ``kept``: for a copy made at the combined gradient reduction, the
    (first, last) positions the value it is made from must be kept past its own buffer
    (``intervals``: tensor -> its buffer's positions), or None.  The one rule of the
    ILP's copies (:func:`copy_groups`) and the prediction's (:func:`reshard_buffers`)."""
    t = graph.tensors[tid]
    if t.kind in ("literal", "const") or not t.shape:
        return None
    nbytes = t.nbytes * spec.shard_fraction(mesh.mesh)
    layout = mesh.memory_layout
    if layout.early_input_reshards and t.producer is None:
        return nbytes, 0, None, None, None
    start = combined_reduction(graph, tid, readers, pos) if layout.late_updates else None
    if start is None:
        return nbytes, None, None, None, None
    end = intervals[tid][1] if tid in intervals else pos[t.producer]
    kept = (end + 1, start) if end < start else None
    return nbytes, start, start, kept, _tail_materialized(graph, readers, intervals)


def combined_copy_bytes(nbytes: float, source_bytes: float, tail: bool) -> float:
    """Bytes a copy made at the combined gradient reduction adds at that point: XLA:CPU
    all-reduces the partial sum whole, in the source's own layout, and slices after
    (ZeRO-2's reduce-scatter is an all-reduce and a dynamic-slice there), so the reduced
    buffer is the larger of the source's and the copy's; a materialised op after the copy
    (``tail``) already holds the copy's own bytes."""
    return max(source_bytes, nbytes) - (nbytes if tail else 0.0)


def _tail_materialized(graph: Graph, readers: Sequence[int], intervals) -> bool:
    """Whether an op between the copy's readers and the updates (the readers included)
    writes a buffer of its own, which then holds the reduced gradient."""
    stack, seen = list(readers), set()
    while stack:
        i = stack.pop()
        if i in seen or graph.nodes[i].phase == "update":
            continue
        seen.add(i)
        for o in graph.nodes[i].outputs:
            if o in intervals:
                return True
            stack.extend(graph.tensors[o].consumers)
    return False


def reshard_buffers(
    graph: Graph,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    pos: Sequence[int],
    intervals: Mapping[int, tuple[int, int]],
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each value in each layout it is resharded to,
    and of each gradient kept until the combined reduction past its own buffer."""
    uses: dict[tuple[int, ShardingSpec], list[int]] = {}
    for node_index, slots in operand_specs.items():
        node = graph.nodes[node_index]
        for slot, spec in slots.items():
            uses.setdefault((node.inputs[slot], spec), []).append(node_index)
    out, kept = [], {}
    for (tid, spec), readers in uses.items():
        copy = resharded_copy(graph, tid, spec, mesh, readers, pos, intervals)
        if copy is None:
            continue
        nbytes, start, end, keep, tail = copy
        where = [pos[r] for r in readers]
        if tail is not None:
            own = spec_of.get(tid)
            source = (
                0.0 if own is None else graph.tensors[tid].nbytes * own.shard_fraction(mesh.mesh)
            )
            nbytes = combined_copy_bytes(nbytes, source, tail) if own is not None else 0.0
        if nbytes:
            first = min(where) if start is None else start
            out.append((first, max(where) if end is None else end, nbytes))
        if keep is not None and tid in spec_of:
            kept[tid] = keep
    for tid, (first, last) in kept.items():
        size = graph.tensors[tid].nbytes * spec_of[tid].shard_fraction(mesh.mesh)
        out.append((first, last, size))
    return out


@dataclass(frozen=True)
class CopyGroup:
    """A buffer some strategy choices create, for the ILP's memory rows: it exists when
    ILP node ``source`` picks one of ``source_strategies`` and some reader reads it
    (``readers``: (program position, reader ILP node, its strategies that read it), in
    program order).  It lives from ``start`` to ``end`` (None: from its first reader to
    its last, as the readers that have read it and are still to read it say)."""

    source: int
    source_strategies: tuple[int, ...]
    bytes: float
    start: int | None
    end: int | None
    readers: tuple[tuple[int, int, tuple[int, ...]], ...]


def copy_groups(
    graph: Graph, strategies, producer, n_in: int, mesh: DeviceMesh, operands, pos, intervals
) -> list[CopyGroup]:
    """One :class:`CopyGroup` per value and layout some reader may want that its
    producer may not give (the buffers of :func:`reshard_buffers`), and, for a copy made
    at the combined gradient reduction, one per size of the gradient kept until then."""
    found: dict[tuple[int, ShardingSpec], list] = {}
    for op in operands:
        if op.slot < 0 or op.dst < n_in:
            continue
        wants: dict[ShardingSpec, list[int]] = {}
        for q, s in enumerate(strategies[op.dst]):
            spec = s.input_specs[op.slot]
            if spec is not None:
                wants.setdefault(spec, []).append(q)
        for spec, qs in wants.items():
            found.setdefault((op.tensor, spec), []).append((pos[op.dst - n_in], op.dst, tuple(qs)))
    out, kept = [], set()
    for (tid, spec), readers in found.items():
        src, k = producer[tid]
        other = tuple(p for p, s in enumerate(strategies[src]) if s.output_specs[k] != spec)
        readers = tuple(sorted(readers))
        copy = resharded_copy(
            graph, tid, spec, mesh, [r[1] - n_in for r in readers], pos, intervals
        )
        if not other or copy is None:
            continue
        nbytes, start, end, keep, tail = copy
        by_size: dict[float, list[int]] = {}  # the source's bytes under each strategy
        for p in other:
            spec_p = strategies[src][p].output_specs[k]
            size = graph.tensors[tid].nbytes * spec_p.shard_fraction(mesh.mesh)
            by_size.setdefault(size, []).append(p)
        if tail is None:
            if nbytes:
                out.append(CopyGroup(src, other, nbytes, start, end, readers))
        else:
            for size, ps in by_size.items():
                made = combined_copy_bytes(nbytes, size, tail)
                if made:
                    out.append(CopyGroup(src, tuple(ps), made, start, end, readers))
        if keep is None or tid in kept:
            continue
        kept.add(tid)
        out += [
            CopyGroup(src, tuple(ps), size, keep[0], keep[1], readers)
            for size, ps in by_size.items()
            if size
        ]
    return out


__all__ = [
    "GRADIENT_TAIL",
    "CopyGroup",
    "combined_copy_bytes",
    "combined_reduction",
    "copy_groups",
    "reshard_buffers",
    "resharded_copy",
]
