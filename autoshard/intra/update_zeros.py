"""The zeros an in-place update writes into, where XLA:CPU keeps them (jax-free).

Takes a graph, the tensors computed from constants only and the in-place update
primitives (:mod:`autoshard.intra.memory` has both); returns, for each update whose
operand is such zeros (a ``scatter-add`` into ``broadcast(0)``: an embedding's gradient,
the log-softmax's one-hot), the add XLA may fold the zeros into.

XLA's algebraic simplifier rewrites ``add(x, scatter(0, i, u))`` into
``scatter(x, i, u)``: the zeros are never a buffer (gpt-350m's one-hot scatter writes
into the other term of the logits gradient, and the bf16 plans' embedding scatter into
the logits dot's term). Where nothing can be folded (the update's result is not read by
one add), or where a collective sits between the update and the add (its result is
resharded for the add: gpt-350m f32 dp all-reduces the embedding scatter's partial sum
in the combined gradient all-reduce before adding it), the zeros are a buffer of their
own; on XLA:CPU, which makes what depends on no computed value at the start of the step
(``early_input_reshards``), from there to the update, which then takes the buffer over
(``wrapped_broadcast.7``, ``f32[51200, 1024]``, 200 MiB, at XLA's peak on gpt-350m f32
dp, docs/truth.md).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from autoshard.ir.graph import Graph

ADDS = frozenset({"add", "add_any"})


@dataclass(frozen=True)
class UpdateZeros:
    """Zeros ``zeros`` (tensor id) that node ``update`` writes into; ``add`` (node index)
    reads the update's result at operand ``slot`` and may absorb the zeros, or is None
    (the zeros are always a buffer)."""

    zeros: int
    update: int
    add: int | None
    slot: int


def update_zeros(
    graph: Graph, data_free: Collection[int], in_place: Collection[str]
) -> list[UpdateZeros]:
    """Every update (a node in ``in_place``) whose operand 0 is in ``data_free``, with the
    add its zeros may be folded into: the update's result's only reader, an add of two
    values of the same shape."""
    out = []
    for node in graph.nodes:
        if node.primitive not in in_place:
            continue
        zeros = node.inputs[0]
        if zeros not in data_free or not graph.tensors[zeros].shape:
            continue
        result = graph.tensors[node.outputs[0]]
        readers = sorted(set(result.consumers))
        add, slot = None, -1
        if len(readers) == 1 and graph.nodes[readers[0]].primitive in ADDS:
            reader = graph.nodes[readers[0]]
            other = [i for i in reader.inputs if i != result.id]
            if len(other) == 1 and graph.tensors[other[0]].shape == result.shape:
                add, slot = reader.index, reader.inputs.index(result.id)
        out.append(UpdateZeros(zeros, node.index, add, slot))
    return out


__all__ = ["ADDS", "UpdateZeros", "update_zeros"]
