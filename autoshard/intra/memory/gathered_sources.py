"""A forward value's own buffer that XLA:CPU frees once its backward readers read a
gathered copy instead (jax-free).

On XLA:CPU (``early_backward_operand_reshards``, ``freed_gathered_sources``) a forward value that a backward dot or
conv reads in another layout (a weight gradient's operand, all-gathered over ``model``)
is copied into that layout right after it is made, and the copy is kept to those dots
(:mod:`autoshard.intra.memory.reshard_copies`).  The value's own buffer is then read by nothing
in the backward pass: XLA frees it after its last reader in its own layout.  In
gpt-tiny's fused ZeRO-3 step on 4x2 (SGD) the GELU output ``multiply_bitcast_fusion.1``
(``[2, 32, 128]`` f32, its forward dot's operand) dies at that dot while its gathered copy
``copy_bitcast_fusion.3`` (``[64, 256]``) lives to the weight gradient's dot; so do the
LayerNorm outputs gathered beside it.  Counting the own buffer to the backward dot as well
over-predicted that step by 17.3% (1,179,012 B against XLA's 1,004,812 B).

:func:`gathered_tails` finds the values this can apply to: made in the forward pass, whose
buffer lives to its last reader only because of backward dots and convs (the *tail*
readers).  Whether the own buffer lives past ``fixed`` (its last other reader) depends on
the plan: to the last tail reader that reads the value in its own layout.
:func:`own_buffer_end` is that end for a plan's prediction; :func:`tail_groups` the same
part of the buffer as the ILP's conditional buffers, so the memory rows count what the
prediction counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec

# Ops whose operands a weight gradient reads from memory (library calls on XLA:CPU), as
# reshard_copies' early backward-operand copies.
TAIL_READERS = frozenset({"dot_general", "conv_general_dilated"})


@dataclass(frozen=True)
class GatheredTail:
    """Tensor ``tid``'s own buffer, born at ``first``: it lives to ``fixed`` whatever the
    plan, and past it to the last of ``readers`` ((program position, node, operand slot),
    in program order: backward dots and convs) that reads it in its own layout.
    ``nbytes``: the whole (unsharded) buffer's bytes."""

    tid: int
    first: int
    fixed: int
    readers: tuple[tuple[int, int, int], ...]
    nbytes: float


def gathered_tails(
    graph: Graph,
    mesh: DeviceMesh,
    own: Sequence[tuple[int, int, int, float]],
    pos: Sequence[int],
    readers_of,
) -> dict[int, GatheredTail]:
    """The own buffers (``own``: (tensor, first, last, whole bytes), as
    :func:`~autoshard.intra.memory.model.tensor_buffers`) whose end the plan decides: a forward
    value's, on a layout that gathers backward operands early, the only output with a
    buffer of its producer, held in one buffer (no f32 or transposed copy beside it), whose
    last reader is a backward dot or conv.  ``readers_of(tid)``: every node that reads the
    buffer (through values fused away too)."""
    layout = mesh.memory_layout
    if not (layout.early_backward_operand_reshards and layout.freed_gathered_sources):
        return {}
    count: dict[int, int] = {}
    for b in own:
        count[b[0]] = count.get(b[0], 0) + 1
    intervals = {tid: (first, last, nbytes) for tid, first, last, nbytes in own}
    out: dict[int, GatheredTail] = {}
    for tid, (first, last, nbytes) in intervals.items():
        t = graph.tensors[tid]
        if count[tid] != 1 or t.producer is None or t.last_use >= len(graph.nodes):
            continue
        node = graph.nodes[t.producer]
        if node.phase != "forward" or sum(o in intervals for o in node.outputs) != 1:
            continue
        tail = {
            c
            for c in t.consumers
            if graph.nodes[c].phase == "backward" and graph.nodes[c].primitive in TAIL_READERS
        }
        fixed = max([first] + [pos[c] for c in readers_of(tid) if c not in tail])
        late = sorted(
            (pos[c], c, slot)
            for c in tail
            for slot, x in enumerate(graph.nodes[c].inputs)
            if x == tid and pos[c] > fixed
        )
        if late and late[-1][0] == last:
            out[tid] = GatheredTail(tid, first, fixed, tuple(late), nbytes)
    return out


def own_buffer_end(
    tail: GatheredTail,
    own_spec: ShardingSpec,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]],
) -> int:
    """Where the plan's own buffer of ``tail.tid`` ends: its last tail reader that reads it
    in its own layout (``operand_specs``: node -> slot -> the layout it is resharded to),
    or ``tail.fixed``."""
    end = tail.fixed
    for at, node, slot in tail.readers:
        spec = operand_specs.get(node, {}).get(slot)
        if spec is None or spec == own_spec:
            end = max(end, at)
    return end


def tail_groups(graph: Graph, tails, strategies, producer, n_in: int, mesh: DeviceMesh):
    """The part of each own buffer past ``fixed`` as
    :class:`~autoshard.intra.memory.reshard_copies.CopyGroup` entries for the ILP's memory rows:
    per layout the producer may give, a buffer of that layout's size, live from
    ``fixed + 1`` while a later tail reader reads the value in that layout."""
    from autoshard.intra.memory.reshard_copies import CopyGroup

    out = []
    for tid, tail in tails.items():
        src, k = producer[tid]
        by_spec: dict[ShardingSpec, list[int]] = {}
        for p, s in enumerate(strategies[src]):
            by_spec.setdefault(s.output_specs[k], []).append(p)
        for spec, ps in by_spec.items():
            size = tail.nbytes * spec.shard_fraction(mesh.mesh)
            if not size:
                continue
            reads: dict[tuple[int, int], set[int]] = {}
            for at, node, slot in tail.readers:
                qs = reads.setdefault((at, n_in + node), set())
                for q, s in enumerate(strategies[n_in + node]):
                    if s.input_specs[slot] is None or s.input_specs[slot] == spec:
                        qs.add(q)
            readers = tuple((at, v, tuple(sorted(qs))) for (at, v), qs in sorted(reads.items()))
            out.append(CopyGroup(src, tuple(ps), size, tail.fixed + 1, None, readers))
    return out


__all__ = ["GatheredTail", "gathered_tails", "own_buffer_end", "tail_groups", "TAIL_READERS"]
