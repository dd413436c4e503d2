"""Sharding rules for the primitives a mixture-of-experts layer traces to (jax-free).

Takes a :class:`~autoshard.intra.rules.registry.NodeContext`; returns its slots (see
:mod:`autoshard.intra.rules.strategies`; these rules join its registry when
:mod:`autoshard.intra.rules` is imported).
GShard-style gating and index-based token dispatch trace to primitives that work along one
dimension and leave the others independent:

* ``cumsum`` / ``cumprod`` / ``cummax`` / ``cummin`` / ``cumlogsumexp`` (a token's place
  in its expert's queue), ``sort`` (tokens sorted by expert, ``argsort``) and ``rev``
  (the backward of a reversed scan): every dimension but
  the scanned / sorted / reversed ones may be split, on every operand and result alike.
  The scanned dimension itself is never split: a split scan needs a carry between
  devices that XLA's partitioner does not make, so such a strategy is not offered and
  the plan reshards the operand first (an all-gather or an all-to-all, priced).
* ``top_k`` (a token's best experts): replicated only, since XLA runs the TopK custom
  call it becomes whole, whatever the sharding around it; an explicit rule, so no
  "no rule" warning, and the plan prices the all-gather XLA makes.
* ``scatter`` (an overwrite, ``x.at[i].set(u)``): the scatter-add rule of
  :mod:`autoshard.intra.rules.strategies` without its partial-sum slots, since overwrites from
  different devices do not add up.

``cumsum`` is linear, so it may also carry a partial sum through (a ``through`` slot,
offered only when the registry allows them).
"""

from __future__ import annotations

from autoshard.intra.rules.registry import OUT, NodeContext, Slot, register
from autoshard.intra.rules.strategies import _scatter_add

SCANS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


def _all_but(ctx: NodeContext, fixed: set[int]) -> list[Slot]:
    """One shard slot per dimension outside ``fixed``, over every operand and result
    (they all have the operand's shape there)."""
    n_in, n_out = len(ctx.in_shapes), len(ctx.out_shapes)
    rank = len(ctx.in_shapes[0])
    return [
        Slot(
            "shard",
            tuple((i, d) for i in range(n_in) if not ctx.in_literal[i])
            + tuple((OUT - k, d) for k in range(n_out)),
        )
        for d in range(rank)
        if d not in fixed
    ]


@register(*SCANS)
def _scan(ctx: NodeContext) -> list[Slot]:
    slots = _all_but(ctx, {ctx.node.params["axis"]})
    if ctx.node.primitive == "cumsum":
        slots.append(Slot("through", ((0, -1),)))
    return slots


@register("top_k")
def _top_k(ctx: NodeContext) -> list[Slot]:
    # XLA lowers top_k to a TopK custom call that its SPMD partitioner does not split on
    # any dimension (it all-gathers the operand first, measured with jax 0.10 / Shardy,
    # docs/moe.md): the one strategy XLA follows is the replicated one
    return []


@register("sort")
def _sort(ctx: NodeContext) -> list[Slot]:
    return _all_but(ctx, {ctx.node.params["dimension"]})


@register("rev")
def _rev(ctx: NodeContext) -> list[Slot]:
    return _all_but(ctx, set(ctx.node.params["dimensions"]))


@register("scatter")
def _scatter(ctx: NodeContext) -> list[Slot] | None:
    slots = _scatter_add(ctx)
    return None if slots is None else [s for s in slots if s.kind != "reduce"]


__all__ = ["SCANS"]
