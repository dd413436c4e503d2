"""Alpa's intra-operator integer program over abstract strategy choices (jax-free).

Takes a :class:`ShardingProblem`: for every node of an operator graph, its candidate
strategies and their costs (communication + compute seconds); for every edge a
resharding-cost matrix; optional ties between nodes; optional per-strategy memory with
live sets and a per-device budget. Returns a :class:`Solution`: one strategy per node
that minimises the total cost subject to the ties, the forbidden (infinite-cost)
choices and the memory budget.

Guarantees:

* ``Solution.objective`` is ``objective_of(problem, solution.strategy)``, evaluated in
  float64 on the original problem, not the solver's rescaled value;
* the strategy honours every tie, never picks an infinite cost and keeps
  ``peak_memory`` within the budget (up to the solver's feasibility tolerance);
* merging tied nodes (``merge=True``) changes the size of the program, not its optimum:
  a node tied to another adds no variables, so identical layers tied to a first layer
  cost nothing extra.

Formulation (Alpa, OSDI'22, section 4.2). Each variable node ("root") r has a binary
one-hot vector s_r. An edge (u, v) between different roots gets continuous
e[p, q] >= 0 with sum_q e[p, q] = s_u[p] and sum_p e[p, q] = s_v[q]; for one-hot s this
forces e = s_u s_v^T exactly, with a tighter relaxation than McCormick. The objective is
sum_r c_r . s_r + sum_(u,v) R_uv . e_uv + a constant. Memory: for every live set,
sum_v m_v . s_v <= budget. Before building the model, the code collapses tied nodes onto
their roots, folds into node costs every edge matrix that is separable
(R[p, q] = a[p] + b[q], constant matrices included) or touches a root with one allowed
strategy, sums parallel edges, and drops memory rows that duplicate, are dominated by
another row, or can never bind. With merging it also eliminates, exactly, every root with
one or two neighbours (min-sum variable elimination: chains and trees collapse, the choice
is recovered after the solve), folds roots left with one allowed strategy into their
neighbours and drops strategies that another strategy of the same root beats whatever the
neighbours pick (dead-end elimination) -- all of it, repeated until nothing changes, only
on roots whose memory does not enter a budget row. The optimum is unchanged; among equal
optima the one returned may differ from the unreduced program's.

Solver details that are approximate: the objective is rescaled so that its largest
coefficient is 1 and solved to an absolute gap of 1e-9 on that scale; CBC's best bound
is read from its log, which prints about 5 significant digits, so ``gap`` under CBC is
approximate; HiGHS's bound comes from ``Highs.getInfo().mip_dual_bound``. CBC treats a
random seed of 0 as "time of day", so seeds are passed to CBC as ``seed + 1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import operator
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pulp

SOLVERS = {"cbc": "PULP_CBC_CMD", "highs": "HiGHS"}
_ABS_GAP = 1e-9  # absolute MIP gap on the rescaled objective (largest coefficient 1)
# one step of preference costs this fraction of the problem's largest finite cost: ten
# times the absolute gap the solvers prove, so every solver and version sees the same
# tie-breaks, and small enough to decide only between (near-)equal costs: on gpt-350m
# (2 blocks, 8 devices) HiGHS 1.16 and CBC 2.10 return the same plans with it, at the
# objective found without preferences (1e-7 already moves a budgeted plan's objective)
TIE_BREAK = 1e-8
_TOLERANCE = 1e-9  # the solvers' optimality tolerances: below TIE_BREAK


class InfeasibleBudgetError(ValueError):
    """No plan fits ``memory_budget_bytes``; ``min_feasible_bytes`` is the smallest peak."""

    def __init__(self, memory_budget_bytes: float, min_feasible_bytes: float, proven: bool):
        self.memory_budget_bytes = memory_budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.proven = proven
        caveat = (
            "" if proven else " (best found within the time limit; the true minimum may be lower)"
        )
        super().__init__(
            f"no sharding plan fits memory_budget_bytes={memory_budget_bytes:.6g} "
            f"({memory_budget_bytes / 2**30:.3f} GiB per device): the smallest peak any plan "
            f"reaches is {min_feasible_bytes:.6g} bytes ({min_feasible_bytes / 2**30:.3f} GiB)"
            f"{caveat}; raise the budget to at least that, or shrink the model or batch"
        )


class InfeasibleProblemError(ValueError):
    """No assignment avoids infinite costs and honours the ties, whatever the budget."""


class SolverTimeLimitError(RuntimeError):
    """The solver hit its time limit before finding any feasible assignment."""


class SolverUnavailableError(RuntimeError):
    """The requested solver is not installed for PuLP."""


class SolverTimeLimitWarning(UserWarning):
    """The solver hit its time limit; the returned plan may not be optimal."""


def _float_matrix(rows) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(c) for c in row) for row in rows)


# id(matrix given) -> (that matrix, its float version); holding the matrix keeps its id
# unique, so the many edges that share one matrix object (identical layers) convert once
_SHARED_MATRICES: dict[int, tuple[object, tuple[tuple[float, ...], ...]]] = {}


def _shared_float_matrix(rows) -> tuple[tuple[float, ...], ...]:
    if not isinstance(rows, tuple) or not all(isinstance(r, tuple) for r in rows):
        return _float_matrix(rows)  # rows that could change later are not memoised
    hit = _SHARED_MATRICES.get(id(rows))
    if hit is None or hit[0] is not rows:
        if len(_SHARED_MATRICES) >= 4096:
            _SHARED_MATRICES.clear()
        hit = _SHARED_MATRICES[id(rows)] = (rows, _float_matrix(rows))
    return hit[1]


@dataclass(frozen=True)
class EdgeCost:
    """Resharding cost ``costs[p][q]`` (seconds) when ``src`` picks p and ``dst`` picks q.

    ``math.inf`` forbids the pair.
    """

    src: int
    dst: int
    costs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", _shared_float_matrix(self.costs))


@dataclass(frozen=True)
class Tie:
    """Strategy of the tied node = ``mapping[strategy of leader]``; -1 forbids that leader
    strategy. Serves follower merging, alias constraints and identical layers."""

    leader: int
    mapping: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mapping", tuple(int(m) for m in self.mapping))


@dataclass(frozen=True)
class CopyBuffer:
    """A buffer that only some strategy choices create: a value resharded into a layout its
    producer does not give it, one copy shared by every reader that wants that layout.

    It exists when node ``source`` picks one of ``source_strategies`` (the value is in
    another layout). ``readers`` lists, in program order, (node, the strategies of that
    node that read the copy). For each ``(live set, a, b)`` in ``windows`` the copy is
    live in that live set when some reader at index <= ``a`` reads it (``a = -1``: no
    reader needed before, the copy is made at the start of the step) and some reader at
    index >= ``b`` reads it. ``bytes`` is its size per device.
    """

    bytes: float
    source: int
    source_strategies: tuple[int, ...]
    readers: tuple[tuple[int, tuple[int, ...]], ...]
    windows: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "bytes", float(self.bytes))
        put(self, "source_strategies", tuple(int(p) for p in self.source_strategies))
        put(self, "readers", tuple((int(v), tuple(int(q) for q in qs)) for v, qs in self.readers))
        put(self, "windows", tuple((int(i), int(a), int(b)) for i, a, b in self.windows))

    def live_in(self, strategy) -> set[int]:
        """The live sets in which the copy is live under the assignment ``strategy``."""
        if strategy[self.source] not in self.source_strategies:
            return set()
        reads = [strategy[v] in qs for v, qs in self.readers]
        before = list(itertools.accumulate(reads, operator.or_))
        after = list(itertools.accumulate(reversed(reads), operator.or_))[::-1]
        return {i for i, a, b in self.windows if (a < 0 or before[a]) and after[b]}


@dataclass(frozen=True)
class ShardingProblem:
    """The integer program's input; validated on construction (ValueError names the part).

    ``live_sets[i]`` lists the nodes whose outputs are live at checkpoint i; a node listed
    twice counts twice. ``node_memory[v][p]`` is bytes per device of v's output under p.
    ``preferences[v][p]`` (optional, finite, >= 0; lower is preferred) breaks ties between
    equal-cost assignments the same way on every solver and version: the solver minimises
    cost + ``TIE_BREAK`` x (largest finite cost) x preference, while ``Solution.objective``
    stays the cost alone.
    ``ties`` is empty (no ties) or has one entry per node. ``copies`` are buffers that
    depend on several nodes' strategies (:class:`CopyBuffer`); they count in the live sets
    their windows name.
    """

    num_strategies: tuple[int, ...]
    node_costs: tuple[tuple[float, ...], ...]
    edges: tuple[EdgeCost, ...] = ()
    ties: tuple[Tie | None, ...] = ()
    node_memory: tuple[tuple[float, ...], ...] | None = None
    live_sets: tuple[tuple[int, ...], ...] = ()
    memory_budget_bytes: float | None = None
    node_names: tuple[str, ...] | None = None
    copies: tuple[CopyBuffer, ...] = ()
    preferences: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "num_strategies", tuple(int(k) for k in self.num_strategies))
        put(self, "node_costs", _float_matrix(self.node_costs))
        put(self, "edges", tuple(self.edges))
        put(self, "ties", tuple(self.ties))
        if self.node_memory is not None:
            put(self, "node_memory", _float_matrix(self.node_memory))
        put(self, "live_sets", tuple(tuple(int(v) for v in s) for s in self.live_sets))
        if self.memory_budget_bytes is not None:
            put(self, "memory_budget_bytes", float(self.memory_budget_bytes))
        if self.node_names is not None:
            put(self, "node_names", tuple(self.node_names))
        put(self, "copies", tuple(self.copies))
        if self.preferences is not None:
            put(self, "preferences", _float_matrix(self.preferences))
        _validate(self)

    @property
    def num_nodes(self) -> int:
        return len(self.num_strategies)

    def node_label(self, v: int) -> str:
        """``node 3`` or ``node 3 ('dot_general.7')`` for error messages."""
        if self.node_names is None:
            return f"node {v}"
        return f"node {v} ({self.node_names[v]!r})"

    def to_json(self) -> str:
        """JSON text (infinite costs as ``Infinity``, which ``json`` reads back)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ShardingProblem:
        d = json.loads(text)
        d["edges"] = tuple(EdgeCost(**e) for e in d["edges"])
        d["ties"] = tuple(None if t is None else Tie(**t) for t in d["ties"])
        d["copies"] = tuple(CopyBuffer(**c) for c in d.get("copies", ()))
        return cls(**d)


