"""The program in matrix form (jax-free): columns, rows and costs built from a reduced
problem (:class:`_Model`, :func:`_build`): one-hot strategy columns, edge variables
with transportation rows, memory rows with copy-window columns, and (``merge=False``)
tie rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autoshard.intra.ilp.reduced import _Reduced

# The objective is rescaled so that its largest coefficient is this. Solvers' tolerances
# are absolute (HiGHS and CBC treat reduced costs under 1e-7 as zero, CBC's preprocessing
# drops smaller objective differences): with the largest coefficient at 1e5 the absolute
# gap the solve proves (solvers._ABS_GAP, 1e-9 of it) is above them.
OBJECTIVE_RANGE = 1e5


@dataclass
class _Model:
    """The program in matrix form: binary strategy columns first (``num_binary``, in
    ``_Reduced`` variable order), then continuous edge and peak columns, and rows
    ``row_lower <= A x <= row_upper`` given as (row, column, value) triplets."""

    num_binary: int = 0
    cost: list[float] = field(default_factory=list)  # per column, rescaled
    preference: list[float] = field(default_factory=list)  # per column, as given
    num_cols: int = 0
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    scale: float = 1.0
    violated: str | None = None  # a constant constraint that cannot hold
    values: np.ndarray | None = None  # column values after a solve
    start: tuple[list[int], list[float]] | None = None  # a starting point: (columns, values)
    presolve: bool = False  # HiGHS's presolve (see autoshard.intra.ilp.solve)
    max_nodes: int | None = None  # a branch-and-bound node limit (deterministic, unlike time)
    lp_first: bool = False  # HiGHS: solve the LP relaxation first, keep it when integral
    # with lp_first: where the relaxation is fractional and the program has more columns
    # than this, no integer program is run (outcome "fractional", the LP's bound)
    mip_max_columns: int | None = None
    # with mip_max_columns: the LP's simplex iteration limit (deterministic, unlike time);
    # an LP stopped there (or by the time limit) has outcome "lp_stopped"
    lp_max_iterations: int | None = None
    lp_values: np.ndarray | None = None  # a fractional LP relaxation's column values
    neighbourhood_free: int | None = None  # binary columns the neighbourhood search left free
    # each binary column's node (its one-hot row's index): the neighbourhood search frees a
    # node's every strategy, not only the columns where the start and the LP differ
    node_of: np.ndarray | None = None
    # the nodes' pairs that share edge columns (an (n, 2) array of node indices): the
    # neighbourhood search also frees a node whose every neighbour is free
    node_pairs: np.ndarray | None = None
    neighbourhood_rounds: int | None = None  # the neighbourhood search's rounds kept

    def column(self, cost: float = 0.0, preference: float = 0.0) -> int:
        self.cost.append(cost)
        self.preference.append(preference)
        self.num_cols += 1
        return self.num_cols - 1

    def row(self, terms, lower: float, upper: float) -> None:
        r = len(self.row_lower)
        for c, v in terms:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def csc(self):
        """Column-wise (start, index, value) arrays of the constraint matrix."""
        rows, cols = np.asarray(self.rows, dtype=np.int64), np.asarray(self.cols, dtype=np.int64)
        vals = np.asarray(self.vals, dtype=float)
        order = np.lexsort((rows, cols))
        start = np.searchsorted(cols[order], np.arange(self.num_cols + 1))
        return start.astype(np.int32), rows[order].astype(np.int32), vals[order]


def _classes(mat: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Class index of every row of ``mat`` (equal rows share one) and a representative
    row per class."""
    seen: dict[bytes, int] = {}
    cls = np.empty(mat.shape[0], dtype=np.int64)
    reps: list[int] = []
    for i, row in enumerate(mat):
        key = row.tobytes()
        if key not in seen:
            seen[key] = len(reps)
            reps.append(i)
        cls[i] = seen[key]
    return cls, reps


