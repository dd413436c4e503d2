"""XLA:GPU's cuDNN filter copies, as the memory model counts them (jax-free).

cuDNN reads a conv's filter as ``[out, spatial..., in]`` (``o01i`` in XLA:GPU's
``dim_labels``); a kernel laid out otherwise (jax's ``[spatial..., in, out]``) is copied
into that layout once, in the forward pass, at its conv (a ``wrapped_transpose`` fusion of
the parameter), and XLA:GPU reads that one copy again:

* in the conv's input gradient, which it runs as cuDNN's backward-input conv on the
  forward's filter where that gradient cannot read the kernel as it is: a kernel wider
  than 1x1 (the reversed kernel the jaxpr reads needs the layout too) or a strided conv
  (its gradient dilates its input);
* in the optimizer's update, where the update reads the kernel's gradient in the kernel's
  own layout, whole: the filter gradient comes out of cuDNN in the filter's layout, XLA
  runs the update in it, and reads the forward's copy of the kernel there rather than
  transposing the kernel again.

So the copy lives from the kernel's first forward conv to the last of these readers. In
wresnet-1b's dp step on 2x4 (jax 0.11.2, H100; docs/truth_gpu.md) each of the 53 kernels
is copied so (3.71 GiB), every copy is read by the update, 19 by a backward-input conv
too (the 16 3x3 kernels and the 3 strided 1x1 projections; the other 1x1 input gradients
read the parameter itself), and all 53 are live at the end of the forward pass. On its
ZeRO-2 step (the gradient reduce-scattered, the update on a shard) 47 of 53 die at the
forward conv or the backward-input conv.

The model counts one buffer per kernel, in the layout the kernel is given, where a forward
conv reads it in that layout (a gathered kernel's copy is made from the gathered value and
freed at the conv: not held), from the first forward conv reading the kernel to the last
forward conv or backward-input conv reading the copy; and, as a second buffer of the same
size, from there to the kernel's update where an update op reads the kernel's gradient
unsplit and unreduced in the kernel's layout. Both the prediction
(:func:`filter_copy_intervals`) and the ILP's rows (:func:`filter_copy_groups`) count them
so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.layout_copies import input_derived_values
from autoshard.intra.memory.reshard_copies import GRADIENT_TAIL, CopyGroup
from autoshard.ir.graph import Graph, conv_dimension_numbers
from autoshard.ir.spec import ShardingSpec

_CONV = "conv_general_dilated"
_TAIL_LIMIT = 8  # GRADIENT_TAIL ops followed from a filter gradient to its update


@dataclass(frozen=True)
class FilterCopy:
    """One kernel's cuDNN-layout copy: ``kernel`` (tensor id) read by the forward convs
    ``forward`` (node indices, program order); ``backward_input``: the backward conv that
    reads the copy (node index) or None; ``gradient_readers``: (update node, operand
    slot) of each update op reading the kernel's filter gradient; ``update_end``: the
    last update op reading the kernel (node index), or None."""

    kernel: int
    forward: tuple[int, ...]
    backward_input: int | None
    gradient_readers: tuple[tuple[int, int], ...]
    update_end: int | None

    def held_end(self) -> int:
        """Node index of the copy's last reader but the update."""
        last = max(self.forward)
        return last if self.backward_input is None else max(last, self.backward_input)


def _cudnn_order(params: dict) -> tuple[int, ...]:
    """The kernel's dims in cuDNN's filter order, outermost first: out, spatial..., in."""
    _, rhs, _ = conv_dimension_numbers(params)
    return (rhs[0], *rhs[2:], rhs[1])


def needs_filter_copy(shape: Sequence[int], params: dict) -> bool:
    """Whether a conv with ``params`` reads a kernel of ``shape`` (row-major) through a
    copy in cuDNN's filter layout: its dims of more than one element are not already in
    that order (a 1x1 kernel read with in and out swapped, an input gradient's, is)."""
    order = [d for d in _cudnn_order(params) if shape[d] != 1]
    return order != sorted(order)


def _dilates_input(params: dict) -> bool:
    return any(d != 1 for d in (params.get("lhs_dilation") or ()))


def filter_copies(graph: Graph, mesh: DeviceMesh) -> list[FilterCopy]:
    """The kernels XLA:GPU copies into cuDNN's filter layout (``cudnn_filter_copies``),
    with their readers (module docstring): each value computed from the program inputs
    alone (a weight, :func:`~autoshard.intra.memory.layout_copies.input_derived_values`)
    that a forward conv reads in another layout."""
    if not mesh.memory_layout.cudnn_filter_copies:
        return []
    derived = input_derived_values(graph)
    forward: dict[int, list[int]] = {}
    for node in graph.nodes:
        if node.primitive != _CONV or node.phase != "forward":
            continue
        kernel = node.inputs[1]
        if kernel in derived and needs_filter_copy(graph.tensors[kernel].shape, node.params):
            forward.setdefault(kernel, []).append(node.index)
    out = []
    for kernel, convs in forward.items():
        updates = [c for c in graph.tensors[kernel].consumers if graph.nodes[c].phase == "update"]
        out.append(
            FilterCopy(
                kernel,
                tuple(convs),
                _backward_input(graph, kernel),
                _gradient_readers(graph, kernel, convs),
                max(updates) if updates else None,
            )
        )
    return out


