"""The memory model's resharded copies: one buffer per value and layout it is resharded
to, and where XLA makes it (jax-free).

A value read in a layout its producer does not give is copied into that layout once, and
the copy is shared by every reader that wants it (:func:`resharded_copy`).  Where the copy
is made decides what it overlaps:

* at its first reader (the default);
* right after the value, for a forward value read only by backward dots and convs on
  XLA:CPU (``early_backward_operand_reshards``: a weight gradient's gathered activation);
* at the start of the step: a program input's copy on XLA:CPU (``early_input_reshards``:
  a weight's all-gather, the labels' one-hot need nothing computed);
* right after an optimizer update's value, held to the end of the backward pass, for an
  update gathered to its parameter's layout on XLA:GPU (``held_update_gathers``,
  :func:`held_update_copy`);
* at its first reader, held to the last backward conv reading the value, for a gather of
  an activation that a forward conv reads on XLA:GPU (``reused_conv_gathers``,
  :func:`reused_gather_end`: the filter gradient reads the gathered copy);
* at the combined gradient reduction (``late_updates``, XLA:CPU): XLA combines the
  reductions of every gradient that feeds only the optimizer into one collective after
  the backward pass (gpt-tiny under data parallelism: one all-reduce of a 30-tuple, at
  XLA's live peak), where every gradient is held twice: the partial sum it is made from
  and the reduced copy (:func:`combined_reduction`).  The model's own buffers hold one
  of the two from the gradient's op to its update -- the partial sum, read through free
  views, or the materialised op after the copy (a transpose) -- so the copy is one
  buffer at the reduction (the partial sum's size: XLA reduces it whole and slices
  after), the partial sum is kept until the reduction where its own buffer ended before,
  and the copy's own bytes are not counted twice where a materialised op after it holds
  them.

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


def combined_reduction(
    graph: Graph,
    tid: int,
    readers: Sequence[int],
    pos: Sequence[int],
    intervals: Mapping[int, tuple[int, int]] | None = None,
    first_update: int | None = None,
):
    """Program position where XLA:CPU's combined gradient reduction makes ``tid``'s copy
    read by ``readers``, or None where it is not a gradient's: ``tid`` is computed before
    the optimizer and every reader leads, through :data:`GRADIENT_TAIL` ops only, to
    optimizer updates.  The position is the first update's (``late_updates`` schedules
    the updates in program order, after the backward pass; ``first_update``: its node
    index, found when not given)."""
    found = _gradient_tail(graph, tid, readers, intervals or {}, first_update)
    return None if found is None else pos[found[0]]


def first_update(graph: Graph) -> int | None:
    """Node index of the first optimizer-update op, or None."""
    return next((n.index for n in graph.nodes if n.phase == "update"), None)


def backward_end(graph: Graph, pos: Sequence[int]) -> int:
    """Program position of the backward pass's last op (of the last op that is not an
    optimizer update); -1 for a graph of updates alone."""
    return max((pos[n.index] for n in graph.nodes if n.phase != "update"), default=-1)


def held_update_copy(
    graph: Graph, tid: int, readers: Sequence[int], pos: Sequence[int], end: int
) -> tuple[int, int] | None:
    """(start, end) program positions of ``tid``'s copy read by ``readers`` where XLA:GPU
    holds it (``held_update_gathers``): ``tid`` is made by an optimizer update and only
    update ops read the copy (the add into the donated parameter). XLA:GPU's scheduler
    gathers such an update as soon as it is computed -- right after the gradient -- and
    runs the add after the backward pass (``end``: :func:`backward_end`), so the gathered
    copy lives from the one to the other. In gpt-39b's 8x8 step (jax 0.11.2, H100) each of
    the 192 ``all-gather-done``s of an update follows its ``all-gather-start`` within 19
    instructions (4 at the median) and is read by one ``wrapped_add`` of the parameter at
    positions 7434-8204 of 11,306, after the last backward dot (7421): 190 of them, 19.19
    GB, held at XLA's peak. Only a copy larger than its source is held (a gather; a slice
    is fused into the add): the callers compare. None where the rule does not apply."""
    t = graph.tensors[tid]
    if t.producer is None or graph.nodes[t.producer].phase != "update" or not readers:
        return None
    if any(graph.nodes[r].phase != "update" for r in readers):
        return None
    start = pos[t.producer]
    return start, max(start, end)


_CONV = "conv_general_dilated"


def reused_gather_end(graph: Graph, tid: int, pos: Sequence[int]) -> int | None:
    """Program position to which XLA:GPU holds a gathered copy of ``tid``
    (``reused_conv_gathers``): the last backward conv reading ``tid`` where a forward conv
    reads it too, else None. XLA:GPU's filter-gradient conv reads the forward conv's
    gathered copy of its activation, whatever layout the plan reads it in: in wresnet-1b's
    heuristic step on 2x4 (jax 0.11.2, H100) ``all-gather-start.8`` (``[128, 56, 56, 1280]``
    from ``[..., 160]``, position 210 of 3,549) is read by two forward convs and by
    ``cudnn-conv-bw-filter.88`` at 2835; 49 such copies, 17.4 GiB, are live at XLA's peak.
    Only a copy larger than its source is held (a gather): the callers compare. The
    condition is the graph's alone (a forward conv among the value's readers), so the
    prediction and the ILP's rows hold the same copies."""
    convs = [c for c in graph.tensors[tid].consumers if graph.nodes[c].primitive == _CONV]
    if not any(graph.nodes[c].phase == "forward" for c in convs):
        return None
    back = [pos[c] for c in convs if graph.nodes[c].phase == "backward"]
    return max(back) if back else None


