"""Tilings of a tensor over a mesh, as XLA's partitioner reads them (jax-free): a spec's
layout (the mesh-axis factors cutting each dim, and the replicated ones), its tile counts,
re-cutting a layout, naming factors as (sub-)axes and the axes a permute moves along.
Shared by the planner's routes (:mod:`autoshard.intra.cost.reshard_tiles`) and XLA's own
(:mod:`autoshard.intra.cost.reshard_xla`).
"""

from __future__ import annotations

import itertools
import math

from autoshard.ir.spec import Axes, Mesh, sub_axis_name

# A factor is part of a mesh axis: (axis index, pre, size) -- the axis of size n read as
# [pre, size, n / (pre * size)], the middle digit.  A layout is (dims, rep): the factors
# that cut each tensor dim (major first) and the replicated ones (mesh order, major first).
Factor = tuple[int, int, int]
Layout = tuple[tuple[tuple[Factor, ...], ...], tuple[Factor, ...]]
# One step of a route: (kind, axes, blocks) -- the buffer is the tensor over ``blocks``
Step = tuple[str, Axes, int]


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
