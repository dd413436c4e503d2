"""XLA's tile moves: resharding by collective-permute, as XLA's SPMD partitioner does (jax-free).

Takes two sharding specs without partial sums and a logical mesh; returns the collectives
XLA's partitioner (``PartitionedHlo::ReshardNoCache``) emits between them where its route
has a collective-permute, or None where it does not (then :func:`autoshard.intra.cost.resharding.reshard`
prices the move its own way).  The partitioner compares *tile counts*: how many blocks each
tensor dim is cut into, and, for a spec that leaves axes unused, how many devices hold each
block (its replication), whatever the mesh axes that cut them.  In its order:

1. **Same tile counts, other devices**: one collective-permute of the local buffer
   (``[d0@data]`` -> ``[d0@model]`` on 2x2; ``[d0@data+model]`` -> ``[d0@model+data]``).
2. **One dim's blocks moved to another** (same number of blocks, the source's dim ``i``
   cut as the destination's dim ``j``, both ``1`` on the other): an all-to-all over the
   source dim's axes, then a collective-permute where the devices differ
   (``[d0@data]`` -> ``[d1@model]`` on 2x2).
3. **Finer blocks from a replicated source** (every destination count a multiple of the
   source's): a local slice that cuts the source's blocks with its replicated axes, major
   first, then a collective-permute of the destination's buffer where the devices differ
   (``[d0@data]`` -> ``[d0@model, d1@data]`` on 2x2).
4. **Coarser blocks into a replicated destination** (every source count a multiple of the
   destination's): a collective-permute of the source's buffer into the destination's
   blocks cut finer by its replicated axes, major first, then one all-gather per dim, last
   dim first, over those cuts -- a *sub-axis* (:func:`~autoshard.ir.spec.sub_axis`) where a
   cut is part of a mesh axis (``[d0@data]`` -> ``[d0@model]`` on 4x2: a permute, then an
   all-gather over ``data:(1)2``, pairs of ``data``).

Between a replicated and an unreplicated layout, where none of these applies, XLA's
partial-replicate all-to-all and its "complex reshard" fallbacks come next (the bottom
of :mod:`autoshard.intra.cost.reshard_xla`); they too are routes with a permute where one follows.  XLA's own route
where it has none (all-to-alls between several dims, an all-gather then an all-to-all)
is :func:`~autoshard.intra.cost.reshard_xla.xla_route`'s, which :func:`autoshard.intra.cost.resharding.reshard` prices
where the planner's own route has no step to pin, or costs more.

A permute's axes are the mesh axes along which a device and the one it sends to differ,
pairing devices as XLA does (by their place in the two tile assignments);
``tests/test_reshard_permute.py`` compiles every move of a 2-D tensor on 2x2, 2x4 and 4x2
and compares kind, axes, count and bytes.  Routes depend on the specs and the mesh alone,
and are remembered; bytes scale with the tensor.
"""

from __future__ import annotations

import functools
import itertools
import math

from autoshard.intra.cost.reshard_layouts import (
    Layout,
    Step,
    _cut,
    _layout,
    _minor,
    _names,
    _permute_axes,
    _tiles,
)
from autoshard.intra.cost.reshard_xla import _partial_moves
from autoshard.ir.spec import Mesh, ShardingSpec


def tile_route(src: ShardingSpec, dst: ShardingSpec, mesh: Mesh) -> tuple[Step, ...] | None:
    """XLA's route from ``src`` to ``dst`` (no partial sums) where it has a
    collective-permute, as ``(kind, axes, blocks)`` steps (the step's buffer is the
    tensor's bytes over ``blocks``); None where XLA's route has no permute or is not one
    of the four moves above."""
    return _route(src.dims, dst.dims, mesh)


