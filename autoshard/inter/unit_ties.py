"""The junction between two identical layers, priced inside the layer's own ILP.

A stage unit's ILP (:class:`autoshard.inter.stage_cost.IntraStageCost`) sees the tensors
entering its layer from another layer (the activation from the layer before, the
cotangent from the layer after) as inputs, and an input costs nothing in any spec.  So a
replicated input -- from which every read is a free slice -- is as good as any, and the
ILP may read a cotangent whole over the data-parallel axis (computing a weight gradient
without its data-parallel reduction) as if that cost nothing; the junction then pays an
all-gather of the whole batch's cotangent per layer (gpt-39b on a 16 x 8 logical mesh:
30 ms per block per micro-batch, half the stage's latency; docs/simulator.md).

Where the layer before or after has the same signature (a chain of identical blocks,
planned once), the tensor crossing into input ``k`` is the unit's own output ``j``.  An
edge between the ILP node making output ``j`` and input ``k``'s node prices that
junction in the ILP (seconds to reshard the output's spec into the input's), so the plan
chooses its layouts knowing what crossing between blocks costs.  The junction itself is
priced outside the unit (:meth:`~autoshard.inter.stage_cost.IntraStageCost.junction`):
the unit's communication (its plan's predicted collectives) never holds these edges,
which :func:`tie_seconds` prices.

Where a layer of another signature makes the input (the head's activation from the last
block), that layer's unit is planned first and the input's node costs, per spec, the
reshard from the spec that plan makes it in (:func:`with_feeds`); and where a layer of
another signature planned first reads an output (the first block reads the embedding's),
the node making it costs, per strategy, the reshard into that plan's reads
(:func:`with_drains`). Both are the junction's, not in the unit's communication either
(:func:`fed_seconds` prices them).
"""

from __future__ import annotations

import dataclasses

from autoshard.intra.cost.resharding import reshard


def self_ties(graph, rg_of, crossings, signatures, pair_rep) -> dict:
    """Signature -> ((input position, output position), ...): the inputs of that
    signature's unit that another layer of the same signature makes, as the unit's own
    output (``rg_of(layer)``: a layer's :class:`~autoshard.inter.subgraph.RangeGraph`;
    ``crossings``: (producer, consumer) layer pairs; ``pair_rep``: pair -> the shallow
    pair that stands for it)."""
    ties: dict = {}
    for a, b in crossings:
        if signatures[a] != signatures[b]:
            continue
        sa, sb = pair_rep[(a, b)]
        ga, gb = rg_of(sa), rg_of(sb)
        out_pos = {ga.tensor_ids[t]: j for j, t in enumerate(ga.graph.outputs)}
        found = ties.setdefault(signatures[a], set())
        for k, tid in enumerate(gb.graph.inputs):
            if gb.tensor_ids[tid] in out_pos:
                found.add((k, out_pos[gb.tensor_ids[tid]]))
    return {sig: tuple(sorted(pairs)) for sig, pairs in ties.items() if pairs}


def feeds(rg_of, crossings, signatures, ties) -> dict:
    """Signature -> ((input position, producer layer, output position), ...): the inputs
    of that signature's unit that a layer of another signature makes (the head's
    activation from the last block, the embedding's cotangent from the first), but not
    the inputs :func:`self_ties` ties (a block's input from the embedding is where the
    other blocks' inputs come from the block before)."""
    return _across(rg_of, crossings, signatures, ties, inputs=True)


def drains(rg_of, crossings, signatures, ties) -> dict:
    """Signature -> ((output position, consumer layer, input position), ...): the outputs
    of that signature's unit that a layer of another signature reads (the embedding's
    activation, read by the first block), but not the outputs :func:`self_ties` ties."""
    return _across(rg_of, crossings, signatures, ties, inputs=False)


def _across(rg_of, crossings, signatures, ties, inputs: bool) -> dict:
    """:func:`feeds` (``inputs``: the consumer's inputs made by the producer) or
    :func:`drains` (the producer's outputs read by the consumer), per crossing of two
    signatures."""
    found: dict = {}
    for a, b in crossings:
        if signatures[a] == signatures[b]:
            continue
        ga, gb = rg_of(a), rg_of(b)
        if inputs:  # b's inputs that a makes
            sig, own, mine, other, theirs, layer = (
                signatures[b],
                gb,
                gb.graph.inputs,
                ga,
                ga.graph.outputs,
                a,
            )
        else:  # a's outputs that b reads
            sig, own, mine, other, theirs, layer = (
                signatures[a],
                ga,
                ga.graph.outputs,
                gb,
                gb.graph.inputs,
                b,
            )
        at = {other.tensor_ids[t]: p for p, t in enumerate(theirs)}
        tied = {pair[0 if inputs else 1] for pair in ties.get(sig, ())}
        rows = found.setdefault(sig, {})
        for p, tid in enumerate(mine):
            if own.tensor_ids[tid] in at and p not in tied:
                rows.setdefault(p, (p, layer, at[own.tensor_ids[tid]]))
    return {sig: tuple(rows[p] for p in sorted(rows)) for sig, rows in found.items() if rows}


