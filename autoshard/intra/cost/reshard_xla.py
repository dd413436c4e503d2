"""XLA's own reshard routes where it permutes no whole buffer (jax-free): all-to-alls
between several dims, the partial-replicate all-to-all and the partitioner's "complex
reshard" fallbacks, in the order ``ReshardNoCache`` tries them. Priced by
:func:`autoshard.intra.cost.resharding.reshard` where the planner's own route
(:mod:`autoshard.intra.cost.reshard_tiles`) has no step to pin, or costs more.
"""

from __future__ import annotations

import functools
import itertools
import math

from autoshard.intra.cost.reshard_layouts import (
    Layout,
    Step,
    _cut,
    _digit,
    _layout,
    _minor,
    _names,
    _permute_axes,
    _tiles,
)
from autoshard.ir.spec import Mesh, ShardingSpec

# ------------------------------------------------------------------ XLA's other moves
#
# Where XLA's partitioner reshards without a permute of the whole buffer it still follows
# a fixed order (``ReshardNoCache``): all-to-alls that swap tile counts between dims (one
# per pair of dims, :func:`_swap_pairs`), then, between a replicated and an unreplicated
# layout, the partial-replicate all-to-all (:func:`_replicated_all_to_all_from` and
# ``_to``), then its "complex" fallbacks: cutting a replicated source along the first dim
# that wants the replicas (:func:`_cut_replicas_into_dim`), or gathering the one source
# dim whose count matches the destination's replicas (:func:`_gather_one_dim`).  Each
# rule below ends with :func:`_finish`, what the partitioner does from the layout it
# reached (a permute, all-to-alls, or a local slice), and gives up (None) where that is
# none of these.


def xla_route(src: ShardingSpec, dst: ShardingSpec, mesh: Mesh) -> tuple[Step, ...] | None:
    """XLA's own route from ``src`` to ``dst`` (no partial sums) where it is one of the
    moves below, as ``(kind, axes, blocks)`` steps, with or without a permute; None
    elsewhere.  :func:`autoshard.intra.cost.resharding.reshard` prices it where the
    planner's own route would not be pinned, or would cost more."""
    return _xla_route(src.dims, dst.dims, mesh)


@functools.lru_cache(maxsize=100_000)
def _xla_route(src_dims, dst_dims, mesh: Mesh) -> tuple[Step, ...] | None:
    a, b = _layout(src_dims, mesh), _layout(dst_dims, mesh)
    if math.prod(_tiles(a)) == 1 or math.prod(_tiles(b)) == 1:
        return None  # a local slice, or one all-gather per dim (cost.reshard's gathers)
    if bool(a[1]) == bool(b[1]):
        ca, cb = _counts(a), _counts(b)
        pairs = _swap_pairs(ca, cb, bool(a[1])) if ca != cb else None
        if not pairs:
            return None
        moved = _all_to_alls(a, pairs, mesh)
        if moved is None:
            return None
        steps, now = moved
        return tuple(steps + _permute(now, b, mesh))
    steps = _partial_moves(a, b, mesh)
    return None if steps is None else tuple(steps)


