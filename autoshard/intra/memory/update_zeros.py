"""The zeros an in-place update writes into, where XLA:CPU keeps them (jax-free).

Takes a graph, the tensors computed from constants only and the in-place update
primitives (:mod:`autoshard.intra.memory.model` has both); returns, for each update whose
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

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec

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


def foldable_zeros(zeros: list[UpdateZeros], mesh: DeviceMesh) -> list[UpdateZeros]:
    """Of ``zeros`` (:func:`update_zeros`), those an add may absorb, on a backend that
    makes them early (``early_input_reshards``); the others are buffers of
    :func:`autoshard.intra.memory.intervals.live_intervals`."""
    if not mesh.memory_layout.early_input_reshards:
        return []
    return [z for z in zeros if z.add is not None]


def zeros_bytes(graph: Graph, z, spec: ShardingSpec, mesh: DeviceMesh) -> float:
    return graph.tensors[z.zeros].nbytes * spec.shard_fraction(mesh.mesh)


def zeros_groups(graph, zeros, strategies, producer, n_in, mesh, pos) -> list[CopyGroup]:
    """:func:`foldable_zeros` (``zeros``) as :class:`CopyGroup` entries: the zeros are a buffer from
    the start to their update when the add reads the update's result in another layout
    than the update gives (per layout the add may want, and per size of the update's
    result, which writes into the zeros in place and so has their layout)."""
    out = []
    for z in zeros:
        result = graph.nodes[z.update].outputs[0]
        src, k = producer[result]
        wants: dict[ShardingSpec, list[int]] = {}
        for q, s in enumerate(strategies[n_in + z.add]):
            if s.input_specs[z.slot] is not None:
                wants.setdefault(s.input_specs[z.slot], []).append(q)
        for spec, qs in wants.items():
            by_size: dict[float, list[int]] = {}
            for p, s in enumerate(strategies[src]):
                if s.output_specs[k] != spec:
                    by_size.setdefault(zeros_bytes(graph, z, s.output_specs[k], mesh), []).append(p)
            reader = ((pos[z.add], n_in + z.add, tuple(qs)),)
            end = max(0, pos[z.update] - 1)
            out += [CopyGroup(src, tuple(ps), b, 0, end, reader) for b, ps in by_size.items() if b]
    return out


__all__ = ["ADDS", "UpdateZeros", "foldable_zeros", "update_zeros", "zeros_bytes", "zeros_groups"]
