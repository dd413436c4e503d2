"""Partial sums read through one layout op (jax-free): the ILP's discount and surcharge
nodes of :mod:`autoshard.intra.problem.value_edges` (its module docstring says what XLA
does there), kept apart as their own topic: a :class:`SliceChain` (producer, layout op,
reader), its node (:class:`ChainGroup`) and the nodes' cost matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.cost.reshard_tiles import slices_again
from autoshard.intra.cost.resharding import collective_cost
from autoshard.ir.spec import Collective, ShardingSpec

INF = math.inf


def _relevant(src: ShardingSpec, steps, batch_dims) -> tuple[tuple, tuple]:
    """``(steps, batch_dims)`` reduced to what :func:`reshard_to_consumers` reads from
    ``src``: the steps' axes over which ``src`` is partial (empty groups dropped), the
    batch dims only for a partial ``src`` (they only shape a reduction)."""
    if not src.partial:
        return (), ()
    kept = (tuple(a for a in g if a in src.partial) for g in steps)
    return tuple(g for g in kept if g), batch_dims


@dataclass(frozen=True)
class SliceChain:
    """A value (output ``k`` of ILP node ``src``) read only by ILP node ``mid``, a
    transpose or an op that relabels its elements (operand 0), whose one result is read
    only by ILP node ``reader`` as operand ``slot``: where the value is a partial sum
    that ``mid`` reads reduced and ``reader`` splits over the reduced axes, XLA makes the
    all-reduce and the slice one reduce-scatter (see the module docstring)."""

    src: int
    k: int
    mid: int
    reader: int
    slot: int
    relabels: bool = False  # the layout op only relabels elements (not a transpose)


@dataclass(frozen=True)
class ChainGroup:
    """The discount node ``node`` of a :class:`SliceChain` and its three cost matrices
    (producer, layout op and reader rows; a column per discount strategy, 0 = none)."""

    chain: SliceChain
    node: int
    matrices: tuple[tuple, tuple, tuple]


def _chain_matrices(chain: SliceChain, v, strategies, mesh, options):
    """The discount node's matrices for ``chain`` (producer, layout op, reader; a column
    per discount strategy, column 0 "none"), or None where no strategies make the
    pattern: the producer's spec ``a`` partial (a sum) over axes A, resolved for the
    layout op's input spec (``a``'s dims, reduced) by one all-reduce over A, the layout
    op's output free of A, and the reader wanting that output with exactly A added to
    one dim."""
    mids, readers = strategies[chain.mid], strategies[chain.reader]
    found: dict[tuple[int, tuple[str, ...]], None] = {}  # (layout op strategy, A), in order
    discounts: list[dict] = []  # per producer strategy: (t, A) -> the price taken back
    for a, st in zip((s.output_specs[chain.k] for s in strategies[chain.src]), v.steps):
        here: dict = {}
        discounts.append(here)
        if not a.partial or a.partial_op != "sum":
            continue
        for t, m in enumerate(mids):
            b, out = m.input_specs[0], m.output_specs[0]
            if b is None or b.partial or b.dims != a.dims or out.partial:
                continue
            rel = _relevant(a, st, v.batch_dims)
            made = reshard_to_consumers(a, [b], v.shape, v.itemsize, mesh, options, *rel)
            if len(made.collectives) != 1:
                continue
            ar = made.collectives[0]
            if ar.kind != "all-reduce" or set(ar.axes) != set(a.partial):
                continue
            if any(x in ar.axes for d in out.dims for x in d):
                continue
            rs = Collective("reduce-scatter", ar.axes, ar.bytes)
            saved = collective_cost(mesh, ar, options) - collective_cost(mesh, rs, options)
            here[t, ar.axes] = -saved
            found[t, ar.axes] = None
    cols = [
        (t, axes)
        for t, axes in found
        if any(_splits(q.input_specs[chain.slot], mids[t].output_specs[0], axes) for q in readers)
    ]
    if not cols:
        return None
    producer = tuple((0.0,) + tuple(d.get(c, INF) for c in cols) for d in discounts)
    mid = tuple((0.0,) + tuple(0.0 if t == c[0] else INF for c in cols) for t in range(len(mids)))
    reader = tuple(
        (0.0,)
        + tuple(
            0.0 if _splits(q.input_specs[chain.slot], mids[t].output_specs[0], axes) else INF
            for t, axes in cols
        )
        for q in readers
    )
    return producer, mid, reader


def _fold_matrices(chain: SliceChain, v, strategies, mesh, options):
    """The surcharge node's matrices for ``chain`` (producer, layout op, reader), or None
    where no strategies make the pattern: the producer's partial sum ``a`` resolved for
    the layout op's input by collectives ending in a reduce-scatter, and the reader
    slicing the layout op's output again (:func:`~autoshard.intra.cost.reshard_tiles.slices_again`).
    XLA then makes the two slices one and the reduce-scatter an all-reduce
    (``predict._scatter_folded_into_a_slice``); the surcharge is the difference.

    Columns: "none" (the layout op's strategy makes no pattern), then per layout op
    strategy ``t`` that may: the pattern (surcharged), "the producer does not make it",
    "the reader does not slice again"; one of the three must hold under ``t``."""
    mids, readers = strategies[chain.mid], strategies[chain.reader]
    extra: list[dict[int, float]] = []  # per producer strategy: layout op strategy -> surcharge
    for a, st in zip((s.output_specs[chain.k] for s in strategies[chain.src]), v.steps):
        here: dict[int, float] = {}
        extra.append(here)
        if not a.partial or a.partial_op != "sum":
            continue
        for t, m in enumerate(mids):
            b, out = m.input_specs[0], m.output_specs[0]
            if b is None or b.partial or out.partial:
                continue
            rel = _relevant(a, st, v.batch_dims)
            made = reshard_to_consumers(a, [b], v.shape, v.itemsize, mesh, options, *rel)
            cols = made.collectives
            if not cols or cols[-1].kind != "reduce-scatter":
                continue
            if len(cols) == 1 and set(cols[0].axes) == set(a.partial):
                continue  # predicted a reduce-scatter again (_sliced_after_all_reduce)
            rs = cols[-1]
            ar = Collective("all-reduce", rs.axes, rs.bytes)
            here[t] = collective_cost(mesh, ar, options) - collective_cost(mesh, rs, options)
    ts = sorted({t for here in extra for t in here})
    again = [
        [slices_again(mids[t].output_specs[0], q.input_specs[chain.slot], mesh.mesh) for t in ts]
        for q in readers
    ]
    if not ts or not any(any(row) for row in again):
        return None
    producer = tuple(
        (0.0,)
        + tuple(x for t in ts for x in ((here[t], INF, 0.0) if t in here else (INF, 0.0, 0.0)))
        for here in extra
    )
    mid = tuple(
        (INF if t in ts else 0.0,) + tuple(0.0 if u == t else INF for u in ts for _ in range(3))
        for t in range(len(mids))
    )
    reader = tuple(
        (0.0,) + tuple(x for hit in row for x in ((0.0, 0.0, INF) if hit else (INF, 0.0, 0.0)))
        for row in again
    )
    return producer, mid, reader


def _splits(want: ShardingSpec | None, have: ShardingSpec, axes: tuple[str, ...]) -> bool:
    """Does reading ``have`` as ``want`` slice exactly one dim over exactly ``axes``?"""
    if want is None or want.partial or len(want.dims) != len(have.dims):
        return False
    grown = [j for j, (w, d) in enumerate(zip(want.dims, have.dims)) if w != d]
    return len(grown) == 1 and want.dims[grown[0]] == have.dims[grown[0]] + tuple(axes)
