"""Exact reductions of a :class:`ShardingProblem` before any solver sees it (jax-free).

:func:`_reduce` merges tied nodes onto their roots (blocks), folds fixed and separable
edges into node costs, sums parallel edges and, with merging, eliminates chains and
trees and dominated strategies (:func:`_eliminate`). The result, :class:`_Reduced`, is the
problem in block space, with its memory rows (:mod:`.memory`).

With preferences the reductions are lexicographic: every cost is a complex number, its
real part the cost (rounded to :func:`cost_quantum`), its imaginary part the preference,
and numpy orders complex numbers lexicographically (real part first), so a min over
strategies (elimination), a dominance test and the decoding's argmin keep the least
cost first and, among equal costs, the least preference -- exactly, with no weight
that could trade one against the other.
"""

from __future__ import annotations

import math

import numpy as np

from autoshard.intra.ilp.memory_rows import _memory_rows
from autoshard.intra.ilp.problem import (
    InfeasibleProblemError,
    ShardingProblem,
    cost_quantum,
    resolve_ties,
)
from autoshard.intra.ilp.reduced import _Reduced


def _reduce(
    pb: ShardingProblem,
    merge: bool,
    eliminate: bool = True,
    memory: bool = False,
    lexicographic: bool | None = None,
) -> _Reduced:
    """``memory``: build the memory rows even without a budget (to minimise the peak).
    ``lexicographic`` (None: where ``pb`` has preferences): costs as complex numbers,
    cost then preference (see the module)."""
    roots, root_maps = resolve_ties(pb)  # also rejects cycles when merge=False
    if lexicographic is None:
        lexicographic = pb.preferences is not None
    quantum = cost_quantum(pb) if lexicographic else None

    def rounded(c: np.ndarray) -> np.ndarray:  # exact: the quantum is a power of two
        return c if quantum is None else np.round(c / quantum) * quantum

    def node_cost(v: int) -> np.ndarray:
        c = rounded(np.asarray(pb.node_costs[v], dtype=float))
        if not lexicographic:
            return c
        z = np.empty(c.size, complex)
        z.real, z.imag = c, pb.preferences[v] if pb.preferences is not None else 0.0
        return z

    n, k = pb.num_nodes, pb.num_strategies
    if merge:
        blocks = sorted(set(roots))
        index = {r: b for b, r in enumerate(blocks)}
        block_of = np.array([index[r] for r in roots], dtype=int)
        maps = [np.asarray(m, dtype=int) for m in root_maps]
    else:
        blocks, block_of = list(range(n)), np.arange(n)
        maps = [np.arange(kv) for kv in k]
    inf = math.inf
    cost = [np.zeros(k[r], complex if lexicographic else float) for r in blocks]
    for v in range(n):
        m = maps[v]
        cost[block_of[v]] += np.where(m >= 0, node_cost(v)[m], inf)
    pair_acc: dict[tuple[int, int], np.ndarray] = {}
    matrices: dict[int, np.ndarray] = {}  # edges of identical layers share one matrix
    for e in pb.edges:
        a, b, ma, mb = block_of[e.src], block_of[e.dst], maps[e.src], maps[e.dst]
        c = matrices.get(id(e.costs))
        if c is None:
            c = matrices[id(e.costs)] = rounded(np.asarray(e.costs, dtype=float))
        if a == b:  # both ends on one root: a node-cost term of that root
            cost[a] += np.where((ma >= 0) & (mb >= 0), c[ma, mb], inf)
            continue
        mat = c[np.ix_(ma, mb)]
        mat[ma < 0, :] = inf
        mat[:, mb < 0] = inf
        if a > b:
            a, b, mat = b, a, mat.T
        prev = pair_acc.get((a, b))
        pair_acc[(a, b)] = mat if prev is None else prev + mat

    def where(b: int) -> str:
        r = blocks[b]
        tied = int(np.sum(block_of == b)) - 1 if merge else 0
        return pb.node_label(r) + (f" (with the {tied} nodes tied to it)" if tied else "")

    def allowed(b: int, why: str) -> np.ndarray:
        ok = np.flatnonzero(np.isfinite(cost[b]))
        if ok.size == 0:
            raise InfeasibleProblemError(f"every strategy of {where(b)} is forbidden {why}")
        return ok

    first = [
        allowed(b, "(infinite node or tie-internal edge cost, or tie mapping -1)")
        for b in range(len(blocks))
    ]
    fixed = [int(ok[0]) if ok.size == 1 else -1 for ok in first]
    red = _Reduced(pb, block_of, maps, blocks, [], fixed, np.zeros(0, int), cost)
    free_pairs = []
    for (a, b), mat in pair_acc.items():
        fa, fb = fixed[a], fixed[b]
        if fa >= 0 and fb >= 0:
            if not math.isfinite(mat[fa, fb]):
                raise InfeasibleProblemError(
                    f"the only strategies of {where(a)} and {where(b)} are a forbidden pair"
                )
            red.constant += mat[fa, fb].item()
        elif fa >= 0:
            cost[b] = cost[b] + mat[fa, :]
        elif fb >= 0:
            cost[a] = cost[a] + mat[:, fb]
        else:
            free_pairs.append((a, b, mat))
    if merge and eliminate:
        free_pairs = _eliminate(red, pb, cost, fixed, free_pairs)
    gone = {b for b, _, _ in red.eliminated}
    for b, f in enumerate(fixed):
        if f >= 0:
            red.constant += cost[b][f].item()
            red.cols.append(np.zeros(0, int))
        elif b in gone:
            red.cols.append(np.zeros(0, int))
        else:
            red.cols.append(allowed(b, "given the only strategies of its neighbours"))
    red.offset = np.cumsum([0] + [c.size for c in red.cols])[:-1]
    costs = [cost[b][red.cols[b]] for b in range(len(blocks))]
    for a, b, mat in free_pairs:
        sub = mat[np.ix_(red.cols[a], red.cols[b])]
        finite = np.isfinite(sub)
        if not finite.any():
            raise InfeasibleProblemError(
                f"every strategy pair of {where(a)} and {where(b)} is forbidden"
            )
        split = _separable(sub)
        if split is not None:  # separable (constant included): no edge variables
            costs[a] = costs[a] + split[0]
            costs[b] = costs[b] + split[1]
            continue
        low = sub[finite].min()
        red.constant += low.item()
        red.pairs.append((a, b, sub - low))
    for b in range(len(blocks)):
        if costs[b].size:
            low = costs[b].min()
            red.constant += low.item()
            costs[b] = costs[b] - low
    red.costs = costs
    if not merge:
        red.ties = [(v, t.leader, t.mapping) for v, t in enumerate(pb.ties) if t is not None]
    if (
        pb.node_memory is not None
        and pb.live_sets
        and (memory or pb.memory_budget_bytes is not None)
    ):
        red.mem_rows = _memory_rows(red)  # only a budget or the peak needs them
    return red