def _validate(pb: ShardingProblem) -> None:
    n, k = pb.num_nodes, pb.num_strategies
    for v, kv in enumerate(k):
        if kv < 1:
            raise ValueError(f"{pb.node_label(v)} has {kv} strategies; every node needs >= 1")
    if pb.node_names is not None and len(pb.node_names) != n:
        raise ValueError(f"node_names has {len(pb.node_names)} entries for {n} nodes")

    def check_vectors(name: str, rows, allow_inf: bool) -> None:
        if len(rows) != n:
            raise ValueError(f"{name} has {len(rows)} rows for {n} nodes (one per node)")
        for v, row in enumerate(rows):
            if len(row) != k[v]:
                raise ValueError(
                    f"{name}[{v}] of {pb.node_label(v)} has {len(row)} entries; "
                    f"num_strategies says {k[v]}"
                )
            bad = [
                c
                for c in row
                if math.isnan(c) or c == -math.inf or (not allow_inf and c == math.inf)
            ]
            if bad or (not allow_inf and any(c < 0 for c in row)):
                want = "finite and >= 0" if not allow_inf else "a number or +inf"
                raise ValueError(
                    f"{name}[{v}] of {pb.node_label(v)} has {row}; each must be {want}"
                )

    check_vectors("node_costs", pb.node_costs, allow_inf=True)
    if pb.preferences is not None:
        check_vectors("preferences", pb.preferences, allow_inf=False)
    finite_checked: set[int] = set()  # ids of matrices already scanned (edges share them)
    for i, e in enumerate(pb.edges):
        if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
            raise ValueError(
                f"edge {i} ({e.src} -> {e.dst}) must join two different nodes in [0, {n})"
            )
        shape = (len(e.costs), {len(r) for r in e.costs})
        if shape != (k[e.src], {k[e.dst]}):
            raise ValueError(
                f"edge {i} ({pb.node_label(e.src)} -> {pb.node_label(e.dst)}) needs a "
                f"{k[e.src]} x {k[e.dst]} cost matrix, got {len(e.costs)} rows of lengths {shape[1]}"
            )
        if id(e.costs) in finite_checked:
            continue
        if any(math.isnan(c) or c == -math.inf for r in e.costs for c in r):
            raise ValueError(f"edge {i} ({e.src} -> {e.dst}) has NaN or -inf costs")
        finite_checked.add(id(e.costs))
    if pb.ties and len(pb.ties) != n:
        raise ValueError(f"ties has {len(pb.ties)} entries for {n} nodes (use () for no ties)")
    for v, tie in enumerate(pb.ties):
        if tie is None:
            continue
        if not 0 <= tie.leader < n or tie.leader == v:
            raise ValueError(
                f"{pb.node_label(v)} is tied to leader {tie.leader}; need another node in [0, {n})"
            )
        if len(tie.mapping) != k[tie.leader] or any(not -1 <= m < k[v] for m in tie.mapping):
            raise ValueError(
                f"tie of {pb.node_label(v)} to {pb.node_label(tie.leader)} has mapping {tie.mapping}; "
                f"need {k[tie.leader]} entries, each in [-1, {k[v]})"
            )
    if pb.node_memory is not None:
        check_vectors("node_memory", pb.node_memory, allow_inf=False)
    elif pb.live_sets or pb.memory_budget_bytes is not None:
        raise ValueError(
            "live_sets and memory_budget_bytes need node_memory (bytes per node per strategy)"
        )
    for i, live in enumerate(pb.live_sets):
        if any(not 0 <= v < n for v in live):
            raise ValueError(f"live_sets[{i}] = {live} names nodes outside [0, {n})")
    if pb.copies and pb.node_memory is None:
        raise ValueError("copies need node_memory and live_sets (bytes per node per strategy)")
    for i, c in enumerate(pb.copies):
        where = f"copies[{i}]"
        if not (c.bytes >= 0 and math.isfinite(c.bytes)):
            raise ValueError(f"{where} has bytes={c.bytes}; need a finite number >= 0")
        nodes = [(c.source, c.source_strategies)] + list(c.readers)
        for v, qs in nodes:
            if not 0 <= v < n or any(not 0 <= q < k[v] for q in qs):
                raise ValueError(
                    f"{where} names node {v} with strategies {qs}; need a node in [0, {n}) "
                    f"and strategies of it"
                )
        if not c.readers:
            raise ValueError(f"{where} has no readers")
        for j, a, b in c.windows:
            if not 0 <= j < len(pb.live_sets) or not (
                -1 <= a < len(c.readers) and 0 <= b < len(c.readers)
            ):
                raise ValueError(
                    f"{where} has window {(j, a, b)}; need a live set in "
                    f"[0, {len(pb.live_sets)}), a in [-1, {len(c.readers)}) and b in "
                    f"[0, {len(c.readers)})"
                )
    b = pb.memory_budget_bytes
    if b is not None and not (b >= 0 and math.isfinite(b)):
        raise ValueError(
            f"memory_budget_bytes={b}; give a finite number >= 0, or None for no budget"
        )


