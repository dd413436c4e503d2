"""Intra-operator planning: op graph + device mesh -> ILP -> ParallelPlan (jax-free).

Takes a :class:`~autoshard.ir.graph.Graph` and a :class:`~autoshard.intra.cost.DeviceMesh`;
builds Alpa's sharding problem (one node per program input and per equation, strategies
from :mod:`autoshard.intra.strategies`, resharding costs on every edge from
:mod:`autoshard.intra.cost`), solves it with :mod:`autoshard.intra.ilp` and returns a
:class:`~autoshard.ir.plan.ParallelPlan` with the predicted collectives and peak memory.

Problem-size reductions, all exact with respect to the plans they allow:

* followers -- a light op with one array operand (unary elementwise, broadcasts,
  reshapes, transposes, reductions) takes the strategy that matches its operand's;
* identical layers -- every node of a layer whose equations have the same primitives and
  shapes as an earlier layer's shares that layer's variables (on by default), so the
  number of variables does not grow with depth;
* aliases -- a parameter or optimizer-state input and its updated output are forced to
  the same spec (an edge whose other pairs cost infinity).

Pinning input specs (``pinned_inputs``) turns the same machinery into the baselines:
data parallel, ZeRO and Megatron fix the inputs and let the ILP place the rest.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from autoshard.intra.cost import (
    DEFAULT_COST_OPTIONS,
    CostOptions,
    DeviceMesh,
    reshard,
    reshard_to_consumers,
)
from autoshard.intra.ilp import (
    CopyBuffer,
    EdgeCost,
    ShardingProblem,
    Solution,
    Tie,
    peak_memory,
    solve,
)
from autoshard.intra.strategies import Strategy, input_strategies, node_strategies
from autoshard.ir.graph import REDUCTIONS as ALL_REDUCTIONS
from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Collective, ShardingSpec

NOT_FOLLOWERS = frozenset(
    {
        "dot_general",
        "gather",
        "scatter-add",
        "scatter_add",
        "iota",
        "broadcast_in_dim",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
    }
)


@dataclass(frozen=True)
class Operand:
    """One use of a tensor: ILP node ``src`` produces it, node ``dst`` reads it."""

    src: int
    dst: int
    tensor: int
    slot: int  # operand index on dst (-1: alias edge)


@dataclass(frozen=True)
class IntraProblem:
    graph: Graph
    mesh: DeviceMesh
    problem: ShardingProblem
    # ILP node -> its candidate (input specs, output specs) ; inputs first, then graph nodes
    strategies: tuple[tuple[Strategy, ...], ...]
    operands: tuple[Operand, ...]
    num_inputs: int

    def node_of(self, graph_node: int) -> int:
        return self.num_inputs + graph_node


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


@lru_cache(maxsize=1_000_000)
def _reshard_cached(
    src: ShardingSpec, dst: ShardingSpec, shape, itemsize, mesh, options, in_place=False
):
    return reshard(src, dst, shape, itemsize, mesh, options, reduce_in_place=in_place)


def _xla_resolves(src: ShardingSpec, dst: ShardingSpec) -> bool:
    """Can XLA turn the partial sum ``src`` into ``dst`` right at the producing op?

    XLA's SPMD partitioner resolves a partial sum with one all-reduce or reduce-scatter
    into the sharding its consumer needs; when that sharding drops or moves a split of
    the output, it re-partitions the producing op instead (gathering its operands), a
    different plan.  So from a partial sum we only allow targets that keep every split
    the producer has (and may add the reduced axes to a dim: a reduce-scatter).
    """
    return all(d[: len(s)] == s for s, d in zip(src.dims, dst.dims))


def _edge_matrix(
    src_strategies, k, dst_strategies, slot, shape, item, mesh, options, in_place=False
):
    """Resharding cost of output ``k`` of every source strategy into operand ``slot`` of
    every destination strategy (``math.inf`` where XLA cannot resolve a partial sum).
    ``in_place``: the source op reduces its partial sums where it makes them (a reduction
    or a scatter-add, see :func:`autoshard.intra.cost.reshard`)."""
    wants = [s.input_specs[slot] for s in dst_strategies]
    matrix = []
    for s in src_strategies:
        a = s.output_specs[k]
        row = []
        for b in wants:
            if b is None:
                row.append(0.0)
            elif a.partial and not _xla_resolves(a, b):
                row.append(math.inf)
            else:
                cost = _reshard_cached(a, b, shape, item, mesh, options, in_place and a.partial)
                row.append(cost.cost)
        matrix.append(tuple(row))
    return tuple(matrix)


def _input_strategy(spec: ShardingSpec) -> Strategy:
    return Strategy(str(spec), (), (spec,), 0.0, 1)


def build_problem(
    graph: Graph,
    mesh: DeviceMesh,
    *,
    memory_budget_bytes: float | None = None,
    pinned_inputs: Mapping[int, ShardingSpec] | None = None,
    share_layers: bool = True,
    followers: bool = True,
    merge_elementwise: bool = False,
    options: CostOptions = DEFAULT_COST_OPTIONS,
    copy_buffers: bool | None = None,
) -> IntraProblem:
    """Alpa's intra-operator ILP for ``graph`` on ``mesh``.

    ``pinned_inputs`` maps input positions (index into ``graph.inputs``) to a fixed spec.
    ``merge_elementwise`` also makes binary elementwise ops follow their deepest operand
    (Alpa's rule): a smaller, faster ILP that can miss the best plan.
    ``copy_buffers``: give the problem the resharded copies (:class:`CopyBuffer`), so that
    its memory rows and ``peak_memory`` count what :func:`predicted_peak_bytes` counts;
    default: only with a budget (without one nothing reads them, and they take a second
    to list on a large graph).
    """
    if copy_buffers is None:
        copy_buffers = memory_budget_bytes is not None
    pinned = dict(pinned_inputs or {})
    n_in = len(graph.inputs)
    strategies: list[tuple[Strategy, ...]] = []
    producer: dict[int, tuple[int, int]] = {}  # tensor -> (ILP node, output index)
    # identical inputs / nodes share one strategy tuple (and so their edges' matrices)
    input_cache: dict[tuple[int, ...], tuple[Strategy, ...]] = {}
    for pos, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        if pos in pinned:
            pinned[pos].validate(mesh.mesh, t.shape)
            strategies.append((_input_strategy(pinned[pos]),))
        else:
            if t.shape not in input_cache:
                specs = input_strategies(t.shape, mesh)
                input_cache[t.shape] = tuple(_input_strategy(s) for s in specs)
            strategies.append(input_cache[t.shape])
        producer[tid] = (pos, 0)
    warned: set[str] = set()
    # memory-bound ops are charged the buffers they stream, under XLA:CPU's fusion model on
    # every backend: on one H100 the attention's softmax kernels took 18.5 ms a step, where
    # the values XLA:GPU keeps (mesh.fused_transcendentals) would price 7.7 ms and these
    # 27.0 ms (docs/validation.md)
    materialized = (
        materialized_tensors(graph, mesh.reductions_read_memory)
        if math.isfinite(mesh.hbm_bandwidth)
        else None
    )
    node_cache: dict = {}
    as_tuple: dict[int, tuple[Strategy, ...]] = {}
    for node in graph.nodes:
        found = node_strategies(graph, node, mesh, warned, materialized, node_cache)
        if id(found) not in as_tuple:
            as_tuple[id(found)] = tuple(found)
        strategies.append(as_tuple[id(found)])
        for k, tid in enumerate(node.outputs):
            producer[tid] = (n_in + node.index, k)

    outputs = set(graph.outputs)
    node_costs = []
    for i, strats in enumerate(strategies):
        costs = []
        for s in strats:
            c = s.compute_cost
            if i >= n_in and s.output_specs and s.output_specs[0].partial:
                node = graph.nodes[i - n_in]
                if any(t in outputs for t in node.outputs):
                    c = math.inf  # program outputs cannot be unreduced
            costs.append(c)
        node_costs.append(tuple(costs))
    preferences = _preferences(graph, strategies, n_in, mesh)

    def out_spec(ilp_node: int, k: int, p: int) -> ShardingSpec:
        return strategies[ilp_node][p].output_specs[k]

    # operand edges
    operands: list[Operand] = []
    edges: list[EdgeCost] = []
    matrices: dict[tuple, tuple[tuple[float, ...], ...]] = {}  # by strategy tuples' identity
    for node in graph.nodes:
        dst = n_in + node.index
        for slot, tid in enumerate(node.inputs):
            if tid not in producer:
                continue  # literal or closed-over constant: available everywhere
            src, k = producer[tid]
            t = graph.tensors[tid]
            item = _itemsize(t.dtype)
            in_place = src >= n_in and graph.nodes[src - n_in].primitive in REDUCED_IN_PLACE
            key = (id(strategies[src]), k, id(strategies[dst]), slot, t.shape, item, in_place)
            matrix = matrices.get(key)
            if matrix is None:
                matrix = matrices[key] = _edge_matrix(
                    strategies[src], k, strategies[dst], slot, t.shape, item, mesh, options,
                    in_place,
                )  # fmt: skip
            operands.append(Operand(src, dst, tid, slot))
            edges.append(EdgeCost(src, dst, matrix))
    # alias edges: state input and its updated output share a spec
    for in_tid, out_tid in graph.aliases:
        if out_tid not in producer or producer[out_tid][0] < n_in:
            continue
        src = graph.inputs.index(in_tid)
        dst, k = producer[out_tid]
        matrix = tuple(
            tuple(
                0.0 if out_spec(src, 0, p) == out_spec(dst, k, q) else math.inf
                for q in range(len(strategies[dst]))
            )
            for p in range(len(strategies[src]))
        )
        operands.append(Operand(src, dst, out_tid, -1))
        edges.append(EdgeCost(src, dst, matrix))

    ties: list[Tie | None] = [None] * len(strategies)
    if followers:
        _follower_ties(graph, strategies, producer, n_in, ties, follow_deepest=merge_elementwise)
    if share_layers:
        _layer_ties(graph, strategies, n_in, ties)

    node_memory, live_sets, copies = _memory_model(
        graph, strategies, producer, n_in, mesh, operands if copy_buffers else ()
    )
    problem = ShardingProblem(
        num_strategies=tuple(len(s) for s in strategies),
        node_costs=tuple(node_costs),
        edges=tuple(edges),
        ties=tuple(ties),
        node_memory=node_memory,
        live_sets=live_sets,
        memory_budget_bytes=memory_budget_bytes,
        copies=copies,
        preferences=preferences,
    )
    return IntraProblem(graph, mesh, problem, tuple(strategies), tuple(operands), n_in)


def _preferences(graph, strategies, n_in, mesh) -> tuple[tuple[float, ...], ...]:
    """The tie-break between equal-cost plans (:class:`ShardingProblem` ``preferences``):
    a node's strategies ranked by the bytes per device of its outputs, then by their
    order. So equal-cost plans keep data split and state sharded (Alpa, too, adds a small
    penalty for replicated parameters), and resolve the same way on every solver."""
    ranked: dict[int, tuple[float, ...]] = {}  # by strategy tuple: identical layers share
    out = []
    for i, strats in enumerate(strategies):
        tids = (graph.inputs[i],) if i < n_in else graph.nodes[i - n_in].outputs
        key = (id(strats), tuple(graph.tensors[t].nbytes for t in tids))
        if key not in ranked:
            held = [
                sum(
                    graph.tensors[t].nbytes * spec.shard_fraction(mesh.mesh)
                    for t, spec in zip(tids, s.output_specs, strict=False)
                    if spec is not None
                )
                for s in strats
            ]
            order = sorted(range(len(strats)), key=lambda p: (round(held[p]), p))
            rank = [0.0] * len(strats)
            for r, p in enumerate(order):
                rank[p] = float(r)
            ranked[key] = tuple(rank)
        out.append(ranked[key])
    return tuple(out)


def _follower_ties(graph, strategies, producer, n_in, ties, follow_deepest=False) -> None:
    for node in graph.nodes:
        if node.primitive in NOT_FOLLOWERS or len(node.outputs) != 1:
            continue
        out_shape = graph.tensors[node.outputs[0]].shape
        arrays = [
            (k, t) for k, t in enumerate(node.inputs) if t in producer and graph.tensors[t].shape
        ]
        if not arrays:
            continue
        if len(arrays) > 1:
            # only operands broadcast along size-1 dims besides one full-shape operand
            full = [(k, t) for k, t in arrays if graph.tensors[t].shape == out_shape]
            # (with follow_deepest: Alpa's rule, the latest-made of several full operands)
            if not full or (len(full) > 1 and not follow_deepest):
                continue
            arrays = [max(full, key=lambda kt: producer[kt[1]][0])]
        slot, tid = arrays[0]
        src, k = producer[tid]
        if any(s.output_specs[k].partial for s in strategies[src]):
            continue  # the reduction's target (all-reduce or reduce-scatter) stays a choice
        me = n_in + node.index
        by_input: dict[ShardingSpec, int] = {}
        for q, s in enumerate(strategies[me]):
            spec = s.input_specs[slot]
            if spec is not None:
                by_input.setdefault(spec, q)
        mapping = []
        for p in range(len(strategies[src])):
            want = strategies[src][p].output_specs[k]
            q = by_input.get(want)
            if q is None:
                break
            mapping.append(q)
        else:
            ties[me] = Tie(src, tuple(mapping))


_LAYER_KEY = re.compile(r"\['([^']+)'\]")


def _layer_ties(graph, strategies, n_in, ties) -> None:
    by_layer: dict[str, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.index)
    signature_owner: dict[tuple, str] = {}
    rep_of: dict[str, str] = {}
    for layer in graph.layers:
        idx = by_layer.get(layer, [])
        sig = tuple(
            (
                graph.nodes[i].primitive,
                graph.nodes[i].phase,
                tuple(graph.tensors[t].shape for t in graph.nodes[i].inputs),
                tuple(graph.tensors[t].shape for t in graph.nodes[i].outputs),
            )
            for i in idx
        )
        owner = signature_owner.setdefault(sig, layer)
        if owner == layer:
            continue
        rep_of[layer] = owner
        for a, b in zip(by_layer[owner], idx):
            me = n_in + b
            if ties[me] is None and len(strategies[me]) > 1:
                ties[me] = Tie(n_in + a, tuple(range(len(strategies[me]))))
    # parameters and optimizer state of a shared layer follow the first layer's
    path_index = {graph.tensors[t].path: pos for pos, t in enumerate(graph.inputs)}
    for pos, tid in enumerate(graph.inputs):
        path = graph.tensors[tid].path
        keys = _LAYER_KEY.findall(path)
        layer = next((k for k in keys if k in rep_of), None)
        if layer is None:
            continue
        twin = path_index.get(path.replace(f"['{layer}']", f"['{rep_of[layer]}']"))
        if twin is not None and len(strategies[twin]) == len(strategies[pos]) and ties[pos] is None:
            ties[pos] = Tie(twin, tuple(range(len(strategies[pos]))))


def _memory_model(graph, strategies, producer, n_in, mesh, operands):
    """Per-strategy bytes of each ILP node's live buffers, the live sets at every position
    where a buffer may be born, and the resharded copies as :class:`CopyBuffer` -- the
    same model as :func:`predicted_peak_bytes`."""
    # a tensor's buffers (itself, its f32 copy) count together, over the union of their
    # intervals (the tensor's holds the copy's unless the tensor is fused away)
    intervals: dict[int, tuple[int, int]] = {}
    sizes: dict[int, float] = {}
    for tid, first, last, nbytes in tensor_buffers(graph, mesh):
        a, b = intervals.get(tid, (first, last))
        intervals[tid] = (min(a, first), max(b, last))
        sizes[tid] = sizes.get(tid, 0.0) + nbytes

    node_memory = []
    for i, strats in enumerate(strategies):
        tids = (graph.inputs[i],) if i < n_in else graph.nodes[i - n_in].outputs
        row = []
        for s in strats:
            row.append(
                float(
                    sum(
                        sizes[t] * spec.shard_fraction(mesh.mesh)
                        for t, spec in zip(tids, s.output_specs)
                        if t in intervals
                    )
                )
            )
        node_memory.append(tuple(row))
    owner = {}
    for tid in intervals:
        node, _ = producer[tid]
        owner[tid] = node
    groups = _copy_groups(graph, strategies, producer, n_in, mesh, operands)
    # one sweep over program order: the live set at each position where a buffer is born
    # (a copy is born at one of its readers, or at the start)
    born: dict[int, list[int]] = {}
    for t, (first, _) in intervals.items():
        born.setdefault(first, []).append(t)
    checkpoints = set(born)
    for _, _, early, readers in groups:
        checkpoints.update([0] if early else [r[0] for r in readers])
    by_end = sorted(intervals, key=lambda t: intervals[t][1])
    active: dict[int, int] = {}  # ILP node -> number of its live buffers
    live_sets, at, done = [], [], 0
    for c in sorted(checkpoints):
        for t in born.get(c, ()):
            active[owner[t]] = active.get(owner[t], 0) + 1
        while done < len(by_end) and intervals[by_end[done]][1] < c:
            t = by_end[done]
            done += 1
            if intervals[t][0] <= c:
                active[owner[t]] -= 1
                if not active[owner[t]]:
                    del active[owner[t]]
        if c >= 0:
            live_sets.append(tuple(sorted(active)))
            at.append(c)
    copies = []
    for (src, src_strategies), nbytes, early, readers in groups:
        where = [r[0] for r in readers]
        lo = bisect.bisect_left(at, 0 if early else where[0])
        hi = bisect.bisect_right(at, where[-1])
        windows = []
        for i in range(lo, hi):
            b = bisect.bisect_left(where, at[i])
            a = -1 if early else bisect.bisect_right(where, at[i]) - 1
            windows.append((i, a, b))
        copies.append(
            CopyBuffer(nbytes, src, src_strategies, tuple(r[1:] for r in readers), windows)
        )
    return tuple(node_memory), tuple(live_sets), tuple(copies)


def _copy_groups(graph, strategies, producer, n_in, mesh, operands) -> list:
    """One entry per value and layout some reader may want that its producer may not
    give (the buffers of :func:`_reshard_buffers`): ((producer ILP node, its strategies
    that give another layout), bytes per device, made at the start of the step?,
    [(program position, reader ILP node, its strategies that want the layout)] in
    program order)."""
    pos = program_positions(graph, mesh.late_updates)
    found: dict[tuple[int, ShardingSpec], list] = {}
    for op in operands:
        if op.slot < 0 or op.dst < n_in:
            continue
        wants: dict[ShardingSpec, list[int]] = {}
        for q, s in enumerate(strategies[op.dst]):
            spec = s.input_specs[op.slot]
            if spec is not None:
                wants.setdefault(spec, []).append(q)
        for spec, qs in wants.items():
            found.setdefault((op.tensor, spec), []).append((pos[op.dst - n_in], op.dst, tuple(qs)))
    out = []
    for (tid, spec), readers in found.items():
        src, k = producer[tid]
        other = tuple(p for p, s in enumerate(strategies[src]) if s.output_specs[k] != spec)
        copy = _resharded_copy(graph, tid, spec, mesh)
        if other and copy is not None and copy[0]:
            out.append(((src, other), copy[0], copy[1], sorted(readers)))
    return out


def _resharded_copy(graph: Graph, tid: int, spec: ShardingSpec, mesh: DeviceMesh):
    """(bytes per device, made at the start of the step?) of ``tid``'s copy in layout
    ``spec``, or None where no copy is a buffer (literals, constants, scalars). The one
    rule of the ILP's copies (:func:`_copy_groups`) and the prediction's
    (:func:`_reshard_buffers`)."""
    t = graph.tensors[tid]
    if t.kind in ("literal", "const") or not t.shape:
        return None
    # a program input's resharded copy needs nothing computed: XLA:CPU's scheduler makes
    # it at the start of the step (a weight's all-gather, the labels' one-hot)
    early = mesh.early_input_reshards and t.producer is None
    return t.nbytes * spec.shard_fraction(mesh.mesh), early


# ----------------------------------------------------------------------------- plan


def plan_from_solution(
    ip: IntraProblem, solution: Solution, name: str = "auto", notes: tuple[str, ...] = ()
) -> ParallelPlan:
    graph, mesh = ip.graph, ip.mesh
    choice = solution.strategy
    chosen = [ip.strategies[i][choice[i]] for i in range(len(choice))]
    input_specs = tuple(chosen[i].output_specs[0] for i in range(ip.num_inputs))
    tensor_specs: dict[int, ShardingSpec] = {}
    names = []
    for node in graph.nodes:
        s = chosen[ip.num_inputs + node.index]
        names.append(s.name)
        for tid, spec in zip(node.outputs, s.output_specs):
            tensor_specs[tid] = spec
    spec_of = dict(zip(graph.inputs, input_specs))
    spec_of.update(tensor_specs)
    output_specs = tuple(spec_of[t] for t in graph.outputs)
    collectives = predicted_collectives(ip, choice)
    operand_specs: dict[int, dict[int, ShardingSpec]] = {}
    for op in ip.operands:
        if op.slot < 0 or op.dst < ip.num_inputs:
            continue
        want = chosen[op.dst].input_specs[op.slot]
        if want is not None and want != spec_of.get(op.tensor):
            operand_specs.setdefault(op.dst - ip.num_inputs, {})[op.slot] = want
    return ParallelPlan(
        name=name,
        mesh=mesh.mesh,
        input_specs=input_specs,
        input_paths=tuple(graph.tensors[t].path for t in graph.inputs),
        output_specs=output_specs,
        tensor_specs=tensor_specs,
        operand_specs=operand_specs,
        node_strategies=tuple(names),
        predicted_collectives=collectives,
        predicted_peak_bytes=predicted_peak_bytes(graph, spec_of, mesh, operand_specs),
        objective=solution.objective,
        solver=json.loads(solution.to_json()),
        notes=notes,
    )


def predicted_collectives(ip: IntraProblem, choice) -> tuple[Collective, ...]:
    """The collectives XLA will emit for the plan ``choice``: every value is resharded
    once per distinct spec its consumers want (:func:`autoshard.intra.cost.reshard_to_consumers`),
    in program order of first use."""
    graph = ip.graph
    source: dict[int, ShardingSpec] = {}
    steps: dict[int, tuple[tuple[str, ...], ...]] = {}
    targets: dict[int, list[ShardingSpec]] = {}
    for op in ip.operands:
        if op.slot < 0:
            continue
        src_s = ip.strategies[op.src][choice[op.src]]
        dst_s = ip.strategies[op.dst][choice[op.dst]]
        k = (
            0
            if op.src < ip.num_inputs
            else graph.nodes[op.src - ip.num_inputs].outputs.index(op.tensor)
        )
        b = dst_s.input_specs[op.slot]
        if b is None:
            continue
        source[op.tensor] = src_s.output_specs[k]
        if op.src >= ip.num_inputs:
            steps[op.tensor] = _reduce_steps(graph.nodes[op.src - ip.num_inputs], src_s)
        wants = targets.setdefault(op.tensor, [])
        if b not in wants:
            wants.append(b)
    out: list[Collective] = []
    for tid, wants in targets.items():
        t = graph.tensors[tid]
        r = reshard_to_consumers(
            source[tid],
            wants,
            t.shape,
            _itemsize(t.dtype),
            ip.mesh,
            DEFAULT_COST_OPTIONS,
            reduce_first=steps.get(tid, ()),
        )
        out.extend(r.collectives)
    return tuple(out)


REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# ops whose partial sums XLA reduces where they are made, before any new split
REDUCED_IN_PLACE = REDUCTIONS | {"scatter-add", "scatter_add"}


def _reduce_steps(node, strategy: Strategy) -> tuple[tuple[str, ...], ...]:
    """For a reduce or scatter-add whose output is partial: its partial axes, reduced
    where the op makes them; for a reduce grouped by the summed dim of the operand they
    split, last dim first (the order XLA all-reduces them in, see
    :func:`autoshard.intra.cost.reshard_to_consumers`); otherwise ()."""
    out = strategy.output_specs[0] if strategy.output_specs else None
    operand = strategy.input_specs[0] if strategy.input_specs else None
    if node.primitive not in REDUCED_IN_PLACE or out is None or not out.partial:
        return ()
    groups = ()
    if node.primitive in REDUCTIONS and operand is not None:
        groups = tuple(
            g
            for g in (tuple(a for a in d if a in out.partial) for d in reversed(operand.dims))
            if g
        )
    return groups or (tuple(out.partial),)  # a scatter-add: all at once, where it is made


# Ops after which XLA materialises a buffer; elementwise producers are fused into their
# consumers, reshapes are bitcasts.
MATERIALIZING = frozenset(
    "dot_general gather scatter-add scatter_add reduce_sum reduce_max reduce_min argmax argmin "
    "concatenate cumsum cumprod cummax sort dynamic_update_slice transpose".split()
)
# Ops that read their operands from memory (no fusion into them).
UNFUSED_CONSUMERS = frozenset("dot_general gather scatter-add scatter_add concatenate".split())
TRANSCENDENTAL = frozenset("exp log tanh logistic log1p expm1 erf pow sin cos".split())
EXPENSIVE = TRANSCENDENTAL | {"div"}  # not recomputed in the backward pass when saved
FREE_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "copy", "stop_gradient"})


def materialized_tensors(
    graph: Graph, reductions_read_memory: bool = False, fused_transcendentals: bool = False
) -> set[int]:
    """Tensors that occupy memory in the compiled step (a model of XLA's fusion).

    A tensor is materialised when it is a program input or output, when an op that
    always writes a buffer made it (dots, reductions, gathers, scatters, transposes,
    concatenations), or when an unfused op reads it (a dot's operands; with
    ``reductions_read_memory``, as on XLA:CPU, whose reductions are library calls, a
    reduction's operand too).

    Cheap elementwise values (anything but transcendentals and divisions) are fused into
    every reader, the backward pass's included: XLA recomputes them there from the
    buffers they are made of (a LayerNorm's centred and normalised input, from its input
    and statistics) rather than keeping them; :func:`live_intervals` keeps those buffers
    alive until then.  A transcendental or a division read by several ops is kept; one
    made in the forward pass and read in the backward is kept unless its operands are
    kept until then anyway.

    With ``fused_transcendentals`` (XLA:GPU) transcendentals are cheap too: fused into
    every reader and recomputed in the backward pass (softmax's ``exp``).

    Values that depend on no program input (an attention mask: iota, compare,
    broadcast) never are: XLA folds them or regenerates them inside each reader's fusion.
    """
    expensive = EXPENSIVE - TRANSCENDENTAL if fused_transcendentals else EXPENSIVE
    kept_when_shared = frozenset() if fused_transcendentals else TRANSCENDENTAL
    out = set(graph.inputs) | set(graph.outputs)
    data_free = _data_free_tensors(graph)
    unfused = UNFUSED_CONSUMERS | (ALL_REDUCTIONS if reductions_read_memory else frozenset())
    for node in graph.nodes:
        for tid in node.outputs:
            t = graph.tensors[tid]
            if node.primitive in FREE_VIEWS or not t.shape:
                continue
            if tid in data_free and tid not in out:
                continue
            users = [graph.nodes[c] for c in t.consumers]
            if node.primitive in MATERIALIZING or any(u.primitive in unfused for u in users):
                out.add(tid)
            elif node.primitive in kept_when_shared and len({u.index for u in users}) > 1:
                out.add(tid)  # too dear to recompute in every consumer's fusion
            elif node.primitive not in expensive:
                continue  # recomputed wherever it is read
            elif node.phase == "forward" and any(u.phase != "forward" for u in users):
                # saved for the backward pass -- unless XLA can recompute it inside the
                # backward fusion from operands that are kept until then anyway
                last = t.last_use
                recomputable = all(
                    graph.tensors[i].kind in ("literal", "const")
                    or not graph.tensors[i].shape
                    or (i in out and graph.tensors[i].last_use >= last)
                    for i in node.inputs
                )
                if not recomputable:
                    out.add(tid)
    return out


def _data_free_tensors(graph: Graph) -> set[int]:
    """Tensors computed from literals and constants only, by ops XLA fuses or folds (no
    dots, reductions, gathers, scatters: whatever always writes a buffer)."""
    free: set[int] = set()
    for node in graph.nodes:
        if node.primitive in MATERIALIZING:
            continue
        if all(graph.tensors[i].kind in ("literal", "const") or i in free for i in node.inputs):
            free.update(node.outputs)
    return free


def program_positions(graph: Graph, late_updates: bool = False) -> list[int]:
    """Node index -> position in the modelled schedule: program order, except that XLA
    schedules each parameter's update as soon as its gradient is ready (update ops move
    to just after their last input) -- unless ``late_updates`` (XLA:CPU, which combines
    the gradient reductions into one at the end of the backward pass, so every gradient
    waits for it)."""
    pos = list(range(len(graph.nodes)))
    if late_updates:
        return pos
    for node in graph.nodes:
        if node.phase == "update":
            ready = [
                pos[graph.tensors[t].producer]
                for t in node.inputs
                if graph.tensors[t].producer is not None
            ]
            pos[node.index] = max(ready, default=0)
    return pos


def live_intervals(
    graph: Graph,
    reductions_read_memory: bool = False,
    late_updates: bool = False,
    fused_transcendentals: bool = False,
) -> dict[int, tuple[int, int]]:
    """Tensor id -> (first, last) program position of every buffer that occupies memory.

    Program inputs live throughout ((-1, n)); updated state reuses its donated input, so
    aliased outputs take no extra room.  Positions are :func:`program_positions`.
    The flags are :class:`~autoshard.intra.cost.DeviceMesh`'s (:func:`mesh_intervals`).  Only
    materialised tensors count (:func:`materialized_tensors`); a buffer lives until the
    last op that reads it, directly or through values fused away (:func:`_readers`: a
    value recomputed in the backward pass keeps what it is made of alive until then).
    """
    n = len(graph.nodes)
    pos = program_positions(graph, late_updates)
    keep = materialized_tensors(graph, reductions_read_memory, fused_transcendentals)
    aliased_outputs = {dst for _, dst in graph.aliases}
    out: dict[int, tuple[int, int]] = {}
    for t in graph.tensors:
        if t.id not in keep or t.id in aliased_outputs or t.kind in ("literal", "const"):
            continue
        if t.producer is None:
            out[t.id] = (-1, n)
            continue
        first = pos[t.producer]
        if t.last_use >= n:
            last = n
        else:
            last = max([pos[c] for c in _readers(graph, t.id, keep)] + [first])
        out[t.id] = (first, last)
    for node in graph.nodes:  # outputs written into a dying operand's buffer
        shared = _shared_operand(graph, node, out)
        if shared is not None:
            first, _ = out[shared]
            out[shared] = (first, max(first, pos[node.index] - 1))
    return out


def mesh_intervals(graph: Graph, mesh: DeviceMesh) -> dict[int, tuple[int, int]]:
    """:func:`live_intervals` as ``mesh``'s backend lays memory out."""
    return live_intervals(
        graph, mesh.reductions_read_memory, mesh.late_updates, mesh.fused_transcendentals
    )


def _readers(graph: Graph, tid: int, keep: set[int]) -> set[int]:
    """Nodes that read ``tid``'s buffer: its consumers and, through every value that is
    not materialised (fused into its readers), the readers of that value in turn."""
    seen: set[int] = set()
    stack, readers = [tid], set()
    while stack:
        for c in graph.tensors[stack.pop()].consumers:
            readers.add(c)
            for o in graph.nodes[c].outputs:
                constant = graph.tensors[o].kind in ("literal", "const")
                if o not in keep and o not in seen and not constant:
                    seen.add(o)
                    stack.append(o)
    return readers


# Ops whose output XLA writes into an operand's buffer when that operand dies there:
# scatters and dynamic-update-slice update in place.  Elementwise loop fusions could, but
# XLA:CPU's buffer assignment rarely lets them: in the compiled gpt-350m dp step, 11 of 117
# loop fusions whose same-size operand dies there share its buffer (the scatters and a few
# optimizer updates), the other 106 get a buffer of their own -- among them
# ``exp(logits - max) * g``, which holds a second 200 MiB logits-sized buffer at XLA's peak.
# The model therefore shares for in-place updates only.
IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "dynamic_update_slice"})


def _shared_operand(graph: Graph, node, intervals) -> int | None:
    """The operand whose buffer ``node``'s output reuses, if any (XLA's buffer sharing)."""
    if len(node.outputs) != 1 or node.outputs[0] not in intervals:
        return None
    if node.primitive not in IN_PLACE:
        return None
    candidates = node.inputs[:1]
    out = graph.tensors[node.outputs[0]]
    for tid in candidates:
        t = graph.tensors[tid]
        if (
            tid in intervals
            and t.producer is not None
            and t.nbytes == out.nbytes
            and t.shape == out.shape
            and t.last_use == node.index
            and max(t.consumers) == node.index
        ):
            return tid
    return None


NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def buffer_bytes(graph: Graph, tid: int, mesh: DeviceMesh) -> int:
    """Bytes of tensor ``tid``'s whole (unsharded) buffer on ``mesh``'s devices: its own
    size, except a bf16/f16 dot result on a device that computes narrow dots in f32
    (XLA:CPU, ``mesh.narrow_dots_in_f32``), whose buffer is f32."""
    t = graph.tensors[tid]
    if (
        mesh.narrow_dots_in_f32
        and t.dtype in NARROW_FLOATS
        and t.producer is not None
        and graph.nodes[t.producer].primitive == "dot_general"
    ):
        return 2 * t.nbytes
    return t.nbytes


def widened_dot_operands(graph: Graph, mesh: DeviceMesh) -> dict[int, tuple[int, int]]:
    """bf16/f16 tensors that dots read, on a device that computes narrow dots in f32
    (``mesh.narrow_dots_in_f32``) -> the (first, last) program position of their f32 copy.

    XLA:CPU converts each narrow dot operand to an f32 buffer of its own and shares the
    copy between every dot that reads the same value (a weight's copy serves its forward
    and backward dots, so it lives across the step): in the compiled gpt-350m bf16 dp
    step, 45 of the 39 dot fusions' operands are such converts, among them an f32 copy
    of the 51200 x 1024 embedding read by the logits dot and its gradient (made straight
    from the f32 parameter: see :func:`_replaced_by_copies`)."""
    if not mesh.narrow_dots_in_f32:
        return {}
    out = {}
    for t in graph.tensors:
        if t.dtype not in NARROW_FLOATS or not t.shape or t.kind in ("literal", "const"):
            continue
        dots = [c for c in t.consumers if graph.nodes[c].primitive == "dot_general"]
        if dots:
            out[t.id] = (min(dots), max(dots))
    return out


def _replaced_by_copies(graph: Graph, widened) -> set[int]:
    """Narrow tensors that only dots read, made by anything but a dot: XLA fuses their
    producer into the convert that makes the f32 copy (an f32 weight converted to bf16
    for its dots is one f32 buffer, not a bf16 one and an f32 one)."""
    boundary = set(graph.inputs) | set(graph.outputs)
    out = set()
    for tid in widened:
        t = graph.tensors[tid]
        if tid in boundary or t.producer is None:
            continue
        if graph.nodes[t.producer].primitive == "dot_general":
            continue
        if all(graph.nodes[c].primitive == "dot_general" for c in t.consumers):
            out.add(tid)
    return out


def tensor_buffers(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int, int, int]]:
    """(tensor, first, last, whole bytes) of every buffer that holds a value in its own
    layout: the live buffers of :func:`mesh_intervals` (but those an f32 copy replaces)
    and the f32 copies of :func:`widened_dot_operands`.  The ILP's memory rows and
    :func:`predicted_peak_bytes` both count these."""
    widened = widened_dot_operands(graph, mesh)
    replaced = _replaced_by_copies(graph, widened)
    out = [
        (tid, first, last, buffer_bytes(graph, tid, mesh))
        for tid, (first, last) in mesh_intervals(graph, mesh).items()
        if tid not in replaced
    ]
    out += [
        (tid, first, last, 2 * graph.tensors[tid].nbytes) for tid, (first, last) in widened.items()
    ]
    return out


