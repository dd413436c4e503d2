"""Resharding charged once per value, as XLA performs it (jax-free).

Takes the strategies :func:`autoshard.intra.problem.build.build_problem` listed, the operand
uses of every value and the mesh; returns :class:`ValueEdges`: extra ILP nodes and the
edges that price every value's resharding the way
:func:`autoshard.intra.cost.consumers.reshard_to_consumers` predicts it -- once per distinct spec
its consumers want, a partial sum reduced once -- so that the objective of every
assignment (minimised over the extra nodes) is the cost of the collectives the plan
predicts plus its compute.

Formulation. A value read by one consumer gets a plain edge (producer x consumer). A
value read by several consumers gets, for every spec ``b`` some consumer strategy may
want, a *copy node* ``y_b`` with two strategies (absent, present):

* consumer -- ``y_b``: a consumer strategy that wants ``b`` forbids ``y_b`` absent;
* producer -- ``y_b``: present costs ``reshard(a, b)`` from the producer's spec ``a``;

so each wanted spec is paid once. When the producer may make a partial sum, a
*resolution node* ``R`` chooses the spec XLA reduces it into (or "none" when the
producer's spec is not partial): producer -- ``R`` costs the reduction into ``r``
(``inf`` where XLA cannot resolve into ``r``, see :func:`xla_resolves`); ``R = r`` needs
``y_r`` present and forbids every present ``y_b`` that XLA would prefer to ``r``
(:func:`autoshard.intra.cost.consumers.producer_preference`), and a present ``y_b != r`` costs
``reshard(r, b)``. The cheapest completion then reduces into the preferred wanted spec
and reshards from there, exactly the prediction. Copy and resolution nodes of a value
whose producer and consumers are tied to another value's are tied to that value's, so
identical layers add no variables.

Hubs (``hubs``, on meshes of several axes). A value whose uses may want few sets of
specs together gets instead one *hub node* ``W`` with a strategy per such set ``S``:
producer -- ``W`` costs ``reshard_to_consumers(a, S)`` (the prediction itself, partial
sums included; ``inf`` where XLA cannot resolve the partial ``a`` into some spec of
``S``), consumer -- ``W`` forbids every set without the spec the consumer's strategy
wants.  A set may hold a spec no use wants, which never lowers the price of a value
that is never partial; where the producer may make a partial sum (a spec XLA prefers
could resolve it more cheaply) the hub's strategies are the tuples of the spec each use
wants instead, each use pinned to its own.  Exact (without the copy nodes' gap on a
partial sum wanted in several specs), and much tighter: the copy nodes charge each spec
through an OR that the LP relaxation splits at will (on Alpa's 4-layer conv net on 2x2
its bound was 4,620 against the optimum 6,040, and HiGHS, started from the per-demand
plan, kept that plan, 23% above the optimum, at its time cap), where the relaxation with
hubs reached the optimum itself.  The sets grow as the product of the uses' wanted
specs, so a value with more than ``hubs`` of them keeps copy nodes.

Slice chains (``chains``). A partial sum whose one reader is a layout op (a transpose,
or an op that relabels its elements) whose result's one reader splits it over the
reduced axes is all-reduced for the layout op and sliced after it; XLA moves the slice
ahead of the layout op and makes the two a reduce-scatter
(:func:`autoshard.intra.problem.predict.collectives_by_value` predicts it so). The
producer -- layout op edge prices the all-reduce, as for any reader; a *discount node*
``Z`` takes the difference back: its strategies are "none" (free) and one per (layout
op strategy, reduced axes) under which the pattern can hold, and a strategy other than
"none" needs the producer's spec partial over those axes in the layout op's input
layout (the edge to the producer carries minus the all-reduce's price plus the
reduce-scatter's), the layout op's own strategy, and a reader that splits one dim of
the layout op's output over exactly those axes. The cheapest completion takes the
discount exactly where the prediction has the reduce-scatter.

The other way round (``SliceChain.relabels``): a partial sum resolved for an op that
relabels its elements by collectives ending in a reduce-scatter, whose result the one
reader slices again (a local slice, or a slice then a permute), is all-reduced by XLA,
which makes the two slices one (``predict._scatter_folded_into_a_slice``). A *surcharge
node* adds the all-reduce's price over the reduce-scatter's there: per layout op strategy
that may make the pattern it has three strategies, the pattern (surcharged), "the
producer does not make it" and "the reader does not slice again", one of which the
chosen specs must allow; "none" is allowed only under the layout op's other strategies.
Only one layout op between the producer and the reader is priced so; the prediction also
follows longer chains.

Shared reads (``SHARED_READS``, off by default; the per-demand program only): one move
charged for the readers that want one spec, by share nodes
(:mod:`autoshard.intra.problem.shared_reads`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.cost.consumers import producer_preference
from autoshard.intra.cost.resharding import CostOptions
from autoshard.intra.ilp import EdgeCost, Tie
from autoshard.intra.problem.hub_sets import hub_max_sets, specs_of, wanted_sets_memo
from autoshard.intra.problem.shared_reads import SharedRead, share_matrices
from autoshard.intra.problem.slice_chains import (
    ChainGroup,
    SliceChain,
    _chain_matrices,
    _fold_matrices,
    _relevant,
)
from autoshard.intra.problem.value_costs import (
    consumers_cost,
    reshard_cost,
    resolve_cost,
    xla_resolves,
)
from autoshard.ir.spec import ShardingSpec

INF = math.inf
# the per-demand program's share nodes (autoshard.intra.problem.shared_reads): off, as their solve took
# 247-301 s where the per-demand one took 8 s on wresnet-tiny 2x4 (docs/sharing.md)
SHARED_READS = False
# which values get share nodes where SHARED_READS is on: those with at least
# SHARED_READS_MIN_USES distinct uses (2: every value read by several demands), and with
# SHARED_READS_NO_PARTIAL only where the producer never makes a partial sum. On
# wresnet-tiny 2x4, 4 values of 4 uses: 5.5% cheaper in 14 s, every value: 9.05% in
# 247-301 s; on gpt-tiny 2x4 past 120 s with nothing cheaper
# (benchmarks/studies/wide_exact_signal.py, docs/sharing.md)
SHARED_READS_MIN_USES = 2
SHARED_READS_NO_PARTIAL = False


def hubbed_values(values, strategies, ties, hubs: int, memo: dict | None = None) -> frozenset:
    """The indices of ``values`` that :func:`value_edges` (``exact``, ``hubs``) prices by
    a hub on these ``strategies`` and ``ties`` (``memo`` as there: the values' distinct
    demands are shared), so that a plan priced on its chosen strategies alone
    (:func:`autoshard.intra.problem.exact_values.price_per_value`) prices each value the way the
    full program does."""
    if not hubs:
        return frozenset()
    memo = {} if memo is None else memo
    distinct: dict[int, Value] = memo.setdefault("distinct", {})
    roots, maps = _roots(ties, strategies)
    out = []
    for i, v in enumerate(values):
        if len(v.uses) < 2:  # one demand at most: a plain edge
            continue
        if i not in distinct:
            src_specs = tuple(s.output_specs[v.k] for s in strategies[v.src])
            distinct[i] = _distinct_demands(v, strategies, src_specs, roots, maps)
        v = distinct[i]
        if len(v.uses) < 2:
            continue
        wants = [tuple(s.input_specs[u.slot] for s in strategies[u.dst]) for u in v.uses]
        targets = list(dict.fromkeys(b for w in wants for b in w if b is not None))
        partial_src = any(s.output_specs[v.k].partial for s in strategies[v.src])
        sets = wanted_sets_memo(memo, v, strategies, roots, maps, targets, hubs, partial_src)
        if targets and sets is not None:
            out.append(i)
    return frozenset(out)


@dataclass(frozen=True)
class Use:
    """One read of a value: ILP node ``dst`` reads it as operand ``slot``."""

    dst: int
    slot: int


@dataclass(frozen=True)
class Value:
    """A value as the ILP sees it: its producer (ILP node, output index), global shape,
    bytes per element, the reduction steps of each producer strategy
    (:func:`autoshard.intra.problem.predict.reduce_steps`), and its uses."""

    src: int
    k: int
    shape: tuple[int, ...]
    itemsize: int
    steps: tuple[tuple[tuple[str, ...], ...], ...]
    uses: tuple[Use, ...]
    batch_dims: tuple[int, ...] = ()  # a batched dot's result: its batch dims


@dataclass(frozen=True)
class CopyGroup:
    """The extra nodes of one value: a copy node per target spec, and the resolution node
    (-1: the producer never makes a partial result); or, for a value priced by a hub
    (``hub`` >= 0, no copy or resolution nodes), the hub node, whose strategy j stands
    for the set ``sets[j]`` of specs the value's uses want (a frozenset), or, where the
    producer may make a partial sum, for the spec each use wants (a tuple in
    ``value.uses``'s order)."""

    value: Value
    targets: tuple[ShardingSpec, ...]
    copies: tuple[int, ...]
    resolution: int
    hub: int = -1
    sets: tuple = ()


@dataclass(frozen=True)
class ValueEdges:
    """What the values add to the problem: ``num_strategies`` of the new nodes (numbered
    from ``first_node``), ``edges``, the ``ties`` of the new nodes (None: free), for
    every edge the ILP nodes whose reads it prices (``edge_consumers``), and the values'
    extra nodes (``groups``)."""

    first_node: int
    num_strategies: tuple[int, ...]
    edges: tuple[EdgeCost, ...]
    ties: tuple[Tie | None, ...]
    edge_consumers: tuple[tuple[int, ...], ...]
    groups: tuple[CopyGroup, ...] = ()
    chain_groups: tuple[ChainGroup, ...] = ()
    shares: tuple[SharedRead, ...] = ()

    def complete(self, strategies, choice, mesh: DeviceMesh) -> tuple[int, ...]:
        """``choice`` for the real nodes (the first ``first_node`` entries) extended with
        the extra nodes' choices XLA's behaviour implies: a copy wherever some use wants
        the spec, the partial result resolved into the spec XLA prefers among them (so
        the objective is the predicted resharding)."""
        out = list(choice[: self.first_node]) + [0] * len(self.num_strategies)
        for g in self.groups:
            v = g.value
            wanted = {strategies[u.dst][out[u.dst]].input_specs[u.slot] for u in v.uses}
            if g.hub >= 0:
                if g.sets and isinstance(g.sets[0], tuple):  # a state per use
                    state = tuple(strategies[u.dst][out[u.dst]].input_specs[u.slot] for u in v.uses)
                else:
                    state = frozenset(wanted - {None})
                out[g.hub] = g.sets.index(state)
                continue
            for b, y in zip(g.targets, g.copies, strict=True):
                out[y] = int(b in wanted)
            if g.resolution >= 0 and strategies[v.src][out[v.src]].output_specs[v.k].partial:
                first = min(
                    (b for b in g.targets if b in wanted),
                    key=lambda b: producer_preference(b, mesh),
                )
                out[g.resolution] = 1 + g.targets.index(first)
        for r in self.shares:  # shared wherever the first use wants the same spec
            out[r.node] = r.state(
                strategies[r.use.dst][out[r.use.dst]].input_specs[r.use.slot],
                strategies[r.lead.dst][out[r.lead.dst]].input_specs[r.lead.slot],
            )
        for g in self.chain_groups:  # the discount wherever the chosen specs allow it
            c, (pz, tz, rz) = g.chain, g.matrices
            p, t, r = out[c.src], out[c.mid], out[c.reader]
            out[g.node] = min(range(len(pz[p])), key=lambda z: pz[p][z] + tz[t][z] + rz[r][z])
        return tuple(out)


def _roots(ties, strategies):
    """Root and strategy map of every node (ties among the real nodes only)."""
    n = len(strategies)
    roots: list[int | None] = [None] * n
    maps: list[tuple[int, ...] | None] = [None] * n

    def find(v):
        if roots[v] is None:
            tie = ties[v]
            if tie is None:
                roots[v], maps[v] = v, tuple(range(len(strategies[v])))
            else:
                r, m = find(tie.leader)
                roots[v], maps[v] = r, tuple(-1 if p < 0 else tie.mapping[p] for p in m)
        return roots[v], maps[v]

    for v in range(n):
        find(v)
    return roots, maps


def _demand(u: Use, strategies, roots, maps) -> tuple:
    """What ``u`` wants for every strategy of its root: (root, wanted spec per root
    strategy, None where the root strategy is forbidden or the operand is a literal)."""
    specs = tuple(s.input_specs[u.slot] for s in strategies[u.dst])
    return roots[u.dst], tuple(None if q < 0 else specs[q] for q in maps[u.dst])


def _distinct_demands(v: Value, strategies, src_specs, roots, maps) -> Value:
    """``v`` with the uses that add nothing left out: a use tied to the producer that
    always wants the producer's own spec (a follower: free), and a use whose demand, per
    strategy of the root both are tied to, repeats another's (one copy serves both)."""
    mine = roots[v.src], tuple(
        None if q < 0 else src_specs[q]
        for q in maps[v.src]
    )  # fmt: skip
    kept: dict[tuple, Use] = {}
    for u in v.uses:
        d = _demand(u, strategies, roots, maps)
        if d[0] == mine[0] and all(w is None or w == a for w, a in zip(d[1], mine[1])):
            continue
        kept.setdefault(d, u)
    if len(kept) == len(v.uses):
        return v
    return dataclasses.replace(v, uses=tuple(kept.values()))


def value_edges(
    values: list[Value],
    strategies,
    ties,
    mesh: DeviceMesh,
    options: CostOptions,
    exact: bool = False,
    memo: dict | None = None,
    forbidden: frozenset[str] = frozenset(),
    hubs: int = 0,
    hub_only: frozenset | None = None,
    chains: tuple[SliceChain, ...] = (),
    priced_per_value: frozenset = frozenset(),
) -> ValueEdges:
    """The nodes and edges that price ``values`` (see the module docstring).
    ``strategies``: every ILP node's strategies; ``ties``: the real nodes' ties.

    ``exact``: copy and resolution nodes for every value read by several distinct
    demands, so that each resharding is paid once. Off: one edge per distinct demand
    (no new nodes) -- uses that always want the same spec (tied to one root) pay once,
    but a value two independent consumers want in one new spec pays twice, and a partial
    sum resolved into two specs pays two reductions.

    ``memo``: a dict kept between calls on the same ``strategies`` and ``ties`` (both
    programs of one plan, :func:`autoshard.intra.problem.build.auto_shard_graph`), so that the
    cost matrices and the values' distinct demands are computed once for both.

    ``forbidden``: collective kinds no resharding may use; a resharding that needs one
    costs ``inf`` (``IntraOptions.all_reduce_only``).

    ``hubs`` (with ``exact``): a value whose uses may want at most this many sets of
    specs together gets a hub instead of copy and resolution nodes (0: none;
    :func:`hub_max_sets` picks it per mesh); ``hub_only``: the indices of the values
    that may get one (None: any).  A value with one distinct demand gets a plain edge
    whatever these say.

    ``priced_per_value`` (without ``exact``): the indices of values priced per value
    anyway, the others per demand (a study's hybrid, ``wide_exact_signal.py``).

    ``chains``: the values read by a layout op whose result one reader may split, each
    given a discount node (module docstring); none where ``forbidden`` holds the
    reduce-scatter (the all-reduce is then what the plan is priced for)."""
    first = len(strategies)
    sizes: list[int] = []
    new_ties: list[Tie | None] = []
    edges: list[EdgeCost] = []
    consumers: list[tuple[int, ...]] = []
    groups: list[CopyGroup] = []
    roots, maps = _roots(ties, strategies)
    seen: dict[tuple, list[int]] = {}  # signature of a value -> its aux nodes
    memo = {} if memo is None else memo
    # cost matrices (their keys name the strategies by id: valid while they are alive,
    # which the memo's owner guarantees by keeping them), and each value's distinct uses
    matrices: dict[tuple, tuple] = memo.setdefault("matrices", {})
    distinct: dict[int, Value] = memo.setdefault("distinct", {})
    prices: dict[tuple, dict] = memo.setdefault(("prices", mesh, options, forbidden), {})

    def node(n_strats: int, leader: int | None) -> int:
        sizes.append(n_strats)
        new_ties.append(None if leader is None else Tie(leader, tuple(range(n_strats))))
        return first + len(sizes) - 1

    shares: list[SharedRead] = []

    def shared_read(v: Value, u: Use, w: tuple, lead: tuple, matrix: tuple) -> None:
        """Price use ``u`` of ``v`` (its wants ``w``, its per-demand ``matrix``) through a
        share node: its state is (own, b) -- the move into b paid, as per demand -- or
        (shared, b), free, allowed only where the value's first use wants b too."""
        sig = ("share", roots[v.src], maps[v.src], id(strategies[v.src]), v.k, v.shape,
               v.itemsize, v.steps, v.batch_dims, roots[u.dst], maps[u.dst],
               id(strategies[u.dst]), u.slot, roots[v.uses[0].dst], maps[v.uses[0].dst],
               id(strategies[v.uses[0].dst]), v.uses[0].slot)  # fmt: skip
        own, both, src_m, use_m, lead_m = share_matrices(w, lead, matrix)
        leader = seen.get(sig)
        z = node(len(own) + len(both), None if leader is None else leader[0])
        seen.setdefault(sig, [z])
        for a, m in ((v.src, src_m), (u.dst, use_m), (v.uses[0].dst, lead_m)):
            edges.append(EdgeCost.of_floats(a, z, m))
            consumers.append((u.dst,))
        shares.append(SharedRead(z, v.uses[0], u, own, both))

    for i, v in enumerate(values):
        src_specs = tuple(s.output_specs[v.k] for s in strategies[v.src])
        if i not in distinct:
            distinct[i] = _distinct_demands(v, strategies, src_specs, roots, maps)
        v = distinct[i]
        if not v.uses:
            continue
        wants = [tuple(s.input_specs[u.slot] for s in strategies[u.dst]) for u in v.uses]
        readers = tuple(dict.fromkeys(u.dst for u in v.uses))
        if len(v.uses) == 1 or not (exact or i in priced_per_value):
            # with forbidden kinds, a partial sum several demands read is all-reduced into
            # the producer's own layout only: per demand, a reduce-scatter for one use and
            # an all-reduce for another would price fine, but XLA would reduce once and
            # gather or exchange for the other (the kind forbidden); the per-value program
            # is exact and may still find the reduce-scatter where it is safe
            guarded = bool(forbidden) and len(v.uses) > 1
            share = (
                SHARED_READS
                and not guarded
                and len(v.uses) >= SHARED_READS_MIN_USES
                and not (SHARED_READS_NO_PARTIAL and any(a.partial for a in src_specs))
            )
            for u, w in zip(v.uses, wants):
                key = ("edge", id(strategies[v.src]), v.k, id(strategies[u.dst]), u.slot,
                       v.shape, v.itemsize, v.steps, v.batch_dims, guarded)  # fmt: skip
                if key not in matrices:
                    # a row per distinct (spec, relevant steps): producer strategies that
                    # make the value alike share one row object
                    rows: dict[tuple, tuple[float, ...]] = {}
                    distinct_w = tuple(dict.fromkeys(w))
                    matrix = []
                    for a, st in zip(src_specs, v.steps):
                        rel = _relevant(a, st, v.batch_dims)
                        row = rows.get((a, rel))
                        if row is None:
                            # this build's prices of a into each b (resolve_cost's, looked
                            # up by b alone: the lru's nine-part key cost more than a price)
                            known = prices.setdefault((a, v.shape, v.itemsize, rel), {})
                            price = {}
                            for b in distinct_w:
                                if a.partial and guarded and b is not None and b.dims != a.dims:
                                    price[b] = INF
                                    continue
                                c = known.get(b)
                                if c is None:
                                    c = known[b] = (
                                        0.0 if b is None
                                        else INF if a.partial and not xla_resolves(a, b)
                                        else resolve_cost(a, b, v.shape, v.itemsize, mesh,
                                                           options, *rel, forbidden)
                                    )  # fmt: skip
                                price[b] = c
                            row = rows[a, rel] = tuple(price[b] for b in w)
                        matrix.append(row)
                    matrices[key] = tuple(matrix)
                if share and u is not v.uses[0]:
                    shared_read(v, u, w, wants[0], matrices[key])
                    continue
                edges.append(EdgeCost.of_floats(v.src, u.dst, matrices[key]))
                consumers.append((u.dst,))
            continue
        targets = list(dict.fromkeys(b for w in wants for b in w if b is not None))
        if not targets:
            continue
        partial_src = any(a.partial for a in src_specs)
        if any(b.partial for b in targets):
            raise ValueError(
                "internal error: a consumer wants a partial sum (a 'through' strategy); "
                "per-value resharding does not model those"
            )
        sig = (
            roots[v.src], maps[v.src], id(strategies[v.src]), v.k, v.shape, v.itemsize,
            tuple((roots[u.dst], maps[u.dst], id(strategies[u.dst]), u.slot) for u in v.uses),
        )  # fmt: skip
        leaders = seen.get(sig)
        sets = None
        if hubs and (hub_only is None or i in hub_only):
            sets = wanted_sets_memo(memo, v, strategies, roots, maps, targets, hubs, partial_src)
        if sets is not None:
            # a hub: one node whose strategy is the set of specs the uses want, priced
            # from the producer's spec as predicted (reshard_to_consumers)
            hub = node(len(sets), None if leaders is None else leaders[0])
            key = ("hub", id(strategies[v.src]), v.k, tuple(sets), v.shape, v.itemsize,
                   v.steps, v.batch_dims)  # fmt: skip
            if key not in matrices:
                rows: dict[tuple, tuple[float, ...]] = {}
                matrix = []
                for a, st in zip(src_specs, v.steps):
                    rel = _relevant(a, st, v.batch_dims)
                    row = rows.get((a, rel))
                    if row is None:
                        row = rows[a, rel] = tuple(
                            consumers_cost(a, tuple(sorted(specs_of(x), key=targets.index)),
                                            v.shape, v.itemsize, mesh, options, *rel, forbidden)
                            for x in sets
                        )  # fmt: skip
                    matrix.append(row)
                matrices[key] = tuple(matrix)
            edges.append(EdgeCost.of_floats(v.src, hub, matrices[key]))
            consumers.append(readers)
            for j, (u, w) in enumerate(zip(v.uses, wants)):
                key = ("member", id(strategies[u.dst]), u.slot, tuple(sets), partial_src and j)
                if key not in matrices:
                    matrices[key] = tuple(
                        tuple(
                            0.0 if (x[j] == b if partial_src else b is None or b in x) else INF
                            for x in sets
                        )
                        for b in w
                    )
                edges.append(EdgeCost.of_floats(u.dst, hub, matrices[key]))
                consumers.append(readers)
            groups.append(CopyGroup(v, tuple(targets), (), -1, hub, tuple(sets)))
            if leaders is None:
                seen[sig] = [hub]
            continue
        aux: list[int] = []
        # copy nodes: absent (0) / present (1)
        copy_of: dict[ShardingSpec, int] = {}
        for j, b in enumerate(targets):
            y = node(2, None if leaders is None else leaders[j])
            aux.append(y)
            copy_of[b] = y
            key = ("copy", id(strategies[v.src]), v.k, b, v.shape, v.itemsize)
            if key not in matrices:
                matrices[key] = tuple(
                    (0.0, (0.0 if xla_resolves(a, b) else INF) if a.partial
                     else reshard_cost(a, b, v.shape, v.itemsize, mesh, options, forbidden))
                    for a in src_specs
                )  # fmt: skip
            edges.append(EdgeCost.of_floats(v.src, y, matrices[key]))
            consumers.append(readers)
        for u, w in zip(v.uses, wants):
            for b in dict.fromkeys(x for x in w if x is not None):
                key = ("need", id(strategies[u.dst]), u.slot, b)
                if key not in matrices:
                    matrices[key] = tuple((INF if x == b else 0.0, 0.0) for x in w)
                edges.append(EdgeCost.of_floats(u.dst, copy_of[b], matrices[key]))
                consumers.append(readers)
        if partial_src:
            # resolution node: 0 = none (the producer's spec is not partial), 1 + j = targets[j]
            r = node(1 + len(targets), None if leaders is None else leaders[len(targets)])
            aux.append(r)
            key = ("resolve", id(strategies[v.src]), v.k, tuple(targets), v.shape, v.itemsize,
                   v.steps, v.batch_dims)  # fmt: skip
            if key not in matrices:
                matrices[key] = tuple(
                    (INF,) + tuple(
                        resolve_cost(a, t, v.shape, v.itemsize, mesh, options,
                                      *_relevant(a, st, v.batch_dims), forbidden)
                        if xla_resolves(a, t) else INF
                        for t in targets
                    ) if a.partial else (0.0,) + (INF,) * len(targets)
                    for a, st in zip(src_specs, v.steps)
                )  # fmt: skip
            edges.append(EdgeCost.of_floats(v.src, r, matrices[key]))
            consumers.append(readers)
            rank = {t: producer_preference(t, mesh) for t in targets}
            for b in targets:
                key = ("then", tuple(targets), b, v.shape, v.itemsize)
                if key not in matrices:
                    rows = [(0.0, 0.0)]
                    for t in targets:
                        if t == b:
                            rows.append((INF, 0.0))
                        elif rank[b] < rank[t]:  # XLA would reduce into b, not t
                            rows.append((0.0, INF))
                        else:
                            rows.append(
                                (
                                    0.0,
                                    reshard_cost(
                                        t, b, v.shape, v.itemsize, mesh, options, forbidden
                                    ),
                                )
                            )
                    matrices[key] = tuple(rows)
                edges.append(EdgeCost.of_floats(r, copy_of[b], matrices[key]))
                consumers.append(readers)
        groups.append(
            CopyGroup(
                v, tuple(targets), tuple(copy_of[b] for b in targets), r if partial_src else -1
            )
        )
        if leaders is None:
            seen[sig] = aux
    chain_groups: list[ChainGroup] = []
    by_src = {(v.src, v.k): v for v in values}
    for chain in chains if "reduce-scatter" not in forbidden else ():
        v = by_src.get((chain.src, chain.k))
        if v is None:
            continue
        key = ("chain", id(strategies[chain.src]), chain.k, id(strategies[chain.mid]),
               id(strategies[chain.reader]), chain.slot, v.shape, v.itemsize, v.steps,
               v.batch_dims)  # fmt: skip
        kinds = [("chain", _chain_matrices)]
        if chain.relabels:
            kinds.append(("fold", _fold_matrices))
        for tag, make in kinds:
            tagged = (tag,) + key[1:]
            if tagged not in matrices:
                matrices[tagged] = make(chain, v, strategies, mesh, options)
            found = matrices[tagged]
            if found is None:
                continue
            nodes = (chain.src, chain.mid, chain.reader)
            sig = (tagged,) + tuple((roots[n], maps[n]) for n in nodes)
            leader = seen.get(sig)
            z = node(len(found[0][0]), None if leader is None else leader[0])
            seen.setdefault(sig, [z])
            for n, m in zip(nodes, found, strict=True):
                edges.append(EdgeCost.of_floats(n, z, m))
                consumers.append((chain.mid,))
            chain_groups.append(ChainGroup(chain, z, found))
    return ValueEdges(
        first, tuple(sizes), tuple(edges), tuple(new_ties), tuple(consumers), tuple(groups),
        tuple(chain_groups), tuple(shares),
    )  # fmt: skip


__all__ = [
    "ChainGroup",
    "CopyGroup",
    "SliceChain",
    "Use",
    "Value",
    "ValueEdges",
    "hub_max_sets",
    "hubbed_values",
    "value_edges",
    "xla_resolves",
]