def resolve_ties(problem: ShardingProblem) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Follow ties to their roots: returns (root of each node, mapping from the root's
    strategies to the node's, -1 where forbidden). Raises ValueError on a cycle."""
    n, k = problem.num_nodes, problem.num_strategies
    roots = [-1] * n
    maps: list[np.ndarray | None] = [None] * n
    for start in range(n):
        path: list[int] = []
        on_path: set[int] = set()
        v = start
        while roots[v] < 0:
            tie = problem.ties[v] if problem.ties else None
            if tie is None:
                roots[v], maps[v] = v, np.arange(k[v])
                break
            if v in on_path:
                cycle = path[path.index(v) :] + [v]
                raise ValueError(
                    "ties form a cycle: " + " -> ".join(problem.node_label(u) for u in cycle)
                )
            path.append(v)
            on_path.add(v)
            v = tie.leader
        for u in reversed(path):
            tie = problem.ties[u]
            lead = maps[tie.leader]
            roots[u] = roots[tie.leader]
            maps[u] = np.where(lead >= 0, np.asarray(tie.mapping)[lead], -1)
    return tuple(roots), tuple(tuple(int(p) for p in m) for m in maps)


def with_preferences(problem: ShardingProblem) -> ShardingProblem:
    """The problem the solver minimises: node costs plus the weighted preferences (the
    problem itself when it has none). One step of preference weighs ``TIE_BREAK`` x the
    largest finite cost, so the plan returned costs at most that times the sum over nodes
    of their preference ranges more than the least-cost plan (gpt-350m, 2 blocks: none)."""
    if problem.preferences is None:
        return problem
    finite = [c for row in problem.node_costs for c in row if math.isfinite(c)]
    seen: set[int] = set()  # edges of identical layers share one matrix
    for e in problem.edges:
        if id(e.costs) not in seen:
            seen.add(id(e.costs))
            finite.extend(c for row in e.costs for c in row if math.isfinite(c))
    weight = TIE_BREAK * max([abs(c) for c in finite] + [0.0])
    if weight == 0.0:  # every cost zero: preferences alone decide
        weight = 1.0
    costs = tuple(
        tuple(c + weight * p for c, p in zip(row, pref, strict=True))
        for row, pref in zip(problem.node_costs, problem.preferences, strict=True)
    )
    return dataclasses.replace(problem, node_costs=costs, preferences=None)


def objective_of(problem: ShardingProblem, strategy) -> float:
    """Total cost of an assignment; ``math.inf`` if it breaks a tie or picks an infinite
    cost. Raises ValueError if it has the wrong length or an out-of-range strategy."""
    s = _check_assignment(problem, strategy)
    for v, tie in enumerate(problem.ties):
        if tie is not None and tie.mapping[s[tie.leader]] != s[v]:
            return math.inf
    total = math.fsum(problem.node_costs[v][s[v]] for v in range(problem.num_nodes))
    return total + math.fsum(e.costs[s[e.src]][s[e.dst]] for e in problem.edges)


def peak_memory(problem: ShardingProblem, strategy) -> float:
    """Largest live-set memory (bytes per device) of an assignment, copies included; 0
    without live sets."""
    s = _check_assignment(problem, strategy)
    mem = problem.node_memory
    total = [math.fsum(mem[v][s[v]] for v in live) for live in problem.live_sets]
    for c in problem.copies:
        for i in c.live_in(s):
            total[i] += c.bytes
    return max(total, default=0.0)


def _check_assignment(problem: ShardingProblem, strategy) -> tuple[int, ...]:
    s = tuple(int(p) for p in strategy)
    if len(s) != problem.num_nodes:
        raise ValueError(f"assignment has {len(s)} entries for {problem.num_nodes} nodes")
    for v, p in enumerate(s):
        if not 0 <= p < problem.num_strategies[v]:
            raise ValueError(
                f"{problem.node_label(v)} has strategy {p}; need [0, {problem.num_strategies[v]})"
            )
    return s


@dataclass(frozen=True)
class Solution:
    """The chosen strategy of every original node and how the solve went.

    ``status`` is "optimal" (within ``mip_gap``) or "time_limit" (best incumbent).
    ``gap`` is (objective - best bound) / |objective|, None where the solver gave no bound.
    ``seconds`` covers build + solve; ``build_seconds`` the model building alone.
    """

    strategy: tuple[int, ...]
    objective: float
    status: str
    gap: float | None
    solver: str
    seconds: float
    build_seconds: float
    num_variables: int
    num_constraints: int
    num_roots: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Solution:
        d = json.loads(text)
        d["strategy"] = tuple(d["strategy"])
        return cls(**d)


@dataclass
class _Reduced:
    """The problem after merging and folding, in block space (a block = a root)."""

    problem: ShardingProblem
    block_of: np.ndarray  # node -> block
    maps: list[np.ndarray]  # node -> node strategy for each block strategy (-1 forbidden)
    blocks: list[int]  # block -> its original node
    cols: list[np.ndarray]  # block -> strategies that get a variable (empty when fixed)
    fixed: list[int]  # block -> its only strategy, or -1 when it has variables
    offset: np.ndarray  # block -> index of its first variable
    costs: list[np.ndarray]  # block -> cost per column (shifted, >= 0)
    pairs: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # cols_a x cols_b
    constant: float = 0.0
    mem_rows: list[tuple[float, np.ndarray, np.ndarray]] = field(default_factory=list)
    # copies' windows (see _copy_windows); memory-row columns >= num_strategy_cols are
    # window columns
    windows: list[tuple] = field(default_factory=list)
    num_strategy_cols: int = 0
    ties: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # merge=False
    # blocks eliminated before the solve, in order: (block, its cost, [(neighbour, matrix
    # block x neighbour)]); decoded in reverse, each given its neighbours' choices
    eliminated: list[tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]] = field(
        default_factory=list
    )


