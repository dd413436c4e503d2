"""Sharding rules of the fused attention operators (jax-free).

Takes a fused attention node's context (:class:`~autoshard.intra.strategies.NodeContext`:
``attention_fwd[_causal]`` reads ``q, k, v`` and writes ``out`` and the log-sum-exp
``lse``; ``attention_bwd[_causal]`` reads ``q, k, v, out, lse, d_out`` and writes
``dq, dk, dv``; :mod:`autoshard.models.attention`); returns its slots.

Attention is independent per sequence and per head, so two dims may be split, each on
every operand and result at once (``shard`` slots; no partial sums anywhere):

* the batch -- dim 0 of everything;
* the heads -- dim 2 of each ``[B, S, H, D]`` tensor, dim 1 of ``lse`` (``[B, H, S]``).

Either, both (the batch over one mesh axis and the heads over another), or neither
(replicated) -- the enumeration offers every assignment that divides evenly.  The
sequence is never split: each query row reads every key and value row before it, so the
kernel needs its ``k`` and ``v`` whole (a split sequence is ring attention, a different
algorithm with its own collectives, which neither XLA's partitioner nor cuDNN runs for
this call).  The head dim ``D`` is contracted inside the kernel and never split either.

An operand this rule cannot place (a saved tensor of another kernel's layout: a rank
other than 3 or 4, or sizes that match neither layout) gives no rule, so the node is
planned replicated with the registry's one warning.
"""

from __future__ import annotations

from autoshard.intra.strategies import OUT, NodeContext, Slot, register
from autoshard.ir.primitives import ATTENTION, ATTENTION_FWD


def _heads_dim(shape: tuple[int, ...], batch: int, heads: int) -> int | None:
    """Which dim of an attention operand or result holds the heads: 2 of ``[B, S, H, D]``,
    1 of ``[B, H, S]`` (the log-sum-exp) or of ``[B, H, S, 1]`` (softmax statistics
    kept 4-D); None when the shape is neither."""
    if not shape or shape[0] != batch:
        return None
    if len(shape) == 4 and shape[2] == heads and shape[3] != 1:
        return 2
    if len(shape) in (3, 4) and shape[1] == heads:
        return 1
    return None


@register(*ATTENTION)
def _attention(ctx: NodeContext) -> list[Slot] | None:
    # the [B, S, H, D] that fixes B and H: out forward, dq backward
    ref = ctx.out_shapes[0]
    if len(ref) != 4:
        return None
    batch, heads = ref[0], ref[2]
    batch_pos, heads_pos = [], []
    tensors = [(i, s) for i, s in enumerate(ctx.in_shapes) if not ctx.in_literal[i]]
    tensors += [(OUT - k, s) for k, s in enumerate(ctx.out_shapes)]
    for where, shape in tensors:
        d = _heads_dim(shape, batch, heads)
        if d is None:
            return None
        batch_pos.append((where, 0))
        heads_pos.append((where, d))
    if ctx.node.primitive in ATTENTION_FWD and len(ctx.in_shapes) != 3:
        return None
    return [Slot("shard", tuple(batch_pos)), Slot("shard", tuple(heads_pos))]
