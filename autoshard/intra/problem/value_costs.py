"""What one value's moves cost in the ILP's value edges (jax-free): a value into one
spec with its reductions at the producer (:func:`resolve_cost`), into every spec its
consumers want as the prediction makes them (:func:`consumers_cost`: a partial sum reduced
once, a replication's first all-gather shared), which targets XLA resolves a partial sum
into at the producer (:func:`xla_resolves`), and a forbidden collective kind priced
infinite. Memoised: the same (source, target, shape) recurs across a model's layers.
:mod:`autoshard.intra.problem.value_edges` builds the edges and nodes from them.
"""

from __future__ import annotations

import math
from functools import lru_cache

from autoshard.intra.cost.consumers import replication, reshard_to_consumers
from autoshard.intra.cost.resharding import collective_cost, reshard
from autoshard.intra.problem.options import collective_forbidden
from autoshard.ir.spec import ShardingSpec

INF = math.inf


def xla_resolves(src: ShardingSpec, dst: ShardingSpec) -> bool:
    """Can XLA turn the partial sum ``src`` into ``dst`` right at the producing op?

    XLA's SPMD partitioner resolves a partial sum with one all-reduce or reduce-scatter
    into the sharding its consumer needs; when that sharding drops or moves a split of
    the output, it re-partitions the producing op instead (gathering its operands), a
    different plan.  So from a partial sum we only allow targets that keep every split
    the producer has (and may add the reduced axes to a dim: a reduce-scatter).  A partial
    max or min is resolved by an all-reduce into the producer's own layout only (on 2x4
    gpt-tiny, XLA did not reduce-scatter the log-softmax's partial max into the split
    the consumer wanted, and the prediction that it would disagreed with the compiled step).
    """
    if src.partial and src.partial_op != "sum":
        return dst.dims == src.dims
    return all(d[: len(s)] == s for s, d in zip(src.dims, dst.dims))


def _priced(r, forbidden: frozenset[str]) -> float:
    """The cost of resharding ``r``, infinite where it uses a ``forbidden`` kind."""
    if forbidden and any(collective_forbidden(c.kind, c.axes, forbidden) for c in r.collectives):
        return INF
    return float(r.cost)


@lru_cache(maxsize=1_000_000)
def resolve_cost(
    src, dst, shape, itemsize, mesh, options, steps, batch_dims=(), forbidden=frozenset()
) -> float:
    """One value into one spec, reductions at the producer included (``steps``; a
    batched dot's ``batch_dims``); infinite where that needs a ``forbidden`` collective
    kind (:meth:`~autoshard.intra.problem.options.IntraOptions.forbidden_collectives`).  Give
    ``steps`` and ``batch_dims`` through :func:`~autoshard.intra.problem.slice_chains._relevant`, so that equal costs share
    one memo entry."""
    r = reshard_to_consumers(
        src, [dst], shape, itemsize, mesh, options, steps, batch_dims=batch_dims
    )
    return _priced(r, forbidden)


@lru_cache(maxsize=1_000_000)
def consumers_cost(
    src, dsts, shape, itemsize, mesh, options, steps=(), batch_dims=(), forbidden=frozenset()
) -> float:
    """One value into every spec of ``dsts`` (a tuple), as predicted: once per spec, a
    partial sum reduced once (:func:`reshard_to_consumers`); infinite where a partial
    ``src`` cannot be resolved into one of them at the producer (:func:`xla_resolves`) or
    a ``forbidden`` kind is needed.  Give ``steps`` and ``batch_dims`` through
    :func:`~autoshard.intra.problem.slice_chains._relevant`."""
    if not dsts:
        return 0.0
    if src.partial and not all(xla_resolves(src, b) for b in dsts):
        return INF
    if not src.partial:
        costs = [reshard_cost(src, b, shape, itemsize, mesh, options, forbidden) for b in dsts]
        if len(dsts) < 2 or not all(map(math.isfinite, costs)):
            return math.fsum(costs)
        # the targets reached by the value's replication share its first all-gather,
        # as predicted (reshard_to_consumers)
        rep = replication(src, shape, itemsize, mesh, options)
        if rep is None:
            return math.fsum(costs)
        shared = sum(reshard(src, b, shape, itemsize, mesh, options).collectives
                     == rep.collectives for b in dsts)  # fmt: skip
        first = collective_cost(mesh, rep.collectives[0], options)
        return math.fsum(costs) - max(shared - 1, 0) * first
    r = reshard_to_consumers(
        src, list(dsts), shape, itemsize, mesh, options, steps, batch_dims=batch_dims
    )
    return _priced(r, forbidden)


@lru_cache(maxsize=1_000_000)
def reshard_cost(src, dst, shape, itemsize, mesh, options, forbidden=frozenset()) -> float:
    return _priced(reshard(src, dst, shape, itemsize, mesh, options), forbidden)