def _reduce(
    pb: ShardingProblem, merge: bool, eliminate: bool = True, memory: bool = False
) -> _Reduced:
    """``memory``: build the memory rows even without a budget (to minimise the peak)."""
    roots, root_maps = resolve_ties(pb)  # also rejects cycles when merge=False
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
    cost = [np.zeros(k[r]) for r in blocks]
    for v in range(n):
        m = maps[v]
        cost[block_of[v]] += np.where(m >= 0, np.asarray(pb.node_costs[v])[m], inf)
    pair_acc: dict[tuple[int, int], np.ndarray] = {}
    for e in pb.edges:
        a, b, ma, mb = block_of[e.src], block_of[e.dst], maps[e.src], maps[e.dst]
        c = np.asarray(e.costs)
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
            red.constant += float(mat[fa, fb])
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
            red.constant += float(cost[b][f])
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
        red.constant += float(low)
        red.pairs.append((a, b, sub - low))
    for b in range(len(blocks)):
        if costs[b].size:
            low = costs[b].min()
            red.constant += float(low)
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
    """(a, b) with sub[p, q] = a[p] + b[q] (to rounding), or None."""
    if not sub.size or not np.isfinite(sub).all():
        return None
    row, col = sub[:, 0], sub[0, :] - sub[0, 0]
    if np.allclose(sub, row[:, None] + col[None, :], rtol=1e-12, atol=1e-12 * np.abs(sub).max()):
        return row, col
    return None