def _gradient_tail(graph, tid, readers, intervals, first=None) -> tuple[int, bool] | None:
    """(first update's node index, whether an op on the way writes a buffer of its own --
    which then holds the reduced gradient) when every reader of ``tid``'s copy leads to
    optimizer updates through :data:`GRADIENT_TAIL` ops only (at most
    :data:`_TAIL_LIMIT` of them per reader, none a step output); else None."""
    t = graph.tensors[tid]
    if t.producer is None or graph.nodes[t.producer].phase == "update" or not readers:
        return None
    first = first_update(graph) if first is None else first
    if first is None:
        return None
    materialized = False
    for r in readers:
        stack, seen = [r], set()
        while stack:
            i = stack.pop()
            if i in seen or graph.nodes[i].phase == "update":
                continue
            seen.add(i)
            node = graph.nodes[i]
            if len(seen) > _TAIL_LIMIT or node.primitive not in GRADIENT_TAIL:
                return None
            for o in node.outputs:
                out = graph.tensors[o]
                if out.last_use >= len(graph.nodes) or not out.consumers:
                    return None
                materialized = materialized or o in intervals
                stack.extend(out.consumers)
    return first, materialized


# Ops whose operands a weight gradient reads from memory (library calls on XLA:CPU).
_LIBRARY_READERS = frozenset({"dot_general", "conv_general_dilated"})


def _backward_operand(graph: Graph, tid: int, readers: Sequence[int]) -> bool:
    """Whether ``tid`` is made in the forward pass and every reader of its copy is a
    backward dot or conv (``early_backward_operand_reshards``): XLA:CPU's scheduler then
    makes the copy right after the value, in the forward pass, and keeps it to them. In
    gpt-tiny's ZeRO-2 step on 2x4 (AdamW) the MLP activation all-gathered over ``model``
    for its weight gradient (``all-gather.28``) is made at position 194 of 1,126 and its
    layout copy (``copy_bitcast_fusion.16``) lives 196-408, to the gradient's dot; on
    moe-tiny's ZeRO-3 step on 4x2, ``all-gather.33`` (311-367) is at XLA's peak."""
    producer = graph.tensors[tid].producer
    if producer is None or graph.nodes[producer].phase != "forward" or not readers:
        return False
    return all(
        graph.nodes[r].phase == "backward" and graph.nodes[r].primitive in _LIBRARY_READERS
        for r in readers
    )


