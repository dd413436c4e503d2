"""Sub-graphs of a traced step by layer: the pieces the stage costs plan one at a time.

:func:`range_subgraph` cuts the forward, backward and update equations of layers
``[start, end)`` out of a step's :class:`~autoshard.ir.graph.Graph` as a Graph of their
own (tensors made outside the range enter as inputs); :func:`layer_signatures` says which
layers plan identically; :func:`param_owner_layers` which layer updates each state input.
Jax-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.graph import Graph, build_graph
from autoshard.ir.records import EqnRecord, TensorRecord, TraceRecords


@dataclass(frozen=True)
class RangeGraph:
    """The sub-graph of layers ``[start, end)`` and where its pieces come from."""

    graph: Graph
    start: int
    end: int
    node_ids: tuple[int, ...]  # original node index of each sub-graph node
    tensor_ids: tuple[int, ...]  # original tensor id of each sub-graph tensor
    boundary_inputs: tuple[int, ...]  # original ids of tensors made outside, now inputs


@dataclass(frozen=True)
class RangeIds:
    """Where the sub-graph of layers ``[start, end)`` comes from, without the sub-graph
    (:func:`range_ids`): enough to map a plan made for an identical range onto it."""

    start: int
    end: int
    node_ids: tuple[int, ...]  # original node index of each sub-graph node
    tensor_ids: tuple[int, ...]  # original tensor id of each sub-graph tensor
    inputs: tuple[int, ...]  # the sub-graph's inputs (sub-graph tensor ids), in order


def _cut(graph: Graph, start: int, end: int, nodes=None):
    """The pieces of :func:`range_subgraph`: (nodes, inputs, boundary, alias_of, outputs,
    order), ids original; ``nodes``: the range's nodes where the caller has them."""
    if not 0 <= start < end <= len(graph.layers):
        raise ValueError(
            f"layer range [{start}, {end}) is not a non-empty range of the "
            f"{len(graph.layers)} layers {list(graph.layers)}"
        )
    if nodes is None:
        in_range = set(graph.layers[start:end])
        nodes = [n for n in graph.nodes if n.layer in in_range]
    chosen = {n.index for n in nodes}
    made = {t for n in nodes for t in n.outputs}
    alias_of = {dst: src for src, dst in graph.aliases if dst in made}
    program_inputs = set(graph.inputs)
    read = {t for n in nodes for t in n.inputs} | set(alias_of.values())
    inputs = [t for t in graph.inputs if t in read]
    boundary = sorted(
        t
        for t in read
        if t not in made
        and t not in program_inputs
        and graph.tensors[t].kind not in ("literal", "const")
    )
    inputs += boundary
    program_outputs = set(graph.outputs)
    outputs = [
        t
        for t in sorted(made)
        if t in program_outputs or any(c not in chosen for c in graph.tensors[t].consumers)
    ]
    # renumber tensors densely, in order of first mention
    order: dict[int, int] = {}
    for t in inputs:
        order.setdefault(t, len(order))
    for n in nodes:
        for t in (*n.inputs, *n.outputs):
            order.setdefault(t, len(order))
    return nodes, inputs, boundary, alias_of, outputs, order


def range_ids(graph: Graph, start: int, end: int, nodes=None) -> RangeIds:
    """:func:`range_subgraph`'s ids without building its Graph (``nodes``: the range's
    nodes, in order, where the caller has them)."""
    nodes, inputs, _, _, _, order = _cut(graph, start, end, nodes)
    return RangeIds(
        start, end, tuple(n.index for n in nodes), tuple(order), tuple(order[t] for t in inputs)
    )


def range_subgraph(graph: Graph, start: int, end: int) -> RangeGraph:
    """Forward, backward and update equations of layers ``[start, end)`` as a Graph.

    Inputs: program inputs the range reads or updates (kinds kept) and tensors made by
    equations outside the range (kind ``"data"``).  Outputs: what the range makes that
    the rest of the program reads, and program outputs made in the range.  Aliases: the
    range's state and its updates.
    """
    nodes, inputs, boundary, alias_of, outputs, order = _cut(graph, start, end)
    boundary_set = set(boundary)
    tensors = []
    for old, new in order.items():
        t = graph.tensors[old]
        kind = "data" if old in boundary_set else t.kind
        tensors.append(TensorRecord(new, t.shape, t.dtype, kind, t.path, t.literal))
    eqns = tuple(
        EqnRecord(
            i,
            n.primitive,
            tuple(order[t] for t in n.inputs),
            tuple(order[t] for t in n.outputs),
            n.params,
            n.layer,
            n.phase,
            n.module_path,
            n.elementwise,
        )
        for i, n in enumerate(nodes)
    )
    records = TraceRecords(
        tensors=tuple(tensors),
        eqns=eqns,
        inputs=tuple(order[t] for t in inputs),
        outputs=tuple(order[t] for t in outputs),
        aliases=tuple((order[src], order[dst]) for dst, src in alias_of.items()),
        layers=graph.layers[start:end],
    )
    return RangeGraph(
        build_graph(records),
        start,
        end,
        tuple(n.index for n in nodes),
        tuple(order),
        tuple(boundary),
    )


def layer_signatures(graph: Graph) -> tuple[int, ...]:
    """Per layer, a small id shared by layers with the same equations (primitive, phase,
    operand and result shapes and dtypes, in order): layers that plan identically."""
    by_layer: dict[str, list] = {name: [] for name in graph.layers}
    for n in graph.nodes:
        if n.layer in by_layer:
            by_layer[n.layer].append(
                (
                    n.primitive,
                    n.phase,
                    tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.inputs),
                    tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.outputs),
                )
            )
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(tuple(by_layer[name]), len(ids)) for name in graph.layers)


def param_owner_layers(graph: Graph) -> dict[int, int]:
    """State input tensor id -> index of the layer whose update equations write it."""
    producer_layer = {}
    for src, dst in graph.aliases:
        p = graph.tensors[dst].producer
        if p is not None and graph.nodes[p].layer in graph.layers:
            producer_layer[src] = graph.layers.index(graph.nodes[p].layer)
    return producer_layer