def _reshard_buffers(graph: Graph, operand_specs, mesh: DeviceMesh) -> list:
    """(first, last, bytes per device) of each value in each layout it is resharded to."""
    pos = program_positions(graph, mesh.late_updates)
    uses: dict[tuple[int, ShardingSpec], list[int]] = {}
    for node_index, slots in operand_specs.items():
        node = graph.nodes[node_index]
        for slot, spec in slots.items():
            uses.setdefault((node.inputs[slot], spec), []).append(pos[node_index])
    out = []
    for (tid, spec), where in uses.items():
        copy = _resharded_copy(graph, tid, spec, mesh)
        if copy is not None:
            nbytes, early = copy
            out.append((0 if early else min(where), max(where), nbytes))
    return out


def predicted_peak_bytes(
    graph: Graph,
    spec_of: Mapping[int, ShardingSpec],
    mesh: DeviceMesh,
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]] | None = None,
) -> float:
    """Peak per-device bytes of live buffers over the program: :func:`live_intervals`,
    the f32 copies of :func:`widened_dot_operands`, and, given the plan's
    ``operand_specs`` (node -> operand slot -> the spec it is resharded to), one buffer
    per value and resharded layout, from its first reader in that layout to its last
    (XLA gathers a weight once for its forward and backward dots and keeps the gathered
    copy; a reduced partial sum is a buffer of its own)."""
    n = len(graph.nodes)
    delta = [0.0] * (n + 3)
    buffers = [
        (first, last, nbytes * spec_of[tid].shard_fraction(mesh.mesh))
        for tid, first, last, nbytes in tensor_buffers(graph, mesh)
        if tid in spec_of
    ]
    buffers += _reshard_buffers(graph, operand_specs or {}, mesh)
    for first, last, size in buffers:
        delta[first + 1] += size
        delta[min(last, n) + 2] -= size
    peak = cur = 0.0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return peak


