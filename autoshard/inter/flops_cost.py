"""A FLOPs-only stage cost: the pipeline's cost model when stages are not planned by ILPs.

:func:`layer_stats` measures one microbatch's forward per layer (FLOPs, parameter bytes,
input activation bytes); :func:`flops_stage_cost` turns that into a stage-cost callback
for :func:`autoshard.inter.stages.optimal_stage_plan` (data parallel stages, no
communication).  Jax-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.inter.stages import StageCost, StageCostFn
from autoshard.ir.graph import flops_of
from autoshard.ir.records import TraceRecords

NOMINAL_PEAK_FLOPS = 100e12  # a placeholder peak for the FLOPs-only cost model


@dataclass(frozen=True)
class LayerStats:
    """Per layer of one microbatch's forward: FLOPs, bytes of parameters first read
    there, and bytes of activations it reads from earlier layers."""

    layers: tuple[str, ...]
    forward_flops: tuple[float, ...]
    param_bytes: tuple[float, ...]
    input_activation_bytes: tuple[float, ...]


def layer_stats(records: TraceRecords) -> LayerStats:
    """FLOPs (graph's rules; unknown primitives count 0) and bytes per layer."""
    layers = records.layers or ("model",)
    index = {name: i for i, name in enumerate(layers)}
    flops = [0.0] * len(layers)
    param_bytes = [0.0] * len(layers)
    act_bytes = [0.0] * len(layers)
    made_in: dict[int, int] = {}
    seen_params: set[int] = set()
    tensors = records.tensors
    for eqn in records.eqns:
        li = index.get(eqn.layer, 0)
        ins = [tensors[t] for t in eqn.inputs]
        flops[li] += flops_of(eqn, ins, [tensors[t] for t in eqn.outputs]) or 0.0
        for t in dict.fromkeys(eqn.inputs):
            if tensors[t].kind == "param" and t not in seen_params:
                seen_params.add(t)
                param_bytes[li] += tensors[t].nbytes
            elif made_in.get(t, li) < li:
                act_bytes[li] += tensors[t].nbytes
        for t in eqn.outputs:
            made_in[t] = li
    return LayerStats(tuple(layers), tuple(flops), tuple(param_bytes), tuple(act_bytes))


def flops_stage_cost(
    stats: LayerStats,
    peak_flops: float = NOMINAL_PEAK_FLOPS,
    state_bytes_per_param_byte: float = 4.0,
) -> StageCostFn:
    """A stage cost for :func:`autoshard.inter.stages.optimal_stage_plan` from FLOPs alone.

    Latency of layers ``[start, end)`` on a sub-mesh of ``n`` devices: forward + backward
    + recompute = ``3 x forward FLOPs / (n x peak_flops)``; no communication.  Memory per
    device: parameters replicated (weights, gradients, two Adam moments:
    ``state_bytes_per_param_byte`` = 4) and, per microbatch in flight, the stage's input
    activations split over data parallelism.  Only the pure data-parallel logical mesh
    ``(n, 1)`` is runnable, as that is what the default runtime layout does; a cost
    backed by the intra-op ILP replaces this function later.
    """

    def cost(start: int, end: int, submesh: tuple[int, int], logical: tuple[int, int]):
        dp, tp = logical
        if tp != 1:
            return StageCost(math.inf, 0.0, 0.0)
        n = submesh[0] * submesh[1]
        latency = 3.0 * sum(stats.forward_flops[start:end]) / (n * peak_flops)
        params = state_bytes_per_param_byte * sum(stats.param_bytes[start:end])
        return StageCost(latency, params, stats.input_activation_bytes[start] / dp)

    return cost
