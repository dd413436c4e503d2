"""One value, several readers: what XLA does when the consumers of a value want it in
different specs -- the spec it resolves the producer to (:func:`producer_preference`), the
reshards from there, partial sums reduced one summed dim's axes at a time, and a
replication several readers share made once (:func:`reshard_to_consumers`). The moves of
one value into one spec are :mod:`autoshard.intra.cost.resharding`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.cost.collectives import DEFAULT_COST_OPTIONS, CostOptions, collective_cost
from autoshard.intra.cost.resharding import Reshard, _gather_then_slice, reshard
from autoshard.ir.spec import Axes, Collective, ShardingSpec


def producer_preference(spec: ShardingSpec, mesh: DeviceMesh) -> tuple:
    """Sort key of the sharding XLA gives a value its consumers disagree about: the most
    devices split over first; on a tie, the one that puts its axes on the lower dims
    (propagation resolves an axis two consumers want on different dims for the lower dim);
    then by the axes themselves, so that the order is total and does not depend on the
    order of the consumers (the ILP prices it per value, :mod:`autoshard.intra.problem.value_edges`)."""
    used = tuple(a for d in spec.dims for a in d)
    dims = sorted(i for i, d in enumerate(spec.dims) for _ in d)
    return (-mesh.mesh.size(used), dims, spec.dims)


def _resolution(src: ShardingSpec, dsts, mesh: DeviceMesh, in_place: bool) -> ShardingSpec:
    """The spec XLA reduces a partial sum into when several consumers want it reduced:
    the most split target (:func:`producer_preference`), except where a consumer reads it
    in the producer's own layout (``own``) and XLA all-reduces into that and slices for
    the others: always when a reduce makes it (``in_place``), and, when a dot or a
    convolution makes it, where the most split target only splits further dims ``own``
    already splits (wresnet-1b's conv output ``[.., 2560@data]`` partial over model, read
    ``[.., 2560@data+model]`` and ``[.., 2560@data]``: one all-reduce over model;
    ``tests/test_partial_resolution.py`` compiles both)."""
    first = min(dsts, key=lambda d: producer_preference(d, mesh))
    own = ShardingSpec(src.dims)
    if own not in dsts or first == own:
        return first
    if in_place:
        return own
    refines = all(
        f[: len(o)] == o and (len(f) == len(o) or o) for f, o in zip(first.dims, own.dims)
    )
    return own if refines else first


@functools.lru_cache(maxsize=100_000)
def replication(
    src: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh: DeviceMesh,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> Reshard | None:
    """XLA's replication of a value laid out as ``src`` (no partial sums): one all-gather
    per split dim, the last first (:func:`gather_then_slice` into the replicated spec);
    None where ``src`` is partial or replicated, or outside XLA's way of reducing
    (``options.group_reductions`` off)."""
    if src.partial or not options.group_reductions or not any(src.dims):
        return None
    rep = _gather_then_slice(src, ShardingSpec(((),) * len(shape)), shape, itemsize, mesh, options)
    return rep if rep.collectives else None


def _replicated_once(src, parts, shape, itemsize, mesh, options) -> list[Reshard]:
    """``parts`` (reshards of one value from ``src``, one per target) with the first
    all-gather of the value's replication made once.  A reshard XLA's partitioner cannot
    do efficiently is a replication and a local slice ("involuntary full
    rematerialization"), and it keeps what it made from a value per target layout, so
    the targets whose route is the whole replication (:func:`replication`: the
    replicated spec, and each such move) share its first all-gather; the later ones are
    shared only at times (wresnet-1b zero3 on 2x4, XLA:CPU and XLA:GPU, jax 0.11: of ten
    values replicated in two steps, the first gather made once and the second per
    target on eight, both once on two), so they are counted per target: never fewer
    collectives than XLA makes (``tests/test_xla_remat.py``, docs/truth_gpu.md)."""
    if len(parts) < 2:
        return parts
    rep = replication(src, shape, itemsize, mesh, options)
    if rep is None:
        return parts
    out, seen = [], False
    first = rep.collectives[0]
    for r in parts:
        if r.collectives == rep.collectives:
            if seen:
                r = Reshard(r.collectives[1:], r.cost - collective_cost(mesh, first, options))
            seen = True
        out.append(r)
    return out


def reshard_to_consumers(
    src: ShardingSpec,
    dsts: Sequence[ShardingSpec],
    shape: tuple[int, ...],
    itemsize: int,
    mesh: DeviceMesh,
    options: CostOptions = DEFAULT_COST_OPTIONS,
    reduce_first: Sequence[Axes] = (),
    batch_dims: tuple[int, ...] = (),
) -> Reshard:
    """Collectives that give every consumer of one value its spec (``dsts``: distinct).

    A value is resharded once per distinct target (:func:`reshard` for each), except a
    partial sum read by several consumers that all want it reduced: JAX cannot constrain a
    partial sum, so XLA's sharding propagation gives the producing op *one* sharding and
    its partitioner reduces once, into that sharding -- the target splitting the most
    devices, ties to the one with its splits on the lower dims -- and every other consumer
    reshards from there (a reduce-scatter then an all-to-all or an all-gather, never two
    reductions).  The targets whose route is the value's whole replication (the
    replicated spec, and the moves XLA makes by replicating and slicing) share the
    replication's first all-gather (:func:`_replicated_once`).

    ``reduce_first``: groups of partial axes that XLA all-reduces one group at a time
    before anything else, at the producing op.  A ``reduce`` whose summed dims are split
    over different mesh axes is such an op: XLA's partitioner all-reduces one summed dim's
    axes at a time, from the last dim to the first (jax 0.10 / Shardy), so a sum of an
    ``[8@data, 32@model]`` array is an all-reduce over model, then one over data.  All
    groups but the last are all-reduced on the local buffer; the last stays partial and
    is resolved like any other.

    ``batch_dims``: the value is a batched dot's result with these batch dims (see
    :func:`reshard`).
    """
    dsts = list(dict.fromkeys(dsts))
    steps = [tuple(a for a in g if a in src.partial) for g in reduce_first]
    steps = [g for g in steps if g]
    if len(steps) > 1 and not any(d.partial for d in dsts):
        done = {a for g in steps[:-1] for a in g}
        local = itemsize
        for size, axes in zip(shape, src.dims):
            local *= size // mesh.mesh.size(axes)
        early = [Collective("all-reduce", g, local) for g in steps[:-1] if mesh.mesh.size(g) > 1]
        rest = ShardingSpec(src.dims, tuple(a for a in src.partial if a not in done))
        tail = reshard_to_consumers(
            rest, dsts, shape, itemsize, mesh, options, reduce_first=steps[-1:]
        )
        head_cost = sum(collective_cost(mesh, c, options) for c in early)
        return Reshard(tuple(early) + tail.collectives, head_cost + tail.cost)
    in_place = bool(steps)
    if not src.partial or len(dsts) < 2 or any(d.partial for d in dsts):
        parts = [
            reshard(src, d, shape, itemsize, mesh, options, reduce_in_place=in_place,
                    batch_dims=batch_dims)
            for d in dsts
        ]  # fmt: skip
        parts = _replicated_once(src, parts, shape, itemsize, mesh, options)
    else:
        first = _resolution(src, dsts, mesh, in_place)
        parts = [reshard(src, first, shape, itemsize, mesh, options, reduce_in_place=in_place,
                         batch_dims=batch_dims)]  # fmt: skip
        rest = [reshard(first, d, shape, itemsize, mesh, options) for d in dsts if d != first]
        parts += _replicated_once(first, rest, shape, itemsize, mesh, options)
    return Reshard(
        tuple(c for r in parts for c in r.collectives), sum((r.cost for r in parts), 0.0)
    )


__all__ = ["producer_preference", "replication", "reshard_to_consumers"]