@functools.lru_cache(maxsize=100_000)
def _route(src_dims, dst_dims, mesh: Mesh) -> tuple[Step, ...] | None:
    a, b = _layout(src_dims, mesh), _layout(dst_dims, mesh)
    ta, tb = _tiles(a), _tiles(b)
    if math.prod(ta) == 1:
        return None  # from replicated: a local slice
    if math.prod(tb) == 1:  # to replicated: one all-gather per split dim, last first,
        return None  # no permute (cost.reshard's gathers, which record the route's steps)
    if ta == tb:  # 1: same tile counts
        moved = _permute_axes(a, b, mesh)
        return (("collective-permute", moved, math.prod(ta)),) if moved else None
    if bool(a[1]) == bool(b[1]) and math.prod(ta) == math.prod(tb):  # 2: all-to-all
        return _all_to_all_then_permute(a, b, ta, tb, mesh)
    if a[1] and all(y % x == 0 for x, y in zip(ta, tb)):  # 3: slice, then permute
        if _extends(dst_dims, src_dims):
            return None  # a local slice alone (XLA orders the cuts to match)
        cut = _cut(a, [y // x for x, y in zip(ta, tb)])
        if cut is None:
            return None
        moved = _permute_axes(cut[0], b, mesh)
        return (("collective-permute", moved, math.prod(tb)),) if moved else None
    if b[1] and all(x % y == 0 for x, y in zip(ta, tb)):  # 4: permute, then all-gathers
        if _extends(src_dims, dst_dims):
            return None  # all-gathers of minor axes alone
        cut = _cut(b, [x // y for x, y in zip(ta, tb)])
        if cut is None:
            return None
        finer, chunks = cut
        moved = _permute_axes(a, finer, mesh)
        if not moved:
            return None
        steps = [("collective-permute", moved, math.prod(ta))]
        blocks = list(ta)
        for d in reversed(range(len(ta))):
            if chunks[d]:
                blocks[d] = tb[d]
                steps.append(("all-gather", _names(chunks[d], mesh), math.prod(blocks)))
        return tuple(steps)
    if bool(a[1]) != bool(b[1]) and _partial_moves(a, b, mesh) is not None:
        return None  # XLA's own route (xla_route), priced unless a pinned one is cheaper
    if a[1] and math.prod(tb) > math.prod(ta):  # 5: all-to-all and slice
        return _all_to_all_and_slice(a, b, ta, tb, mesh)
    if b[1] and math.prod(ta) > math.prod(tb):  # 6: all-gather, then all-to-all
        return _all_gather_then_all_to_all(a, b, ta, tb, mesh)
    return None


def _extends(longer, shorter) -> bool:
    """Does every dim of ``longer`` start with ``shorter``'s axes for that dim?"""
    return all(d[: len(s)] == s for d, s in zip(longer, shorter))


def _swap(ta, tb):
    """(i, j, k): the one dim ``i`` that loses ``k`` blocks and the one dim ``j`` that
    gains them, every other dim equal; None where the counts differ otherwise."""
    differ = [d for d in range(len(ta)) if ta[d] != tb[d]]
    if len(differ) != 2:
        return None
    i, j = differ if ta[differ[0]] > tb[differ[0]] else differ[::-1]
    if ta[i] % tb[i] or tb[j] % ta[j] or ta[i] // tb[i] != tb[j] // ta[j]:
        return None
    return i, j, ta[i] // tb[i]


def _all_to_all_then_permute(a: Layout, b: Layout, ta, tb, mesh: Mesh):
    """2: an all-to-all moves the minor ``k`` of dim ``i``'s cut to the minor end of dim
    ``j``, then a permute where the devices differ (None where none is needed)."""
    swap = _swap(ta, tb)
    if swap is None:
        return None
    i, j, k = swap
    moved_part = _minor(a[0][i], k)
    if moved_part is None:
        return None
    kept, part = moved_part
    dims = list(a[0])
    dims[i], dims[j] = kept, dims[j] + part
    moved = _permute_axes((tuple(dims), a[1]), b, mesh)
    if not moved:
        return None
    blocks = math.prod(ta)
    return (("all-to-all", _names(part, mesh), blocks), ("collective-permute", moved, blocks))


def _all_to_all_and_slice(a: Layout, b: Layout, ta, tb, mesh: Mesh):
    """5: from a replicated source into more blocks (XLA's partial-replicate all-to-all).
    Where one dim ``i`` moves whole into a lower dim ``j`` that wants exactly its count,
    the all-to-all comes first and the other dims are cut locally after (into a higher
    dim, XLA cuts first: compiled on 2x4 and 4x2); otherwise, into a
    destination without replicas only, the source is cut first, so that the all-to-all
    brings dim ``j`` its count, then a permute where the devices differ."""
    for i, j in itertools.permutations(range(len(ta)), 2):
        if i > j and ta[i] > 1 and ta[j] == 1 and tb[j] == ta[i]:
            dims = list(a[0])
            dims[i], dims[j] = (), dims[i]
            moved_layout = (tuple(dims), a[1])
            rest = [y // x for x, y in zip(_tiles(moved_layout), tb)]
            cut = (
                _cut(moved_layout, rest)
                if all(y % x == 0 for x, y in zip(_tiles(moved_layout), tb))
                else None
            )
            if cut is None:
                return None
            moved = _permute_axes(cut[0], b, mesh)
            if not moved:
                return None  # the all-to-all and the slice: priced as before
            blocks = math.prod(ta)
            return (
                ("all-to-all", _names(a[0][i], mesh), blocks),
                ("collective-permute", moved, math.prod(tb)),
            )
    if b[1]:
        return None  # XLA replicates (an involuntary full rematerialization)
    for i, j in itertools.permutations(range(len(ta)), 2):
        if ta[i] <= tb[i] or ta[i] % tb[i]:
            continue
        k = ta[i] // tb[i]
        if tb[j] % k:
            continue
        want = list(tb)
        want[i], want[j] = ta[i], tb[j] // k
        if any(w % x for w, x in zip(want, ta)):
            continue
        cut = _cut(a, [w // x for w, x in zip(want, ta)])
        if cut is None:
            continue
        route = _all_to_all_then_permute(cut[0], b, tuple(want), tb, mesh)
        if route is not None:
            return route
    return None


def _all_gather_then_all_to_all(a: Layout, b: Layout, ta, tb, mesh: Mesh):
    """6: into a replicated destination with fewer blocks, where one dim ``i`` moves whole
    into a dim ``j`` that wants exactly its count: dim ``j``'s cut is all-gathered, then
    the all-to-all, then a permute where the devices differ."""
    for i, j in itertools.permutations(range(len(ta)), 2):
        if not (ta[i] > 1 and tb[i] == 1 and tb[j] == ta[i] and ta[j] > 1):
            continue
        if any(ta[d] != tb[d] for d in range(len(ta)) if d not in (i, j)):
            continue
        blocks = math.prod(ta) // ta[j]
        steps = [
            ("all-gather", _names(a[0][j], mesh), blocks),
            ("all-to-all", _names(a[0][i], mesh), blocks),
        ]
        dims = list(a[0])
        dims[i], dims[j] = (), dims[i]
        rep = tuple(sorted(a[1] + a[0][j]))
        moved = _permute_axes((tuple(dims), rep), b, mesh)
        if moved:
            steps.append(("collective-permute", moved, blocks))
        return tuple(steps)
    return None


def slices_then_permutes(src: ShardingSpec, dst: ShardingSpec, mesh: Mesh) -> bool:
    """Is XLA's route from ``src`` to ``dst`` move 3, a local slice and then a permute?"""
    a, b = _layout(src.dims, mesh), _layout(dst.dims, mesh)
    ta, tb = _tiles(a), _tiles(b)
    route = _route(src.dims, dst.dims, mesh)
    return (
        route is not None
        and len(route) == 1
        and ta != tb
        and bool(a[1])
        and all(y % x == 0 for x, y in zip(ta, tb))
    )


def slices_again(have: ShardingSpec, want: ShardingSpec | None, mesh: Mesh) -> bool:
    """Does reading ``have`` as ``want`` (another spec) slice it again: a local slice (every
    dim keeps its axes, some split over more: ``[..., 16@data]`` read as
    ``[..., 16@data+model]``) or XLA's slice then permute
    (:func:`slices_then_permutes`)?  XLA makes such a
    slice and the one of a reduce-scatter before it one slice of the all-reduced buffer."""
    if want is None or want.partial or len(want.dims) != len(have.dims) or want.dims == have.dims:
        return False
    if all(tuple(w[: len(d)]) == tuple(d) for d, w in zip(have.dims, want.dims)):
        return True
    return slices_then_permutes(ShardingSpec(tuple(have.dims)), want, mesh)


def sliced_dims(src: ShardingSpec, dst: ShardingSpec, mesh: Mesh):
    """Where XLA's route from ``src`` to ``dst`` is move 3 (a local slice, then a
    permute), the dims the slice gives, named by whole mesh axes; else None.  A value
    all-reduced over the axes that slice adds is the reduce-scatter XLA makes of an
    all-reduce and a slice (:func:`autoshard.intra.problem.predict.collectives_by_value`)."""
    route = _route(src.dims, dst.dims, mesh)
    a, b = _layout(src.dims, mesh), _layout(dst.dims, mesh)
    ta, tb = _tiles(a), _tiles(b)
    if route is None or len(route) != 1 or ta == tb or not a[1]:
        return None
    if any(y % x for x, y in zip(ta, tb)):
        return None
    cut = _cut(a, [y // x for x, y in zip(ta, tb)])
    if cut is None:
        return None
    factors = [f for d in cut[0][0] for f in d]
    if any((pre, size) != (1, mesh.shape[axis]) for axis, pre, size in factors):
        return None  # part of an axis: no spec names it
    names = tuple(tuple(mesh.axis_names[f[0]] for f in d) for d in cut[0][0])
    return names