def _build(red: _Reduced, minimise_peak: bool) -> _Model:
    """The program: minimise cost under the budget, or minimise the peak memory."""
    model = _Model()
    inf = math.inf
    for cols in red.cols:
        for _ in range(cols.size):
            model.column()
    model.num_binary = model.num_cols
    model.node_of = np.repeat(np.arange(len(red.cols)), [cols.size for cols in red.cols])
    model.node_pairs = np.array([(a, b) for a, b, _ in red.pairs], dtype=np.int64).reshape(-1, 2)
    for b, cols in enumerate(red.cols):
        if cols.size:
            o = int(red.offset[b])
            model.row([(o + i, 1.0) for i in range(cols.size)], 1.0, 1.0)
    finite = [c for c in red.costs if c.size] + [m[np.isfinite(m)] for _, _, m in red.pairs]
    finite = [c for c in finite if c.size]
    largest = max([float(np.abs(c.real).max()) for c in finite] + [0.0]) or 1.0
    model.scale = largest / OBJECTIVE_RANGE
    if not minimise_peak:
        for b, c in enumerate(red.costs):
            o = int(red.offset[b])
            for i, w in enumerate(c.tolist()):
                model.cost[o + i] = w.real / model.scale
                model.preference[o + i] = w.imag
    for a, b, mat in red.pairs:
        finite_pairs = np.isfinite(mat)
        if minimise_peak and finite_pairs.all():
            continue
        # Strategies whose rows (columns) of the cost matrix are identical -- e.g. the
        # same output spec -- share edge variables: with one-hot marginals the
        # transportation constraints still force the exact pair, with far fewer variables.
        row_of, rows_rep = _classes(mat)
        col_of, cols_rep = _classes(mat.T)
        cmat = mat[np.ix_(rows_rep, cols_rep)]
        e = {}
        for p, q in zip(*np.nonzero(np.isfinite(cmat)), strict=True):
            w = 0.0 if minimise_peak else complex(cmat[p, q])
            e[p, q] = model.column(w.real / model.scale, w.imag)
        oa, ob = int(red.offset[a]), int(red.offset[b])
        for p in range(cmat.shape[0]):
            terms = [(e[p, q], 1.0) for q in range(cmat.shape[1]) if (p, q) in e]
            members = [(oa + i, -1.0) for i in np.flatnonzero(row_of == p).tolist()]
            model.row(terms + members, 0.0, 0.0)
        for q in range(cmat.shape[1]):
            terms = [(e[p, q], 1.0) for p in range(cmat.shape[0]) if (p, q) in e]
            members = [(ob + i, -1.0) for i in np.flatnonzero(col_of == q).tolist()]
            model.row(terms + members, 0.0, 0.0)
    _add_ties(red, model)
    # memory-row column -> model column: strategy columns are model columns, window
    # columns are the Z columns _window_columns adds
    to_model = np.r_[np.arange(red.num_strategy_cols), _window_columns(red, model)].astype(int)

    def mem_terms(cols, w, scale):
        return [
            (int(i), wi / scale) for i, wi in zip(to_model[cols].tolist(), w.tolist(), strict=True)
        ]

    rows = red.mem_rows
    mem_scale = (
        max([float(w.max()) for _, _, w in rows if w.size] + [abs(c) for c, _, _ in rows] + [0.0])
        or 1.0
    )
    budget = red.problem.memory_budget_bytes
    if minimise_peak:
        peak = model.column(1.0)
        model.row([(peak, 1.0)], max([c for c, _, _ in rows] + [0.0]) / mem_scale, inf)
        for constant, cols, w in rows:
            terms = mem_terms(cols, w, mem_scale)
            model.row(terms + [(peak, -1.0)], -inf, -constant / mem_scale)
    elif budget is not None:
        col_block = np.r_[  # a window column is a block of its own
            np.repeat(np.arange(len(red.cols)), [c.size for c in red.cols]),
            len(red.cols) + np.arange(len(red.windows)),
        ]
        for constant, cols, w in rows:
            if constant > budget:
                model.violated = "memory"
                break
            if cols.size:  # can this row ever exceed the budget? (max per block, summed)
                starts = np.flatnonzero(np.r_[True, np.diff(col_block[cols]) != 0])
                if constant + np.maximum.reduceat(w, starts).sum() <= budget:
                    continue
                model.row(mem_terms(cols, w, mem_scale), -inf, (budget - constant) / mem_scale)
    return model


