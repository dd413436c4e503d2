"""Sharding rules of the reductions over array dims (jax-free).

Takes a reduction node's context (:class:`~autoshard.intra.rules.registry.NodeContext`);
returns its slots: every kept dim is a ``shard`` slot shared with the output; a reduced
dim is a ``reduce`` slot when XLA's SPMD partitioner can split it -- each device reduces
its shard and an all-reduce combines the partial results with the same computation
(``reduce_sum``: a sum, ``reduce_max`` / ``reduce_min``: a max / min, recorded as the
output spec's ``partial_op``) -- and is left whole otherwise (``argmax``, ``argmin``,
``reduce_prod``, ``reduce_and``, ``reduce_or``).
"""

from __future__ import annotations

from autoshard.intra.rules.registry import OUT, NodeContext, Slot, register

# Reductions that may split the dim they reduce, and how the partial results combine
# (XLA's partitioner: a local reduction, then an all-reduce with that computation).
SPLIT_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


@register(
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
)
def _reduce(ctx: NodeContext) -> list[Slot]:
    axes = tuple(ctx.node.params["axes"])
    src = ctx.in_shapes[0]
    slots = []
    out_dim = 0
    for d in range(len(src)):
        if d in axes:
            op = SPLIT_REDUCTIONS.get(ctx.node.primitive)
            if op is not None:  # partial results on every device, then an all-reduce
                slots.append(Slot("reduce", ((0, d),), op))
        else:
            slots.append(Slot("shard", ((0, d), (OUT, out_dim))))
            out_dim += 1
    if ctx.node.primitive == "reduce_sum":
        slots.append(Slot("through", ((0, -1),)))
    return slots
