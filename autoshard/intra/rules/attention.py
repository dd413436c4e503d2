"""Sharding rules of the fused attention operators (jax-free).

Takes a fused attention node's context (:class:`~autoshard.intra.rules.registry.NodeContext`:
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

Compute cost (:func:`attention_seconds`, the node cost of
:func:`~autoshard.intra.rules.strategies.strategy_seconds` on a priced mesh): on a device with a
fused kernel (``mesh.attention``) the shard's FLOPs at the attention table's efficiency
for its ``(B x H, S, D)``; on one without (V100: cuDNN's flash attention needs Ampere or
later) what XLA's unfused attention runs there -- its batched GEMMs timed by the GEMM
table (forward ``QK^T`` and ``PV``; backward ``dV``, ``dP``, ``dQ``, ``dK``: no recompute,
the unfused program keeps the probabilities) plus the softmax's memory-bound passes over
the ``S x S`` block (forward: read the scores, write the probabilities; backward: read the
probabilities and ``dP``, write ``dS``), each byte once: the GEMMs' own reads of their
operands are in the GEMM time, not counted again.

An operand this rule cannot place (a saved tensor of another kernel's layout: a rank
other than 3 or 4, or sizes that match neither layout) gives no rule, so the node is
planned replicated with the registry's one warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.intra.rules.registry import OUT, NodeContext, Slot, register
from autoshard.ir.primitives import ATTENTION, ATTENTION_FWD

if TYPE_CHECKING:
    from autoshard.hardware.mesh import DeviceMesh
    from autoshard.ir.spec import ShardingSpec

# passes over the S x S block the unfused softmax makes, forward and backward
UNFUSED_SOFTMAX_PASSES = {False: 2, True: 3}


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


def attention_seconds(ctx: NodeContext, spec: ShardingSpec, factor: int, mesh: DeviceMesh) -> float:
    """Per-device seconds of a fused attention node whose ``[B, S, H, D]`` result (``out``
    forward, ``dq`` backward) is in layout ``spec``, its work split ``factor`` ways, on a
    mesh with a GEMM timing (module docstring)."""
    node = ctx.node
    backward = node.primitive not in ATTENTION_FWD
    b, sq, h, d = ctx.out_shapes[0]
    sk = (ctx.in_shapes[1] if not backward else ctx.out_shapes[1])[1]
    b //= mesh.mesh.size(spec.dims[0])
    h //= mesh.mesh.size(spec.dims[2])
    if mesh.attention is not None and ctx.itemsize == 2:  # flash kernels are 16-bit only
        return mesh.attention.seconds(node.flops / factor, b * h, sq, d, backward)
    gemms = (  # (M, N, K) per (batch x head)
        ((sk, d, sq), (sq, sk, d), (sq, d, sk), (sk, d, sq))
        if backward
        else ((sq, sk, d), (sq, d, sk))
    )
    seconds = sum(mesh.gemm.seconds(b * h, m, n, k, ctx.itemsize) for m, n, k in gemms)
    softmax_bytes = UNFUSED_SOFTMAX_PASSES[backward] * b * h * sq * sk * ctx.itemsize
    if softmax_bytes and mesh.hbm_bandwidth < float("inf"):
        seconds += softmax_bytes / mesh.hbm_bandwidth
    return seconds
