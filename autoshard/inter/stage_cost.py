"""Stage costs from intra-operator plans: :class:`IntraStageCost`, the search's callback.

The stage DP asks for the cost of layers ``[start, end)`` on every logical mesh.  Here a
cost comes from the intra-op ILP (:mod:`autoshard.intra.problem.build`) run on the range's sub-graph
(:func:`autoshard.inter.subgraph.range_subgraph`): its forward, backward and update equations; tensors made
outside the range enter as inputs (kind ``"data"`` for activations and cotangents, the
original kind for parameters and optimizer state).  Equations with no layer (Adam's
shared step count: scalars) belong to no range.  Per microbatch::

    latency_s        = compute: each equation's seconds under its chosen strategy
                       (:func:`autoshard.intra.rules.strategies.strategy_seconds`: on a cluster
                       preset, GEMMs from the device's GEMM table at their per-device
                       shard shape and other equations' bytes over HBM bandwidth, as in
                       the Megatron grid model; FLOPs / (split x peak) otherwise)
                     + communication: alpha-beta seconds of the plan's resharding
    param_bytes      = owned params + their gradients + optimizer state, per device
                       (+ parameters read from a range outside, e.g. a tied embedding)
    activation_bytes = tensors made in the forward and kept for the backward, per device

Both come from one ILP whose objective is compute + communication (the mesh's peak
FLOP/s, :data:`~autoshard.inter.submesh.DEFAULT_PEAK_FLOPS` where it has none), so replicated work is not credited
with devices it does not use.  The ILP is the per-demand program (a spec two readers of a
value want is paid twice); the unit's communication is its plan's collectives priced once
per value, as XLA compiles them (:func:`~autoshard.inter.unit_cost.communication_by_axis`).  Gradients are accumulated over the ``B`` microbatches and
reduced once per step, so the update equations' compute and the resharding into them
(the gradient all-reduce or reduce-scatter) are scaled by ``1 / B``: the objective is
seconds per microbatch with the once-per-step work spread over the microbatches.
Alpa's tie-breaking constants are left out (they are not seconds).

Identical layers are planned once (``granularity``):

* ``"layer"`` (default): every layer is planned alone and a range costs the sum of its
  layers' plans plus the resharding at each junction between them (from the spec one
  layer's plan produces a crossing tensor in straight to the specs the next one's
  equations read it in, :meth:`IntraStageCost.junction`).  Each layer's ILP prices the
  junctions it can see (:mod:`autoshard.inter.unit_ties`): with an identical neighbour
  (the tensors a block passes the next block are its own outputs) and with the layers
  of other signatures planned before it; an input is otherwise free in any spec.  Layers
  with the same structural signature (primitives, phases, shapes) share one ILP per
  logical mesh, so a GPT needs 3 ILPs (embedding, block, head) per logical mesh whatever
  its depth.  Exact for the junction costs it adds; it cannot choose layouts jointly
  across a junction, which the ILP of a whole range could.
* ``"range"``: every distinct range (sequence of layer signatures) is planned as one
  sub-graph; ``share_layers`` keeps a k-block ILP as small as a 2-block one (identical
  layers tied two at a time, ``layer_period``), but the number of ILPs grows with the
  number of distinct ranges (about 4 x depth).

Everything uses abstract shapes: no parameter is allocated.  Jax-free.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from autoshard.hardware.mesh import DeviceMesh
from autoshard.inter.axis_swap import swap_axes, swappable
from autoshard.inter.folding import crossing_pairs, fold_chain
from autoshard.inter.options import GRANULARITIES
from autoshard.inter.plan import Shape2, StageSpecs
from autoshard.inter.stage_handoffs import LayerHandoffs
from autoshard.inter.stage_memory import (
    amortise_update,
    cast_copies,
    kept_activations,
    recompute_costs,
    unit_state,
)
from autoshard.inter.stage_memory import spec_fraction as _spec_fraction
from autoshard.inter.stage_ranges import RangeCosts
from autoshard.inter.stage_replicas import ReplicaCosts
from autoshard.inter.stage_specs import assemble_stage_specs
from autoshard.inter.stages import GRAD_REDUCES, StageCost
from autoshard.inter.subgraph import (
    RangeGraph,
    RangeIds,
    layer_signatures,
    param_owner_layers,
    range_ids,
    range_subgraph,
)
from autoshard.inter.submesh import DEFAULT_PEAK_FLOPS
from autoshard.inter.unit_cache import UnitCache
from autoshard.inter.unit_cost import (
    UnitCost,
    communication_by_axis,
)
from autoshard.inter.unit_pool import PooledUnits
from autoshard.inter.unit_ties import with_drains, with_feeds, with_ties
from autoshard.intra.cost.resharding import CostOptions
from autoshard.intra.ilp import InfeasibleProblemError, solve
from autoshard.intra.offload.placement import (
    NO_OFFLOAD,
    Offload,
    cast_once_params,
)
from autoshard.intra.problem.build import build_problem, plan_from_solution
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.graph import Graph

_NO_TIES = CostOptions(tie_breakers=False)
_NO_TIES_OPTIONS = IntraOptions(cost=_NO_TIES)  # the stage ILPs price in seconds


class IntraStageCost(RangeCosts, ReplicaCosts, PooledUnits, LayerHandoffs):
    """``stage_cost(start, end, submesh, logical) -> StageCost`` backed by intra-op ILPs.

    Memoised by structural signature (see the module docstring); ``num_ilps``,
    ``num_cache_hits`` and ``ilp_seconds`` say what the ILPs cost, ``seconds`` the time
    spent in this callback in all. ``baseline`` (a name of
    :data:`autoshard.intra.baselines.tables.BASELINES`) pins every range's inputs -- parameters,
    optimizer state, and the activations entering it, as data -- the way that baseline
    does, so a stage costs the baseline's plan (the weak-scaling figure's ZeRO and expert
    parallel baselines); a range the baseline cannot plan costs infinity, and why (the
    baseline's refusal) goes into ``refusals``.
    """

    def __init__(
        self,
        graph: Graph,
        mesh_for: Callable[[Shape2], DeviceMesh],
        *,
        solver: str = "highs",
        time_limit_s: float = 60.0,
        granularity: str = "layer",
        num_microbatches: int = 1,
        baseline: str | None = None,
        deep_layers: int | None = None,
        offload: Offload = NO_OFFLOAD,
        cluster=None,
        replicas: Callable[[int], IntraStageCost] | None = None,
        cast_once: bool = True,
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.graph = graph
        self.mesh_for = mesh_for
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.granularity = granularity
        self.num_microbatches = num_microbatches
        self.baseline = baseline
        if offload and getattr(cluster, "host", None) is None:
            raise ValueError("offload in the stage search needs a cluster with a 'host' section")
        self.offload, self.cluster = offload, cluster
        # dp -> the cost of this step traced at 1/dp of the microbatch, with these
        # microbatches (:meth:`replica_range_cost`); None: no once-a-step reduction priced
        self.replicas = replicas
        # the f32 weights cast to 16 bits once a step, not once per microbatch (the
        # pipeline runtime's default, :func:`~autoshard.intra.offload.placement.
        # cast_once_params`): whole-graph tensor id -> its convert
        self.cast_once = cast_once
        self._cast_once = cast_once_params(graph) if cast_once else {}
        self._replica_layers: dict = {}  # (signature, logical, replica cost) -> ReplicaLayer
        self._replica_couplings: dict = {}  # dp -> row_couplings against its replica trace
        self.owners = param_owner_layers(graph)
        shallow_signatures = layer_signatures(graph)
        self._shallow_signatures = shallow_signatures
        self._ties: dict | None = None  # shallow signature -> self_ties' pairs
        self._feeds: dict = {}  # shallow signature -> unit_ties.feeds' rows
        self._drains: dict = {}  # shallow signature -> unit_ties.drains' rows
        self._planning: set = set()  # unit keys being planned (unit: feeds first)
        self.layer_names: tuple[str, ...] = graph.layers
        self._shallow_names = graph.layers  # the traced layers (folded: fewer)
        self._shallow_of: tuple[int, ...] = tuple(range(len(graph.layers)))
        crossings = crossing_pairs(self.graph)
        self._pair_rep = {pair: pair for pair in crossings}
        self.folded = deep_layers is not None and deep_layers != len(graph.layers)
        if self.folded:
            crossings = self._fold(deep_layers, crossings, shallow_signatures)
        self.num_layers = len(self.layer_names)
        self.signatures = tuple(shallow_signatures[i] for i in self._shallow_of)
        self.num_ilps = 0
        self.num_cache_hits = 0
        self.num_disk_hits = 0  # units read from the on-disk cache (unit_cache)
        self.cache = UnitCache.from_env()
        self._graph_keys: dict[tuple[int, int], str] = {}
        self.ilp_seconds = 0.0
        self.seconds = 0.0
        # why the baseline refused a unit (its pins cannot mean the baseline's name there),
        # once each: the stage DP's "no plan" error quotes them
        self.refusals: list[str] = []
        self._units: dict[tuple, UnitCost] = {}
        self._subgraphs: dict[tuple[int, int], RangeGraph] = {}
        self._nodes_by_layer: dict | None = None  # layer name -> its nodes (_ids)
        self._junctions: dict[tuple, float] = {}
        self._tables: dict[Shape2, tuple] = {}
        # the same ILP from two logical meshes (1 x n and n x 1 give identical programs
        # with the axes renamed): solved once, the strategy indices carry over
        self._solutions: dict = {}
        self._crossings = crossings
        self._crossings_by_high: dict | None = None
        self._borrowers: dict[int, list[int]] = {}
        self._range_keys: dict[tuple[int, int], int] = {}
        self._key_ids: dict[tuple, int] = {}
        self._rep: dict = {}  # signature -> its first layer
        for i, sig in enumerate(self.signatures):
            self._rep.setdefault(sig, i)
        self._owners_of: dict = {}
        self._offloaded: dict = {}  # Offload -> this cost under it (with_offload)
        # with_offload: the cost whose units this one takes (None: it solves its own) and
        # whether it prices its own training state on their plans (_restated)
        self._source: IntraStageCost | None = None
        self._restate = False

    # -- folding a deep chain onto a shallow trace
    def _fold(self, deep_layers: int, crossings, signatures) -> tuple[tuple[int, int], ...]:
        """Make this cost stand for a chain of ``deep_layers`` layers
        (:func:`~autoshard.inter.folding.fold_chain`); returns the deep crossing pairs."""
        if self.granularity != "layer" or self.baseline is not None:
            raise ValueError("a folded stage cost needs granularity='layer' and no baseline")
        self._shallow_of, self.layer_names, self._pair_rep = fold_chain(
            self.graph.layers, crossings, signatures, deep_layers
        )
        return tuple(sorted(self._pair_rep))

    def _deep_owner(self, owner: int) -> int:
        """A shallow owner layer index as a deep one (-1: no layer)."""
        if not self.folded or owner <= 0:
            return owner
        if owner == len(self._shallow_names) - 1:
            return self.num_layers - 1
        raise ValueError(
            f"layer {self._shallow_names[owner]} lends parameters to another: a folded trace "
            "cannot say which deep block would"
        )

    # -- helpers
    def subgraph(self, start: int, end: int) -> RangeGraph:
        """The sub-graph of layers ``[start, end)`` (folded: of one layer, its shallow one)."""
        if self.folded:
            if end != start + 1:
                raise ValueError("a folded stage cost plans one layer at a time")
            start = self._shallow_of[start]
            end = start + 1
        if (start, end) not in self._subgraphs:
            self._subgraphs[start, end] = range_subgraph(self.graph, start, end)
        return self._subgraphs[start, end]

    def _ids(self, start: int, end: int) -> RangeIds:
        """The ids of :meth:`subgraph`'s range without its Graph (a stage's plan maps
        through them; building every layer's Graph for that took a second on gpt-39b)."""
        if (start, end) in self._subgraphs:
            rg = self._subgraphs[start, end]
            return RangeIds(start, end, rg.node_ids, rg.tensor_ids, rg.graph.inputs)
        if self._nodes_by_layer is None:
            self._nodes_by_layer = {name: [] for name in self.graph.layers}
            for n in self.graph.nodes:
                if n.layer in self._nodes_by_layer:
                    self._nodes_by_layer[n.layer].append(n)
        nodes = [n for name in self.graph.layers[start:end] for n in self._nodes_by_layer[name]]
        nodes.sort(key=lambda n: n.index)
        return range_ids(self.graph, start, end, nodes)

    def _shallow_subgraph(self, layer: int) -> RangeGraph:
        if (layer, layer + 1) not in self._subgraphs:
            self._subgraphs[layer, layer + 1] = range_subgraph(self.graph, layer, layer + 1)
        return self._subgraphs[layer, layer + 1]

    def unit(self, start: int, end: int, logical: Shape2) -> UnitCost:
        """The plan of ``[start, end)`` on ``logical``, or of an identical range's (one
        layer: always its signature's first layer's, the representative)."""
        mesh = self.mesh_for(logical)
        key = (tuple(self.signatures[start:end]), mesh)
        if key in self._units:
            self.num_cache_hits += 1
            return self._units[key]
        if self._source is not None:  # a derived cost (with_offload): the source's plan
            unit = self._source.unit(start, end, logical)
            if self._restate and unit.plan is not None:
                unit = self._restated(unit, start, end, mesh)
            self._units[key] = unit
            return unit
        twin = self._twin(logical, mesh)
        if twin is not None:  # (dp, tp) with dp > tp: the (tp, dp) plan, axes swapped
            self._units[key] = cost = swap_axes(self.unit(start, end, twin), mesh)
            return cost
        if end == start + 1:
            start = self._rep[self.signatures[start]]
            end = start + 1
        self._planning.add(key)
        try:
            for producer in self._feeders(self.subgraph(start, end)):
                if ((producer,), mesh) not in self._planning:  # its feeds priced first
                    self.unit(self._rep[producer], self._rep[producer] + 1, logical)
            self._units[key] = cost = self._plan_unit(self.subgraph(start, end), mesh)
        finally:
            self._planning.discard(key)
        return cost

    def _restated(self, unit: UnitCost, start: int, end: int, mesh: DeviceMesh) -> UnitCost:
        """``unit`` (the plain cost's plan of ``[start, end)``) with this cost's training
        state priced on it: resident bytes, transfers, staging and host bytes of a device
        update's placement (its ILP is the plain one: the stage ILPs have no memory
        budget, so leaving the offloaded state out of HBM changes no strategy's price)."""
        if end == start + 1:  # as unit() planned it: the signature's first layer
            start = self._rep[self.signatures[start]]
            end = start + 1
        rg = self.subgraph(start, end)
        owned, borrowed, offload_s, staging, host_bytes = unit_state(
            rg.graph, unit.plan, mesh, self.offload.state, self.cluster, self.num_microbatches,
            lambda tid: self._deep_owner(self.owners.get(rg.tensor_ids[tid], -1)),
            self._cast_once_in(rg),
        )  # fmt: skip
        return dataclasses.replace(
            unit,
            owned_state_bytes=owned,
            borrowed_param_bytes=borrowed,
            offload_s=offload_s,
            staging_bytes=staging,
            host_bytes=host_bytes,
        )

    def _cast_once_in(self, rg: RangeGraph) -> dict[int, int]:
        """Sub-graph parameter id -> its convert node, for the weights of ``rg`` cast
        once a step (the whole graph's rule: one reader in the whole step, not only in
        the range)."""
        if not self._cast_once:
            return {}
        return {
            t: node
            for t, node in cast_once_params(rg.graph).items()
            if rg.tensor_ids[t] in self._cast_once
        }

    def _twin(self, logical: Shape2, mesh: DeviceMesh) -> Shape2 | None:
        """``(tp, dp)`` when ``logical = (dp, tp)`` has ``dp > tp`` and the two meshes
        differ only by which axis has which size: the same links on both axes and one node
        (or no node layout), the same device figures.  The ILP on one is then the ILP on
        the other with the axis names swapped, but for one thing: a dimension split over
        both axes lists its strategies in mesh order, so the two ILPs are not exact mirrors
        and the swapped plan can cost a little more than the ``dp > tp`` mesh's own optimum
        (gpt-2.6b on 1 x 8: +0.15%, docs/results.md); the search trades that for a third
        fewer ILPs.  :meth:`unit` plans the ``dp < tp`` mesh and swaps its plan's axes.
        None otherwise (a baseline or offload pins axes by name)."""
        if self.baseline is not None or self.offload or len(logical) != 2:
            return None
        dp, tp = logical
        if dp <= tp:
            return None
        other = self.mesh_for((tp, dp))
        if not swappable(mesh, other):
            return None
        return (tp, dp)

    def _plan_unit(
        self, rg: RangeGraph, mesh: DeviceMesh, handoffs: tuple | None = None
    ) -> UnitCost:
        """A unit from the on-disk cache (:mod:`autoshard.inter.unit_cache`, when on), else
        :meth:`_solve_unit`'s, then kept there. ``handoffs``: ``(fed specs, drain reads)``
        as :meth:`_fed_specs` and :meth:`_drain_reads` give them, read by the caller from
        the units planned before (a worker process has none of them); None: read here."""
        if handoffs is None:
            handoffs = (self._fed_specs(rg, mesh), self._drain_reads(rg, mesh))
        if self.cache is None or self.baseline is not None:  # a baseline's refusals: solve
            return self._solve_unit(rg, mesh, handoffs)
        owners = tuple(
            self._deep_owner(self.owners.get(rg.tensor_ids[t], -1)) for t in rg.graph.inputs
        )
        settings = (self.solver, self.time_limit_s, self.num_microbatches, self.baseline)
        settings += (self._tie_pairs(rg), repr(handoffs[0]))
        settings += (repr(handoffs[1]),)
        settings += (repr(self.offload), repr(getattr(self.cluster, "host", None)))
        settings += (("cast_once", self.cast_once),)
        if (rg.start, rg.end) not in self._graph_keys:  # one per sub-graph, not per mesh
            self._graph_keys[rg.start, rg.end] = self.cache.key(rg.graph)
        # the mesh by its repr: its GEMM timing keeps memo tables that pickle as they fill
        key = self.cache.key(self._graph_keys[rg.start, rg.end], repr(mesh), owners, settings)
        unit = self.cache.get(key)
        if unit is None:
            unit = self._solve_unit(rg, mesh, handoffs)
            self.cache.put(key, unit)
        else:
            self.num_disk_hits += 1
        return unit

    def _solve_unit(self, rg: RangeGraph, mesh: DeviceMesh, handoffs: tuple) -> UnitCost:
        graph = rg.graph
        fed_specs, drain_reads = handoffs  # (:meth:`_plan_unit`)
        if not math.isfinite(mesh.peak_flops):
            mesh = dataclasses.replace(mesh, peak_flops=DEFAULT_PEAK_FLOPS)
        amortise = 1.0 / self.num_microbatches
        once = self._cast_once_in(rg)  # sub-graph param -> its convert, run once a step
        once_nodes = frozenset(once.values())
        t0 = time.perf_counter()
        self.num_ilps += 1
        try:
            options, pinned = _NO_TIES_OPTIONS, None
            if self.baseline is not None:
                from autoshard.intra.baselines.tables import baseline_inputs, baseline_options

                try:
                    pinned = baseline_inputs(graph, mesh.mesh, self.baseline)
                except ValueError as err:  # e.g. experts the data-parallel axes do not divide
                    if str(err) not in self.refusals:
                        self.refusals.append(str(err))
                    raise InfeasibleProblemError(f"baseline {self.baseline}") from None
                options = baseline_options(options, mesh.mesh, self.baseline)
            if self.offload.state:  # a host update costs the device nothing
                options = options.replace(offload=self.offload.state.classes)
            ip = build_problem(graph, mesh, options, pinned_inputs=pinned)
            ip, _ = with_ties(ip, self._tie_pairs(rg), _NO_TIES)
            ip, _ = with_feeds(ip, fed_specs, _NO_TIES)
            ip, _ = with_drains(ip, drain_reads, _NO_TIES)
            problem = amortise_update(ip, amortise, once_nodes)
            solution = self._solutions.get(problem)
            if solution is None:
                solution = solve(
                    problem, solver=self.solver, time_limit_s=self.time_limit_s, lp_first=True
                )
                self._solutions[problem] = solution
            else:
                self.num_ilps -= 1  # counted as a cache hit, not an ILP
                self.num_cache_hits += 1
        except InfeasibleProblemError:
            self.ilp_seconds += time.perf_counter() - t0
            return UnitCost(None, graph.flops, math.inf, math.inf, 0.0, {}, 0.0)
        plan = plan_from_solution(ip, solution, name="stage")
        self.ilp_seconds += time.perf_counter() - t0
        on_host = self.offload.host_update  # then the host runs the update, not the device
        compute = sum(
            ip.strategies[ip.node_of(n.index)][solution.strategy[ip.node_of(n.index)]].compute_cost
            * (amortise if n.phase == "update" or n.index in once_nodes else 1.0)
            for n in graph.nodes
            if not (on_host and n.phase == "update")
        )
        spec_of = plan.specs_by_tensor(graph.inputs)
        kept = kept_activations(graph, spec_of, mesh, cast_copies(graph, plan, once))
        forward_reads = {t for n in graph.nodes if n.phase == "forward" for t in n.inputs}
        layer_inputs = {  # what full recompute keeps: the activations the forward reads
            tid: graph.tensors[tid].nbytes * _spec_fraction(spec_of[tid], mesh)
            for tid in graph.inputs
            if graph.tensors[tid].kind not in ("param", "opt_state")
            and tid in forward_reads
            and tid in spec_of
        }
        recompute_s, kept_bytes = recompute_costs(
            graph, ip, solution, kept, layer_inputs, once_nodes
        )
        owned, borrowed, offload_s, staging, host_bytes = unit_state(
            graph, plan, mesh, self.offload.state, self.cluster, self.num_microbatches,
            lambda tid: self._deep_owner(self.owners.get(rg.tensor_ids[tid], -1)),
            once,
        )  # fmt: skip
        # the plan's collectives, priced once per value as XLA makes them (not the
        # objective: the per-demand program may pay a value twice); the junctions the ILP
        # priced (ties, feeds, drains) are no value's collectives: the stage's, not the unit's
        by_axis = communication_by_axis(ip, solution.strategy, mesh, amortise, _NO_TIES)
        communication = math.fsum(by_axis.values())
        return UnitCost(
            plan,
            graph.flops,
            compute,
            communication,
            owned,
            borrowed,
            sum(kept.values()),
            recompute_s,
            kept_bytes,
            offload_s,
            staging,
            host_bytes,
            by_axis,
        )

    def stage_specs(self, start: int, end: int, logical: Shape2) -> StageSpecs:
        """The plan of layers ``[start, end)`` on ``logical``, mapped to the graph's ids.

        With ``granularity="layer"`` it is the union of the layers' own plans (a plan made
        for an identical layer is applied to this one position by position); with
        ``"range"`` the range's plan.  Raises if the range has no finite plan there.
        """
        logical = tuple(logical)
        if self.folded:
            raise ValueError(
                "a folded stage cost (deep_layers) has no tensor-level plan of the deep step"
            )
        if self.granularity == "range":
            pieces = [(self.unit(start, end, logical), self._ids(start, end))]
        else:
            pieces = [
                (self.unit(i, i + 1, logical), self._ids(i, i + 1)) for i in range(start, end)
            ]
        return assemble_stage_specs(
            self.graph, pieces, logical, self.mesh_for(logical).mesh, start, end
        )

    # -- the callback: range_key, range_cost and their tables (RangeCosts)
    @property
    def placements(self) -> tuple[str, ...]:
        """The one offload placement every stage of this cost takes (the stage DP's
        ``placements``; :mod:`autoshard.inter.stage_offload` offers several)."""
        return (self.offload.label,)

    def with_offload(self, offload: Offload, cluster=None) -> IntraStageCost:
        """This cost's step, meshes and ILP settings under another placement (one per
        placement, kept: the search asks again for each stage DP it runs). Only a host
        update (``gradients``) solves ILPs of its own (its update equations cost the
        device nothing); a device update takes this cost's plans and prices its state on
        them (:meth:`_restated`), and ``activations`` take the plans of the same placement
        without it (they change the stage's terms, not the plan): no ILP."""
        if not offload:
            if not self.offload:
                return self
            raise ValueError("with_offload(none) of an offloaded cost: use the cost without")
        if self.offload:
            raise ValueError("with_offload is a plain cost's (built without offload)")
        memo = self._offloaded
        if offload not in memo:
            memo[offload] = IntraStageCost(
                self.graph,
                self.mesh_for,
                solver=self.solver,
                time_limit_s=self.time_limit_s,
                granularity=self.granularity,
                num_microbatches=self.num_microbatches,
                baseline=self.baseline,
                deep_layers=self.num_layers if self.folded else None,
                offload=offload,
                cluster=cluster,
                cast_once=self.cast_once,
            )
            derived = memo[offload]
            derived._solutions = self._solutions  # equal ILPs: solved once
            if offload.activations:
                derived._source = self.with_offload(offload.state, cluster)
            elif not offload.host_update:
                derived._source, derived._restate = self, True
        return memo[offload]

    def cost_of(self, placement: str) -> IntraStageCost:
        """The cost of a stage that took ``placement``: this one's own, or one
        :meth:`with_offload` made of this plain cost."""
        if placement == self.offload.label:
            return self
        for offload, cost in self._offloaded.items():
            if offload.label == placement:
                return cost
        raise ValueError(f"this stage cost prices offload {self.offload.label}, not {placement}")

    def __call__(
        self,
        start: int,
        end: int,
        submesh: Shape2,
        logical: Shape2,
        recompute: str = "none",
        placement: str | None = None,
        grad_reduce: str = "microbatch",
    ) -> StageCost:
        if placement is not None and placement != self.offload.label:
            raise ValueError(
                f"this stage cost prices offload {self.offload.label}, not {placement}"
            )
        if grad_reduce not in GRAD_REDUCES:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCES}, got {grad_reduce!r}")
        t0 = time.perf_counter()
        try:
            if grad_reduce == "step":
                return self.replica_range_cost(start, end, tuple(logical), recompute)
            return self.range_cost(start, end, tuple(logical), recompute)
        finally:
            self.seconds += time.perf_counter() - t0
