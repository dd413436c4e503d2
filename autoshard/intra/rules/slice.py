"""Sharding rules for static slices (jax-free): ``slice`` and ``pad``.

A ``slice`` keeps every dim it does not cut, so a dim taken whole (start 0, full length,
stride 1) may stay split over the same mesh axes on operand and output; a cut dim is
never split (XLA would have to move data to re-align the pieces).  Partial sums pass
through (a slice is linear).  The tracer makes these when it unrolls a ``scan``: slice
``i`` of a stacked ``[L, ...]`` parameter is read by iteration ``i``.
"""

from __future__ import annotations

from autoshard.intra.rules.registry import OUT, NodeContext, Slot, register


@register("slice")
def _slice(ctx: NodeContext) -> list[Slot]:
    shape = ctx.in_shapes[0]
    start = ctx.node.params["start_indices"]
    limit = ctx.node.params["limit_indices"]
    strides = ctx.node.params.get("strides") or (1,) * len(shape)
    whole = [
        d for d in range(len(shape)) if start[d] == 0 and limit[d] == shape[d] and strides[d] == 1
    ]
    return [Slot("shard", ((0, d), (OUT, d))) for d in whole] + [Slot("through", ((0, -1),))]


@register("pad")
def _pad(ctx: NodeContext) -> list[Slot]:
    """``pad`` (the transpose of a slice: the fused program's q/k/v kernel gradients) keeps
    every dim it does not pad, which may stay split over the same mesh axes on operand and
    output; a padded dim is never split.  Partial sums do not pass: the padding value is an
    operand of its own, not summed."""
    config = ctx.node.params["padding_config"]
    whole = [d for d, (lo, hi, interior) in enumerate(config) if lo == hi == interior == 0]
    return [Slot("shard", ((0, d), (OUT, d))) for d in whole]