def _eliminate(red: _Reduced, pb: ShardingProblem, cost, fixed, free_pairs):
    """Exact reductions of the free blocks before the solve (merge=True only).

    * Elimination: a block b with one neighbour u and edge matrix M (b x u) adds
      min_p (c_b[p] + M[p, :]) to u's cost; with two neighbours u, w it adds
      min_p (c_b[p] + M_bu[p, :, None] + M_bw[p, None, :]) to the edge (u, w); with one
      allowed strategy p it adds M[p, :] to every neighbour's cost. The optimum over the
      remaining blocks is unchanged, and b's best strategy given its neighbours' is
      recovered after the solve (``_decode``).
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
                add = np.zeros(ok.size)
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
        gone = np.zeros(ok.size, bool)
        for i in range(ok.size):
            others = ~gone
            others[i] = False
            if np.any(worst[others, i] <= 0):
                gone[i] = True
        if not gone.any():
            return False
        c_new = cost[b].copy()
        c_new[ok[gone]] = math.inf
        cost[b] = c_new
        return True

    todo = set(b for b in nbrs if fixed[b] < 0)
    while todo:
        queue = sorted(todo)
        todo = set()
        while queue:  # eliminate while anything can go
            b = queue.pop()
            if can_go(b):
                queue.extend(u for u in eliminate(b) if can_go(u))
        for b in sorted(nbrs):
            if b not in protected and nbrs[b] and dominated(b):
                todo.add(b)
                todo.update(nbrs[b])
    return [(a, b, m) for (a, b), m in mats.items()]


def _indicator(red: _Reduced, v: int, strategies) -> bool | np.ndarray:
    """ "Node v picks one of ``strategies``" in variable space: a constant, or the columns
    whose sum is that 0/1 indicator."""
    b = int(red.block_of[v])
    hit = np.isin(red.maps[v], np.asarray(strategies, dtype=int))
    if red.fixed[b] >= 0:
        return bool(hit[red.fixed[b]])
    cols = red.cols[b]
    if not cols.size:
        raise RuntimeError(f"internal error: node {v}, which a copy reads, was eliminated")
    sel = np.flatnonzero(hit[cols])
    if sel.size in (0, cols.size):
        return bool(sel.size)
    return red.offset[b] + sel


def _copy_windows(red: _Reduced, constant: np.ndarray) -> dict[int, dict[int, float]]:
    """The copies' terms of the memory rows: live set -> {window: bytes}; windows whose
    liveness the fixed strategies already decide go to ``constant`` (or nowhere).

    Sets ``red.windows``: per window (copy, source indicator or True, the copy's reader
    indicators, last reader index <= a that is not constant or None when the prefix
    condition holds anyway, first index >= b likewise)."""
    red.windows, red.num_strategy_cols = [], int(sum(c.size for c in red.cols))
    out: dict[int, dict[int, float]] = {}
    index: dict[tuple, int] = {}
    for ci, copy in enumerate(red.problem.copies):
        exists = _indicator(red, copy.source, copy.source_strategies)
        if exists is False or not copy.bytes:
            continue
        reads = [_indicator(red, v, qs) for v, qs in copy.readers]
        variable = [j for j, r in enumerate(reads) if r is not True and r is not False]
        for i, a, b in copy.windows:
            if a < 0 or any(r is True for r in reads[: a + 1]):
                pre = None
            else:
                before = [j for j in variable if j <= a]
                if not before:
                    continue
                pre = before[-1]
            if any(r is True for r in reads[b:]):
                suf = None
            else:
                after = [j for j in variable if j >= b]
                if not after:
                    continue
                suf = after[0]
            if exists is True and pre is None and suf is None:
                constant[i] += copy.bytes
                continue
            key = (ci, pre, suf)
            if key not in index:
                index[key] = len(red.windows)
                red.windows.append((ci, exists, reads, pre, suf))
            wid = index[key]
            row = out.setdefault(i, {})
            row[wid] = row.get(wid, 0.0) + copy.bytes
    return out


def _memory_rows(red: _Reduced) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Live sets in variable space as (constant, columns, coefficients >= 0), without
    duplicates or rows dominated coefficient-wise by another row.

    Vectorised over all (live set, node, block strategy) triples: a block's memory under
    its fixed strategy, and the minimum over its allowed strategies, go to the constant
    (exact, since exactly one strategy per block is chosen)."""
    pb, k = red.problem, red.problem.num_strategies
    block_k = np.array([k[r] for r in red.blocks])
    slot_base = np.r_[0, np.cumsum(block_k)]
    num_slots = int(slot_base[-1])
    node_vec = [
        np.where(m >= 0, np.asarray(pb.node_memory[v])[np.maximum(m, 0)], 0.0)
        for v, m in enumerate(red.maps)
    ]
    node_val_start = np.r_[0, np.cumsum([len(x) for x in node_vec])][:-1]
    node_val = np.concatenate(node_vec)
    nodes = np.fromiter(itertools.chain.from_iterable(pb.live_sets), dtype=np.int64)
    set_id = np.repeat(np.arange(len(pb.live_sets)), [len(s) for s in pb.live_sets])
    reps = block_k[red.block_of[nodes]]
    within = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    slot = np.repeat(slot_base[red.block_of[nodes]], reps) + within
    value = node_val[np.repeat(node_val_start[nodes], reps) + within]
    key, inverse = np.unique(np.repeat(set_id, reps) * num_slots + slot, return_inverse=True)
    value = np.bincount(inverse, weights=value)  # duplicates (a node listed twice) add up
    row, slot = key // num_slots, key % num_slots
    # per slot: its block, and its variable column (-1 if fixed or forbidden)
    slot_block = np.repeat(np.arange(len(red.blocks)), block_k)
    slot_col = np.full(num_slots, -1)
    fixed_slot = np.zeros(num_slots, bool)
    for b, cols in enumerate(red.cols):
        slot_col[slot_base[b] + cols] = red.offset[b] + np.arange(cols.size)
        if red.fixed[b] >= 0:
            fixed_slot[slot_base[b] + red.fixed[b]] = True
    for b, c, _ in red.eliminated:  # its memory is the same under every allowed strategy
        fixed_slot[slot_base[b] + int(np.argmin(c))] = True
    num_sets = len(pb.live_sets)
    is_fixed = fixed_slot[slot]
    constant = np.bincount(row[is_fixed], value[is_fixed], minlength=num_sets).astype(float)
    free = slot_col[slot] >= 0
    row, slot, value = row[free], slot[free], value[free]
    group = row * len(red.blocks) + slot_block[slot]  # sorted, so each (set, block) is a run
    starts = np.flatnonzero(np.r_[True, np.diff(group) != 0]) if group.size else group
    low = np.minimum.reduceat(value, starts) if group.size else value
    constant += np.bincount(row[starts], weights=low, minlength=num_sets)
    coef = value - np.repeat(low, np.diff(np.r_[starts, value.size]))
    keep = coef > 0
    row, col, coef = row[keep], slot_col[slot[keep]], coef[keep]
    bounds = np.searchsorted(row, np.arange(num_sets + 1))
    extra = _copy_windows(red, constant)  # window columns follow the strategy columns
    rows: dict[tuple, tuple[float, np.ndarray, np.ndarray]] = {}
    for i in range(num_sets):
        c, w = col[bounds[i] : bounds[i + 1]], coef[bounds[i] : bounds[i + 1]]
        if i in extra:
            wids, sizes = zip(*sorted(extra[i].items()), strict=True)
            c = np.r_[c, red.num_strategy_cols + np.asarray(wids)]
            w = np.r_[w, np.asarray(sizes, dtype=float)]
        rows.setdefault((float(constant[i]), c.tobytes(), w.tobytes()), (float(constant[i]), c, w))
    unique = list(rows.values())
    by_col: dict[int, list[int]] = {}
    for i, (_, c, _) in enumerate(unique):
        for col in c.tolist():
            by_col.setdefault(col, []).append(i)
    kept = []
    for i, (const_i, c_i, w_i) in enumerate(unique):
        cands = (
            by_col[min(c_i.tolist(), key=lambda x: len(by_col[x]))]
            if c_i.size
            else range(len(unique))
        )
        dominated = False
        for j in cands:  # j dominates i: const_j >= const_i and w_j >= w_i on i's columns
            const_j, c_j, w_j = unique[j]
            if j == i or const_j < const_i:
                continue
            pos = np.searchsorted(c_j, c_i)
            if not c_i.size or (
                pos[-1] < c_j.size and np.array_equal(c_j[pos], c_i) and np.all(w_j[pos] >= w_i)
            ):
                dominated = True
                break
        if not dominated:
            kept.append(unique[i])
    return kept