def with_drains(ip, reads, options):
    """``ip`` with the node making output ``j`` costing, per strategy, the reshard from
    the spec it makes the output in to the specs the consuming plan reads it in
    (``reads``: ((j, specs), ...)). Returns (the new IntraProblem, ((node, its added
    costs), ...))."""
    from autoshard.intra.cost.consumers import reshard_to_consumers

    graph = ip.graph
    added = []
    for j, specs in reads:
        out = graph.tensors[graph.outputs[j]]
        if out.producer is None:
            continue
        node = ip.node_of(out.producer)
        pos = graph.nodes[out.producer].outputs.index(graph.outputs[j])
        item = max(out.nbytes // max(out.size, 1), 1)
        row = tuple(
            reshard_to_consumers(s.output_specs[pos], specs, out.shape, item, ip.mesh, options).cost
            for s in ip.strategies[node]
        )
        added.append((node, row))
    return _with_node_costs(ip, added)


def with_feeds(ip, made, options):
    """``ip`` with input ``k``'s node costing, per spec, the reshard from the spec its
    producer's plan makes it in (``made``: ((k, spec), ...)). Returns (the new
    IntraProblem, ((k, that input's costs), ...))."""
    added = []
    for k, src in made:
        t = ip.graph.tensors[ip.graph.inputs[k]]
        item = max(t.nbytes // max(t.size, 1), 1)
        row = tuple(
            reshard(src, h.output_specs[0], t.shape, item, ip.mesh, options).cost
            for h in ip.strategies[k]
        )
        added.append((k, row))
    return _with_node_costs(ip, added)


def _with_node_costs(ip, added):
    """``ip`` with each ``(node, row)`` of ``added`` added to that node's costs per
    strategy; returns (the new IntraProblem, ``added``)."""
    if not added:
        return ip, ()
    costs = list(ip.problem.node_costs)
    for node, row in added:
        costs[node] = tuple(c + r for c, r in zip(costs[node], row, strict=True))
    problem = dataclasses.replace(ip.problem, node_costs=tuple(costs))
    return dataclasses.replace(ip, problem=problem), tuple(added)


def fed_seconds(added, strategy) -> float:
    """Seconds the solution ``strategy`` pays on the inputs :func:`with_feeds` priced."""
    return sum(row[strategy[k]] for k, row in added)


def with_ties(ip, pairs, options):
    """``ip`` with an edge per ``(input position, output position)`` of ``pairs``: from
    the node making the output to the input's node, costing the reshard of the one's spec
    into the other's. Returns (the new IntraProblem, the indices of the added edges)."""
    graph = ip.graph
    edges, added = list(ip.problem.edges), []
    for k, j in pairs:
        out = graph.tensors[graph.outputs[j]]
        if out.producer is None:
            continue  # an input passed through: nothing makes it
        src = ip.node_of(out.producer)
        pos = graph.nodes[out.producer].outputs.index(graph.outputs[j])
        t = graph.tensors[graph.inputs[k]]
        item = max(t.nbytes // max(t.size, 1), 1)
        costs = tuple(
            tuple(
                reshard(
                    s.output_specs[pos], h.output_specs[0], t.shape, item, ip.mesh, options
                ).cost
                for h in ip.strategies[k]
            )
            for s in ip.strategies[src]
        )
        added.append(len(edges))
        edges.append(_edge(src, k, costs))
    if not added:
        return ip, ()
    problem = dataclasses.replace(ip.problem, edges=tuple(edges))
    consumers = tuple(ip.edge_consumers) + ((),) * len(added)
    return dataclasses.replace(ip, problem=problem, edge_consumers=consumers), tuple(added)


def tie_seconds(problem, added, strategy) -> float:
    """Seconds the solution ``strategy`` pays on the edges ``added`` by :func:`with_ties`."""
    return sum(
        problem.edges[e].costs[strategy[problem.edges[e].src]][strategy[problem.edges[e].dst]]
        for e in added
    )


def _edge(src, dst, costs):
    from autoshard.intra.ilp.problem import EdgeCost

    return EdgeCost(src, dst, costs)