def _partial_moves(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """Between a replicated and an unreplicated layout, where XLA neither slices and
    permutes (move 3) nor permutes and gathers (move 4): its partial-replicate all-to-all,
    else its complex-reshard fallbacks, in that order."""
    ta, tb = _tiles(a), _tiles(b)
    if a[1]:
        if all(y % x == 0 for x, y in zip(ta, tb)):
            return None  # move 3
        steps = _replicated_all_to_all_from(a, b, mesh)
        return steps if steps is not None else _cut_replicas_into_dim(a, b, mesh)
    if all(x % y == 0 for x, y in zip(ta, tb)):
        return None  # move 4
    steps = _replicated_all_to_all_to(a, b, mesh)
    return steps if steps is not None else _gather_one_dim(a, b, mesh)


def _counts(layout: Layout) -> tuple[int, ...]:
    """The layout's tile assignment shape: blocks per dim, then the replicas (if any)."""
    reps = (math.prod(f[2] for f in layout[1]),) if layout[1] else ()
    return _tiles(layout) + reps


def _swap_pairs(ca, cb, replicas: bool) -> list[tuple[int, int]] | None:
    """XLA's pairs of (source dim, target dim) that all-to-alls swap, one pair at a time,
    to turn tile assignment shape ``ca`` into ``cb`` (the replicas, if any, are the last
    dim): the dims whose counts differ must hold the same counts on both sides; the
    smallest source count is placed first, its dim taking the count of the dim that
    holds it, preferring one whose own target count is not 1 (from count 1) or equals
    the count it gives up (otherwise).  None where no such pairing exists, or where a
    pair would move ``replicas`` (the last dim) into a cut dim or out of one."""
    if len(ca) != len(cb) or math.prod(ca) != math.prod(cb):
        return None
    src: dict[int, list[int]] = {}
    dst: dict[int, list[int]] = {}
    for d, (x, y) in enumerate(zip(ca, cb)):
        if x != y:
            src.setdefault(x, []).append(d)
            dst.setdefault(y, []).append(d)
    if not src or {k: len(v) for k, v in src.items()} != {k: len(v) for k, v in dst.items()}:
        return None

    def drop(table, size, d):
        table[size].remove(d)
        if not table[size]:
            del table[size]

    pairs = []
    while src:
        size = min(src)
        i = src[size][-1]
        want = cb[i]
        if want == size:
            drop(src, size, i)
            drop(dst, size, i)
            continue
        if want not in src or (size != 1 and want % size):
            return None
        candidates = src[want]
        good = [c for c in candidates if (cb[c] != 1 if size == 1 else cb[c] == size)]
        j = good[0] if good else candidates[-1]
        pairs.append((j, i))
        drop(dst, want, i)
        src[size][-1] = j
        drop(src, want, j)
    if replicas and any(len(ca) - 1 in pair for pair in pairs):
        return None  # replicas moved: XLA replicates (compiled on 2x4 and 4x2)
    return pairs


def _all_to_alls(a: Layout, pairs, mesh: Mesh):
    """The all-to-alls of ``pairs`` ``(s, t)``: each moves the minor ``count(s) /
    count(t)`` of dim ``s``'s cut to the minor end of dim ``t`` (the replicas are dim
    ``rank``); the buffer is the local block before the move.  Where two or more pairs
    share no dim (taken by target dim), XLA makes them one all-to-all over all their
    axes, then the other pairs one by one; otherwise one all-to-all per pair, in order
    (``[d0@data, d1@model, d2, d3]`` -> ``[d0, d1, d2@data, d3@model]``: one over
    ``data`` and ``model``; ``[d0@data, d1@model, d2]`` -> ``[d0, d1@data, d2@model]`` on
    2x4: ``model``, then ``data``).  Returns (steps, the layout reached), or None where a
    count does not divide."""
    rank = len(a[0])
    ext = [*a[0], a[1]] if a[1] else list(a[0])
    together, seen, after = [], set(), []
    for s, t in sorted(pairs, key=lambda pair: pair[1]):
        if s in seen or t in seen:
            after.append((s, t))
        else:
            together.append((s, t))
            seen.update((s, t))
    groups = [together] + [[pair] for pair in after] if len(together) > 1 else [[p] for p in pairs]
    steps: list[Step] = []
    for group in groups:
        blocks = math.prod(math.prod(f[2] for f in d) for d in ext[:rank])
        parts = []
        for s, t in group:
            cs, ct = math.prod(f[2] for f in ext[s]), math.prod(f[2] for f in ext[t])
            split = _minor(ext[s], cs // ct) if cs % ct == 0 else None
            if split is None:
                return None
            ext[s], ext[t] = split[0], ext[t] + split[1]
            parts.extend(split[1])
        steps.append(("all-to-all", _names(parts, mesh), blocks))
    rep = tuple(ext[rank]) if a[1] else ()
    return steps, (tuple(tuple(d) for d in ext[:rank]), rep)


def _permute(a: Layout, b: Layout, mesh: Mesh) -> list[Step]:
    moved = _permute_axes(a, b, mesh)
    return [("collective-permute", moved, math.prod(_tiles(b)))] if moved else []


def _finish(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """XLA's reshard from ``a`` to ``b`` where it is cheap: a permute (same counts),
    all-to-alls then a permute (counts swapped between dims), or a local slice then a
    permute (finer blocks from replicas); None otherwise."""
    ca, cb = _counts(a), _counts(b)
    if bool(a[1]) == bool(b[1]):
        if ca == cb:
            return _permute(a, b, mesh)
        pairs = _swap_pairs(ca, cb, bool(a[1]))
        if pairs:
            moved = _all_to_alls(a, pairs, mesh)
            return None if moved is None else moved[0] + _permute(moved[1], b, mesh)
    ta, tb = _tiles(a), _tiles(b)
    if a[1] and all(y % x == 0 for x, y in zip(ta, tb)):
        if all(d[: len(s)] == s for d, s in zip(b[0], a[0])):
            return []  # the slice XLA orders to match
        cut = _cut(a, [y // x for x, y in zip(ta, tb)])
        return None if cut is None else _permute(cut[0], b, mesh)
    return None


def _same_order(a_dims, b_dims, mesh: Mesh) -> bool:
    """Do two lists of cuts (major first) number the devices alike, read as one
    flattened tile assignment each?"""
    for coords in itertools.product(*(range(n) for n in mesh.shape)):
        flat = []
        for dims in (a_dims, b_dims):
            k = 0
            for f in (f for d in dims for f in d):
                k = k * f[2] + _digit(coords, f, mesh)
            flat.append(k)
        if flat[0] != flat[1]:
            return False
    return True


def _replicated_all_to_all_from(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """XLA's partial-replicate all-to-all, replicated source: where the destination's
    counts are the source's shifted down one dim (the source's first dim uncut, its
    replicas the destination's last cut dim) on the same device order, all-to-alls
    bring the source to the destination with its last cut replicated, then a local
    slice cuts it (``[d0, d1@data, d2]`` -> ``[d0@data, d1, d2@model]`` on 2x4: one
    all-to-all over ``data`` of the local buffer)."""
    ca, tb = _counts(a), _tiles(b)
    rank = len(tb)
    if ca[0] != 1 or any(tb[i] != ca[i + 1] for i in range(rank)):
        return None
    if not _same_order([*a[0], a[1]], b[0], mesh):
        return None
    last = rank - 1  # tb[last] is the source's replicas (> 1)
    tmp = (tuple(() if i == last else d for i, d in enumerate(b[0])), b[0][last])
    pairs = _swap_pairs(ca, _counts(tmp), True)
    moved = _all_to_alls(a, pairs, mesh) if pairs else None
    if moved is None:
        return None
    tail = _finish(moved[1], b, mesh)
    return None if tail is None else moved[0] + tail


def _replicated_all_to_all_to(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """The same, replicated destination: the source's last cut dim is all-gathered into
    replicas, then all-to-alls (``[d0@data, d1, d2@model]`` -> ``[d0, d1@data, d2]`` on
    2x2: an all-gather over ``model``, an all-to-all over ``data``)."""
    ta, cb = _tiles(a), _counts(b)
    rank = len(ta)
    cut = [i for i in range(rank) if ta[i] > 1]
    if cb[0] != 1 or not cut or any(ta[i] != cb[i + 1] for i in range(rank)):
        return None
    if not _same_order([*b[0], b[1]], a[0], mesh):
        return None
    last = cut[-1]
    tmp = (tuple(() if i == last else d for i, d in enumerate(a[0])), a[0][last])
    pairs = _swap_pairs(_counts(tmp), cb, True)
    moved = _all_to_alls(tmp, pairs, mesh) if pairs else None
    if moved is None:
        return None
    gather = ("all-gather", _names(a[0][last], mesh), math.prod(ta) // ta[last])
    return [gather, *moved[0], *_permute(moved[1], b, mesh)]


def _cut_replicas_into_dim(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """XLA's complex reshard from a replicated source into an unreplicated destination:
    the replicas cut the first dim that the source leaves whole and the destination cuts
    by a multiple of them (a local slice), then :func:`_finish` (``[d0@model, d1, d2]``
    -> ``[d0, d1@model, d2@data]`` on 2x4: sliced to ``[d0@model, d1@data, d2]``, then an
    all-to-all over ``data`` and one over ``model``)."""
    ta, tb = _tiles(a), _tiles(b)
    reps = math.prod(f[2] for f in a[1])
    for i in range(len(ta)):
        if ta[i] == 1 and tb[i] != 1 and tb[i] % reps == 0:
            mid = (tuple(a[1] if d == i else c for d, c in enumerate(a[0])), ())
            return _finish(mid, b, mesh)
    return None


def _gather_one_dim(a: Layout, b: Layout, mesh: Mesh) -> list[Step] | None:
    """XLA's complex reshard into a replicated destination: the first source dim cut as
    many times as the destination has replicas is all-gathered into replicas, then
    :func:`_finish` (``[d0@data, d1@model, d2]`` -> ``[d0, d1, d2@data]`` on 2x4: an
    all-gather over ``model``, an all-to-all over ``data``)."""
    ta = _tiles(a)
    reps = math.prod(f[2] for f in b[1])
    for i in range(len(ta)):
        if ta[i] > 1 and ta[i] == reps:
            mid = (tuple(() if d == i else c for d, c in enumerate(a[0])), a[0][i])
            tail = _finish(mid, b, mesh)
            if tail is None:
                return None
            return [("all-gather", _names(a[0][i], mesh), math.prod(ta) // ta[i]), *tail]
    return None
