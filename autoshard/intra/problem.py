"""Intra-operator planning: op graph + device mesh -> ILP -> ParallelPlan (jax-free).

Takes a :class:`~autoshard.ir.graph.Graph` and a priced mesh
(:class:`~autoshard.hardware.mesh.DeviceMesh`); builds Alpa's sharding problem (one node
per program input and per equation, strategies from :mod:`autoshard.intra.strategies`,
resharding costs on every edge from :mod:`autoshard.intra.cost`, memory rows from
:mod:`autoshard.intra.memory`), solves it with :mod:`autoshard.intra.ilp` and returns a
:class:`~autoshard.ir.plan.ParallelPlan` with the predicted collectives and peak memory.

Problem-size reductions, all exact with respect to the plans they allow (written by
:mod:`autoshard.intra.ties`; the plan is read off a solution by :mod:`autoshard.intra.predict`):

* followers -- a light op with one array operand (unary elementwise, broadcasts,
  reshapes, transposes, reductions) takes the strategy that matches its operand's;
* identical layers -- every node of a layer whose equations have the same primitives and
  shapes as an earlier layer's shares the variables of the layer ``layer_period`` (2)
  places before it in that run (on by default), so the number of variables does not grow
  with depth and alternating plans stay reachable;
* aliases -- a parameter or optimizer-state input and its updated output are forced to
  the same spec (an edge whose other pairs cost infinity).

Pinning input specs (``pinned_inputs``) turns the same machinery into the baselines:
data parallel, ZeRO and Megatron fix the inputs and let the ILP place the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.cost import reshard
from autoshard.intra.ilp import (
    EdgeCost,
    ShardingProblem,
    Tie,
    peak_memory,
    solve,
)
from autoshard.intra.memory import memory_rows, streamed_tensors
from autoshard.intra.options import DEFAULT_INTRA_OPTIONS, IntraOptions
from autoshard.intra.predict import (
    REDUCED_IN_PLACE,
    plan_from_solution,
    predicted_collectives,
)
from autoshard.intra.strategies import Strategy, input_strategies, node_strategies
from autoshard.intra.ties import (
    apply_alpa_options,
    follower_ties,
    keep_data_parallel,
    layer_ties,
    preferences,
)
from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import ShardingSpec


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
    src_strategies,
    k,
    dst_strategies,
    slot,
    shape,
    item,
    mesh,
    options,
    in_place=False,
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
    options: IntraOptions = DEFAULT_INTRA_OPTIONS,
    *,
    pinned_inputs: Mapping[int, ShardingSpec] | None = None,
    followers: bool = True,
    copy_buffers: bool | None = None,
) -> IntraProblem:
    """Alpa's intra-operator ILP for ``graph`` on ``mesh``, set up by ``options``
    (:class:`~autoshard.intra.options.IntraOptions`: the budget, merging, layer sharing,
    the cost formulas' knobs and Alpa's ``AutoShardingOption`` knobs; the solver settings
    are for :func:`auto_shard_graph`).

    ``pinned_inputs`` maps input positions (index into ``graph.inputs``) to a fixed spec.
    ``copy_buffers``: give the problem the resharded copies (:class:`CopyBuffer`), so that
    its memory rows and ``peak_memory`` count what :func:`predicted_peak_bytes` counts;
    default: only with a budget (without one nothing reads them, and they take a second
    to list on a large graph).
    """
    memory_budget_bytes = options.memory_budget_bytes
    cost_options = options.cost_options(relative_units=math.isinf(mesh.peak_flops))
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
    # memory-bound ops are charged the buffers they stream
    materialized = streamed_tensors(graph, mesh) if math.isfinite(mesh.hbm_bandwidth) else None
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
    apply_alpa_options(graph, strategies, node_costs, n_in, mesh, options)
    prefs = preferences(graph, strategies, n_in, mesh)

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
                matrix = matrices[key] = keep_data_parallel(
                    _edge_matrix(
                        strategies[src], k, strategies[dst], slot, t.shape, item, mesh,
                        cost_options, in_place,
                    ),
                    strategies[src], k, strategies[dst], slot, options.data_parallel_axes,
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
        follower_ties(
            graph, strategies, producer, n_in, ties, follow_deepest=options.merge_elementwise
        )
    if options.share_layers:
        layer_ties(graph, strategies, n_in, ties, options.layer_period)

    memory = memory_rows(graph, strategies, producer, n_in, mesh, operands if copy_buffers else ())
    problem = ShardingProblem(
        num_strategies=tuple(len(s) for s in strategies),
        node_costs=tuple(node_costs),
        edges=tuple(edges),
        ties=tuple(ties),
        node_memory=memory.node_memory,
        live_sets=memory.live_sets,
        memory_budget_bytes=memory_budget_bytes,
        copies=memory.copies,
        preferences=prefs,
    )
    return IntraProblem(graph, mesh, problem, tuple(strategies), tuple(operands), n_in)


def auto_shard_graph(
    graph: Graph,
    mesh: DeviceMesh,
    options: IntraOptions = DEFAULT_INTRA_OPTIONS,
    *,
    pinned_inputs: Mapping[int, ShardingSpec] | None = None,
    name: str = "auto",
) -> ParallelPlan:
    """Plan ``graph`` on ``mesh`` with the ILP and return the plan with its predictions.

    ``options`` (:class:`~autoshard.intra.options.IntraOptions`) holds every setting: the
    solver, its limits, the memory budget, merging, layer sharing, the cost formulas and
    Alpa's knobs. ``pinned_inputs`` fixes the specs of some inputs (a baseline's).
    """
    memory_budget_bytes = options.memory_budget_bytes
    ip = build_problem(graph, mesh, options, pinned_inputs=pinned_inputs)
    # with a budget, the ILP's memory rows count every buffer predicted_peak_bytes does,
    # resharded copies included (CopyBuffer), so the plan's prediction is its peak
    solution = solve(
        ip.problem,
        solver=options.solver,
        time_limit_s=options.time_limit_s,
        mip_gap=options.mip_gap,
        seed=options.seed,
    )
    plan = plan_from_solution(ip, solution, name=name)
    if solution.fallback is not None and pinned_inputs is None:  # no incumbent: best baseline?
        from autoshard.intra.fallback import cheapest_fallback

        plan = cheapest_fallback(plan, solution, ip, options, plan_from_solution)
        solution = None
    if memory_budget_bytes is not None and solution is not None:
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
    "peak_memory",
]
