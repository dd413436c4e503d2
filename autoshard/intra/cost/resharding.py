"""Cost model: resharding one sharding into another as collectives, priced (jax-free).

Takes a priced mesh (:class:`~autoshard.hardware.mesh.DeviceMesh`: a logical mesh with
per-axis link figures), sharding specs and global tensor shapes; returns times in seconds.
The collectives' own alpha-beta formulas, compute and memory time are
:mod:`autoshard.intra.cost.collectives` (re-exported here).

:func:`reshard` turns one :class:`~autoshard.ir.spec.ShardingSpec` into another and
guarantees: identical specs cost 0; every finite cost is the cost of an explicit,
legal sequence of collectives (listed in the result); the cost never exceeds
:func:`gather_then_slice` (reduce, all-gather everything, slice locally) except on the
moves XLA's partitioner makes with a collective-permute, and on its other own routes
where the planner's route could not be pinned, which are priced as XLA makes them
(:mod:`autoshard.intra.cost.reshard_tiles`); the cost is ``inf`` exactly when the
destination is a partial sum over an axis the source is not.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.cost.collectives import (
    ALPA_TIE_BREAKERS,
    DEFAULT_COST_OPTIONS,
    CostOptions,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    collective_cost,
    compute_cost,
    memory_bound_cost,
    reduce_scatter_cost,
)
from autoshard.intra.cost.reshard_tiles import tile_route
from autoshard.intra.cost.reshard_xla import xla_route
from autoshard.ir.spec import Axes, Collective, ShardingSpec

# ----------------------------------------------------------------------------- resharding


@dataclass(frozen=True)
class Reshard:
    """The collectives that turn one sharding into another, and their total cost.

    ``cost`` is ``inf`` (with no collectives) when the conversion is impossible.
    """

    collectives: tuple[Collective, ...]
    cost: float
    # the specs the value passes through between its collectives (after each one, before
    # the free slices that end the reshard), partial-sum states left out: the runtime pins
    # them (``with_sharding_constraint`` one after the other) so that XLA takes this route
    # and no other (:func:`reshard_route`)
    steps: tuple[ShardingSpec, ...] = ()

    @property
    def is_possible(self) -> bool:
        return math.isfinite(self.cost)


_FREE = Reshard((), 0.0)
_IMPOSSIBLE = Reshard((), math.inf)


def _validate(
    src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, mesh: DeviceMesh
) -> None:
    plain = type(itemsize) is int and all(type(s) is int for s in shape)  # the planner's case
    if not (plain or isinstance(itemsize, numbers.Integral)) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    if any((not plain and not isinstance(s, numbers.Integral)) or s < 0 for s in shape):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    for name, spec in (("source", src), ("destination", dst)):
        try:
            _valid_spec(spec, mesh.mesh, tuple(shape))
        except ValueError as err:
            raise ValueError(f"{name} spec {spec}: {err}") from None


@functools.lru_cache(maxsize=200_000)
def _valid_spec(spec: ShardingSpec, mesh, shape: tuple[int, ...]) -> bool:
    """``spec.validate`` remembered: the planner prices the same (spec, shape) pairs
    thousands of times (a spec that does not fit raises, and is not remembered)."""
    spec.validate(mesh, shape)
    return True


class _Plan:
    """Working state of one resharding plan: the current spec and the collectives so far.

    Every step keeps the state a legal spec: axes are only appended to, or removed from,
    the minor end of a dimension, so the per-device block stays a contiguous tile.
    """

    def __init__(self, src, dst, shape, itemsize, mesh: DeviceMesh, options: CostOptions):
        self.src = src
        self.dims: list[Axes] = list(src.dims)
        self.partial: list[str] = list(src.partial)
        self.dst, self.shape, self.itemsize = dst, shape, itemsize
        self.mesh, self.options = mesh, options
        self.whole_scatter = False  # reduce-scatter only into the exact destination
        self.collectives: list[Collective] = []
        self.cost = 0.0
        self.states: list[ShardingSpec] = []

    def local_bytes(self) -> int:
        n = self.itemsize
        for size, axes in zip(self.shape, self.dims, strict=True):
            n *= size // self.mesh.mesh.size(axes)
        return n

    def emit(self, kind: str, axes: Axes, nbytes: int) -> None:
        if self.mesh.mesh.size(axes) == 1:
            return  # a group of one device moves nothing; XLA emits nothing either
        self.mark(before=True)  # the free slices taken since the last step, if any
        c = Collective(kind, axes, nbytes)
        self.collectives.append(c)
        self.cost += collective_cost(self.mesh, c, self.options)

    def mark(self, before: bool = False) -> None:
        """Record the state after a collective, or ``before`` one (where free slices
        came first): a step of the route, when not partial and not the source."""
        if (self.collectives or before) and not self.partial:
            state = ShardingSpec(tuple(self.dims))
            if state != self.src and (not self.states or self.states[-1] != state):
                self.states.append(state)

    def gather_dims(self, moved: Sequence[tuple[int, Axes]]) -> None:
        """All-gather ``group`` off the minor end of dim ``i`` for every ``(i, group)``:
        one all-gather per dim, the last dim first, each on the buffer as the previous one
        left it. XLA's partitioner replicates dims that way (jax 0.10 to 0.12: an array
        split ``[768@model, 2304@data]`` is all-gathered over data into ``[768@model,
        2304]``, then over model), never with one all-gather over the union of their axes."""
        for i, group in sorted(moved, reverse=True):
            self.emit("all-gather", group, self.local_bytes() * self.mesh.mesh.size(group))
            self.dims[i] = self.dims[i][: -len(group)]
            self.mark()

    def used(self) -> set[str]:
        return {a for d in self.dims for a in d} | set(self.partial)

    def ready(self, j: int, group: Axes) -> bool:
        """Is ``group`` exactly what destination dim ``j`` wants appended next?"""
        cur, want = self.dims[j], self.dst.dims[j]
        k = len(cur)
        return want[:k] == cur and want[k : k + len(group)] == group

    def misplaced(self, i: int) -> Axes:
        """Axes of dim ``i`` past its common prefix with the destination: they must go."""
        cur, want = self.dims[i], self.dst.dims[i]
        k = 0
        while k < min(len(cur), len(want)) and cur[k] == want[k]:
            k += 1
        return cur[k:]

    def slice_free(self) -> None:
        """R -> S(x): append every axis the destination wants next and nobody uses."""
        used = self.used()
        changed = True
        while changed:
            changed = False
            for j, want in enumerate(self.dst.dims):
                cur = self.dims[j]
                k = len(cur)
                if k < len(want) and want[:k] == cur and want[k] not in used:
                    self.dims[j] = cur + (want[k],)
                    used.add(want[k])
                    changed = True

    def reduce(self, axes: Sequence[str]) -> None:
        """Reduce partial ``axes``: reduce-scatter where the destination dim is ready,
        all-reduce the rest (one grouped collective or one per axis, whichever is cheaper)."""
        pending = [a for a in axes if a in self.partial]
        if self.options.group_reductions and pending:
            # XLA: one collective over every pending axis -- a reduce-scatter when one
            # dim takes all of them next, otherwise an all-reduce then local slices
            group = tuple(a for a in self.mesh.axis_names if a in pending)
            nbytes = self.local_bytes()
            j = next((j for j in range(len(self.dims)) if self.ready(j, group)), None)
            if j is not None and self.whole_scatter:
                # reduced where it is made: XLA all-reduces and slices what it keeps in
                # one dynamic-slice -- a reduce-scatter only if that slice is the group's
                after = list(self.dims)
                after[j] = after[j] + group
                if tuple(after) != self.dst.dims:
                    j = None
            if j is not None:
                self.emit("reduce-scatter", group, nbytes)
                self.dims[j] = self.dims[j] + group
            else:
                self.emit("all-reduce", group, nbytes)
            self.partial = [a for a in self.partial if a not in pending]
            self.slice_free()
            return
        progress = True
        while progress:
            progress = False
            for a in pending:
                j = next((j for j in range(len(self.dims)) if self.ready(j, (a,))), None)
                if j is not None:
                    self.emit("reduce-scatter", (a,), self.local_bytes())
                    self.dims[j] = self.dims[j] + (a,)
                    self.partial.remove(a)
                    pending.remove(a)
                    self.slice_free()
                    progress = True
                    break
        if not pending:
            return
        nbytes = self.local_bytes()
        group = tuple(a for a in self.mesh.axis_names if a in pending)
        grouped = all_reduce_cost(self.mesh, group, nbytes, self.options)
        one_by_one = sum(all_reduce_cost(self.mesh, a, nbytes, self.options) for a in group)
        # XLA's SPMD partitioner reduces all pending partial axes with one all-reduce
        split = not self.options.group_reductions and one_by_one < grouped
        for g in [(a,) for a in group] if split else [group]:
            self.emit("all-reduce", g, nbytes)
        self.partial = [a for a in self.partial if a not in pending]
        self.slice_free()

    def clone(self) -> _Plan:
        twin = _Plan.__new__(_Plan)
        twin.__dict__.update(self.__dict__)
        twin.dims, twin.partial = list(self.dims), list(self.partial)
        twin.collectives = list(self.collectives)
        twin.states = list(self.states)
        return twin

    def all_to_all_move(self) -> tuple[int, int, Axes] | None:
        """The best all-to-all available now: a minor-most group of misplaced axes of dim
        ``i`` that dim ``j`` wants next, and that beats gather + slice. Larger groups
        first (one collective instead of several), then the cheaper, then the lower dims."""
        nbytes = self.local_bytes()
        best = None
        for i in range(len(self.dims)):
            m = self.misplaced(i)
            for k in range(1, len(m) + 1):
                group = m[-k:]
                for j in range(len(self.dims)):
                    if j == i or not self.ready(j, group):
                        continue
                    a2a = all_to_all_cost(self.mesh, group, nbytes, self.options)
                    n = self.mesh.mesh.size(group)
                    if a2a > all_gather_cost(self.mesh, group, nbytes * n, self.options):
                        continue
                    key = (-len(group), a2a, i, j)
                    if best is None or key < best[0]:
                        best = (key, (i, j, group))
        return None if best is None else best[1]

    def result(self) -> Reshard:
        if tuple(self.dims) != self.dst.dims or set(self.partial) != set(self.dst.partial):
            raise RuntimeError(
                f"internal error: resharding plan ended at dims {self.dims} partial "
                f"{self.partial}, not at {self.dst}"
            )
        steps = tuple(st for st in self.states if st != self.dst)
        return Reshard(tuple(self.collectives), self.cost, steps)


def _xla_move_and_finish(plan: _Plan, dropped: Axes, unsliced: _Plan | None = None) -> _Plan:
    """XLA's SPMD partitioner's way: a lone group of axes moving between two dims is one
    all-to-all; anything else gathers every misplaced axis with one all-gather over their
    union and then slices locally: the gather moves the buffer as it is, before any new
    split is sliced off (XLA's replicate-then-slice fallback)."""
    plan.slice_free()
    moved = [(i, plan.misplaced(i)) for i in range(len(plan.dims)) if plan.misplaced(i)]
    if len(moved) == 1:
        i, group = moved[0]
        targets = [j for j in range(len(plan.dims)) if j != i and plan.ready(j, group)]
        if targets:
            plan.emit("all-to-all", group, plan.local_bytes())
            plan.dims[i] = plan.dims[i][: -len(group)]
            plan.dims[targets[0]] = plan.dims[targets[0]] + group
            plan.mark()
            moved = []
    if moved:
        if unsliced is not None and not plan.collectives and unsliced.partial == plan.partial:
            plan = unsliced
        plan.gather_dims(moved)
    plan.slice_free()
    plan.reduce(dropped)
    plan.slice_free()
    return plan


def _move_and_finish(plan: _Plan, dropped: Axes) -> _Plan:
    """Take every misplaced axis off its dim, then reduce what is left and slice.

    All-to-alls are taken greedily (they keep the buffer size); when none applies, each
    dim's minor-most misplaced axis is a candidate all-gather, and we try them all
    (depth at most the number of mesh axes), because the cheapest gather now can block a
    cheap all-to-all later. Free slices follow every step.
    """
    while True:
        plan.slice_free()
        move = plan.all_to_all_move()
        if move is None:
            break
        i, j, group = move
        plan.emit("all-to-all", group, plan.local_bytes())
        plan.dims[i] = plan.dims[i][: -len(group)]
        plan.dims[j] = plan.dims[j] + group
    gathers = [i for i in range(len(plan.dims)) if plan.misplaced(i)]
    if not gathers:
        plan.reduce(dropped)
        plan.slice_free()
        return plan
    best = None
    for i in gathers:
        branch = plan.clone()
        # XLA gathers every misplaced axis of a dim with one all-gather over the group
        k = len(plan.misplaced(i)) if plan.options.group_reductions else 1
        group = tuple(branch.dims[i][-k:])
        branch.emit("all-gather", group, branch.local_bytes() * plan.mesh.mesh.size(group))
        branch.dims[i] = branch.dims[i][:-k]
        done = _move_and_finish(branch, dropped)
        if best is None or done.cost < best.cost:
            best = done
    return best


def gather_then_slice(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh: DeviceMesh,
    options: CostOptions = DEFAULT_COST_OPTIONS,
) -> Reshard:
    """The always-possible fallback: one all-reduce over every partial axis the destination
    drops (on the source's local buffer), one all-gather over every axis the source shards
    (output: the whole tensor), then a free local slice."""
    _validate(src, dst, tuple(shape), itemsize, mesh)
    shape, itemsize = tuple(int(s) for s in shape), int(itemsize)
    return _gather_then_slice(src, dst, shape, itemsize, mesh, options)


def _gather_then_slice(src, dst, shape, itemsize, mesh, options) -> Reshard:
    """:func:`gather_then_slice` on arguments already validated."""
    if not set(dst.partial) <= set(src.partial):
        return _IMPOSSIBLE
    plan = _Plan(src, dst, shape, itemsize, mesh, options)
    dropped = tuple(a for a in mesh.axis_names if a in src.partial and a not in dst.partial)
    if dropped:
        plan.emit("all-reduce", dropped, plan.local_bytes())
    if options.group_reductions:  # XLA's way: one all-gather per split dim, the last first
        plan.partial = [a for a in plan.partial if a not in dropped]
        plan.mark()
        plan.gather_dims([(i, d) for i, d in enumerate(src.dims) if d])
        steps = tuple(st for st in plan.states if st != dst)
        return Reshard(tuple(plan.collectives), plan.cost, steps)
    sharded = tuple(a for a in mesh.axis_names if any(a in d for d in src.dims))
    if sharded:
        plan.emit("all-gather", sharded, plan.local_bytes() * mesh.mesh.size(sharded))
    return Reshard(tuple(plan.collectives), plan.cost)


def reshard(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh: DeviceMesh,
    options: CostOptions = DEFAULT_COST_OPTIONS,
    *,
    reduce_in_place: bool = False,
    batch_dims: tuple[int, ...] = (),
) -> Reshard:
    """Collectives and cost to turn a tensor of global ``shape`` from ``src`` into ``dst``.

    Rules: identical specs are free; without partial sums, the moves XLA's partitioner
    makes with a collective-permute are priced as it makes them
    (:func:`~autoshard.intra.cost.reshard_tiles.tile_route`: same tile counts on other devices,
    finer or coarser blocks); XLA's other own routes
    (:func:`~autoshard.intra.cost.reshard_xla.xla_route`: all-to-alls between several
    dims, an all-gather then an all-to-all, ...) are priced as it takes them where the
    route below would have no step to pin, or would cost more; ``R -> S(x)`` is a free
    local slice; ``S(x) -> R``
    is an all-gather on ``x`` (bytes: the gathered per-device buffer); an axis moving
    from one dim to another is an all-to-all; ``partial(x) -> R`` is an all-reduce and
    ``partial(x) -> S(x)`` a reduce-scatter (bytes: the buffer before scattering); a
    destination partial over an axis the source is not partial over is impossible (inf).
    Partial axes are reduced either before or after the data movement, whichever is
    cheaper; anything the rules do not cover goes through gathers, and the result is
    never dearer than :func:`gather_then_slice`. Raises ValueError for specs that do not
    fit the mesh or the shape.

    ``reduce_in_place``: the partial sum comes from a reduction, which XLA's partitioner
    reduces where it is made, on its own layout: the dropped axes are reduced first
    (a reduce-scatter where a dim takes them next, else an all-reduce of the whole local
    buffer), and only then are new splits sliced off.  A ``[64]`` bias gradient summed
    over a batch split on ``data`` and wanted as ``[64@model]`` is an all-reduce of all 64
    values over ``data``, not of the 16 a device keeps.

    ``batch_dims``: the partial sum comes from a batched dot whose batch dims these are.
    Where the destination splits such a dim further with the reduced axes (``[G@data]``
    partial over ``model`` wanted as ``[G@data+model]``), XLA:CPU does not reduce-scatter:
    it all-reduces, all-gathers the dim over the axes it had and slices
    (:func:`_batched_dot_detour`; ``tests/test_moe_rules.py`` compiles it).
    """
    _validate(src, dst, tuple(shape), itemsize, mesh)
    shape, itemsize = tuple(int(s) for s in shape), int(itemsize)
    return _reshard(src, dst, shape, itemsize, mesh, options, reduce_in_place, tuple(batch_dims))


@functools.lru_cache(maxsize=200_000)
def _reshard(src, dst, shape, itemsize, mesh, options, reduce_in_place, batch_dims) -> Reshard:
    """:func:`reshard` on arguments already validated, remembered: a stage ILP prices the
    same move of the same shape for many values (gpt-39b's stage search: 54,000 calls,
    28,550 distinct)."""
    if src.dims == dst.dims and set(src.partial) == set(dst.partial):
        return _FREE
    if not set(dst.partial) <= set(src.partial):
        return _IMPOSSIBLE
    if not src.partial and not dst.partial and options.group_reductions:
        route = tile_route(src, dst, mesh.mesh)  # XLA's collective-permute moves
        if route is not None:
            return _priced_route(route, shape, itemsize, mesh, options)
    dropped = tuple(a for a in mesh.axis_names if a in src.partial and a not in dst.partial)
    detour = _batched_dot_detour(src, dst, shape, itemsize, mesh, options, batch_dims, dropped)
    if detour is not None:
        return detour
    wanted = {a for d in dst.dims for a in d}
    all_reduce_only = tuple(a for a in dropped if a not in wanted)
    best = _gather_then_slice(src, dst, shape, itemsize, mesh, options)
    timings = [dropped, ()] if options.group_reductions else [dropped, (), all_reduce_only]
    if reduce_in_place and dropped:
        timings = [dropped]
    for early in dict.fromkeys(timings):
        plan = _Plan(src, dst, shape, itemsize, mesh, options)
        unsliced = plan.clone()
        if reduce_in_place:
            plan.whole_scatter = True
        else:
            plan.slice_free()
        plan.reduce(early)
        if options.group_reductions:
            candidate = _xla_move_and_finish(plan, dropped, unsliced).result()
        else:
            candidate = _move_and_finish(plan, dropped).result()
        if candidate.cost <= best.cost:
            best = candidate
    if not src.partial and not dst.partial and options.group_reductions:
        own = xla_route(src, dst, mesh.mesh)  # XLA's other moves: all-to-alls, gathers
        if own is not None:
            theirs = _priced_route(own, shape, itemsize, mesh, options)
            # a route of one collective cannot be pinned: XLA takes its own
            if not best.steps or theirs.cost <= best.cost:
                best = theirs
    return best


def _priced_route(route, shape, itemsize, mesh, options) -> Reshard:
    """:func:`~autoshard.intra.cost.reshard_tiles.tile_route`'s steps as priced collectives."""
    total = itemsize * math.prod(shape)
    collectives = tuple(Collective(kind, axes, total // blocks) for kind, axes, blocks in route)
    return Reshard(collectives, sum(collective_cost(mesh, c, options) for c in collectives))


def _batched_dot_detour(src, dst, shape, itemsize, mesh, options, batch_dims, dropped):
    """XLA:CPU's resolution of a batched dot's partial sum (``src``, partial over
    ``dropped``) into ``dst`` where ``dst`` appends reduced axes to a batch dim the source
    already splits: an all-reduce of the local buffer over ``dropped``, an all-gather of
    that dim over the axes it had, then :func:`reshard` of what is left (slices). None
    where the pattern does not apply."""
    for j in batch_dims if dropped else ():
        had, want = src.dims[j], dst.dims[j]
        if had and want[: len(had)] == had and set(want[len(had) :]) & set(dropped):
            break
    else:
        return None
    plan = _Plan(src, dst, shape, itemsize, mesh, options)
    plan.emit("all-reduce", dropped, plan.local_bytes())
    gathered = src.dims[j]
    plan.emit("all-gather", gathered, plan.local_bytes() * mesh.mesh.size(gathered))
    dims = tuple(() if i == j else d for i, d in enumerate(src.dims))
    rest = ShardingSpec(dims, tuple(a for a in src.partial if a not in dropped))
    tail = reshard(rest, dst, shape, itemsize, mesh, options)
    return Reshard(tuple(plan.collectives) + tail.collectives, plan.cost + tail.cost)


__all__ = [
    "ALPA_TIE_BREAKERS",
    "DEFAULT_COST_OPTIONS",
    "CostOptions",
    "Reshard",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "collective_cost",
    "compute_cost",
    "gather_then_slice",
    "memory_bound_cost",
    "reduce_scatter_cost",
    "reshard",
]
