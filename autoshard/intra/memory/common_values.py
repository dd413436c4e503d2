"""Values XLA computes once: the op graph's common subexpressions (jax-free).

Takes an op :class:`~autoshard.ir.graph.Graph`; returns, for the memory model
(:mod:`autoshard.intra.memory.model`), which tensors are the same value as an earlier one
(:func:`common_values`) and every tensor's readers with its copies' readers merged in
(:func:`merged_consumers`).

XLA's CSE pass merges instructions that apply the same operation, with the same
parameters, to the same operands.  The traced step is one flat program, but a
``jax.checkpoint``'s backward recompute keeps its operands behind ``optimization_barrier``
nodes, as JAX lowers it (:func:`autoshard.trace.flatten._recompute_behind_barrier`), so it
is not merged into the forward value it repeats: the fused GELU's ``tanh`` is computed in
the forward pass and again in the backward, and nothing holds it in between.  (Until
2026-11-28 the tracer inlined the body bare; XLA then merged the recompute and kept the
forward's ``tanh`` -- 3.22 GB on gpt-350m -- and this module modelled that merge.)
What it still merges: equal computations of the same operands anywhere in the step.

Two literals are equal when their dtype and value are; a node whose params hold a
sub-program, or that has no operands, is never merged (nothing to compare it by).
"""

from __future__ import annotations

from autoshard.ir.graph import Graph

# Ops that draw random bits or read state: never the same value twice.
NOT_MERGED = frozenset({"rng_uniform", "rng_bit_generator", "random_bits", "random_seed"})


def _operand_key(graph: Graph, tid: int, same: dict[int, int]):
    t = graph.tensors[tid]
    if t.kind == "literal":
        if t.literal is None:
            return ("tensor", tid)  # a literal array: equal only to itself
        return ("literal", t.dtype, t.shape, repr(t.literal))
    return ("tensor", same.get(tid, tid))


def common_values(graph: Graph) -> dict[int, int]:
    """Tensor -> the earlier tensor XLA's CSE makes it (only tensors that are merged)."""
    same: dict[int, int] = {}
    first: dict[tuple, tuple[int, ...]] = {}
    for node in graph.nodes:
        if not node.inputs or node.primitive in NOT_MERGED:
            continue
        try:
            params = repr(sorted(node.params.items()))
        except TypeError:
            continue
        if "jaxpr" in params:
            continue
        key = (
            node.primitive,
            params,
            tuple(_operand_key(graph, i, same) for i in node.inputs),
            tuple((graph.tensors[o].shape, graph.tensors[o].dtype) for o in node.outputs),
        )
        earlier = first.setdefault(key, node.outputs)
        if earlier is not node.outputs:
            same.update(zip(node.outputs, earlier, strict=True))
    return same


def merged_consumers(graph: Graph, same: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Tensor -> the nodes that read it or a value merged into it (:func:`common_values`),
    for every tensor that has a merged copy; the copies themselves are read by nobody."""
    out: dict[int, set[int]] = {}
    for dup, kept in same.items():
        out.setdefault(kept, set(graph.tensors[kept].consumers)).update(
            graph.tensors[dup].consumers
        )
        out.setdefault(dup, set())
    return {tid: tuple(sorted(users)) for tid, users in out.items()}