def _separable(sub: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(a, b) with sub[p, q] = a[p] + b[q] (to rounding; lexicographic costs: both their
    parts), or None."""
    if not sub.size or not np.isfinite(sub).all():
        return None
    row, col = sub[:, 0], sub[0, :] - sub[0, 0]
    both = row[:, None] + col[None, :]
    parts = (
        [(sub.real, both.real), (sub.imag, both.imag)] if np.iscomplexobj(sub) else [(sub, both)]
    )
    for have, want in parts:
        if not np.allclose(have, want, rtol=1e-12, atol=1e-12 * np.abs(have).max()):
            return None
    return row, col


def _eliminate(red: _Reduced, pb: ShardingProblem, cost, fixed, free_pairs):
    """Exact reductions of the free blocks before the solve (merge=True only).

    * Elimination: a block b with one neighbour u and edge matrix M (b x u) adds
      min_p (c_b[p] + M[p, :]) to u's cost; with two neighbours u, w it adds
      min_p (c_b[p] + M_bu[p, :, None] + M_bw[p, None, :]) to the edge (u, w); with one
      allowed strategy p it adds M[p, :] to every neighbour's cost. The optimum over the
      remaining blocks is unchanged, and b's best strategy given its neighbours' is
      recovered after the solve (``_decode``).
    * A block left without neighbours keeps its cheapest strategy alone.
    * Dominance (dead-end elimination): strategy p of b goes when another allowed p' is
      no worse whatever the neighbours pick, c_b[p'] - c_b[p] +
      sum_u max_q (M_bu[p', q] - M_bu[p, q]) <= 0 over the neighbours' allowed q. The
      bound is subadditive, so every dropped strategy keeps a dominator that stays.

    Both repeat until nothing changes: chains and trees of the graph collapse and
    hopeless strategies disappear, so the program shrinks and its relaxation can only get
    tighter. With a memory budget, blocks whose memory differs between strategies are
    left alone (they appear in memory rows).
    """
    protected = set()
    if pb.node_memory is not None and pb.live_sets and pb.memory_budget_bytes is not None:
        for v in {v for live in pb.live_sets for v in live}:
            if len(set(pb.node_memory[v])) > 1:
                protected.add(int(red.block_of[v]))
        for c in pb.copies:  # their strategies decide whether a copy exists
            for v in [c.source] + [v for v, _ in c.readers]:
                protected.add(int(red.block_of[v]))
    mats: dict[tuple[int, int], np.ndarray] = {}
    nbrs: dict[int, set[int]] = {}
    for a, b, mat in free_pairs:
        ok_a, ok_b = np.isfinite(cost[a]), np.isfinite(cost[b])
        split = _separable(mat[np.ix_(ok_a, ok_b)])
        if split is not None:  # no real edge: fold it now, so it links nothing
            for v, ok, part in ((a, ok_a, split[0]), (b, ok_b, split[1])):
                add = np.zeros(ok.size, part.dtype)
                add[ok] = part
                cost[v] = cost[v] + add
            continue
        mats[a, b] = mat
        nbrs.setdefault(a, set()).add(b)
        nbrs.setdefault(b, set()).add(a)

    def oriented(b: int, u: int) -> np.ndarray:  # b x u
        return mats[b, u] if (b, u) in mats else mats[u, b].T

    def can_go(b: int) -> bool:
        if b not in nbrs or b in protected:
            return False
        return 1 <= len(nbrs[b]) <= 2 or np.count_nonzero(np.isfinite(cost[b])) == 1

    def eliminate(b: int) -> list[int]:
        around = sorted(nbrs.pop(b))
        parts = [(u, oriented(b, u)) for u in around]
        for u in around:
            nbrs[u].discard(b)
            mats.pop((min(b, u), max(b, u)))
        c = cost[b]
        ok = np.isfinite(c)
        if np.count_nonzero(ok) == 1:
            p = int(np.flatnonzero(ok)[0])
            for u, m in parts:
                cost[u] = cost[u] + (c[p] + m[p, :] if u == around[0] else m[p, :])
        elif len(parts) == 1:
            ((u, m),) = parts
            cost[u] = cost[u] + (c[:, None] + m).min(axis=0)
        else:
            (u, mu), (w, mw) = parts
            new = (c[:, None, None] + mu[:, :, None] + mw[:, None, :]).min(axis=0)
            if (u, w) in mats:
                mats[u, w] = mats[u, w] + new
            else:
                mats[u, w] = new
                nbrs[u].add(w)
                nbrs[w].add(u)
        red.eliminated.append((b, c, parts))
        for u in around:  # its cost or matrices changed, so may its allowed strategies
            stale.add(u)
            stale.update(nbrs[u])
        return around

    def dominated(b: int) -> bool:
        """Drop b's dominated strategies (cost inf); True if any went."""
        ok = np.flatnonzero(np.isfinite(cost[b]))
        if ok.size < 2:
            return False
        c = cost[b][ok]
        worst = c[:, None] - c[None, :]  # [p', p]: most p' can cost more than p
        with np.errstate(invalid="ignore"):
            for u in nbrs[b]:
                m = oriented(b, u)[np.ix_(ok, np.isfinite(cost[u]))]
                diff = m[:, None, :] - m[None, :, :]
                diff[np.isnan(diff)] = -math.inf  # both forbidden: that q is out either way
                worst = worst + diff.max(axis=2, initial=-math.inf)
            beats = worst <= 0  # [p', p]: p' dominates p (NaN, inf - inf: it does not)
        np.fill_diagonal(beats, False)
        candidates = np.flatnonzero(beats.any(axis=0))
        if candidates.size == 0:  # the common case: nothing dominated, no loop
            return False
        gone = np.zeros(ok.size, bool)
        for i in candidates:  # in order: a strategy already gone dominates nothing
            if np.any(beats[~gone, i]):
                gone[i] = True
        c_new = cost[b].copy()
        c_new[ok[gone]] = math.inf
        cost[b] = c_new
        return True

    # blocks whose dominance test could answer differently from their last one: its
    # inputs (the block's costs, its matrices, its neighbours' allowed strategies) changed
    # since; the others would find nothing again, so the test skips them (same result)
    stale = set(nbrs)
    todo = set(b for b in nbrs if fixed[b] < 0)
    while todo:
        queue = sorted(todo)
        todo = set()
        while queue:  # eliminate while anything can go
            b = queue.pop()
            if can_go(b):
                queue.extend(u for u in eliminate(b) if can_go(u))
        for b in sorted(nbrs):
            if b in protected or not nbrs[b] or b not in stale:
                continue
            stale.discard(b)
            if dominated(b):
                todo.add(b)
                todo.update(nbrs[b])
                stale.add(b)
                stale.update(nbrs[b])
    gone = {b for b, _, _ in red.eliminated}
    for b, c in enumerate(cost):  # alone: its own cheapest strategy (lexicographic: and
        # among the cheapest the preferred), whatever the others pick
        if fixed[b] < 0 and b not in gone and b not in protected and not nbrs.get(b):
            ok = np.isfinite(c)
            if np.count_nonzero(ok) > 1:
                fixed[b] = int(np.argmin(c))
    return [(a, b, m) for (a, b), m in mats.items()]
