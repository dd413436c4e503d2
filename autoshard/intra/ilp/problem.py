"""The integer program's input and what can be read off an assignment (jax-free).

:class:`ShardingProblem` (nodes, strategies, costs, :class:`EdgeCost` matrices, :class:`Tie`
constraints, memory with live sets and :class:`CopyBuffer` copies, preferences), its
validation, :func:`resolve_ties`, :func:`cost_quantum`, :func:`objective_of`,
:func:`peak_memory`, and the errors and warnings the solve raises.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from dataclasses import asdict, dataclass

import numpy as np

# preferences break ties lexicographically: costs are rounded to multiples of a power of
# two this fraction (about 9e-13) of the problem's largest finite cost, so that plans
# whose costs differ only by the rounding of their floating-point sums tie exactly, and
# sums of up to 2**13 such costs stay exact in float64 (see :func:`cost_quantum`)
COST_QUANTUM = 2.0**-40


class InfeasibleBudgetError(ValueError):
    """No plan fits ``memory_budget_bytes``; ``min_feasible_bytes`` is the smallest peak."""

    def __init__(self, memory_budget_bytes: float, min_feasible_bytes: float, proven: bool):
        self.memory_budget_bytes = memory_budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.proven = proven
        self.lower_bound_bytes: float | None = None  # set where only a bound is known
        caveat = (
            "" if proven else " (best found within the time limit; the true minimum may be lower)"
        )
        if not math.isfinite(min_feasible_bytes):
            from autoshard.ir.units import format_bytes

            super().__init__(
                f"no sharding plan fits a budget of {format_bytes(memory_budget_bytes)} per "
                "device, and the solver found "
                "no plan's least peak within the time limit; raise the budget, or shrink "
                "the model or batch"
            )
            return
        from autoshard.ir.units import format_bytes

        super().__init__(
            f"no sharding plan fits a budget of {format_bytes(memory_budget_bytes, exact=True)} "
            f"per device: the smallest peak any plan reaches is "
            f"{format_bytes(min_feasible_bytes, exact=True)}{caveat}; raise the budget to at "
            "least that, or shrink the model or batch"
        )


def peak_lower_bound(node_memory, live_sets) -> float:
    """A lower bound on every assignment's peak (bytes per device), in one pass: each live
    set with every node in its smallest strategy, no resharded copies (a relaxation that
    ignores edges, ties and copies, so no assignment peaks lower); 0 without live sets."""
    if node_memory is None:
        return 0.0
    least = [min(row, default=0.0) for row in node_memory]
    return max((math.fsum(least[v] for v in live) for live in live_sets), default=0.0)


def below_bound_error(budget: float, bound: float) -> InfeasibleBudgetError:
    """The refusal of a budget under :func:`peak_lower_bound`'s ``bound`` (proven, no
    solve)."""
    from autoshard.ir.units import format_bytes

    err = InfeasibleBudgetError(budget, bound, True)
    err.lower_bound_bytes = bound
    err.args = (
        f"no sharding plan fits a budget of {format_bytes(budget)} per device: every plan "
        f"peaks at {format_bytes(bound)} or more (the step's fullest point with each live "
        "tensor split as finely as its shardings allow; proven without solving); raise the "
        "budget above that, or shrink the model or batch",
    )
    return err


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

    @classmethod
    def of_floats(cls, src: int, dst: int, costs: tuple[tuple[float, ...], ...]) -> EdgeCost:
        """An edge on ``costs`` as given, not converted: for builders whose matrices are
        already tuples of tuples of floats, shared by many edges (the planner's values:
        tens of thousands of edges on a large graph).  The problem still validates it."""
        edge = object.__new__(cls)
        object.__setattr__(edge, "src", src)
        object.__setattr__(edge, "dst", dst)
        object.__setattr__(edge, "costs", costs)
        return edge


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

    ``early_unless`` (reader indices, or None) marks the early part of a copy that is made
    right after its source only when none of those readers reads it (XLA:CPU gathers a
    forward value for the backward pass's dots as soon as it exists, but at its first
    reader when a forward op reads the same copy). Its windows then count the positions
    before the first reader that reads it: live when no reader at index <= ``a`` and none
    in ``early_unless`` reads it, and some reader at index >= ``b`` does.
    """

    bytes: float
    source: int
    source_strategies: tuple[int, ...]
    readers: tuple[tuple[int, tuple[int, ...]], ...]
    windows: tuple[tuple[int, int, int], ...]
    early_unless: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "bytes", float(self.bytes))
        put(self, "source_strategies", tuple(int(p) for p in self.source_strategies))
        put(self, "readers", tuple((int(v), tuple(int(q) for q in qs)) for v, qs in self.readers))
        put(self, "windows", tuple((int(i), int(a), int(b)) for i, a, b in self.windows))
        if self.early_unless is not None:
            put(self, "early_unless", tuple(int(j) for j in self.early_unless))

    def blockers(self, a: int) -> tuple[int, ...]:
        """Reader indices whose reading keeps window ``(_, a, _)`` of an early copy dead
        (``early_unless`` and the readers up to ``a``); () for any other copy."""
        if self.early_unless is None:
            return ()
        return tuple(sorted(set(self.early_unless) | set(range(a + 1))))

    def live_in(self, strategy) -> set[int]:
        """The live sets in which the copy is live under the assignment ``strategy``."""
        if strategy[self.source] not in self.source_strategies:
            return set()
        reads = [strategy[v] in qs for v, qs in self.readers]
        after = list(itertools.accumulate(reversed(reads), operator.or_))[::-1]
        if self.early_unless is not None:
            return {
                i
                for i, a, b in self.windows
                if after[b] and not any(reads[j] for j in self.blockers(a))
            }
        before = list(itertools.accumulate(reads, operator.or_))
        return {i for i, a, b in self.windows if (a < 0 or before[a]) and after[b]}


