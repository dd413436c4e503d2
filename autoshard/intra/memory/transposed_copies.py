"""The transposed copies XLA:CPU keeps for convs and batched dots, as buffers (jax-free).

Part of the memory model (:mod:`autoshard.intra.memory.model`).  Which values are copied is
:mod:`autoshard.intra.memory.layout_copies`' question; this module says how each copy is
counted, twice over and alike: as (first, last, bytes per device) intervals under a plan's
layouts, for :func:`~autoshard.intra.memory.model.predicted_live_bytes`, and as
:class:`~autoshard.intra.memory.reshard_copies.CopyGroup` entries over the strategies,
for the ILP's :func:`~autoshard.intra.memory.model.memory_rows`:

* a conv's transposed copy of a value (:func:`conv_copy_buffers`), one buffer per layout
  its convs read the value in (:func:`conv_copy_intervals`, :func:`conv_copy_groups`);
* a batched dot's transposed copy of a weight, made at the start of the step, one buffer
  per layout a dot reads it in with one expert a device
  (:func:`transposed_weight_intervals`, :func:`transposed_weight_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.layout_copies import (
    dot_lhs_copy_bytes,
    input_gradient_copy_ends,
    reads_one_batch_row,
    shared_conv_copies,
    transposed_dot_lhs,
    transposed_weight_copies,
)
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec


def conv_copy_buffers(
    graph: Graph, mesh: DeviceMesh, host: frozenset[int] = frozenset()
) -> list[tuple[int, int, int, int, tuple[int, ...]]]:
    """(tensor, first, last, whole bytes, the convs that read it) of each transposed conv
    copy (:func:`~autoshard.intra.memory.layout_copies.shared_conv_copies`), but those of
    ``host`` tensors.  Its layout is the one its convs read the value in (a resharded
    layout, or the value's own)."""
    return [
        (tid, first, last, graph.tensors[tid].nbytes, convs)
        for tid, first, last, convs in shared_conv_copies(graph, mesh)
        if tid not in host
    ]


def conv_copy_intervals(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    host: frozenset[int] = frozenset(),
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each transposed conv copy
    (:func:`conv_copy_buffers`): made from the value as its convs read it, in the layout
    it is resharded to if it is, so a copy read in several layouts is one buffer per
    layout, each kept to the last conv that reads that layout."""
    out = []
    ends = input_gradient_copy_ends(graph, mesh)
    for tid, first, _, nbytes, convs in conv_copy_buffers(graph, mesh, host):
        if tid not in spec_of:
            continue
        read: dict = {}  # layout read -> the last conv reading it
        for c in convs:  # in program order
            node = graph.nodes[c]
            spec = (
                operand_specs.get(c, {}).get(node.inputs.index(tid)) if tid in node.inputs else None
            )
            read[spec or spec_of[tid]] = c
        out += [
            (first, ends.get((tid, c), c), nbytes * spec.shard_fraction(mesh.mesh))
            for spec, c in read.items()
        ]
    return out


def conv_copy_groups(graph: Graph, strategies, producer, n_in: int, mesh, pos, host) -> list:
    """:func:`conv_copy_buffers` as :class:`CopyGroup` entries, as
    :func:`conv_copy_intervals` counts them: per layout a conv may read the value in (its
    own, per layout its producer may give, or one it is resharded to), the convs'
    strategies that read it so; made at the copy's first position, kept while a later
    conv reads that layout.  ``strategies``, ``producer``, ``n_in``: as
    :func:`~autoshard.intra.memory.model.memory_rows` takes them; ``pos``:
    :func:`~autoshard.intra.memory.intervals.program_positions`."""
    out = []
    ends = input_gradient_copy_ends(graph, mesh)
    for tid, first, _, nbytes, convs in conv_copy_buffers(graph, mesh, host):
        src, k = producer[tid]
        every = tuple(range(len(strategies[src])))
        own: dict = {}  # the producer's layout -> its strategies that give it
        for p, s in enumerate(strategies[src]):
            own.setdefault(s.output_specs[k], []).append(p)
        reads: dict = {}  # layout -> conv -> its strategies that read the value in it
        for c in convs:
            node = graph.nodes[c]
            slot = node.inputs.index(tid) if tid in node.inputs else None
            for q, s in enumerate(strategies[n_in + c]):
                spec = s.input_specs[slot] if slot is not None else None
                reads.setdefault(spec, {}).setdefault(c, []).append(q)
        for spec, readers in reads.items():
            rows = tuple(
                sorted(
                    (pos[ends.get((tid, c), c)], n_in + c, tuple(qs)) for c, qs in readers.items()
                )
            )
            sources = own.items() if spec is None else [(spec, every)]
            for layout, ps in sources:
                size = nbytes * layout.shard_fraction(mesh.mesh)
                if size:
                    out.append(CopyGroup(src, tuple(ps), size, pos[first], None, rows))
    return out


def transposed_weight_intervals(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    pos,
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each transposed weight copy
    (:func:`~autoshard.intra.memory.layout_copies.transposed_weight_copies`): made at the
    start, live to its last reader; one per layout that a dot reading one expert a device
    (:func:`~autoshard.intra.memory.layout_copies.reads_one_batch_row`) reads the weight
    in.  ``pos``: :func:`~autoshard.intra.memory.intervals.program_positions`."""
    out = []
    for tid, dots in transposed_weight_copies(graph, mesh).items():
        if tid not in spec_of:
            continue
        last: dict = {}
        for d in dots:
            spec = operand_specs.get(d, {}).get(graph.nodes[d].inputs.index(tid), spec_of[tid])
            if reads_one_batch_row(graph, d, tid, spec, mesh):
                last[spec] = max(last.get(spec, -1), pos[d])
        out += [
            (0, end, graph.tensors[tid].nbytes * spec.shard_fraction(mesh.mesh))
            for spec, end in last.items()
        ]
    return out


def transposed_weight_groups(graph: Graph, strategies, producer, n_in: int, mesh, pos) -> list:
    """:func:`~autoshard.intra.memory.layout_copies.transposed_weight_copies` as
    :class:`CopyGroup` entries, as :func:`transposed_weight_intervals` counts them: per
    weight and layout a dot reads it in with one expert a device, the dots' strategies
    that read it so; made at the start of the step, whatever the weight's own strategy
    (``pos``: :func:`~autoshard.intra.memory.intervals.program_positions`)."""
    out = []
    for tid, dots in transposed_weight_copies(graph, mesh).items():
        src, _ = producer[tid]
        every = tuple(range(len(strategies[src])))
        # per layout a dot may read one expert a device in: the dots' strategies that do
        by_spec: dict = {}
        for d in dots:
            slot = graph.nodes[d].inputs.index(tid)
            for q, s in enumerate(strategies[n_in + d]):
                spec = s.input_specs[slot]
                if spec is not None and reads_one_batch_row(graph, d, tid, spec, mesh):
                    by_spec.setdefault(spec, {}).setdefault(d, []).append(q)
        for spec, readers in by_spec.items():
            size = graph.tensors[tid].nbytes * spec.shard_fraction(mesh.mesh)
            rows = sorted((pos[d], n_in + d, tuple(qs)) for d, qs in readers.items())
            out.append(CopyGroup(src, every, size, 0, None, tuple(rows)))
    return out


def dot_lhs_copy_intervals(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
    pos,
) -> list[tuple[int, int, float]]:
    """(first, last, bytes per device) of each transposed dot lhs copy
    (:func:`~autoshard.intra.memory.layout_copies.transposed_dot_lhs`): made from the lhs
    as the dot reads it, at the dot, and freed after it."""
    return [
        (
            pos[dot],
            pos[dot],
            dot_lhs_copy_bytes(graph, tid, mesh)
            * operand_specs.get(dot, {}).get(0, spec_of.get(tid)).shard_fraction(mesh.mesh),
        )
        for tid, dot in transposed_dot_lhs(graph, mesh)
        if tid in spec_of
    ]


def dot_lhs_copy_groups(graph: Graph, strategies, n_in: int, mesh, pos) -> list[CopyGroup]:
    """:func:`~autoshard.intra.memory.layout_copies.transposed_dot_lhs` as
    :class:`CopyGroup` entries, as :func:`dot_lhs_copy_intervals` counts them: per dot and
    size, the dot's strategies that read its lhs at that size; live at the dot only."""
    out = []
    for tid, dot in transposed_dot_lhs(graph, mesh):
        node, whole = n_in + dot, dot_lhs_copy_bytes(graph, tid, mesh)
        by_size: dict[float, list[int]] = {}
        for q, s in enumerate(strategies[node]):
            spec = s.input_specs[0]
            if spec is not None:
                by_size.setdefault(whole * spec.shard_fraction(mesh.mesh), []).append(q)
        reader = ((pos[dot], node, tuple(range(len(strategies[node])))),)
        out += [
            CopyGroup(node, tuple(qs), size, pos[dot], pos[dot], reader)
            for size, qs in by_size.items()
            if size
        ]
    return out
