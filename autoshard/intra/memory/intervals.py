"""The schedule of the memory model (jax-free): each buffer's live interval in the
modelled program order (:func:`live_intervals`, :func:`mesh_intervals` as a mesh's backend
lays memory out), the order itself (:func:`program_positions`: XLA's early optimizer
updates), and which outputs XLA writes into an operand's buffer (in-place updates, a
transpose XLA:CPU folds into its dot). :mod:`autoshard.intra.memory.model` sizes and sums
the buffers over these intervals.
"""

from __future__ import annotations

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.common_values import common_values, merged_consumers
from autoshard.intra.memory.layout_copies import NARROW_FLOATS, folded_dot_transpose
from autoshard.intra.memory.materialized import (
    copied_lhs_sources,
    data_free_tensors,
    materialized_tensors,
)
from autoshard.intra.memory.pool_workspace import pool_backwards
from autoshard.intra.memory.update_zeros import UpdateZeros, update_zeros
from autoshard.ir.graph import Graph


def graph_update_zeros(graph: Graph) -> list[UpdateZeros]:
    """:func:`~autoshard.intra.memory.update_zeros.update_zeros` of ``graph``: its in-place
    updates (:data:`IN_PLACE`) into zeros computed from constants alone."""
    return update_zeros(graph, data_free_tensors(graph), IN_PLACE)


def program_positions(graph: Graph, late_updates: bool = False) -> list[int]:
    """Node index -> position in the modelled schedule: program order, except that XLA
    schedules each parameter's update as soon as its gradient is ready (update ops move
    to just after their last input) -- unless ``late_updates`` (XLA:CPU, which combines
    the gradient reductions into one at the end of the backward pass, so every gradient
    waits for it)."""
    pos = list(range(len(graph.nodes)))
    if late_updates:
        return pos
    for node in graph.nodes:
        if node.phase == "update":
            ready = [
                pos[graph.tensors[t].producer]
                for t in node.inputs
                if graph.tensors[t].producer is not None
            ]
            pos[node.index] = max(ready, default=0)
    return pos


def live_intervals(
    graph: Graph,
    reductions_read_memory: bool = False,
    late_updates: bool = False,
    fused_transcendentals: bool = False,
    early_inputs: bool = False,
    dot_lhs_copies: bool = False,
    narrow_dots_in_f32: bool = False,
    folded_dot_transposes: bool = False,
) -> dict[int, tuple[int, int]]:
    """Tensor id -> (first, last) program position of every buffer that occupies memory.

    Program inputs live throughout ((-1, n)); updated state reuses its donated input, so
    aliased outputs take no extra room.  Positions are :func:`program_positions`.
    The flags are :class:`~autoshard.hardware.mesh.MemoryLayout`'s (:func:`mesh_intervals`).  Only
    materialised tensors count (:func:`materialized_tensors`); a buffer lives until the
    last op that reads it, directly or through values fused away (:func:`_readers`: a
    value recomputed in the backward pass keeps what it is made of alive until then).

    With ``dot_lhs_copies`` (XLA:CPU) what a transposed dot lhs copy reads again is kept
    until that dot (:func:`~autoshard.intra.memory.materialized.copied_lhs_sources`).

    With ``early_inputs`` (XLA:CPU, ``early_input_reshards``) the zeros an in-place update
    writes into and no add absorbs (:mod:`autoshard.intra.memory.update_zeros`) are a buffer made
    at the start of the step, which the update's result then takes over.

    With ``folded_dot_transposes`` (XLA:CPU) a transpose that is a dot result's only reader
    continues the dot's buffer (:func:`folded_transpose_operand`).
    """
    n = len(graph.nodes)
    pos = program_positions(graph, late_updates)
    same = common_values(graph)  # once: the fusion part reads it too
    keep = materialized_tensors(graph, reductions_read_memory, fused_transcendentals, same)
    copied = copied_lhs_sources(graph, keep, narrow_dots_in_f32) if dot_lhs_copies else {}
    keep |= copied.keys()
    consumers = merged_consumers(graph, same)
    aliased_outputs = {dst for _, dst in graph.aliases}
    out: dict[int, tuple[int, int]] = {}
    for t in graph.tensors:
        if t.id not in keep or t.id in aliased_outputs or t.kind in ("literal", "const"):
            continue
        if t.producer is None:
            out[t.id] = (-1, n)
            continue
        first = pos[t.producer]
        if t.last_use >= n:
            last = n
        else:
            last = max([pos[c] for c in buffer_readers(graph, t.id, keep, consumers)] + [first])
        out[t.id] = (first, last)
    for src, dot in copied.items():  # read again by the transposed lhs copy, at its dot
        if src in out and out[src][1] < pos[dot]:
            out[src] = (out[src][0], pos[dot])
    if early_inputs:  # zeros no add absorbs: made at the start (update_zeros)
        for z in graph_update_zeros(graph):
            if z.add is None and z.zeros not in out:
                out[z.zeros] = (0, pos[z.update])
    for node in graph.nodes:  # outputs written into a dying operand's buffer
        shared = _shared_operand(graph, node, out)
        if shared is None and folded_dot_transposes:
            shared = folded_transpose_operand(graph, node, out, narrow_dots_in_f32)
        if shared is not None:
            first, _ = out[shared]
            out[shared] = (first, max(first, pos[node.index] - 1))
    return out


def mesh_intervals(graph: Graph, mesh: DeviceMesh) -> dict[int, tuple[int, int]]:
    """:func:`live_intervals` as ``mesh``'s backend lays memory out."""
    layout = mesh.memory_layout
    out = live_intervals(
        graph,
        layout.reductions_read_memory,
        layout.late_updates,
        layout.fused_transcendentals,
        layout.early_input_reshards,
        layout.dot_lhs_copies,
        layout.narrow_dots_in_f32,
        layout.folded_dot_transposes,
    )
    return _pool_operands_read_forward(graph, mesh, out)