@dataclass(frozen=True)
class ShardingProblem:
    """The integer program's input; validated on construction (ValueError names the part).

    ``live_sets[i]`` lists the nodes whose outputs are live at checkpoint i; a node listed
    twice counts twice. ``node_memory[v][p]`` is bytes per device of v's output under p.
    ``preferences[v][p]`` (optional, finite, >= 0; lower is preferred) breaks ties between
    equal-cost assignments the same way on every solver and version, lexicographically:
    the solve first minimises the cost, then the preference total among the assignments
    of that cost (to the solver's tolerance), so a preference never buys cost;
    ``Solution.objective`` is the cost alone.
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
        put(self, "live_sets", _int_sets(self.live_sets))
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


def _int_sets(sets) -> tuple[tuple[int, ...], ...]:
    """``sets`` as a tuple of tuples of ints; those given so are kept as they are (their
    type checked at C speed: a large graph's live sets hold millions of entries)."""
    if isinstance(sets, tuple) and all(type(s) is tuple for s in sets):
        if set(map(type, itertools.chain.from_iterable(sets))) <= {int}:
            return sets
    return tuple(tuple(int(v) for v in s) for s in sets)


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
    shapes: dict[int, tuple] = {}  # id of a matrix -> (rows, set of row lengths)
    for i, e in enumerate(pb.edges):
        if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
            raise ValueError(
                f"edge {i} ({e.src} -> {e.dst}) must join two different nodes in [0, {n})"
            )
        shape = shapes.get(id(e.costs))
        if shape is None:
            shape = shapes[id(e.costs)] = (len(e.costs), {len(r) for r in e.costs})
        if shape != (k[e.src], {k[e.dst]}):
            raise ValueError(
                f"edge {i} ({pb.node_label(e.src)} -> {pb.node_label(e.dst)}) needs a "
                f"{k[e.src]} x {k[e.dst]} cost matrix, got {len(e.costs)} rows of lengths {shape[1]}"
            )
        if id(e.costs) in finite_checked:
            continue
        # the sum is NaN or -inf whenever an entry is (sum() runs at C speed); only then
        # look at the entries (+inf and -inf, or an overflow, also sum to NaN or -inf)
        total = sum(map(sum, e.costs))
        if (total != total or total == -math.inf) and any(
            math.isnan(c) or c == -math.inf for r in e.costs for c in r
        ):
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
    flat = list(itertools.chain.from_iterable(pb.live_sets))  # millions on a large graph
    if flat and not 0 <= min(flat) <= max(flat) < n:
        i = next(i for i, live in enumerate(pb.live_sets) if any(not 0 <= v < n for v in live))
        raise ValueError(f"live_sets[{i}] = {pb.live_sets[i]} names nodes outside [0, {n})")
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
        if c.early_unless is not None and any(not 0 <= j < len(c.readers) for j in c.early_unless):
            raise ValueError(
                f"{where} has early_unless={c.early_unless}; need reader indices in "
                f"[0, {len(c.readers)})"
            )
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


def cost_quantum(problem: ShardingProblem) -> float:
    """The power of two, :data:`COST_QUANTUM` of the largest finite cost (node or edge)
    of ``problem`` or just above, to which the solve rounds costs when the problem has
    preferences (1.0 when every cost is zero or infinite).

    Rounding makes equal costs that floating point computed along different paths equal
    exactly (a tie-break must see them as a tie) and keeps the reductions' sums exact;
    it moves each cost by at most half a quantum, so the plan returned costs at most
    (number of terms) x quantum / 2 more than the least-cost plan before rounding:
    far below the solvers' own tolerance (1e-9 of the largest cost)."""
    largest = 0.0
    for row in problem.node_costs:
        for c in row:
            if c != math.inf and abs(c) > largest:
                largest = abs(c)
    seen: set[int] = set()  # edges of identical layers share one matrix
    for e in problem.edges:
        if id(e.costs) not in seen:
            seen.add(id(e.costs))
            m = np.asarray(e.costs, dtype=float)
            m = np.abs(m[np.isfinite(m)])
            if m.size:
                largest = max(largest, float(m.max()))
    if largest == 0.0:
        return 1.0
    return math.ldexp(COST_QUANTUM, math.frexp(largest)[1])


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