def _window_columns(red: _Reduced, model: _Model) -> list[int]:
    """One continuous column Z per copy window (``red.windows``), with rows that force
    Z >= 1 when the copy exists and is live there: Z >= exists + before + after - (m - 1)
    (minus the blockers' reads, for an early copy) over the m parts that are not
    constant, where ``before`` (``after``) is the OR of the
    reader indicators up to ``a`` (from ``b``), built as a chain of columns
    P_j >= P_(previous reader), P_j >= reads_j. The memory rows push Z (and the chains)
    down, so at an integer point the smallest feasible Z is exactly the copy's liveness."""
    chains: dict[tuple[int, int, int], list[tuple[int, float]]] = {}

    def either(ci: int, reads, j: int, step: int) -> list[tuple[int, float]]:
        """OR of the non-constant reads from index j towards the end (step -1: down to 0,
        step +1: up to the last), as terms of a 0/1 expression."""
        key = (ci, j, step)
        if key in chains:
            return chains[key]
        own = [(int(c), 1.0) for c in reads[j]]
        rest = [
            i
            for i in range(j + step, -1 if step < 0 else len(reads), step)
            if reads[i] is not True and reads[i] is not False
        ]
        if not rest:
            chains[key] = own
            return own
        previous = either(ci, reads, rest[0], step)
        col = model.column()
        model.row([(col, 1.0)] + [(c, -v) for c, v in own], 0.0, math.inf)
        model.row([(col, 1.0)] + [(c, -v) for c, v in previous], 0.0, math.inf)
        chains[key] = [(col, 1.0)]
        return chains[key]

    out = []
    for ci, exists, reads, pre, suf, blk in red.windows:
        parts = [] if exists is True else [[(int(c), 1.0) for c in exists]]
        if pre is not None:
            parts.append(either(ci, reads, pre, -1))
        if suf is not None:
            parts.append(either(ci, reads, suf, +1))
        unique = {tuple(part): part for part in parts}  # a prefix may equal the suffix
        merged: dict[int, float] = {}
        for part in unique.values():
            for c, v in part:  # a source tied to a reader shares its columns
                merged[c] = merged.get(c, 0.0) - v
        for j in blk:  # an early copy's blockers: any that reads lifts the bound
            for c in reads[j]:
                merged[int(c)] = merged.get(int(c), 0.0) + 1.0
        z = model.column()
        model.row([(z, 1.0), *merged.items()], 1.0 - len(unique), math.inf)
        out.append(z)
    return out


def _add_ties(red: _Reduced, model: _Model) -> None:
    """merge=False: x_v[q] = sum_{p: mapping[p] = q} x_leader[p] for every q. Summed over q
    this forces x_leader[p] = 0 where mapping[p] = -1, so those need no extra rows."""

    def term(b: int, p: int):  # (column or None, constant)
        if red.fixed[b] >= 0:
            return None, float(p == red.fixed[b])
        hit = np.flatnonzero(red.cols[b] == p)
        return (int(red.offset[b]) + int(hit[0]), 0.0) if hit.size else (None, 0.0)

    for v, leader, mapping in red.ties:
        bv, bl = int(red.block_of[v]), int(red.block_of[leader])
        for q in range(red.problem.num_strategies[v]):
            parts = [(term(bv, q), 1.0)] + [
                (term(bl, p), -1.0) for p, m in enumerate(mapping) if m == q
            ]
            terms = [(col, sign) for (col, _), sign in parts if col is not None]
            constant = sum(c * sign for (_, c), sign in parts)
            if terms:
                model.row(terms, -constant, -constant)
            elif constant != 0:
                model.violated = model.violated or "tie"
