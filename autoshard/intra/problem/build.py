"""Intra-operator planning: op graph + device mesh -> ILP -> ParallelPlan (jax-free).

Takes a :class:`~autoshard.ir.graph.Graph` and a priced mesh
(:class:`~autoshard.hardware.mesh.DeviceMesh`); builds Alpa's sharding problem (one node
per program input and per equation, strategies from :mod:`autoshard.intra.rules.strategies`,
resharding costs on every edge from :mod:`autoshard.intra.cost.resharding`, memory rows from
:mod:`autoshard.intra.memory.model`), solves it with :mod:`autoshard.intra.ilp` and returns a
:class:`~autoshard.ir.plan.ParallelPlan` with the predicted collectives and peak memory.

Problem-size reductions, all exact with respect to the plans they allow (written by
:mod:`autoshard.intra.problem.ties`; the plan is read off a solution by :mod:`autoshard.intra.problem.predict`):

* followers -- a light op with one array operand (unary elementwise, broadcasts,
  reshapes, transposes, reductions) takes the strategy that matches its operand's;
* identical layers -- every node of a layer whose equations have the same primitives and
  shapes as an earlier layer's shares the variables of the layer ``layer_period`` (2)
  places before it in that run (on by default), so the number of variables does not grow
  with depth and alternating plans stay reachable (``layer_ends``: the first and last layer
  of the run untied, the rest tied among themselves);
* aliases -- a parameter or optimizer-state input and its updated output are forced to
  the same spec (an edge whose other pairs cost infinity).

Pinning input specs (``pinned_inputs``) turns the same machinery into the baselines:
data parallel, ZeRO and Megatron fix the inputs and let the ILP place the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.ilp import (
    EdgeCost,
    ShardingProblem,
    Tie,
    peak_memory,
    solve,
)
from autoshard.intra.ilp.problem import below_bound_error, peak_lower_bound
from autoshard.intra.memory.model import memory_rows, streamed_tensors
from autoshard.intra.offload.placement import Offload, offload_tensors
from autoshard.intra.problem import exact_values as _exact
from autoshard.intra.problem.exact_values import (
    held_warnings,
    hub_share,
    kept_per_demand,
    price_per_value,
    solve_exact,
    unsolved_because,
)
from autoshard.intra.problem.options import (
    DEFAULT_INTRA_OPTIONS,
    IntraOptions,
    solve_time_limit,
)
from autoshard.intra.problem.predict import (
    RELABELS,
    SLICE_PASSES,
    dot_batch_dims,
    plan_from_solution,
    predicted_collectives,
    reduce_steps,
)
from autoshard.intra.problem.records import IntraProblem, Operand, _Common
from autoshard.intra.problem.ties import (
    apply_alpa_options,
    follower_ties,
    keep_data_parallel,
    keep_weight_layout,
    layer_ties,
    preferences,
    shard_largest_dims,
)
from autoshard.intra.problem.value_edges import (
    SliceChain,
    Use,
    Value,
    hub_max_sets,
    value_edges,
)
from autoshard.intra.rules.strategies import Strategy, input_strategies, node_strategies
from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import ShardingSpec

WEIGHT_KINDS = ("param", "opt_state")  # inputs that keep_weight_layout never reshards


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _with_aux_nodes(memory, num_strategies):
    """``memory`` with zero bytes for the nodes that only price values (value_edges)."""
    extra = tuple((0.0,) * k for k in num_strategies)
    return dataclasses.replace(memory, node_memory=memory.node_memory + extra)


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
    exact_values: bool = False,
) -> IntraProblem:
    """Alpa's intra-operator ILP for ``graph`` on ``mesh``, set up by ``options``
    (:class:`~autoshard.intra.problem.options.IntraOptions`: the budget, merging, layer sharing,
    the cost formulas' knobs and Alpa's ``AutoShardingOption`` knobs; the solver settings
    are for :func:`auto_shard_graph`).

    ``pinned_inputs`` maps input positions (index into ``graph.inputs``) to a fixed spec.
    ``copy_buffers``: give the problem the resharded copies (:class:`CopyBuffer`), so that
    its memory rows and ``peak_memory`` count what :func:`predicted_peak_bytes` counts;
    default: only with a budget (without one nothing reads them, and they take a second
    to list on a large graph).
    ``exact_values``: price every value's resharding once, as predicted, with copy and
    resolution nodes (:mod:`autoshard.intra.problem.value_edges`); off, one edge per distinct
    demand on a value (no extra nodes; a spec two independent consumers want is paid twice).
    """
    common = _common(graph, mesh, options, pinned_inputs, followers, copy_buffers)
    return _finish(common, exact_values)


def _common(graph, mesh, options, pinned_inputs, followers, copy_buffers) -> _Common:
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
    # under Megatron-LM's rules a replicated weight's dot (a MoE router, a convolution
    # without a split rule) computes replicated: nothing it splits could be gathered back
    strict_layout = options.keep_weight_layout or options.all_reduce_only
    as_tuple: dict[int, tuple[Strategy, ...]] = {}
    for node in graph.nodes:
        found = node_strategies(
            graph, node, mesh, warned, materialized, node_cache, not strict_layout
        )
        if id(found) not in as_tuple:
            as_tuple[id(found)] = tuple(found)
        strategies.append(as_tuple[id(found)])
        for k, tid in enumerate(node.outputs):
            producer[tid] = (n_in + node.index, k)

    outputs = set(graph.outputs)
    offloaded = None
    if options.offload:  # strict: one mesh's whole step; a stage search's layer may lack one
        offloaded = offload_tensors(graph, Offload(options.offload), strict=False)
    host_update = offloaded is not None and offloaded.offload.host_update
    dead = graph.dead_nodes()  # XLA drops them: no compute, no operand resharded
    node_costs = []
    for i, strats in enumerate(strategies):
        on_host = host_update and i >= n_in and graph.nodes[i - n_in].phase == "update"
        free = on_host or (i >= n_in and i - n_in in dead)  # the host runs the update
        costs = []
        for s in strats:
            c = 0.0 if free else s.compute_cost
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

    # operand edges: every value's resharding priced once (value_edges)
    operands: list[Operand] = []
    uses: dict[int, list[Use]] = {}
    for node in graph.nodes:
        if node.index in dead:
            continue
        dst = n_in + node.index
        for slot, tid in enumerate(node.inputs):
            if tid not in producer:
                continue  # literal or closed-over constant: available everywhere
            operands.append(Operand(producer[tid][0], dst, tid, slot))
            uses.setdefault(tid, []).append(Use(dst, slot))
    values = []
    steps_cache: dict[tuple, tuple] = {}
    for tid, used in uses.items():
        src, k = producer[tid]
        t = graph.tensors[tid]
        key = (id(strategies[src]), src if src >= n_in else -1)
        if key not in steps_cache:
            steps_cache[key] = tuple(
                reduce_steps(graph.nodes[src - n_in], s) if src >= n_in else ()
                for s in strategies[src]
            )
        batch = dot_batch_dims(graph.nodes[src - n_in]) if src >= n_in else ()
        values.append(
            Value(src, k, t.shape, _itemsize(t.dtype), steps_cache[key], tuple(used), batch)
        )
    chains = _slice_chains(graph, strategies, producer, uses, n_in)
    edges: list[EdgeCost] = []
    edge_consumers: list[tuple[int, ...]] = []
    # data-parallel axes (the dp and megatron baselines): a use may not move a split off
    # them; weights kept in place (megatron): no use may reshard a weight, its gradient
    # into the update or its optimizer state -- feasibility edges (0 or infinity) beside
    # the priced per-value edges
    if options.data_parallel_axes or options.keep_weight_layout:
        forbid: dict[tuple, tuple[tuple[float, ...], ...]] = {}
        for op in operands:
            src, k = producer[op.tensor]
            weight = None
            if options.keep_weight_layout:
                if src < n_in and graph.tensors[graph.inputs[src]].kind in WEIGHT_KINDS:
                    weight = True  # read as pinned
                elif graph.nodes[op.dst - n_in].phase == "update":
                    weight = False  # read as made, partial over data at most
            key = (id(strategies[src]), k, id(strategies[op.dst]), op.slot, weight)
            if key not in forbid:
                m = tuple((0.0,) * len(strategies[op.dst]) for _ in strategies[src])
                m = keep_data_parallel(
                    m, strategies[src], k, strategies[op.dst], op.slot,
                    options.data_parallel_axes,
                )  # fmt: skip
                if weight is not None:
                    m = keep_weight_layout(
                        m, strategies[src], k, strategies[op.dst], op.slot, weight,
                        options.data_parallel_axes,
                    )  # fmt: skip
                forbid[key] = m
            if any(math.isinf(c) for row in forbid[key] for c in row):
                edges.append(EdgeCost(src, op.dst, forbid[key]))
                edge_consumers.append(())
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
        edge_consumers.append(())

    ties: list[Tie | None] = [None] * len(strategies)
    if followers:
        follower_ties(
            graph, strategies, producer, n_in, ties, follow_deepest=options.merge_elementwise
        )
    if options.share_layers:
        layer_ties(graph, strategies, n_in, ties, options.layer_period, options.layer_ends)
    notes: tuple[str, ...] = ()
    if options.shard_largest_dim:  # after the ties: only the operators that choose
        notes = shard_largest_dims(graph, strategies, node_costs, n_in, mesh.mesh, ties)

    host = offloaded.host if offloaded is not None else frozenset()
    memory = memory_rows(
        graph, strategies, producer, n_in, mesh, operands if copy_buffers else (), host
    )
    return _Common(
        graph, mesh, options, cost_options, tuple(strategies), n_in, tuple(node_costs),
        tuple(prefs), tuple(operands), tuple(values), tuple(edges), tuple(edge_consumers),
        tuple(ties), memory, notes, host,
        offloaded.staging_bytes if offloaded is not None else 0.0, chains,
    )  # fmt: skip


def _slice_chains(graph, strategies, producer, uses, n_in) -> tuple[SliceChain, ...]:
    """The values some producer strategy makes partial that are read only by a layout op
    (:data:`~autoshard.intra.problem.predict.SLICE_PASSES`, operand 0, every element
    kept) whose result is read by one operand, neither a program output: where the
    reader splits it over the reduced axes XLA reduce-scatters
    (:class:`~autoshard.intra.problem.value_edges.SliceChain`)."""
    outputs = set(graph.outputs)
    out = []
    for tid, used in uses.items():
        src, k = producer[tid]
        if src < n_in or tid in outputs or len(used) != 1 or used[0].slot != 0:
            continue
        node = graph.nodes[used[0].dst - n_in]
        if node.primitive not in SLICE_PASSES or len(node.outputs) != 1:
            continue
        result = node.outputs[0]
        read = uses.get(result, ())
        if result in outputs or len(read) != 1:
            continue
        if math.prod(graph.tensors[result].shape) != math.prod(graph.tensors[tid].shape):
            continue
        if any(s.output_specs[k].partial for s in strategies[src]):
            relabels = node.primitive in RELABELS
            out.append(SliceChain(src, k, used[0].dst, read[0].dst, read[0].slot, relabels))
    return tuple(out)


def _finish(c: _Common, exact_values: bool, per_value: frozenset = frozenset()) -> IntraProblem:
    """The program of ``c`` with its values priced per value (``exact_values``) or per
    demand (:func:`autoshard.intra.problem.value_edges.value_edges`; ``per_value``: the
    indices of values priced per value all the same)."""
    per_value = value_edges(
        list(c.values), c.strategies, c.ties, c.mesh, c.cost_options, exact_values, c.memo,
        c.options.forbidden_collectives(), hub_max_sets(c.mesh), chains=c.chains,
        priced_per_value=per_value,
    )  # fmt: skip
    extra = per_value.num_strategies
    memory = _with_aux_nodes(c.memory, extra)
    problem = ShardingProblem(
        num_strategies=tuple(len(s) for s in c.strategies) + extra,
        node_costs=c.node_costs + tuple((0.0,) * k for k in extra),
        edges=c.edges + per_value.edges,
        ties=c.ties + per_value.ties,
        node_memory=memory.node_memory,
        live_sets=memory.live_sets,
        memory_budget_bytes=_budget_less_staging(c),
        copies=memory.copies,
        preferences=c.prefs + tuple((0.0,) * k for k in extra),
    )
    return IntraProblem(
        c.graph,
        c.mesh,
        problem,
        c.strategies,
        c.operands,
        c.n_in,
        c.edge_consumers + per_value.edge_consumers,
        per_value,
        c.host,
        c.staging_bytes,
    )


def _budget_less_staging(c: _Common) -> float | None:
    """The ILP's budget: the memory budget less the offload's staging buffers (a constant:
    twice the largest streamed tensor, whole, whatever its split)."""
    budget = c.options.memory_budget_bytes
    if budget is None or not c.staging_bytes:
        return budget
    if budget <= c.staging_bytes:
        raise ValueError(
            f"the memory budget ({budget:.4g} B) does not even hold the offload's staging "
            f"buffers ({c.staging_bytes:.4g} B): raise the budget or offload less"
        )
    return budget - c.staging_bytes


def auto_shard_graph(
    graph: Graph,
    mesh: DeviceMesh,
    options: IntraOptions = DEFAULT_INTRA_OPTIONS,
    *,
    pinned_inputs: Mapping[int, ShardingSpec] | None = None,
    name: str = "auto",
    exact_values: bool | None = None,
    refuse_over: float | None = None,
) -> ParallelPlan:
    """Plan ``graph`` on ``mesh`` with the ILP and return the plan with its predictions.

    ``options`` (:class:`~autoshard.intra.problem.options.IntraOptions`) holds every setting: the
    solver, its limits, the memory budget, merging, layer sharing, the cost formulas and
    Alpa's knobs. ``pinned_inputs`` fixes the specs of some inputs (a baseline's).
    ``exact_values``: see :func:`build_problem` (None: ``options.exact_values``).
    ``options.prefer_reduce_scatter`` re-plans with the optimizer state split
    (:func:`autoshard.intra.problem.alpa_passes.prefer_reduce_scatter`).
    ``refuse_over`` (bytes per device): raise InfeasibleBudgetError before any solve when
    every plan provably peaks over it (:func:`~autoshard.intra.ilp.problem.peak_lower_bound`;
    the options' memory budget is checked so anyway) -- for a plan solved without a budget
    that a caller then fits to one.
    """
    from autoshard.intra.problem.alpa_passes import checked_forbidden, prefer_reduce_scatter

    plan = _plan_once(graph, mesh, options, pinned_inputs, name, exact_values, refuse_over)
    if options.prefer_reduce_scatter:

        def replan(pins):
            return _plan_once(graph, mesh, options, pins, name, exact_values, refuse_over)

        plan = prefer_reduce_scatter(
            graph, mesh.mesh, plan, pinned_inputs or {}, replan, options.allow_mixed_mesh_shape
        )
    exact = options.exact_values if exact_values is None else exact_values
    return checked_forbidden(plan, options, exact)


def _plan_once(
    graph, mesh, options, pinned_inputs, name, exact_values, refuse_over=None
) -> ParallelPlan:
    """:func:`auto_shard_graph` without its post-processing: one plan from the ILP."""
    if exact_values is None:
        exact_values = options.exact_values
    memory_budget_bytes = options.memory_budget_bytes
    common = _common(graph, mesh, options, pinned_inputs, True, None)
    for budget in (memory_budget_bytes, refuse_over):  # proven out of reach: no solve
        if budget is not None:
            bound = common.staging_bytes + peak_lower_bound(
                common.memory.node_memory, common.memory.live_sets
            )
            if bound > budget:
                raise below_bound_error(budget, bound)
    budgeted = memory_budget_bytes is not None
    settings = dict(
        solver=options.solver,
        time_limit_s=solve_time_limit(options),
        mip_gap=options.mip_gap,
        seed=options.seed,
        max_nodes=options.max_nodes,
    )
    unsolved = (
        unsolved_because(mesh, options.exact_search, budgeted, solver=options.solver)
        if exact_values
        else None
    )
    with held_warnings() as held:  # until the plan's objective is known
        ip, solution, plan = _solved(common, mesh, options, pinned_inputs, name, exact_values,
                                     settings, budgeted, unsolved)  # fmt: skip
    held.release(plan.objective)
    if memory_budget_bytes is not None and solution is not None:
        rows = peak_memory(ip.problem, solution.strategy) + ip.staging_bytes
        if not math.isclose(rows, plan.predicted_peak_bytes, rel_tol=1e-9, abs_tol=1.0):
            raise RuntimeError(
                f"internal error: the ILP's memory rows give {rows:.6g} B for the plan, the "
                f"prediction {plan.predicted_peak_bytes:.6g} B"
            )
    return plan


def _solved(common, mesh, options, pinned_inputs, name, exact_values, settings, budgeted,
            unsolved):  # fmt: skip
    """:func:`_plan_once`'s solve: (the problem solved, its solution or None where a
    fallback plan stands in, the plan)."""
    lp_only = options.exact_search == "lp"
    if unsolved is not None and not budgeted and common.values:
        # the exact program would only price the per-demand plan: price it without
        # building that program (a third of the planning time outside the solver on
        # gpt-39b 8x8, docs/sharing.md); with a budget its memory rows are needed
        ip = _finish(common, False)
        first = solve(ip.problem, **settings)
        # exact_search="lp" / "auto" solves a small program of several axes after all, and
        # "lp" a larger one whose values hubs mostly price (its LP tight: hub_share)
        wide = hub_max_sets(mesh) > 0 and first.num_variables > _exact.EXACT_MAX_COLUMNS
        unsolved = unsolved_because(
            mesh, options.exact_search, budgeted, first.num_variables, options.solver,
            hub_share(common) if wide else None,
        )  # fmt: skip
        solution = kept_per_demand(
            first, first.strategy, price_per_value(common, first.strategy), unsolved
        )
        if solution is None:  # solved after all, or it needs a forbidden collective
            demand, ip = ip, _finish(common, True)
            cap = _exact.EXACT_WIDE_LP_MAX_ITERATIONS if wide else None
            solution = solve_exact(ip, demand, mesh, settings, None, first, lp_only, cap)
    else:
        ip = _finish(common, exact_values)
        # with a budget, the ILP's memory rows count every buffer predicted_peak_bytes
        # does, resharded copies included (CopyBuffer), so the plan's prediction is its peak
        if ip.values is not None and ip.values.groups:
            solution = solve_exact(
                ip, _finish(common, False), mesh, settings, unsolved, lp_only=lp_only
            )
        else:
            solution = solve(ip.problem, **settings)
    plan = plan_from_solution(ip, solution, name, forbidden=options.forbidden_collectives())
    if common.notes:
        plan = dataclasses.replace(plan, notes=plan.notes + common.notes)
    if solution.fallback is not None and pinned_inputs is None:  # no incumbent: best baseline?
        from autoshard.intra.baselines.fallback import cheapest_fallback

        plan = cheapest_fallback(plan, solution, ip, options, plan_from_solution)
        solution = None
    return ip, solution, plan


__all__ = [
    "IntraProblem",
    "build_problem",
    "plan_from_solution",
    "auto_shard_graph",
    "price_per_value",
    "predicted_collectives",
    "peak_memory",
]
