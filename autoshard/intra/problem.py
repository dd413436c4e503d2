"""Intra-operator planning: op graph + device mesh -> ILP -> ParallelPlan (jax-free).

Takes a :class:`~autoshard.ir.graph.Graph` and a priced mesh
(:class:`~autoshard.hardware.mesh.DeviceMesh`); builds Alpa's sharding problem (one node
per program input and per equation, strategies from :mod:`autoshard.intra.strategies`,
resharding costs on every edge from :mod:`autoshard.intra.cost`, memory rows from
:mod:`autoshard.intra.memory`), solves it with :mod:`autoshard.intra.ilp` and returns a
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

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.cost import DEFAULT_COST_OPTIONS, reshard, reshard_to_consumers
from autoshard.intra.ilp import (
    EdgeCost,
    ShardingProblem,
    Solution,
    Tie,
    peak_memory,
    solve,
)
from autoshard.intra.memory import memory_rows, predicted_peak_bytes, streamed_tensors
from autoshard.intra.options import DEFAULT_INTRA_OPTIONS, IntraOptions
from autoshard.intra.strategies import Strategy, input_strategies, node_strategies
from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.primitives import SUM_MAX_MIN_REDUCTIONS
from autoshard.ir.spec import Collective, ShardingSpec

NOT_FOLLOWERS = frozenset(
    "dot_general conv_general_dilated gather scatter-add scatter_add iota broadcast_in_dim "
    "reduce_sum reduce_max reduce_min argmax argmin".split()
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
    _apply_alpa_options(graph, strategies, node_costs, n_in, mesh, options)
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
                    strategies[src], k, strategies[dst], slot, t.shape, item, mesh,
                    cost_options, in_place,
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
        _follower_ties(
            graph, strategies, producer, n_in, ties, follow_deepest=options.merge_elementwise
        )
    if options.share_layers:
        _layer_ties(graph, strategies, n_in, ties)

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
        preferences=preferences,
    )
    return IntraProblem(graph, mesh, problem, tuple(strategies), tuple(operands), n_in)


def _apply_alpa_options(graph, strategies, node_costs, n_in, mesh, options) -> None:
    """Forbid (infinite cost) the strategies that ``options``' Alpa knobs rule out:
    ``allow_mixed_mesh_shape=False`` (a dim split over several mesh axes) and
    ``force_batch_dim_to_mesh_axis`` (a data input whose batch dim is not split over that
    axis). Raises ValueError, naming the input, where no strategy is left."""
    axis = options.force_batch_dim_to_mesh_axis
    names = mesh.mesh.axis_names
    if axis is not None and axis not in names:
        raise ValueError(
            f"force_batch_dim_to_mesh_axis={axis!r} is not an axis of the mesh {mesh.mesh}; "
            f"choose one of {list(names)}"
        )

    def mixed(s) -> bool:
        specs = [*s.input_specs, *s.output_specs]
        return any(len(d) > 1 for spec in specs if spec is not None for d in spec.dims)

    for i, strats in enumerate(strategies):
        costs = list(node_costs[i])
        if not options.allow_mixed_mesh_shape:
            costs = [math.inf if mixed(s) else c for s, c in zip(strats, costs, strict=True)]
        if axis is not None and i < n_in:
            t = graph.tensors[graph.inputs[i]]
            if t.kind == "data" and t.shape:
                size = mesh.mesh.shape[names.index(axis)]
                if t.shape[0] % size:
                    raise ValueError(
                        f"force_batch_dim_to_mesh_axis={axis!r}: the batch dim of data input "
                        f"{i} (shape {t.shape}) is not divisible by the {size} devices of axis "
                        f"{axis!r}; use a batch that is a multiple of {size}, or another axis"
                    )
                costs = [
                    c if axis in s.output_specs[0].dims[0] else math.inf
                    for s, c in zip(strats, costs, strict=True)
                ]
        if costs != list(node_costs[i]):
            if all(math.isinf(c) for c in costs):
                what = f"input {i}" if i < n_in else f"node {graph.nodes[i - n_in].primitive}"
                raise ValueError(
                    f"the intra-op options leave {what} no strategy (force_batch_dim_to_mesh_axis"
                    f"={axis!r}, allow_mixed_mesh_shape={options.allow_mixed_mesh_shape}); a "
                    f"pinned spec may contradict them"
                )
            node_costs[i] = tuple(costs)


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


# ops whose partial sums XLA reduces where they are made, before any new split
REDUCED_IN_PLACE = SUM_MAX_MIN_REDUCTIONS | {"scatter-add", "scatter_add"}


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
    if node.primitive in SUM_MAX_MIN_REDUCTIONS and operand is not None:
        groups = tuple(
            g
            for g in (tuple(a for a in d if a in out.partial) for d in reversed(operand.dims))
            if g
        )
    return groups or (tuple(out.partial),)  # a scatter-add: all at once, where it is made


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