def _device_bytes(graph: Graph, tid: int, spec: ShardingSpec, mesh: DeviceMesh) -> float:
    return graph.tensors[tid].nbytes * spec.shard_fraction(mesh.mesh)


def resharded_copy(
    graph: Graph,
    tid: int,
    spec: ShardingSpec,
    mesh: DeviceMesh,
    readers: Sequence[int],
    pos: Sequence[int],
    intervals: Mapping[int, tuple[int, int]],
    first: int | None = None,
):
    """Where and how large ``tid``'s copy in layout ``spec`` read by the nodes
    ``readers`` is: ``(bytes per device, start, end, kept, tail)``, or None where no copy
    is a buffer (literals, constants, scalars).  ``tail`` is None unless the copy is made
    at the combined gradient reduction; then its bytes there are
    :func:`combined_copy_bytes` of the source's layout, ``tail`` saying whether a
    materialised op after it holds the copy's own.  ``start``/``end``: program positions, or None for its first/last
    reader.  ``kept``: for a copy made at the combined gradient reduction, the
    (first, last) positions the value it is made from must be kept past its own buffer
    (``intervals``: tensor -> its buffer's positions), or None.  ``first``: the first
    update's node index (:func:`first_update`, found when not given).  The one rule of the
    ILP's copies (:func:`copy_groups`) and the prediction's (:func:`reshard_buffers`)."""
    t = graph.tensors[tid]
    if t.kind in ("literal", "const") or not t.shape:
        return None
    nbytes = _device_bytes(graph, tid, spec, mesh)
    layout = mesh.memory_layout
    if layout.early_input_reshards and t.producer is None:
        return nbytes, 0, None, None, None
    found = _gradient_tail(graph, tid, readers, intervals, first) if layout.late_updates else None
    if found is None:
        early = layout.early_backward_operand_reshards and _backward_operand(graph, tid, readers)
        return nbytes, pos[t.producer] if early else None, None, None, None
    start = pos[found[0]]
    end = intervals[tid][1] if tid in intervals else pos[t.producer]
    kept = (end + 1, start) if end < start else None
    return nbytes, start, start, kept, found[1]


def combined_copy_bytes(nbytes: float, source_bytes: float, tail: bool) -> float:
    """Bytes a copy made at the combined gradient reduction adds at that point: XLA:CPU
    all-reduces the partial sum whole, in the source's own layout, and slices after
    (ZeRO-2's reduce-scatter is an all-reduce and a dynamic-slice there), so the reduced
    buffer is the larger of the source's and the copy's; a materialised op after the copy
    (``tail``) already holds the copy's own bytes."""
    return max(source_bytes, nbytes) - (nbytes if tail else 0.0)


