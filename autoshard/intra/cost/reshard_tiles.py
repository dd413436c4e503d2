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
of this module); they too are routes with a permute where one follows.  XLA's own route
where it has none (all-to-alls between several dims, an all-gather then an all-to-all)
is :func:`xla_route`'s, which :func:`autoshard.intra.cost.resharding.reshard` prices
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

from autoshard.ir.spec import Axes, Mesh, ShardingSpec, sub_axis_name

# A factor is part of a mesh axis: (axis index, pre, size) -- the axis of size n read as
# [pre, size, n / (pre * size)], the middle digit.  A layout is (dims, rep): the factors
# that cut each tensor dim (major first) and the replicated ones (mesh order, major first).
Factor = tuple[int, int, int]
Layout = tuple[tuple[tuple[Factor, ...], ...], tuple[Factor, ...]]
# One step of a route: (kind, axes, blocks) -- the buffer is the tensor over ``blocks``
Step = tuple[str, Axes, int]


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


def _minor(factors, k: int):
    """``factors`` less their minor part of size ``k``: (kept, part), or None."""
    kept, part = list(factors), []
    while k > 1:
        if not kept:
            return None
        axis, pre, size = kept.pop()
        if k % size == 0:
            part.insert(0, (axis, pre, size))
            k //= size
        elif size % k == 0:
            kept.append((axis, pre, size // k))
            part.insert(0, (axis, pre * (size // k), k))
            k = 1
        else:
            return None
    return tuple(kept), tuple(part)


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


def _layout(dims, mesh: Mesh) -> Layout:
    used = {a for d in dims for a in d}
    cut = tuple(
        tuple((mesh.index(a), 1, mesh.axis_size(a)) for a in d if mesh.axis_size(a) > 1)
        for d in dims
    )
    rep = tuple(
        (i, 1, n) for i, (a, n) in enumerate(zip(mesh.axis_names, mesh.shape)) if n > 1 and a not in used
    )  # fmt: skip
    return cut, rep


def _tiles(layout: Layout) -> tuple[int, ...]:
    return tuple(math.prod(f[2] for f in d) for d in layout[0])


def _cut(layout: Layout, factors: list[int]):
    """``layout`` with each dim ``d`` cut ``factors[d]`` times finer by its replicated
    factors, taken major first (XLA splits the replication dim of the tile assignment
    that way); returns (the finer layout, the factors each dim took), or None where a
    cut does not divide a factor."""
    rep = list(layout[1])
    dims, chunks = [], []
    for d, k in zip(layout[0], factors):
        took = []
        while k > 1:
            if not rep:
                return None
            axis, pre, size = rep.pop(0)
            if k % size == 0:
                took.append((axis, pre, size))
                k //= size
            elif size % k == 0:
                took.append((axis, pre, k))
                rep.insert(0, (axis, pre * k, size // k))
                k = 1
            else:
                return None
        dims.append(d + tuple(took))
        chunks.append(tuple(took))
    return (tuple(dims), tuple(rep)), chunks


def _names(factors, mesh: Mesh) -> Axes:
    """Factors as collective axes: whole axes by name, parts as sub-axes; the parts of one
    axis next to each other (major then minor) merge."""
    merged: list[list[int]] = []
    for axis, pre, size in factors:
        last = merged[-1] if merged else None
        if last and last[0] == axis and last[1] * last[2] == pre:
            last[2] *= size
        else:
            merged.append([axis, pre, size])
    out = []
    for axis, pre, size in sorted(merged):
        name, n = mesh.axis_names[axis], mesh.shape[axis]
        out.append(name if (pre, size) == (1, n) else sub_axis_name(name, pre, size))
    return tuple(out)


def _digit(coords, factor: Factor, mesh: Mesh) -> int:
    axis, pre, size = factor
    return (coords[axis] // (mesh.shape[axis] // (pre * size))) % size


def _place(layout: Layout, coords, mesh: Mesh) -> tuple[int, ...]:
    """A device's place in the layout's tile assignment: its block per dim, then its
    index among the block's replicas."""
    place = []
    for factors in (*layout[0], layout[1]):
        k = 0
        for f in factors:
            k = k * f[2] + _digit(coords, f, mesh)
        place.append(k)
    return tuple(place)


def _permute_axes(a: Layout, b: Layout, mesh: Mesh) -> Axes:
    """The mesh axes along which the device at each place of ``a``'s tile assignment and
    the device at the same place of ``b``'s differ (() where every device stays)."""
    devices = list(itertools.product(*(range(n) for n in mesh.shape)))
    at = {_place(b, x, mesh): x for x in devices}
    moved = set()
    for x in devices:
        y = at[_place(a, x, mesh)]
        moved.update(k for k in range(len(x)) if x[k] != y[k])
    return tuple(mesh.axis_names[k] for k in sorted(moved))


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
