"""Folding a deep chain of identical blocks onto a shallow trace of it (jax-free).

A GPT of hundreds of blocks plans the same as one of three: deep block 1 is shallow block
1, the deep last block the shallow last block, and every other deep block the shallow
second block (their units, junctions and borrowed parameters are the shallow ones).
:class:`~autoshard.inter.stage_cost.IntraStageCost` (``deep_layers``) prices the deep
step from the shallow trace with the maps :func:`fold_chain` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Graph


def crossing_pairs(graph: Graph) -> tuple[tuple[int, int], ...]:
    """(producer layer, consumer layer) pairs that pass a tensor, as layer indices."""
    index = {name: i for i, name in enumerate(graph.layers)}
    pairs = set()
    for n in graph.nodes:
        if n.layer not in index:
            continue
        for t in n.inputs:
            p = graph.tensors[t].producer
            if p is not None and graph.nodes[p].layer in index:
                a, b = index[graph.nodes[p].layer], index[n.layer]
                if a != b:
                    pairs.add((a, b))
    return tuple(sorted(pairs))


def fold_chain(
    names: Sequence[str],
    crossings: Sequence[tuple[int, int]],
    signatures: Sequence,
    deep_layers: int,
) -> tuple[tuple[int, ...], tuple[str, ...], dict[tuple[int, int], tuple[int, int]]]:
    """A shallow trace's layers ``names`` (first, at least three identical blocks, last:
    ``signatures`` says which are identical; ``crossings``: :func:`crossing_pairs`) as a
    chain of ``deep_layers`` layers: (deep layer -> its shallow layer, the deep layers'
    names, deep crossing pair -> the shallow pair it stands for).  Raises ``ValueError``
    where the trace is not such a chain (a crossing other than between neighbours or
    between the first and last layer, blocks that differ, a block name without an index)."""
    last = len(names) - 1  # shallow
    blocks = signatures[1:last]
    if len(blocks) < 3 or len(set(blocks)) != 1 or deep_layers < len(signatures):
        raise ValueError(
            f"folding needs a trace of >= 3 identical blocks between a first and a last "
            f"layer and at least as many deep layers; got signatures {tuple(signatures)} "
            f"for {deep_layers} deep layers"
        )
    for a, b in crossings:
        if abs(a - b) != 1 and {a, b} != {0, last}:
            raise ValueError(
                f"layers {names[a]} and {names[b]} pass a tensor: not a chain of "
                "neighbours, so the trace cannot be folded to another depth"
            )
    n = deep_layers - 1  # deep last
    shallow_of = (0, 1, *([2] * (n - 3)), last - 1, last)
    middle = names[1]
    stem = middle.rstrip("0123456789")
    if stem == middle:
        raise ValueError(f"block name {middle!r} has no index to count deep blocks with")
    first_index = int(middle[len(stem) :])
    deep_names = (names[0], *(f"{stem}{first_index + i}" for i in range(n - 1)), names[last])
    deep: dict[tuple[int, int], tuple[int, int]] = {}
    for a, b in crossings:
        if {a, b} == {0, last}:
            deep[(0 if a == 0 else n, 0 if b == 0 else n)] = (a, b)
        elif min(a, b) == 0:
            deep[(a, b)] = (a, b)
        elif max(a, b) == last:
            deep[(a - last + n, b - last + n)] = (a, b)
        else:  # block to block, one way or the other
            for i in range(1, n - 1):
                deep[(i + a - min(a, b), i + b - min(a, b))] = (a, b)
    return shallow_of, deep_names, deep