def auto_shard_graph(
    graph: Graph,
    mesh: DeviceMesh,
    *,
    memory_budget_bytes: float | None = None,
    pinned_inputs: Mapping[int, ShardingSpec] | None = None,
    solver: str = "cbc",
    time_limit_s: float = 60.0,
    mip_gap: float = 0.0,
    seed: int = 0,
    share_layers: bool = True,
    merge_elementwise: bool = False,
    name: str = "auto",
    options: CostOptions | None = None,
) -> ParallelPlan:
    """Plan ``graph`` on ``mesh`` with the ILP and return the plan with its predictions.

    ``options`` default: Alpa's tie-breakers on for meshes in relative units (no finite
    peak FLOP/s, like Alpa's test mesh), off for meshes in seconds (cluster presets),
    where a 0.1 s constant per all-gather would swamp real costs.
    """
    if options is None:
        options = CostOptions(tie_breakers=math.isinf(mesh.peak_flops))

    ip = build_problem(
        graph,
        mesh,
        memory_budget_bytes=memory_budget_bytes,
        pinned_inputs=pinned_inputs,
        share_layers=share_layers,
        merge_elementwise=merge_elementwise,
        options=options,
    )
    # with a budget, the ILP's memory rows count every buffer predicted_peak_bytes does,
    # resharded copies included (CopyBuffer), so the plan's prediction is its peak
    solution = solve(
        ip.problem, solver=solver, time_limit_s=time_limit_s, mip_gap=mip_gap, seed=seed
    )
    plan = plan_from_solution(ip, solution, name=name)
    if memory_budget_bytes is not None:
        rows = peak_memory(ip.problem, solution.strategy)
        if not math.isclose(rows, plan.predicted_peak_bytes, rel_tol=1e-9, abs_tol=1.0):
            raise RuntimeError(
                f"internal error: the ILP's memory rows give {rows:.6g} B for the plan, the "
                f"prediction {plan.predicted_peak_bytes:.6g} B"
            )
    return plan


__all__ = [
    "IntraProblem",
    "build_problem",
    "plan_from_solution",
    "auto_shard_graph",
    "predicted_collectives",
    "predicted_peak_bytes",
    "peak_memory",
]