@dataclass
class _Model:
    """The program in matrix form: binary strategy columns first (``num_binary``, in
    ``_Reduced`` variable order), then continuous edge and peak columns, and rows
    ``row_lower <= A x <= row_upper`` given as (row, column, value) triplets."""

    num_binary: int = 0
    cost: list[float] = field(default_factory=list)  # per column, rescaled
    num_cols: int = 0
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    scale: float = 1.0
    violated: str | None = None  # a constant constraint that cannot hold
    values: np.ndarray | None = None  # column values after a solve

    def column(self, cost: float = 0.0) -> int:
        self.cost.append(cost)
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


def _new_var(prob: pulp.LpProblem, name: str, low=None, cat=pulp.LpContinuous) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3; constructing LpVariable is deprecated there
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def _expr(terms, constant: float = 0.0) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression(terms, constant=constant)


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
    for b, cols in enumerate(red.cols):
        if cols.size:
            o = int(red.offset[b])
            model.row([(o + i, 1.0) for i in range(cols.size)], 1.0, 1.0)
    finite = [c for c in red.costs if c.size] + [m[np.isfinite(m)] for _, _, m in red.pairs]
    model.scale = max([float(np.abs(c).max()) for c in finite if c.size] + [0.0]) or 1.0
    if not minimise_peak:
        for b, c in enumerate(red.costs):
            o = int(red.offset[b])
            for i, w in enumerate(c.tolist()):
                model.cost[o + i] = w / model.scale
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
            w = 0.0 if minimise_peak else float(cmat[p, q]) / model.scale
            e[p, q] = model.column(w)
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
    over the m parts that are not constant, where ``before`` (``after``) is the OR of the
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
    for ci, exists, reads, pre, suf in red.windows:
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


@dataclass(frozen=True)
class _Outcome:
    status: str  # optimal | time_limit | no_incumbent | infeasible
    bound: float | None  # best bound on the model objective