def _pool_operands_read_forward(graph: Graph, mesh: DeviceMesh, out: dict) -> dict:
    """``out`` (:func:`live_intervals`) with each max pooling's forward operand freed after
    its last reader but the pooling's backward, where the backend expands that backward
    (:func:`~autoshard.intra.memory.pool_workspace.pool_backwards`): the expansion reads the
    operand only in its index reduce-window, which XLA:CPU runs at the forward pooling; the
    scatter in the backward pass reads the held indices instead. In wresnet-tiny's
    compiled dp step on 8 devices the stem's ReLU output (``broadcast_maximum_fusion.4``,
    ``f32[1,16,16,8]``, 8 KiB a device), which only the pooling and its backward read,
    lives at positions 74-76 of 361, beside the pooling's padded copy (75-77); the model
    held it to the pooling's backward, through XLA's backward peak (191). Only an operand
    with a buffer of its own: one fused into the pooling is read where its sources are."""
    pools = [p for p in pool_backwards(graph, mesh) if p.forward is not None]
    if not pools:
        return out
    pos = program_positions(graph, mesh.memory_layout.late_updates)
    consumers = merged_consumers(graph, common_values(graph))
    keep = set(out)
    for pool in pools:
        tid = graph.nodes[pool.node].inputs[1]  # (source, operand)
        if tid not in out or graph.tensors[tid].producer is None:
            continue
        first, last = out[tid]
        if last != pos[pool.node]:
            continue  # read later by something else
        readers = buffer_readers(graph, tid, keep, consumers) - {pool.node}
        out[tid] = (first, max([pos[r] for r in readers] + [first]))
    return out


def buffer_readers(graph: Graph, tid: int, keep: set[int], consumers=None) -> set[int]:
    """Nodes that read ``tid``'s buffer: its consumers and, through every value that is
    not materialised (fused into its readers), the readers of that value in turn
    (``consumers``: :func:`~autoshard.intra.memory.common_values.merged_consumers`, the readers
    of a value's merged copies counted as its own)."""
    consumers = consumers or {}
    seen: set[int] = set()
    stack, readers = [tid], set()
    while stack:
        v = stack.pop()
        for c in consumers.get(v, graph.tensors[v].consumers):
            readers.add(c)
            for o in graph.nodes[c].outputs:
                constant = graph.tensors[o].kind in ("literal", "const")
                if o not in keep and o not in seen and not constant:
                    seen.add(o)
                    stack.append(o)
    return readers


# Ops whose output XLA writes into an operand's buffer when that operand dies there:
# scatters and dynamic-update-slice update in place.  Elementwise loop fusions could, but
# XLA:CPU's buffer assignment rarely lets them: in the compiled gpt-350m dp step, 11 of 117
# loop fusions whose same-size operand dies there share its buffer (the scatters and a few
# optimizer updates), the other 106 get a buffer of their own -- among them
# ``exp(logits - max) * g``, which holds a second 200 MiB logits-sized buffer at XLA's peak.
# The model therefore shares for in-place updates only.
IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "dynamic_update_slice"})


def _shared_operand(graph: Graph, node, intervals) -> int | None:
    """The operand whose buffer ``node``'s output reuses, if any (XLA's buffer sharing)."""
    if len(node.outputs) != 1 or node.outputs[0] not in intervals:
        return None
    if node.primitive not in IN_PLACE:
        return None
    candidates = node.inputs[:1]
    out = graph.tensors[node.outputs[0]]
    for tid in candidates:
        t = graph.tensors[tid]
        if (
            tid in intervals
            and t.producer is not None
            and t.nbytes == out.nbytes
            and t.shape == out.shape
            and t.last_use == node.index
            and max(t.consumers) == node.index
        ):
            return tid
    return None


def folded_transpose_operand(
    graph: Graph, node, intervals, narrow_dots_in_f32: bool = False
) -> int | None:
    """The dot result whose buffer ``node``'s output continues, if ``node`` is a transpose
    that XLA:CPU folds into that dot (``folded_dot_transposes``): the transpose is the
    result's only reader, so XLA swaps the dot's operands and the dot writes the transposed
    result itself. JAX's transpose rule makes every weight gradient so (``dot_general(g,
    x)``, then a transpose to the kernel's layout): in mlp-64x1024's step planned on 2x2
    (bench_exact_verify, jax 0.10.2) ``dot.6 = f32[512,512] dot(x, g),
    lhs_contracting_dims={0}`` is the gradient of ``dense_1``'s kernel in its own layout and
    no transpose follows; the model held the dot's result and its transpose, 1 MiB each.
    Not for a narrow result computed in f32 (``narrow_dots_in_f32``): the transpose reads the
    convert down, not the dot. The rule is the graph's alone (the ILP's rows and the
    prediction count the same): where the plan reshards the result before the transpose,
    XLA does not fold (a collective reads it), and a gradient's partial sum is held to the
    combined reduction by its copy (:mod:`autoshard.intra.memory.reshard_copies`). Which
    transposes fold is :func:`~autoshard.intra.memory.layout_copies.folded_dot_transpose`
    (the compute-time pricing's rule too)."""
    tid = folded_dot_transpose(graph, node)
    if tid is None or tid not in intervals or node.outputs[0] not in intervals:
        return None
    if narrow_dots_in_f32 and graph.tensors[tid].dtype in NARROW_FLOATS:
        return None
    return tid