def _backward_input(graph: Graph, kernel: int) -> int | None:
    """The last backward conv that reads ``kernel`` (directly or reversed, as the input
    gradient's transpose rule does) through the forward's copy: one whose kernel operand
    needs cuDNN's layout, or that dilates its input (a strided conv's gradient)."""
    read = {kernel} | {
        o
        for c in graph.tensors[kernel].consumers
        if graph.nodes[c].primitive == "rev"
        for o in graph.nodes[c].outputs
    }
    found = [
        c
        for t in read
        for c in graph.tensors[t].consumers
        if graph.nodes[c].primitive == _CONV
        and graph.nodes[c].phase == "backward"
        and graph.nodes[c].inputs[1] == t
        and (
            needs_filter_copy(graph.tensors[t].shape, graph.nodes[c].params)
            or _dilates_input(graph.nodes[c].params)
        )
    ]
    return max(found) if found else None


def _gradient_readers(graph: Graph, kernel: int, convs: Sequence[int]) -> tuple:
    """(update node, slot) of the update ops that read ``kernel``'s filter gradient: the
    output of a backward conv that reads a forward conv's input and has the kernel's
    shape, followed through :data:`GRADIENT_TAIL` ops (a sum of terms, a cast)."""
    shape = graph.tensors[kernel].shape
    inputs = {graph.nodes[c].inputs[0] for c in convs}
    grads = [
        graph.nodes[c].outputs[0]
        for t in inputs
        for c in graph.tensors[t].consumers
        if graph.nodes[c].primitive == _CONV
        and graph.nodes[c].phase == "backward"
        and graph.tensors[graph.nodes[c].outputs[0]].shape == shape
    ]
    out: set[tuple[int, int]] = set()
    stack, seen, tail = list(grads), set(), 0
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in graph.tensors[t].consumers:
            node = graph.nodes[c]
            if node.phase == "update":
                out.update((c, k) for k, i in enumerate(node.inputs) if i == t)
            elif node.primitive in GRADIENT_TAIL and tail < _TAIL_LIMIT:
                tail += 1
                stack.extend(node.outputs)
    return tuple(sorted(out))


def _reads_whole_gradient(spec: ShardingSpec | None, layout: ShardingSpec) -> bool:
    """Whether an update reads the filter gradient in ``spec`` as the kernel is laid out
    (``layout``): the same split, reduced."""
    return spec is not None and not spec.partial and spec.dims == layout.dims


def filter_copy_intervals(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    pos: Sequence[int],
    host: frozenset[int] = frozenset(),
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each filter copy of a plan (module docstring;
    ``pos``: the program positions). A reader's layout is the one ``operand_specs`` reads
    the value in, else the value's own."""
    out = []
    for fc in filter_copies(graph, mesh):
        own = spec_of.get(fc.kernel)
        if own is None or fc.kernel in host:
            continue
        size = graph.tensors[fc.kernel].nbytes * own.shard_fraction(mesh.mesh)
        if not size:
            continue
        held = pos[fc.held_end()]
        if any(operand_specs.get(c, {}).get(1, own) == own for c in fc.forward):
            out.append((pos[fc.forward[0]], held, size))
        if fc.update_end is None or pos[fc.update_end] <= held:
            continue
        for r, slot in fc.gradient_readers:
            tid = graph.nodes[r].inputs[slot]
            if _reads_whole_gradient(operand_specs.get(r, {}).get(slot, spec_of.get(tid)), own):
                out.append((held + 1, pos[fc.update_end], size))
                break
    return out


def filter_copy_groups(
    graph: Graph,
    strategies,
    producer: Mapping[int, tuple[int, int]],
    n_in: int,
    mesh: DeviceMesh,
    pos: Sequence[int],
    host: frozenset[int] = frozenset(),
) -> list[CopyGroup]:
    """:func:`filter_copy_intervals` as :class:`CopyGroup` entries for the ILP's rows: per
    layout the kernel's producer may give, the copy while a forward conv's strategy reads
    the kernel in it, and its hold to the update while an update op's strategy reads the
    gradient in it; fixed starts and ends, as the prediction's."""
    out = []
    for fc in filter_copies(graph, mesh):
        if fc.kernel in host:
            continue
        src, k = producer[fc.kernel]
        layouts: dict[ShardingSpec, list[int]] = {}
        for p, s in enumerate(strategies[src]):
            layouts.setdefault(s.output_specs[k], []).append(p)
        held = pos[fc.held_end()]
        hold = fc.update_end is not None and pos[fc.update_end] > held
        forward = [(c, 1) for c in fc.forward]
        for layout, ps in layouts.items():
            size = graph.tensors[fc.kernel].nbytes * layout.shard_fraction(mesh.mesh)
            if not size:
                continue
            readers = _readers(strategies, n_in, pos, forward, layout, whole=False)
            if readers:
                out.append(CopyGroup(src, tuple(ps), size, pos[fc.forward[0]], held, readers))
            if not hold:
                continue
            readers = _readers(strategies, n_in, pos, fc.gradient_readers, layout, whole=True)
            if readers:
                out.append(CopyGroup(src, tuple(ps), size, held + 1, pos[fc.update_end], readers))
    return out


def _readers(strategies, n_in: int, pos, slots, layout: ShardingSpec, whole: bool) -> tuple:
    """(position, ILP node, its strategies that read the operand at the slot in
    ``layout``) of each (node, slot) of ``slots`` that has such strategies, in program
    order; ``whole``: a gradient read as the kernel is laid out
    (:func:`_reads_whole_gradient`), else the kernel itself in ``layout``."""
    rows = []
    for node, slot in slots:
        qs = tuple(
            q
            for q, s in enumerate(strategies[n_in + node])
            if (
                _reads_whole_gradient(s.input_specs[slot], layout)
                if whole
                else s.input_specs[slot] == layout
            )
        )
        if qs:
            rows.append((pos[node], n_in + node, qs))
    return tuple(sorted(rows))


__all__ = [
    "FilterCopy",
    "filter_copies",
    "filter_copy_groups",
    "filter_copy_intervals",
    "needs_filter_copy",
]