def _check_solver(name: str) -> None:
    """Clear errors for an unknown solver or one that is not installed."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; choose one of {sorted(SOLVERS)}")
    available = pulp.listSolvers(onlyAvailable=True)
    if SOLVERS[name] not in available:
        ours = sorted(n for n, p in SOLVERS.items() if p in available)
        raise SolverUnavailableError(
            f"solver {name!r} (PuLP's {SOLVERS[name]}) is not installed; available here: {ours} "
            f"(all PuLP solvers found: {available})"
        )


def _cbc(time_limit_s: float | None, mip_gap: float, seed: int, log_path: str):
    opts = [f"randomCbcSeed {seed + 1}", f"randomSeed {seed + 1}", f"dualT {_TOLERANCE}"]
    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC for 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=time_limit_s,
            gapRel=mip_gap,
            gapAbs=_ABS_GAP,
            options=opts,
            logPath=log_path,
        )


@contextlib.contextmanager
def solver_output_to_stderr():
    """Send whatever is written to file descriptor 1 meanwhile to descriptor 2.

    Solvers print from C and C++ (HiGHS 1.16 prints its banner on stdout when a ``Highs``
    object is made, before any option can silence it); Python-level redirection cannot
    catch that, so this swaps the descriptors and flushes C's buffers on the way out. The
    stdout of a ``--json`` command then holds the JSON alone.
    """
    try:
        sys.stdout.flush()
        out_fd, err_fd = 1, 2
        saved = os.dup(out_fd)
    except (OSError, ValueError):  # no descriptors to swap (embedded interpreters)
        yield
        return
    try:
        os.dup2(err_fd, out_fd)
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, out_fd)
        os.close(saved)


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to reach (not POSIX)
        pass


def _run(
    model: _Model, solver: str, time_limit_s: float | None, mip_gap: float, seed: int
) -> _Outcome:
    with solver_output_to_stderr():
        _check_solver(solver)
        if solver == "highs":
            return _run_highs(model, time_limit_s, mip_gap, seed)
        return _run_cbc(model, time_limit_s, mip_gap, seed)


def _run_highs(model: _Model, time_limit_s: float | None, mip_gap: float, seed: int) -> _Outcome:
    """HiGHS through its own Python API, the matrix passed as is (no PuLP objects)."""
    import highspy

    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    if time_limit_s is not None:
        highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(mip_gap))
    highs.setOptionValue("mip_abs_gap", _ABS_GAP)
    # under the default tolerances (1e-7 on reduced costs, 1e-6 in the MIP) an objective
    # step of TIE_BREAK can pass for zero, and equal-cost plans resolve by the solver's path
    highs.setOptionValue("dual_feasibility_tolerance", _TOLERANCE)
    highs.setOptionValue("mip_feasibility_tolerance", _TOLERANCE)
    highs.setOptionValue("random_seed", int(seed))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_ = np.asarray(model.cost, dtype=float)
    lp.col_lower_ = np.zeros(model.num_cols)
    upper = np.full(model.num_cols, highspy.kHighsInf)
    upper[: model.num_binary] = 1.0
    lp.col_upper_ = upper
    lp.row_lower_ = np.asarray(model.row_lower, dtype=float).clip(-highspy.kHighsInf)
    lp.row_upper_ = np.asarray(model.row_upper, dtype=float).clip(None, highspy.kHighsInf)
    start, index, value = model.csc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger] * model.num_binary + [kinds.kContinuous] * (
        model.num_cols - model.num_binary
    )
    highs.passModel(lp)
    highs.run()
    ms, info, status = highs.getModelStatus(), highs.getInfo(), highspy.HighsModelStatus
    if ms in (status.kInfeasible, status.kUnboundedOrInfeasible):
        return _Outcome("infeasible", None)
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if has:
        model.values = np.asarray(highs.getSolution().col_value)
    if ms == status.kOptimal:
        return _Outcome("optimal", info.mip_dual_bound)
    if ms in (status.kTimeLimit, status.kIterationLimit, status.kInterrupt):
        return _Outcome("time_limit" if has else "no_incumbent", info.mip_dual_bound)
    raise RuntimeError(f"HiGHS ended with model status {highs.modelStatusToString(ms)}")


def _run_cbc(model: _Model, time_limit_s: float | None, mip_gap: float, seed: int) -> _Outcome:
    """CBC through PuLP: the matrix model rebuilt as a PuLP problem."""
    prob = pulp.LpProblem("autoshard_intra_op", pulp.LpMinimize)
    x = [
        _new_var(
            prob, f"x{j}", low=0, cat=pulp.LpBinary if j < model.num_binary else pulp.LpContinuous
        )
        for j in range(model.num_cols)
    ]
    by_row: list[list[tuple]] = [[] for _ in range(model.num_rows)]
    for r, c, v in zip(model.rows, model.cols, model.vals, strict=True):
        by_row[r].append((x[c], v))
    for terms, lo, hi in zip(by_row, model.row_lower, model.row_upper, strict=True):
        if lo == hi:
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintEQ, rhs=lo))
            continue
        if math.isfinite(lo):
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintGE, rhs=lo))
        if math.isfinite(hi):
            prob.addConstraint(pulp.LpConstraint(_expr(terms), pulp.LpConstraintLE, rhs=hi))
    prob.setObjective(_expr([(x[j], w) for j, w in enumerate(model.cost) if w]))
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        prob.solve(_cbc(time_limit_s, mip_gap, seed, log_path))
        log = Path(log_path).read_text() if os.path.exists(log_path) else ""
    found = re.search(r"Lower bound:\s+(\S+)", log)
    bound = float(found.group(1)) if found else None
    status, sol_status = prob.status, prob.sol_status
    if status == pulp.LpStatusInfeasible:
        return _Outcome("infeasible", None)
    if status == pulp.LpStatusNotSolved:
        return _Outcome("no_incumbent", bound)
    if status == pulp.LpStatusOptimal:
        model.values = np.array([v.varValue or 0.0 for v in x])
        optimal = sol_status == pulp.LpSolutionOptimal
        return _Outcome("optimal" if optimal else "time_limit", bound)
    raise RuntimeError(
        f"CBC ended with PuLP status {pulp.LpStatus[status]}; log tail:\n{log[-2000:]}"
    )


def _decode(red: _Reduced, model: _Model) -> tuple[int, ...]:
    chosen = []
    for b, cols in enumerate(red.cols):
        if cols.size:
            o = red.offset[b]
            vals = model.values[o : o + cols.size]
            chosen.append(int(cols[int(np.argmax(vals))]))
        else:
            chosen.append(red.fixed[b])
    for b, c, parts in reversed(red.eliminated):
        total = c + sum(m[:, chosen[u]] for u, m in parts)
        chosen[b] = int(np.argmin(total))
    return tuple(int(red.maps[v][chosen[red.block_of[v]]]) for v in range(red.problem.num_nodes))


def _solve_model(red, model, solver, time_limit_s, mip_gap, seed) -> _Outcome:
    if model.violated:
        return _Outcome("infeasible", None)
    if not model.num_binary:  # everything fixed: nothing for a solver to do
        return _Outcome("optimal", 0.0)
    return _run(model, solver, time_limit_s, mip_gap, seed)


def _min_peak(pb: ShardingProblem, solver: str, time_limit_s, seed: int) -> tuple[float, bool]:
    red = _reduce(pb, merge=True, eliminate=False, memory=True)  # eliminating follows costs
    model = _build(red, minimise_peak=True)
    out = _solve_model(red, model, solver, time_limit_s, 0.0, seed)
    if out.status == "infeasible":
        raise InfeasibleProblemError("no assignment avoids infinite costs while honouring the ties")
    if out.status == "no_incumbent":
        raise SolverTimeLimitError(
            f"{solver} found no feasible assignment (ignoring the budget) within time_limit_s={time_limit_s}"
        )
    return peak_memory(pb, _decode(red, model)), out.status == "optimal"


def min_peak_memory(
    problem: ShardingProblem,
    *,
    solver: str = "cbc",
    time_limit_s: float | None = 60.0,
    seed: int = 0,
) -> float:
    """Smallest peak live-set memory any feasible assignment reaches, ignoring costs."""
    return _min_peak(problem, solver, time_limit_s, seed)[0]


def solve(
    problem: ShardingProblem,
    solver: str = "cbc",
    time_limit_s: float | None = 60.0,
    mip_gap: float = 0.0,
    seed: int = 0,
    merge: bool = True,
) -> Solution:
    """Minimise total cost over one strategy per node; see the module docstring.

    Raises InfeasibleBudgetError (with ``min_feasible_bytes``) when only the budget is in
    the way, InfeasibleProblemError when infinite costs and ties leave no assignment,
    SolverTimeLimitError when the time limit passes with no incumbent, and
    SolverUnavailableError / ValueError for a missing or unknown solver. Returns the
    incumbent with a SolverTimeLimitWarning when the time limit passes with one.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    if not 0.0 <= mip_gap < 1.0:
        raise ValueError(f"mip_gap={mip_gap} is a relative gap; give a value in [0, 1)")
    start = time.perf_counter()
    work = with_preferences(problem)
    red = _reduce(work, merge)
    model = _build(red, minimise_peak=False)
    build_seconds = time.perf_counter() - start
    out = _solve_model(red, model, solver, time_limit_s, mip_gap, seed)
    if out.status == "infeasible":
        if problem.memory_budget_bytes is None or model.violated == "tie" or not red.mem_rows:
            raise InfeasibleProblemError(
                "no assignment avoids infinite costs while honouring the ties"
            )
        need, proven = _min_peak(problem, solver, time_limit_s, seed)
        raise InfeasibleBudgetError(problem.memory_budget_bytes, need, proven)
    if out.status == "no_incumbent":
        raise SolverTimeLimitError(
            f"{solver} found no feasible assignment within time_limit_s={time_limit_s} "
            f"({model.num_binary} binary variables); raise time_limit_s or the budget"
        )
    strategy = _decode(red, model)
    objective = objective_of(problem, strategy)
    if not math.isfinite(objective):
        raise RuntimeError(
            f"internal error: the {solver} solution breaks a tie or picks an infinite cost"
        )
    gap = None
    if out.bound is not None:  # a bound on cost + preferences
        bound = out.bound * model.scale + red.constant
        solved = objective_of(work, strategy)
        gap = max(0.0, solved - bound) / max(abs(solved), 1e-300)
    elif out.status == "optimal" and mip_gap == 0.0:
        gap = 0.0
    if out.status == "time_limit":
        warnings.warn(
            f"{solver} stopped at time_limit_s={time_limit_s} with objective {objective:.6g} and "
            f"relative gap {gap if gap is None else f'{gap:.3g}'}; raise time_limit_s for a better plan",
            SolverTimeLimitWarning,
            stacklevel=2,
        )
    return Solution(
        strategy=strategy,
        objective=objective,
        status=out.status,
        gap=gap,
        solver=solver,
        seconds=time.perf_counter() - start,
        build_seconds=build_seconds,
        num_variables=model.num_cols,
        num_constraints=model.num_rows,
        num_roots=len(red.blocks),
    )
