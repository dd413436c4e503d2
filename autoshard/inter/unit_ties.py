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
the unit's communication leaves these edges out (:func:`tie_seconds`).
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