def reshard_buffers(
    graph: Graph,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    pos: Sequence[int],
    intervals: Mapping[int, tuple[int, int]],
    read_at: Mapping[tuple[int, int], int] | None = None,
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each value in each layout it is resharded to,
    and of each gradient kept until the combined reduction past its own buffer.
    ``read_at``: (value, reader node) -> the node where that reader reads the copy instead
    (:func:`~autoshard.intra.memory.layout_copies.conv_copy_reads`: a backward conv reads
    its transposed copy, made from this one where the value is made)."""
    read_at = read_at or {}
    uses: dict[tuple[int, ShardingSpec], list[int]] = {}
    for node_index, slots in operand_specs.items():
        node = graph.nodes[node_index]
        for slot, spec in slots.items():
            uses.setdefault((node.inputs[slot], spec), []).append(node_index)
    out, kept, update = [], {}, first_update(graph)
    held = mesh.memory_layout.held_update_gathers
    reuse = mesh.memory_layout.reused_conv_gathers
    end_of_backward = backward_end(graph, pos) if held else -1
    for (tid, spec), readers in uses.items():
        copy = resharded_copy(graph, tid, spec, mesh, readers, pos, intervals, update)
        if copy is None:
            continue
        nbytes, start, end, keep, tail = copy
        window = held_update_copy(graph, tid, readers, pos, end_of_backward) if held else None
        own = spec_of.get(tid)
        gathers = own is not None and nbytes > _device_bytes(graph, tid, own, mesh)
        if window is not None and gathers:
            start, end = window
        where = [pos[read_at.get((tid, r), r)] for r in readers]
        reused = reused_gather_end(graph, tid, pos) if reuse and gathers else None
        if reused is not None and end is None and tail is None:
            end = max(max(where), reused)
        if tail is not None:
            own = spec_of.get(tid)
            source = 0.0 if own is None else _device_bytes(graph, tid, own, mesh)
            nbytes = combined_copy_bytes(nbytes, source, tail) if own is not None else 0.0
        if nbytes:
            first = min(where) if start is None else start
            out.append((first, max(where) if end is None else end, nbytes))
        if keep is not None and tid in spec_of:
            kept[tid] = keep
    out += [(a, b, _device_bytes(graph, t, spec_of[t], mesh)) for t, (a, b) in kept.items()]
    return out


def _early_unless(graph: Graph, tid: int, readers, n_in: int, mesh: DeviceMesh):
    """For a copy that the readers which may read it do not all make early (a forward
    op among them), the indices of those that are not backward dots or convs, when the
    others would (:func:`_backward_operand`): the plan whose readers are only the latter
    gets the copy right after the value.  None otherwise."""
    if not mesh.memory_layout.early_backward_operand_reshards:
        return None
    nodes = [r[1] - n_in for r in readers]
    late = [j for j, v in enumerate(nodes) if _backward_operand(graph, tid, [v])]
    if not late or len(late) == len(nodes):
        return None
    return tuple(j for j in range(len(nodes)) if j not in set(late))


@dataclass(frozen=True)
class CopyGroup:
    """A buffer some strategy choices create, for the ILP's memory rows: it exists when
    ILP node ``source`` picks one of ``source_strategies`` and some reader reads it
    (``readers``: (program position, reader ILP node, its strategies that read it), in
    program order).  It lives from ``start`` to ``end`` (None: from its first reader to
    its last, as the readers that have read it and are still to read it say).
    ``early_unless``: see :attr:`~autoshard.intra.ilp.CopyBuffer.early_unless` (then
    ``start`` is where the early copy is made)."""

    source: int
    source_strategies: tuple[int, ...]
    bytes: float
    start: int | None
    end: int | None
    readers: tuple[tuple[int, int, tuple[int, ...]], ...]
    early_unless: tuple[int, ...] | None = None


def copy_groups(
    graph: Graph,
    strategies,
    producer,
    n_in: int,
    mesh: DeviceMesh,
    operands,
    pos,
    intervals,
    read_at: Mapping[tuple[int, int], int] | None = None,
) -> list[CopyGroup]:
    """One :class:`CopyGroup` per value and layout some reader may want that its
    producer may not give (the buffers of :func:`reshard_buffers`, ``read_at`` as there),
    and, for a copy made at the combined gradient reduction, the gradient kept until then
    (:func:`_kept_groups`)."""
    read_at = read_at or {}
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
            at = pos[read_at.get((op.tensor, op.dst - n_in), op.dst - n_in)]
            found.setdefault((op.tensor, spec), []).append((at, op.dst, tuple(qs)))
    out, update = [], first_update(graph)
    tails: dict[int, tuple[tuple[int, int], list]] = {}  # tid -> (kept, [(layout, readers)])
    held = mesh.memory_layout.held_update_gathers
    reuse = mesh.memory_layout.reused_conv_gathers
    end_of_backward = backward_end(graph, pos) if held else -1
    for (tid, spec), readers in found.items():
        src, k = producer[tid]
        other = tuple(p for p, s in enumerate(strategies[src]) if s.output_specs[k] != spec)
        readers = tuple(sorted(readers))
        copy = resharded_copy(
            graph, tid, spec, mesh, [r[1] - n_in for r in readers], pos, intervals, update
        )
        if not other or copy is None:
            continue
        nbytes, start, end, keep, tail = copy
        window = None
        if held and tail is None:
            nodes = [r[1] - n_in for r in readers]
            window = held_update_copy(graph, tid, nodes, pos, end_of_backward)
        if window is not None:  # held where it gathers (its source is smaller), else not
            gathers = tuple(p for p in other if _device_bytes(
                graph, tid, strategies[src][p].output_specs[k], mesh) < nbytes)  # fmt: skip
            rest = tuple(p for p in other if p not in set(gathers))
            if nbytes and gathers:
                out.append(CopyGroup(src, gathers, nbytes, window[0], window[1], readers))
            if nbytes and rest:
                out.append(CopyGroup(src, rest, nbytes, start, end, readers))
            continue
        reused = reused_gather_end(graph, tid, pos) if reuse and tail is None else None
        if reused is not None and end is None:  # gathers held to the backward conv
            gathers = tuple(p for p in other if _device_bytes(
                graph, tid, strategies[src][p].output_specs[k], mesh) < nbytes)  # fmt: skip
            other = tuple(p for p in other if p not in set(gathers))
            if nbytes and gathers:
                held_end = max(readers[-1][0], reused)
                out.append(CopyGroup(src, gathers, nbytes, start, held_end, readers))
            if not other:
                continue
        if tail is None:
            if nbytes:
                out.append(CopyGroup(src, other, nbytes, start, end, readers))
            early = _early_unless(graph, tid, readers, n_in, mesh) if start is None else None
            if nbytes and early is not None:  # made right after the value if only they read
                t = graph.tensors[tid]
                out.append(CopyGroup(src, other, nbytes, pos[t.producer], None, readers, early))
            continue
        by_size: dict[float, list[int]] = {}  # the source's bytes under each strategy
        for p in other:
            size = _device_bytes(graph, tid, strategies[src][p].output_specs[k], mesh)
            by_size.setdefault(size, []).append(p)
        for size, ps in by_size.items():
            made = combined_copy_bytes(nbytes, size, tail)
            if made:
                out.append(CopyGroup(src, tuple(ps), made, start, end, readers))
        if keep is not None:
            tails.setdefault(tid, (keep, []))[1].append((spec, readers))
    for tid, (keep, read) in tails.items():
        out += _kept_groups(graph, tid, strategies, producer, mesh, keep, read)
    return out


def _kept_groups(graph, tid, strategies, producer, mesh, keep, tails) -> list[CopyGroup]:
    """The gradient ``tid`` kept from ``keep[0]`` to the combined reduction at ``keep[1]``
    past its own buffer, as :class:`CopyGroup` entries: one buffer, whichever layouts it is
    copied to there (:func:`reshard_buffers` counts it once per value).  Per layout the
    source may give, it is live when the source gives that layout and some reader reads
    the value in another layout that is made at the reduction (``tails``: (layout, its
    readers as in :class:`CopyGroup`) for each such layout); source layouts of one size
    and one such reader set share a group."""
    src, k = producer[tid]
    by_spec: dict[ShardingSpec, list[int]] = {}
    for p, s in enumerate(strategies[src]):
        by_spec.setdefault(s.output_specs[k], []).append(p)
    merged: dict[tuple, list[int]] = {}
    for own, ps in by_spec.items():
        size = _device_bytes(graph, tid, own, mesh)
        reads: dict[tuple[int, int], set[int]] = {}  # (position, reader) -> its strategies
        for spec, readers in tails:
            if spec != own:
                for at, node, qs in readers:
                    reads.setdefault((at, node), set()).update(qs)
        if size and reads:
            key = (size, tuple((at, v, tuple(sorted(qs))) for (at, v), qs in sorted(reads.items())))
            merged.setdefault(key, []).extend(ps)
    return [
        CopyGroup(src, tuple(sorted(ps)), size, keep[0], keep[1], readers)
        for (size, readers), ps in merged.items()
    ]


__all__ = [
    "GRADIENT_TAIL",
    "CopyGroup",
    "backward_end",
    "combined_copy_bytes",
    "combined_reduction",
    "copy_groups",
    "first_update",
    "held_update_copy",
    "reshard_buffers",
    "resharded_copy",
]
