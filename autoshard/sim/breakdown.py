"""Why a step takes the time it does: the step-time breakdown every simulation reports.

Takes the pieces of a predicted step in seconds; returns a read-only mapping
(``SimulationReport.step_breakdown``) whose values add up to the step time, so a user can
see why a plan is slow. Keys (:data:`STEP_COMPONENTS`, then one ``comm_<axis>`` per mesh
axis that communicates):

* ``compute`` -- GEMMs and memory-bound work of the forward and backward passes on the
  critical path (the slowest pipeline stage, once per micro-batch), recompute excluded;
* ``recompute`` -- what activation recomputation runs again on that path;
* ``comm_model`` / ``comm_data`` / ``comm_pipe`` (and ``comm_reshard``) -- exposed
  communication per mesh axis: nothing is assumed to overlap with compute, so all of it is
  exposed. On Megatron-LM's program: ``model`` is the tensor-parallel collectives,
  ``data`` the gradient all-reduce (and ZeRO's reduce-scatters and all-gathers), ``pipe``
  the point-to-point sends and the tied-embedding all-reduce. On the traced program each
  stage's intra-op communication is split over the logical mesh's axes by each collective's
  seconds (``comm_data`` holds the gradients' data-parallel reductions, which the pipeline
  runtime runs once per micro-batch: it accumulates reduced gradients, where Megatron-LM
  reduces once per step); ``comm_reshard`` is resharding between the layers of a stage
  (:meth:`~autoshard.inter.stage_cost.IntraStageCost.junction`);
* ``pipeline_bubble`` -- the pipeline's fill and drain: (p - 1) / v slowest-stage times on
  Megatron's schedule, the other stages' latencies under Alpa's objective
  ``sum(t) + (m - 1) max(t)``;
* ``optimizer`` -- the optimizer update (memory-bound). On the traced program the update
  equations are amortised into each stage's ``compute`` by the search and are not
  separated (``optimizer`` is 0 there);
* ``offload`` -- host <-> device transfers not hidden behind the backward pass and the
  host's optimizer update, when state lives in host memory (:mod:`autoshard.intra.offload.placement`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

STEP_COMPONENTS = ("compute", "recompute", "pipeline_bubble", "optimizer", "offload")
COMM_PREFIX = "comm_"


def step_breakdown(step_time_s: float, parts: Mapping[str, float]) -> Mapping[str, float]:
    """``parts`` checked (known keys, finite, >= 0, summing to ``step_time_s`` within 1e-9
    relative) and returned read-only, the fixed components first, then ``comm_*``."""
    unknown = [k for k in parts if k not in STEP_COMPONENTS and not k.startswith(COMM_PREFIX)]
    if unknown:
        raise ValueError(f"unknown step component(s) {unknown}; use {STEP_COMPONENTS} or comm_*")
    bad = {k: v for k, v in parts.items() if not math.isfinite(v) or v < -1e-12}
    if bad:
        raise ValueError(f"step components must be finite seconds >= 0, got {bad}")
    total = sum(parts.values())
    if not math.isclose(total, step_time_s, rel_tol=1e-9, abs_tol=1e-15):
        raise ValueError(f"step components add up to {total} s, not the step's {step_time_s} s")
    ordered = {k: max(float(parts.get(k, 0.0)), 0.0) for k in STEP_COMPONENTS}
    ordered.update(
        {k: max(float(v), 0.0) for k, v in sorted(parts.items()) if k.startswith(COMM_PREFIX)}
    )
    return MappingProxyType(ordered)


def split_by_axis(seconds: float, weights: Mapping[str, float]) -> dict[str, float]:
    """``seconds`` of communication split over mesh axes in proportion to ``weights``
    (``comm_<axis>`` keys); all of it on ``comm_reshard`` when no axis has weight."""
    total = sum(weights.values())
    if seconds <= 0:
        return {}
    if total <= 0:
        return {f"{COMM_PREFIX}reshard": seconds}
    return {f"{COMM_PREFIX}{axis}": seconds * w / total for axis, w in weights.items() if w > 0}


def _axis_weights(plan, mesh) -> dict[str, float]:
    """Per mesh axis: predicted collective bytes times that axis's per-byte time (a
    collective over several axes is split evenly over them)."""
    weights: dict[str, float] = {}
    for (_kind, axes), nbytes in plan.collective_totals().items():
        axes = tuple(axes) or ()
        for axis in axes:
            _alpha, beta = mesh.link(axis)
            weights[axis] = weights.get(axis, 0.0) + nbytes * beta / len(axes)
    return weights


def pipeline_step_breakdown(cost, stages, num_microbatches: int, step_time_s: float):
    """The step breakdown of a pipeline priced by the search's stage costs.

    ``cost``: the :class:`~autoshard.inter.stage_cost.IntraStageCost` the stages were
    priced with; ``stages``: ``(start, end, logical_mesh, recompute_mode, latency_s)`` per
    stage, optionally with the stage's offload placement last (then priced by
    ``cost.cost_of(placement)``, as the stage DP priced it) and then its gradient
    reduction (``"step"``: its replicas' units, from ``cost.replica_cost``, and their
    once-a-step all-reduces on ``comm_data``); the step is Alpa's ``sum(t) + (m - 1) max(t)``. The slowest stage's time, once
    per micro-batch, is split into compute, recompute and communication per axis from its
    layers' intra-op plans (each unit's ``communication_by_axis``: the update's
    collectives once per step, its gradients' data-parallel reductions once per
    micro-batch, as the pipeline runtime runs them), and the resharding between its
    layers (``cost.junctions_s``, ``comm_reshard``); the other stages' latencies are the
    bubble.
    """
    m = num_microbatches
    slowest = max(range(len(stages)), key=lambda i: stages[i][4])
    start, end, logical, mode, latency, *rest = stages[slowest]
    placement, grad_reduce = (*rest, None, None)[:2]
    if placement is not None:
        cost = cost.cost_of(placement)
    logical = tuple(logical)
    comm: dict[str, float] = {}
    compute = recompute = offload = 0.0
    if grad_reduce == "step":  # replicas of a plan on (1, tp); reduced once a step
        reduce_s = cost.replica_reduce_s(start, end, logical) / m
        if reduce_s > 0:
            comm[f"{COMM_PREFIX}data"] = reduce_s
        # their update sharded over data: less than the replica's units say
        compute -= sum(cost.replica_layer(i, logical).update_saved_s for i in range(start, end)) / m
        cost, logical = cost.replica_cost(logical), (1, logical[1])
    mesh = cost.mesh_for(logical)
    for layer in range(start, end):
        unit = cost.unit(layer, layer + 1, logical)
        compute += unit.compute_s
        offload += unit.offload_s / m  # per step, spread over the micro-batches
        offload += cost.activation_offload_s(layer, logical, mode)  # per micro-batch
        if mode != "none" and cost.recomputes(layer):
            recompute += unit.recompute_s[mode]
        if unit.plan is not None:
            weights = unit.communication_by_axis
            if weights is None:  # a unit made without it: bytes times per-byte time
                weights = _axis_weights(unit.plan, mesh)
            for key, sec in split_by_axis(unit.communication_s, weights).items():
                comm[key] = comm.get(key, 0.0) + sec
    # the junctions between the stage's layers, and anything else its latency holds
    reshard = cost.junctions_s(start, end, logical)
    reshard = max(reshard, latency - compute - recompute - offload - sum(comm.values()))
    if reshard > 1e-9 * latency:  # not the rounding of the subtraction above
        comm[f"{COMM_PREFIX}reshard"] = comm.get(f"{COMM_PREFIX}reshard", 0.0) + reshard
    parts = {"compute": m * compute, "recompute": m * recompute, "offload": m * offload}
    parts.update({k: m * v for k, v in comm.items()})
    parts["pipeline_bubble"] = sum(st[4] for i, st in enumerate(stages) if i != slowest)
    # the slowest stage's latency is the sum of its parts (up to rounding): rescale the
    # rounding away so that the parts add up to the step exactly
    scale = step_time_s / sum(parts.values())
    return step_breakdown(step_time_s, {k: v * scale for k, v in parts.items()})
