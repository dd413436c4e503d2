"""Stage costs from intra-operator plans, and Alpa's full inter-operator search.

Takes a traced training step (:class:`~autoshard.ir.graph.Graph` of forward, backward and
optimizer update, traced at the **microbatch** size), a cluster and a number of
microbatches; returns an :class:`InterPlan`: contiguous layer ranges, each on a sub-mesh
viewed as a ``(dp, tp)`` logical mesh, minimising Alpa's pipeline latency
``sum(t) + (B - 1) max(t)`` (the DP of :mod:`autoshard.inter.stages`).

The stage DP asks for the cost of layers ``[start, end)`` on every logical mesh.  Here a
cost comes from the intra-op ILP (:mod:`autoshard.intra.problem`) run on the range's sub-graph
(:func:`range_subgraph`): its forward, backward and update equations; tensors made
outside the range enter as inputs (kind ``"data"`` for activations and cotangents, the
original kind for parameters and optimizer state).  Equations with no layer (Adam's
shared step count: scalars) belong to no range.  Per microbatch::

    latency_s        = compute: each equation's seconds under its chosen strategy
                       (:func:`autoshard.intra.strategies.strategy_seconds`: on a cluster
                       preset, GEMMs from the device's GEMM table at their per-device
                       shard shape and other equations' bytes over HBM bandwidth, as in
                       the Megatron grid model; FLOPs / (split x peak) otherwise)
                     + communication: alpha-beta seconds of the plan's resharding
    param_bytes      = owned params + their gradients + optimizer state, per device
                       (+ parameters read from a range outside, e.g. a tied embedding)
    activation_bytes = tensors made in the forward and kept for the backward, per device

Both come from one ILP whose objective is compute + communication (the mesh's peak
FLOP/s, :data:`DEFAULT_PEAK_FLOPS` where it has none), so replicated work is not credited
with devices it does not use.  Gradients are accumulated over the ``B`` microbatches and
reduced once per step, so the update equations' compute and the resharding into them
(the gradient all-reduce or reduce-scatter) are scaled by ``1 / B``: the objective is
seconds per microbatch with the once-per-step work spread over the microbatches.
Alpa's tie-breaking constants are left out (they are not seconds).

Identical layers are planned once (``granularity``):

* ``"layer"`` (default): every layer is planned alone and a range costs the sum of its
  layers' plans plus the resharding at each junction between them (the spec one layer's
  plan produces a crossing tensor in versus the spec the next one reads it in).  Layers
  with the same structural signature (primitives, phases, shapes) share one ILP per
  logical mesh, so a GPT needs 3 ILPs (embedding, block, head) per logical mesh whatever
  its depth.  Exact for the junction costs it adds; it cannot choose layouts jointly
  across a junction, which the ILP of a whole range could.
* ``"range"``: every distinct range (sequence of layer signatures) is planned as one
  sub-graph; ``share_layers`` keeps a k-block ILP as small as a 1-block one, but the
  number of ILPs grows with the number of distinct ranges (about 4 x depth).

Everything uses abstract shapes: no parameter is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh, uniform_mesh
from autoshard.inter.stages import (
    NO_RECOMPUTE,
    RECOMPUTE_MODES,
    StageCost,
    StagePlan,
    cost_stage_choices,
    equal_flops_stages,
    equal_layer_stages,
    logical_mesh_shapes,
    optimal_stage_plan,
    place_submeshes,
    submesh_shapes,
)
from autoshard.intra.cost import CostOptions, reshard
from autoshard.intra.ilp import InfeasibleProblemError, solve
from autoshard.intra.memory import mesh_intervals
from autoshard.intra.problem import build_problem, plan_from_solution
from autoshard.ir.graph import Graph, build_graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.records import EqnRecord, TensorRecord, TraceRecords
from autoshard.ir.spec import ShardingSpec

DEFAULT_PEAK_FLOPS = 100e12  # FLOP/s per device when the mesh has no finite peak
LOGICAL_AXES = ("data", "model")
STAGE_METHODS = ("auto", "equal-layer", "equal-flops")
GRANULARITIES = ("layer", "range")
# Without a cluster preset: an abstract cluster with round link figures (bytes/s, s).
DEFAULT_INTRA_HOST = (100e9, 5e-6)
DEFAULT_INTER_HOST = (12.5e9, 10e-6)
_NO_TIES = CostOptions(tie_breakers=False)
Shape2 = tuple[int, int]


# ----------------------------------------------------------------------------- sub-graphs


@dataclass(frozen=True)
class RangeGraph:
    """The sub-graph of layers ``[start, end)`` and where its pieces come from."""

    graph: Graph
    start: int
    end: int
    node_ids: tuple[int, ...]  # original node index of each sub-graph node
    tensor_ids: tuple[int, ...]  # original tensor id of each sub-graph tensor
    boundary_inputs: tuple[int, ...]  # original ids of tensors made outside, now inputs


def range_subgraph(graph: Graph, start: int, end: int) -> RangeGraph:
    """Forward, backward and update equations of layers ``[start, end)`` as a Graph.

    Inputs: program inputs the range reads or updates (kinds kept) and tensors made by
    equations outside the range (kind ``"data"``).  Outputs: what the range makes that
    the rest of the program reads, and program outputs made in the range.  Aliases: the
    range's state and its updates.
    """
    if not 0 <= start < end <= len(graph.layers):
        raise ValueError(
            f"layer range [{start}, {end}) is not a non-empty range of the "
            f"{len(graph.layers)} layers {list(graph.layers)}"
        )
    in_range = set(graph.layers[start:end])
    nodes = [n for n in graph.nodes if n.layer in in_range]
    chosen = {n.index for n in nodes}
    made = {t for n in nodes for t in n.outputs}
    alias_of = {dst: src for src, dst in graph.aliases if dst in made}
    program_inputs = set(graph.inputs)
    read = {t for n in nodes for t in n.inputs} | set(alias_of.values())
    inputs = [t for t in graph.inputs if t in read]
    boundary = sorted(
        t
        for t in read
        if t not in made
        and t not in program_inputs
        and graph.tensors[t].kind not in ("literal", "const")
    )
    inputs += boundary
    program_outputs = set(graph.outputs)
    outputs = [
        t
        for t in sorted(made)
        if t in program_outputs or any(c not in chosen for c in graph.tensors[t].consumers)
    ]
    # renumber tensors densely, in order of first mention
    order: dict[int, int] = {}
    for t in inputs:
        order.setdefault(t, len(order))
    for n in nodes:
        for t in (*n.inputs, *n.outputs):
            order.setdefault(t, len(order))
    boundary_set = set(boundary)
    tensors = []
    for old, new in order.items():
        t = graph.tensors[old]
        kind = "data" if old in boundary_set else t.kind
        tensors.append(TensorRecord(new, t.shape, t.dtype, kind, t.path))
    eqns = tuple(
        EqnRecord(
            i,
            n.primitive,
            tuple(order[t] for t in n.inputs),
            tuple(order[t] for t in n.outputs),
            n.params,
            n.layer,
            n.phase,
            n.module_path,
        )
        for i, n in enumerate(nodes)
    )
    records = TraceRecords(
        tensors=tuple(tensors),
        eqns=eqns,
        inputs=tuple(order[t] for t in inputs),
        outputs=tuple(order[t] for t in outputs),
        aliases=tuple((order[src], order[dst]) for dst, src in alias_of.items()),
        layers=graph.layers[start:end],
    )
    return RangeGraph(
        build_graph(records),
        start,
        end,
        tuple(n.index for n in nodes),
        tuple(order),
        tuple(boundary),
    )


def layer_signatures(graph: Graph) -> tuple[int, ...]:
    """Per layer, a small id shared by layers with the same equations (primitive, phase,
    operand and result shapes and dtypes, in order): layers that plan identically."""
    by_layer: dict[str, list] = {name: [] for name in graph.layers}
    for n in graph.nodes:
        if n.layer in by_layer:
            by_layer[n.layer].append(
                (
                    n.primitive,
                    n.phase,
                    tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.inputs),
                    tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in n.outputs),
                )
            )
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(tuple(by_layer[name]), len(ids)) for name in graph.layers)


# ----------------------------------------------------------------------------- unit plans


@dataclass(frozen=True)
class UnitCost:
    """One planned sub-graph (a layer or a range) on one logical mesh."""

    plan: ParallelPlan | None  # None: the ILP found no finite plan
    flops: float
    compute_s: float
    communication_s: float
    owned_state_bytes: float  # params + gradients + optimizer state the unit updates
    borrowed_param_bytes: Mapping[int, float]  # owner layer index -> bytes read from it
    activation_bytes: float
    # per recompute mode: seconds it adds per microbatch, activation bytes it keeps
    recompute_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    kept_activation_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)


def is_attention_sized(shape: tuple[int, ...]) -> bool:
    """A ``[batch, heads, s, s]`` tensor: attention scores, probabilities, their masks."""
    return len(shape) == 4 and shape[-1] == shape[-2] > 1


@dataclass(frozen=True)
class StageSpecs:
    """The intra-op plan of one stage, on the ids of the whole step's graph.

    ``tensor_specs``: node output id -> spec, for every equation of the stage's layers
    (forward, backward, update).  ``input_specs``: id -> spec of what the layers read from
    outside their own plan (parameters, optimizer state, batch leaves, activations and
    cotangents of other layers); where several layers read one tensor, the first one's
    spec.  ``operand_specs``: node index -> operand position -> the spec the plan reads it
    in, where that differs from the producer's.  All on the logical mesh ``logical_mesh``
    with axes :data:`LOGICAL_AXES`.
    """

    logical_mesh: Shape2
    tensor_specs: Mapping[int, ShardingSpec]
    input_specs: Mapping[int, ShardingSpec]
    operand_specs: Mapping[int, Mapping[int, ShardingSpec]]


def _spec_fraction(spec: ShardingSpec, mesh: DeviceMesh) -> float:
    return spec.shard_fraction(mesh.mesh)


def activation_bytes_of(graph: Graph, spec_of: Mapping[int, ShardingSpec], mesh) -> float:
    """Per-device bytes of buffers live across the forward -> backward boundary: made (or
    received) before the last forward equation and still read after it."""
    return sum(kept_activations(graph, spec_of, mesh).values())


def kept_activations(graph: Graph, spec_of: Mapping[int, ShardingSpec], mesh) -> dict[int, float]:
    """Tensor id -> per-device bytes of each buffer :func:`activation_bytes_of` counts."""
    forward = [n.index for n in graph.nodes if n.phase == "forward"]
    if not forward:
        return {}
    boundary = max(forward)
    kept: dict[int, float] = {}
    for tid, (first, last) in mesh_intervals(graph, mesh).items():
        t = graph.tensors[tid]
        if t.kind in ("param", "opt_state") or tid not in spec_of:
            continue
        if t.producer is None:  # an input: kept when the forward reads it and a later op too
            reads = list(t.consumers)
            keep = (
                any(graph.nodes[c].phase == "forward" for c in reads)
                and max(reads, default=-1) > boundary
            )
        else:
            keep = first <= boundary < last and graph.nodes[t.producer].phase == "forward"
        if keep:
            kept[tid] = t.nbytes * _spec_fraction(spec_of[tid], mesh)
    return kept


def recompute_costs(graph: Graph, ip, solution, kept: Mapping[int, float]):
    """Per recompute mode, (seconds added per microbatch, activation bytes kept).

    * ``none``: nothing added; every kept buffer.
    * ``selective`` (Korthikanti et al.): the attention core is recomputed -- the forward
      equations that make or read attention-sized tensors (:func:`is_attention_sized`:
      Q K^T, softmax, dropout, P V) -- and its buffers are not kept.
    * ``full``: the whole forward (equations at their chosen strategies, plus the
      resharding into them) runs again; only the unit's inputs (the layer input) are kept.
    """
    forward = {n.index for n in graph.nodes if n.phase == "forward"}
    chosen = [
        ip.strategies[ip.node_of(n.index)][solution.strategy[ip.node_of(n.index)]]
        for n in graph.nodes
    ]
    forward_s = sum(chosen[i].compute_cost for i in forward)
    for edge, operand in zip(ip.problem.edges, ip.operands, strict=True):
        if operand.dst >= ip.num_inputs and operand.dst - ip.num_inputs in forward:
            forward_s += edge.costs[solution.strategy[edge.src]][solution.strategy[edge.dst]]
    attention = [
        n.index
        for n in graph.nodes
        if n.index in forward
        and any(is_attention_sized(graph.tensors[t].shape) for t in (*n.inputs, *n.outputs))
    ]
    selective_s = sum(chosen[i].compute_cost for i in attention)
    total = sum(kept.values())
    attention_bytes = sum(b for t, b in kept.items() if is_attention_sized(graph.tensors[t].shape))
    inputs_bytes = sum(b for t, b in kept.items() if graph.tensors[t].producer is None)
    seconds = {"none": 0.0, "selective": selective_s, "full": forward_s}
    kept_bytes = {"none": total, "selective": total - attention_bytes, "full": inputs_bytes}
    return seconds, kept_bytes


def param_owner_layers(graph: Graph) -> dict[int, int]:
    """State input tensor id -> index of the layer whose update equations write it."""
    producer_layer = {}
    for src, dst in graph.aliases:
        p = graph.tensors[dst].producer
        if p is not None and graph.nodes[p].layer in graph.layers:
            producer_layer[src] = graph.layers.index(graph.nodes[p].layer)
    return producer_layer


def _amortise_update(ip, factor: float):
    """The ILP with the optimizer update's costs scaled by ``factor`` (= 1 / microbatches).

    Gradients are accumulated over microbatches; the reduction (the resharding into the
    update equations) and the update itself run once per step.  Scaling their compute
    costs and the costs of edges into them makes the objective seconds per microbatch.
    """
    if factor == 1.0:
        return ip.problem
    update = {ip.node_of(n.index) for n in ip.graph.nodes if n.phase == "update"}
    edges = tuple(
        dataclasses.replace(e, costs=tuple(tuple(c * factor for c in row) for row in e.costs))
        if e.dst in update
        else e
        for e in ip.problem.edges
    )
    node_costs = tuple(
        tuple(c * factor for c in row) if i in update else row
        for i, row in enumerate(ip.problem.node_costs)
    )
    return dataclasses.replace(ip.problem, edges=edges, node_costs=node_costs)


# ----------------------------------------------------------------------------- cost model


class IntraStageCost:
    """``stage_cost(start, end, submesh, logical) -> StageCost`` backed by intra-op ILPs.

    Memoised by structural signature (see the module docstring); ``num_ilps``,
    ``num_cache_hits`` and ``ilp_seconds`` say what the ILPs cost, ``seconds`` the time
    spent in this callback in all.
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
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.graph = graph
        self.mesh_for = mesh_for
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.granularity = granularity
        self.num_microbatches = num_microbatches
        self.signatures = layer_signatures(graph)
        self.owners = param_owner_layers(graph)
        self.num_ilps = 0
        self.num_cache_hits = 0
        self.ilp_seconds = 0.0
        self.seconds = 0.0
        self._units: dict[tuple, UnitCost] = {}
        self._subgraphs: dict[tuple[int, int], RangeGraph] = {}
        self._junctions: dict[tuple, float] = {}
        self._tables: dict[Shape2, tuple] = {}
        # the same ILP from two logical meshes (1 x n and n x 1 give identical programs
        # with the axes renamed): solved once, the strategy indices carry over
        self._solutions: dict = {}
        self._crossings = self._crossing_pairs()

    # -- helpers
    def subgraph(self, start: int, end: int) -> RangeGraph:
        if (start, end) not in self._subgraphs:
            self._subgraphs[start, end] = range_subgraph(self.graph, start, end)
        return self._subgraphs[start, end]

    def _crossing_pairs(self) -> tuple[tuple[int, int], ...]:
        """(producer layer, consumer layer) pairs that pass a tensor, as layer indices."""
        index = {name: i for i, name in enumerate(self.graph.layers)}
        pairs = set()
        for n in self.graph.nodes:
            if n.layer not in index:
                continue
            for t in n.inputs:
                p = self.graph.tensors[t].producer
                if p is not None and self.graph.nodes[p].layer in index:
                    a, b = index[self.graph.nodes[p].layer], index[n.layer]
                    if a != b:
                        pairs.add((a, b))
        return tuple(sorted(pairs))

    def unit(self, start: int, end: int, logical: Shape2) -> UnitCost:
        """The plan of ``[start, end)`` on ``logical``, or of an identical range's."""
        mesh = self.mesh_for(logical)
        key = (tuple(self.signatures[start:end]), mesh)
        if key in self._units:
            self.num_cache_hits += 1
            return self._units[key]
        self._units[key] = cost = self._plan_unit(self.subgraph(start, end), mesh)
        return cost

    def _plan_unit(self, rg: RangeGraph, mesh: DeviceMesh) -> UnitCost:
        graph = rg.graph
        if not math.isfinite(mesh.peak_flops):
            mesh = dataclasses.replace(mesh, peak_flops=DEFAULT_PEAK_FLOPS)
        amortise = 1.0 / self.num_microbatches
        t0 = time.perf_counter()
        self.num_ilps += 1
        try:
            ip = build_problem(graph, mesh, options=_NO_TIES)
            problem = _amortise_update(ip, amortise)
            solution = self._solutions.get(problem)
            if solution is None:
                solution = solve(problem, solver=self.solver, time_limit_s=self.time_limit_s)
                self._solutions[problem] = solution
            else:
                self.num_ilps -= 1  # counted as a cache hit, not an ILP
                self.num_cache_hits += 1
        except InfeasibleProblemError:
            self.ilp_seconds += time.perf_counter() - t0
            return UnitCost(None, graph.flops, math.inf, math.inf, 0.0, {}, 0.0)
        plan = plan_from_solution(ip, solution, name="stage")
        self.ilp_seconds += time.perf_counter() - t0
        compute = sum(
            ip.strategies[ip.node_of(n.index)][solution.strategy[ip.node_of(n.index)]].compute_cost
            * (amortise if n.phase == "update" else 1.0)
            for n in graph.nodes
        )
        kept = kept_activations(graph, plan.specs_by_tensor(graph.inputs), mesh)
        recompute_s, kept_bytes = recompute_costs(graph, ip, solution, kept)
        aliased = {src for src, _ in graph.aliases}
        owned = 0.0
        borrowed: dict[int, float] = {}
        for tid, spec in zip(graph.inputs, plan.input_specs):
            t = graph.tensors[tid]
            if t.kind not in ("param", "opt_state"):
                continue
            size = t.nbytes * _spec_fraction(spec, mesh)
            if tid in aliased:
                owned += size * (2 if t.kind == "param" else 1)  # a param's gradient too
            else:
                owner = self.owners.get(rg.tensor_ids[tid], -1)
                borrowed[owner] = borrowed.get(owner, 0.0) + size
        return UnitCost(
            plan,
            graph.flops,
            compute,
            max(solution.objective - compute, 0.0),
            owned,
            borrowed,
            sum(kept.values()),
            recompute_s,
            kept_bytes,
        )

    def junction(self, a: int, b: int, logical: Shape2) -> float:
        """Seconds to reshard what layer ``a``'s plan sends layer ``b``'s plan."""
        mesh = self.mesh_for(logical)
        key = (self.signatures[a], self.signatures[b], b - a, mesh)
        if key not in self._junctions:
            ua, ub = self.unit(a, a + 1, logical), self.unit(b, b + 1, logical)
            ga, gb = self.subgraph(a, a + 1), self.subgraph(b, b + 1)
            cost = 0.0
            if ua.plan is None or ub.plan is None:
                cost = math.inf
            else:
                out_pos = {ga.tensor_ids[t]: k for k, t in enumerate(ga.graph.outputs)}
                for k, tid in enumerate(gb.graph.inputs):
                    orig = gb.tensor_ids[tid]
                    if orig in out_pos:
                        t = gb.graph.tensors[tid]
                        src = ua.plan.output_specs[out_pos[orig]]
                        dst = ub.plan.input_specs[k]
                        item = max(t.nbytes // max(t.size, 1), 1)
                        cost += reshard(src, dst, t.shape, item, mesh, _NO_TIES).cost
            self._junctions[key] = cost
        return self._junctions[key]

    def stage_specs(self, start: int, end: int, logical: Shape2) -> StageSpecs:
        """The plan of layers ``[start, end)`` on ``logical``, mapped to the graph's ids.

        With ``granularity="layer"`` it is the union of the layers' own plans (a plan made
        for an identical layer is applied to this one position by position); with
        ``"range"`` the range's plan.  Raises if the range has no finite plan there.
        """
        logical = tuple(logical)
        if self.granularity == "range":
            pieces = [(self.unit(start, end, logical), self.subgraph(start, end))]
        else:
            pieces = [
                (self.unit(i, i + 1, logical), self.subgraph(i, i + 1)) for i in range(start, end)
            ]
        tensor_specs: dict[int, ShardingSpec] = {}
        input_specs: dict[int, ShardingSpec] = {}
        operand_specs: dict[int, dict[int, ShardingSpec]] = {}
        for unit, rg in pieces:
            if unit.plan is None:
                raise ValueError(
                    f"layers {list(self.graph.layers[start:end])} have no finite intra-op plan "
                    f"on the logical mesh {logical}"
                )
            plan, g = unit.plan, rg.graph
            if len(plan.input_specs) != len(g.inputs) or len(plan.node_strategies) != len(g.nodes):
                raise AssertionError(f"the plan reused for layers [{rg.start}, {rg.end}) differs")
            for tid, spec in zip(g.inputs, plan.input_specs, strict=True):
                input_specs.setdefault(rg.tensor_ids[tid], spec)
            for tid, spec in plan.tensor_specs.items():
                tensor_specs[rg.tensor_ids[tid]] = spec
            for node, ops in plan.operand_specs.items():
                operand_specs[rg.node_ids[node]] = dict(ops)
        mesh = self.mesh_for(logical).mesh
        for tid, spec in (*input_specs.items(), *tensor_specs.items()):
            spec.validate(mesh, self.graph.tensors[tid].shape)  # a reused plan must fit
        return StageSpecs(logical, tensor_specs, input_specs, operand_specs)

    # -- the callback
    def recomputes(self, layer: int) -> bool:
        """Recompute applies to the inner layers (transformer blocks), not to the first
        (embedding) and last (head, loss: Megatron never recomputes the logits)."""
        return 0 < layer < len(self.graph.layers) - 1

    @staticmethod
    def _mode_terms(u: UnitCost, mode: str, recomputed: bool) -> tuple[float, float, float]:
        """(latency, kept activation bytes, working bytes) of one unit under ``mode``."""
        latency = u.compute_s + u.communication_s
        if mode == "none" or not recomputed or not math.isfinite(latency):
            return latency, u.activation_bytes, 0.0
        working = u.activation_bytes if mode == "full" else 0.0
        return latency + u.recompute_s[mode], u.kept_activation_bytes[mode], working

    def _layer_table(self, logical: Shape2, mode: str) -> tuple:
        """Per layer: (latency, owned bytes, kept activation bytes, working bytes,
        borrowed) under ``mode``; per crossing pair: junction seconds.  Built once per
        logical mesh and mode."""
        if (logical, mode) not in self._tables:
            units = [self.unit(i, i + 1, logical) for i in range(len(self.graph.layers))]
            crossings = [(a, b, self.junction(a, b, logical)) for a, b in self._crossings]
            terms = [self._mode_terms(u, mode, self.recomputes(i)) for i, u in enumerate(units)]
            self._tables[logical, mode] = (
                [t[0] for t in terms],
                [u.owned_state_bytes for u in units],
                [t[1] for t in terms],
                [t[2] for t in terms],
                [dict(u.borrowed_param_bytes) for u in units],
                crossings,
            )
        return self._tables[logical, mode]

    def range_cost(self, start: int, end: int, logical: Shape2, mode: str = "none") -> StageCost:
        """Latency and memory of layers ``[start, end)`` on ``logical`` (one microbatch)
        with recompute ``mode`` in its inner layers (see :meth:`recomputes`)."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
        if self.granularity == "range":
            u = self.unit(start, end, logical)
            inner = any(self.recomputes(i) for i in range(start, end))
            latency, act, working = self._mode_terms(u, mode, inner)
            owned = u.owned_state_bytes
            borrowed_list = [dict(u.borrowed_param_bytes)]
        else:
            lat, own, acts, work, borrowed_list, crossings = self._layer_table(logical, mode)
            latency = sum(lat[start:end]) + sum(
                c for a, b, c in crossings if start <= a < end and start <= b < end
            )
            owned, act = sum(own[start:end]), sum(acts[start:end])
            working = max(work[start:end])
            borrowed_list = borrowed_list[start:end]
        if not math.isfinite(latency):
            return StageCost(math.inf, 0.0, 0.0)
        borrowed: dict[int, float] = {}
        for items in borrowed_list:
            for owner, size in items.items():
                if not start <= owner < end:
                    borrowed[owner] = max(borrowed.get(owner, 0.0), size)
        return StageCost(latency, owned + sum(borrowed.values()), act, working)

    def __call__(
        self, start: int, end: int, submesh: Shape2, logical: Shape2, recompute: str = "none"
    ) -> StageCost:
        t0 = time.perf_counter()
        try:
            return self.range_cost(start, end, tuple(logical), recompute)
        finally:
            self.seconds += time.perf_counter() - t0


# ----------------------------------------------------------------------------- meshes


def cluster_for(cluster, num_hosts: int, devices_per_host: int):
    """A :class:`~autoshard.hardware.clusters.Cluster` of ``num_hosts x devices_per_host``.

    ``cluster``: a preset name, a preset file path, a Cluster, or None for an abstract
    cluster (:data:`DEFAULT_INTRA_HOST` / :data:`DEFAULT_INTER_HOST` links,
    :data:`DEFAULT_PEAK_FLOPS`, unbounded memory).
    """
    from types import MappingProxyType

    from autoshard.hardware.clusters import Cluster, DeviceSpec, LinkSpec, load_cluster

    if cluster is None:
        return Cluster(
            "abstract",
            DeviceSpec(
                "abstract",
                MappingProxyType({"fp32": DEFAULT_PEAK_FLOPS}),
                math.inf,
                math.inf,
                "fp32",
            ),
            devices_per_host,
            num_hosts,
            LinkSpec("intra-host", *DEFAULT_INTRA_HOST),
            LinkSpec("inter-host", *DEFAULT_INTER_HOST),
        )
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    return dataclasses.replace(
        cluster, devices_per_node=devices_per_host, num_nodes=num_hosts, max_nodes=None
    )


def logical_mesh_costs(cluster, dtype: str | None = None):
    """``logical (dp, tp) -> DeviceMesh`` on ``cluster`` (memoised; a frozen mesh per shape).

    On a preset whose device names a GEMM table the meshes time GEMMs with it and charge
    memory-bound operations their bytes over HBM bandwidth: the compute model of
    :mod:`autoshard.sim.megatron`.  The abstract cluster keeps FLOPs at peak.
    """
    from autoshard.hardware.gemm import GemmTable
    from autoshard.hardware.mesh import to_device_mesh

    cache: dict[Shape2, DeviceMesh] = {}
    table = None
    if cluster.name != "abstract" and cluster.device.gemm_table is not None:
        table = GemmTable.load(cluster.device.gemm_table)

    def mesh_for(logical: Shape2) -> DeviceMesh:
        if logical not in cache:
            if cluster.name == "abstract":
                from autoshard.hardware.clusters import cluster_mesh_costs

                alpha, beta = cluster_mesh_costs(cluster, logical, LOGICAL_AXES)
                cache[logical] = uniform_mesh(logical, LOGICAL_AXES, alpha, beta)
            else:
                cache[logical] = to_device_mesh(cluster, logical, LOGICAL_AXES, dtype, table)
        return cache[logical]

    return mesh_for


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class InterStage:
    """One pipeline stage: its layers, sub-mesh, logical mesh and predicted costs."""

    layers: tuple[str, ...]
    start_layer: int
    end_layer: int
    submesh: Shape2
    logical_mesh: Shape2
    device_ids: tuple[int, ...]
    latency_s: float  # one microbatch, forward + backward (+ update, amortised once)
    peak_bytes: float  # per device, with the schedule's microbatches in flight
    recompute: str = "none"  # activation recompute of its inner layers


@dataclass(frozen=True)
class InterPlan:
    """The chosen pipeline: stages, Alpa's latency objective and what the search cost."""

    model: str
    stages: tuple[InterStage, ...]
    objective_s: float
    search_seconds: float
    phase_seconds: Mapping[str, float]  # "trace", "intra_op_ilps", "stage_dp"
    num_ilps: int
    num_cache_hits: int
    num_microbatches: int
    schedule: str
    method: str
    granularity: str
    stage_plan: StagePlan
    stage_specs: tuple[StageSpecs, ...] = ()  # each stage's intra-op plan

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "stages": [
                {
                    "layers": list(s.layers),
                    "start_layer": s.start_layer,
                    "end_layer": s.end_layer,
                    "submesh": list(s.submesh),
                    "logical_mesh": list(s.logical_mesh),
                    "device_ids": list(s.device_ids),
                    "latency_s": s.latency_s,
                    "peak_bytes": s.peak_bytes,
                    "recompute": s.recompute,
                }
                for s in self.stages
            ],
            "objective_s": self.objective_s,
            "search_seconds": self.search_seconds,
            "phase_seconds": dict(self.phase_seconds),
            "num_ilps": self.num_ilps,
            "num_cache_hits": self.num_cache_hits,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "method": self.method,
            "granularity": self.granularity,
        }


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def trace_microbatch(workload, num_microbatches: int, optimizer: str = "adamw", **overrides):
    """Trace ``workload`` (a preset name or a Workload) at the microbatch size.

    The global batch is the workload's (or ``overrides["batch_size"]``); raises if
    ``num_microbatches`` does not divide it, listing the counts that would.
    """
    from autoshard.api import trace_workload
    from autoshard.models import Workload, get_workload

    if isinstance(workload, Workload):
        cfg = workload.config
        keep = ("seq_len", "vocab_size", "num_layers", "hidden", "dtype")
        base = {k: getattr(cfg, k) for k in keep if hasattr(cfg, k)}
        name = workload.name
    else:
        name, base = str(workload), {}
        cfg = get_workload(name, **overrides).config
    base.update({k: v for k, v in overrides.items() if v is not None})
    batch = int(base.pop("batch_size", None) or cfg.batch_size)
    if batch % num_microbatches:
        fits = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"num_microbatches={num_microbatches} does not divide the global batch size "
            f"{batch}; use one of {fits}"
        )
    return trace_workload(name, optimizer, batch_size=batch // num_microbatches, **base)


def _equal_submesh(num_stages: int, num_hosts: int, devices_per_host: int) -> Shape2:
    n = num_hosts * devices_per_host
    per = n // num_stages
    shape = (1, per) if per <= devices_per_host else (per // devices_per_host, devices_per_host)
    if n % num_stages or shape not in submesh_shapes(num_hosts, devices_per_host):
        ok = [
            s
            for s in range(1, n + 1)
            if n % s == 0
            and (
                (1, n // s)
                if n // s <= devices_per_host
                else (n // s // devices_per_host, devices_per_host)
            )
            in submesh_shapes(num_hosts, devices_per_host)
        ]
        raise ValueError(
            f"{n} devices ({num_hosts}x{devices_per_host}) cannot be split into {num_stages} "
            f"equal sub-meshes of Alpa's shapes {submesh_shapes(num_hosts, devices_per_host)}; "
            f"use num_stages in {ok}, or stages='auto'"
        )
    return shape


def auto_stage_plan(
    workload,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    cluster=None,
    memory_budget_bytes: float | None = None,
    schedule: str = "1f1b",
    stages: str = "auto",
    num_stages: int | None = None,
    solver: str = "highs",
    *,
    time_limit_s: float = 60.0,
    granularity: str = "layer",
    optimizer: str = "adamw",
    recompute_modes: tuple[str, ...] = NO_RECOMPUTE,
    **overrides,
) -> InterPlan:
    """Alpa's inter-operator search with stage costs from intra-op ILPs.

    ``workload``: a preset name (``overrides`` such as ``batch_size`` = the global batch
    apply), a :class:`~autoshard.models.Workload`, or a
    :class:`~autoshard.api.TracedWorkload` already traced at the microbatch size.
    ``cluster``: a preset name (``alpa-v100``, ...), a Cluster, or None (abstract links,
    see :func:`cluster_for`).  ``stages``: ``"auto"`` (the stage DP; any stage count
    unless ``num_stages``), ``"equal-layer"`` or ``"equal-flops"`` (``num_stages`` stages
    on equal sub-meshes, each on its fastest logical mesh).  Raises ``ValueError`` for
    microbatches that do not divide the batch, more stages than layers or devices, and a
    model that fits no stage configuration (with the smallest budget that would).
    ``recompute_modes``: the activation-recompute modes each stage may choose from
    (:meth:`IntraStageCost.range_cost`); the DP takes the fastest that fits the budget.
    """
    from autoshard.api import TracedWorkload

    t_start = time.perf_counter()
    _positive_int("num_microbatches", num_microbatches)
    if isinstance(workload, TracedWorkload):
        traced = workload
    else:
        traced = trace_microbatch(workload, num_microbatches, optimizer, **overrides)
    t_trace = time.perf_counter() - t_start
    plan = search_stages(
        traced.graph,
        num_hosts,
        devices_per_host,
        num_microbatches,
        cluster=cluster,
        memory_budget_bytes=memory_budget_bytes,
        schedule=schedule,
        stages=stages,
        num_stages=num_stages,
        solver=solver,
        time_limit_s=time_limit_s,
        granularity=granularity,
        model=traced.workload.name,
        recompute_modes=recompute_modes,
    )
    return dataclasses.replace(
        plan,
        search_seconds=time.perf_counter() - t_start,
        phase_seconds={**plan.phase_seconds, "trace": t_trace},
    )


def _same_graph(a: Graph, b: Graph) -> bool:
    """Whether two traces of a step are the same program (ids, primitives, shapes)."""
    return (
        a is b
        or a.layers == b.layers
        and len(a.nodes) == len(b.nodes)
        and len(a.tensors) == len(b.tensors)
        and all(x.primitive == y.primitive for x, y in zip(a.nodes, b.nodes))
        and all(x.shape == y.shape for x, y in zip(a.tensors, b.tensors))
    )


def _forced_logical(cost, forced: Mapping[tuple[int, int], Shape2]):
    """``cost`` restricted to one logical mesh per range (``inf`` for the others)."""

    def restricted(start: int, end: int, submesh: Shape2, logical: Shape2, *mode: str) -> StageCost:
        want = forced[(start, end)]
        if tuple(logical) != want:
            return StageCost(math.inf, 0.0, 0.0)
        return cost(start, end, submesh, logical, *mode)

    return restricted


def search_stages(
    graph: Graph,
    num_hosts: int,
    devices_per_host: int,
    num_microbatches: int,
    *,
    cluster=None,
    memory_budget_bytes: float | None = None,
    schedule: str = "1f1b",
    stages: str | Sequence[tuple[int, int]] = "auto",
    num_stages: int | None = None,
    logical_meshes: Sequence[Shape2] | None = None,
    solver: str = "highs",
    time_limit_s: float = 60.0,
    granularity: str = "layer",
    cost: IntraStageCost | None = None,
    model: str = "model",
    recompute_modes: tuple[str, ...] = NO_RECOMPUTE,
) -> InterPlan:
    """The search of :func:`auto_stage_plan` on a step already traced at the microbatch size.

    ``stages`` may also be explicit ``[(start, end), ...]`` layer ranges (equal
    sub-meshes); ``logical_meshes`` then fixes each stage's ``(dp, tp)`` view instead of
    taking the fastest.  ``cost`` reuses an :class:`IntraStageCost` (and its solved ILPs)
    built for the same step.  The returned plan carries each stage's intra-op plan
    (``stage_specs``).
    """
    t_start = time.perf_counter()
    _positive_int("num_hosts", num_hosts)
    _positive_int("devices_per_host", devices_per_host)
    _positive_int("num_microbatches", num_microbatches)
    explicit = not isinstance(stages, str)
    if not explicit and stages not in STAGE_METHODS:
        raise ValueError(
            f"unknown stages={stages!r}; use one of {STAGE_METHODS} or (start, end) layer ranges"
        )
    num_layers, num_devices = len(graph.layers), num_hosts * devices_per_host
    if num_layers == 0:
        raise ValueError("the traced step has no layer tags; nothing to split into stages")
    if explicit:
        ranges = tuple((int(a), int(b)) for a, b in stages)
        if num_stages is not None and num_stages != len(ranges):
            raise ValueError(f"num_stages={num_stages} but {len(ranges)} layer ranges were given")
        num_stages = len(ranges)
    if num_stages is not None:
        _positive_int("num_stages", num_stages)
        if num_stages > num_layers or num_stages > num_devices:
            raise ValueError(
                f"num_stages={num_stages} is impossible: {num_layers} layers "
                f"({', '.join(graph.layers)}) on {num_devices} devices; each stage needs a "
                f"layer and a device, so use 1..{min(num_layers, num_devices)}"
            )
    elif stages != "auto":
        raise ValueError(f"stages={stages!r} needs num_stages")
    if logical_meshes is not None and (not explicit or len(logical_meshes) != num_stages):
        raise ValueError(
            "logical_meshes fixes one (dp, tp) per stage: give it with explicit layer ranges, "
            f"one per range; got {len(logical_meshes)} for stages={stages!r}"
        )

    if cost is None:
        cost = IntraStageCost(
            graph,
            logical_mesh_costs(cluster_for(cluster, num_hosts, devices_per_host)),
            solver=solver,
            time_limit_s=time_limit_s,
            granularity=granularity,
            num_microbatches=num_microbatches,
        )
    elif not _same_graph(cost.graph, graph) or cost.num_microbatches != num_microbatches:
        raise ValueError(
            "the IntraStageCost given was built for another traced step or microbatch count"
        )
    t0 = time.perf_counter()
    seconds_before = cost.seconds
    if stages == "auto":
        plan = optimal_stage_plan(
            num_layers,
            num_hosts,
            devices_per_host,
            cost,
            num_microbatches,
            memory_budget_bytes=memory_budget_bytes,
            schedule=schedule,
            num_stages=num_stages,
            recompute_modes=recompute_modes,
        )
    else:
        submesh = _equal_submesh(num_stages, num_hosts, devices_per_host)
        if stages == "equal-layer":
            ranges = equal_layer_stages(num_layers, num_stages)
        elif stages == "equal-flops":
            layer_flops = [0.0] * num_layers
            for n in graph.nodes:
                if n.layer in graph.layers:
                    layer_flops[graph.layers.index(n.layer)] += n.flops
            ranges = equal_flops_stages(layer_flops, num_stages)
        stage_cost = cost
        if logical_meshes is not None:
            forced = {}
            for r, logical in zip(ranges, logical_meshes, strict=True):
                logical = tuple(int(x) for x in logical)
                if logical not in logical_mesh_shapes(submesh):
                    raise ValueError(
                        f"logical mesh {logical} for layers {r} does not view the sub-mesh "
                        f"{submesh}; use one of {list(logical_mesh_shapes(submesh))}"
                    )
                forced[r] = logical
            stage_cost = _forced_logical(cost, forced)
        plan = cost_stage_choices(
            [(r, submesh) for r in ranges],
            num_layers,
            num_hosts,
            devices_per_host,
            stage_cost,
            num_microbatches,
            memory_budget_bytes=memory_budget_bytes,
            schedule=schedule,
            recompute_modes=recompute_modes,
        )
    t_search = time.perf_counter() - t0
    ilp_seconds = cost.seconds - seconds_before
    ids = place_submeshes([s.submesh_shape for s in plan.stages], num_hosts, devices_per_host)
    out_stages = tuple(
        InterStage(
            graph.layers[s.start_layer : s.end_layer],
            s.start_layer,
            s.end_layer,
            tuple(s.submesh_shape),
            tuple(s.logical_shape),
            tuple(group),
            s.latency_s,
            s.memory_bytes,
            s.recompute,
        )
        for s, group in zip(plan.stages, ids, strict=True)
    )
    phases = {
        "trace": 0.0,
        "intra_op_ilps": ilp_seconds,
        "stage_dp": max(t_search - ilp_seconds, 0.0),
    }
    return InterPlan(
        model=model,
        stages=out_stages,
        objective_s=plan.objective_s,
        search_seconds=time.perf_counter() - t_start,
        phase_seconds=phases,
        num_ilps=cost.num_ilps,
        num_cache_hits=cost.num_cache_hits,
        num_microbatches=num_microbatches,
        schedule=schedule,
        method=stages if not explicit else "manual",
        granularity=cost.granularity,
        stage_plan=plan,
        stage_specs=tuple(
            cost.stage_specs(s.start_layer, s.end_layer, s.logical_shape) for s in plan.stages
        ),
    )


__all__ = [
    "DEFAULT_PEAK_FLOPS",
    "InterPlan",
    "InterStage",
    "IntraStageCost",
    "RangeGraph",
    "StageSpecs",
    "UnitCost",
    "activation_bytes_of",
    "auto_stage_plan",
    "cluster_for",
    "layer_signatures",
    "logical_mesh_costs",
    "range_subgraph",
    "search_stages",
    "trace_microbatch",
]
