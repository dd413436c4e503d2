"""Classes of jaxpr primitives, by name and by kind, shared by the passes (no jax).

One definition each of the primitive sets more than one module classifies by: the op
graph's FLOP rules (:mod:`autoshard.ir.graph`), the sharding rules
(:mod:`autoshard.intra.rules.strategies`), the sharding problem (:mod:`autoshard.intra.problem.build`)
and the memory model (:mod:`autoshard.intra.memory.model`).  Tables that encode one module's
own decisions (what XLA materialises, which ops follow their operand) live beside it.
"""

from __future__ import annotations

# Data movement and bookkeeping: no arithmetic.
ZERO_FLOP = frozenset(
    "reshape transpose broadcast_in_dim gather slice dynamic_slice dynamic_update_slice "
    "concatenate split convert_element_type iota select_n copy copy_p stop_gradient squeeze "
    "expand_dims pad rev reduce_precision bitcast_convert_type sharding_constraint "
    "optimization_barrier".split()
)

# Elementwise arithmetic, comparisons and transcendentals: one result per output element.
ELEMENTWISE = frozenset(
    "add sub mul div neg max min abs sign exp exp2 log log1p tanh logistic sqrt rsqrt cbrt "
    "square pow sin cos tan erf erfc erf_inv is_finite floor ceil round eq ne lt le gt ge "
    "and or not xor add_any rem atan2 clamp nextafter expm1 "
    "integer_pow one_minus_square polynomial".split()
)


def elementwise_shapes(
    in_shapes: tuple[tuple[int, ...], ...], out_shapes: tuple[tuple[int, ...], ...]
) -> bool:
    """Whether an op's shapes are those of an elementwise op: one result, at least one
    operand of its shape, and every other operand of its shape, of its rank with size-1
    dims (broadcast), or a scalar.  Shapes alone do not make an op elementwise (a
    Cholesky factor or a cumulative sum keeps its operand's shape too): see
    :func:`is_elementwise`."""
    if len(out_shapes) != 1:
        return False
    out = out_shapes[0]
    if not out:
        return all(not s for s in in_shapes)
    fits = all(
        not s or (len(s) == len(out) and all(a in (b, 1) for a, b in zip(s, out)))
        for s in in_shapes
    )
    return fits and any(s == out for s in in_shapes)


def is_elementwise(
    primitive: str,
    jax_says: bool | None,
    in_shapes: tuple[tuple[int, ...], ...],
    out_shapes: tuple[tuple[int, ...], ...],
) -> bool:
    """Whether an op is elementwise, by kind rather than by name: listed in
    :data:`ELEMENTWISE`, or of elementwise shapes (:func:`elementwise_shapes`) unless JAX
    says otherwise.  ``jax_says`` is the tracer's reading of JAX's own classification
    (:attr:`autoshard.ir.records.EqnRecord.elementwise`): True for the primitives JAX
    batches as elementwise ops, False for those with another batching rule, None when
    JAX does not say (a primitive defined outside ``jax.lax``, records built by hand)."""
    if primitive in ELEMENTWISE:
        return True
    return jax_says is not False and elementwise_shapes(in_shapes, out_shapes)


# Elementwise ops dear enough that XLA keeps a value rather than recompute it.
TRANSCENDENTAL = frozenset("exp log tanh logistic log1p expm1 erf pow sin cos".split())

# Every reduction over array dims (one FLOP per input element; on XLA:CPU a library
# call that reads its operand from memory).
ALL_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)

# The reductions whose partial results XLA's partitioner all-reduces one summed dim's
# mesh axes at a time (see :func:`autoshard.intra.cost.consumers.reshard_to_consumers`).
SUM_MAX_MIN_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})

# The fused attention operators (autoshard.models.attention, kept whole by the tracer):
# forward q, k, v [B, S, H, D] -> out [B, S, H, D], lse [B, H, S]; backward q, k, v,
# out, lse, d_out -> dq, dk, dv.  One kernel each (cuDNN's flash attention on a GPU).
ATTENTION_FWD = frozenset({"attention_fwd", "attention_fwd_causal"})
ATTENTION_BWD = frozenset({"attention_bwd", "attention_bwd_causal"})
ATTENTION = ATTENTION_FWD | ATTENTION_BWD

# The named jits of autoshard.models.attention that the tracer keeps as one equation ->
# (primitive name in the op graph, causal); here, below both, so that the tracer (which
# reads nothing but ir) and the model agree on the names.
FUSED_ATTENTION_CALLS = {
    "autoshard_attention_fwd": ("attention_fwd", False),
    "autoshard_attention_fwd_causal": ("attention_fwd", True),
    "autoshard_attention_bwd": ("attention_bwd", False),
    "autoshard_attention_bwd_causal": ("attention_bwd", True),
}

__all__ = [
    "ALL_REDUCTIONS",
    "ATTENTION",
    "ATTENTION_BWD",
    "ATTENTION_FWD",
    "ELEMENTWISE",
    "FUSED_ATTENTION_CALLS",
    "SUM_MAX_MIN_REDUCTIONS",
    "TRANSCENDENTAL",
    "ZERO_FLOP",
    "elementwise_shapes",
    "is_elementwise",
]
