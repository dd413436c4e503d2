"""The stage DP's tables (Alpa's inter-operator dynamic program, jax-free): the best
fold of stage costs over layer suffixes, stage counts and devices, and the trace back of
an optimum to its stages. :func:`autoshard.inter.stages.optimal_stage_plan` fills the
stage-cost tables they read."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def suffix_dp(cost: np.ndarray, sizes: Sequence[int], num_devices: int, combine) -> np.ndarray:
    """``F[s, k, d]``: best ``combine``-fold of stage costs for layers ``k..L-1`` in ``s``
    stages on exactly ``d`` devices; ``cost[s, j, k, i]`` is stage ``[k, i)`` on sub-mesh
    ``j`` when it is the first of ``s`` remaining stages (``inf`` = not allowed)."""
    max_stages, num_layers = cost.shape[0] - 1, cost.shape[2] - 1
    table = np.full((max_stages + 1, num_layers + 1, num_devices + 1), np.inf)
    table[0, num_layers, 0] = 0.0
    if list(sizes) == [1]:  # one sub-mesh of one unit: s stages use exactly s units
        return one_size_dp(cost, table, combine)
    for k in range(num_layers - 1, -1, -1):
        best = np.full((max_stages, num_devices + 1), np.inf)
        rest = table[:-1, k + 1 :, :]  # rest[s-1, i-k-1, d]: the stages after [k, i)
        for j, size in enumerate(sizes):
            if size > num_devices:
                continue
            stage = cost[1:, j, k, k + 1 :, None]
            merged = combine(stage, rest[:, :, : num_devices + 1 - size]).min(axis=1)
            np.minimum(best[:, size:], merged, out=best[:, size:])
        table[1:, k, :] = best
    return table


def one_size_dp(cost: np.ndarray, table: np.ndarray, combine) -> np.ndarray:
    """:func:`suffix_dp` when every stage takes one device unit: ``F[s, k, d]`` is finite
    only at ``d = s``, so the DP runs over ``(s, k)`` (the same values, ``D`` times less work)."""
    max_stages, num_layers = cost.shape[0] - 1, cost.shape[2] - 1
    best = np.full((max_stages + 1, num_layers + 1), np.inf)
    best[0, num_layers] = 0.0
    for k in range(num_layers - 1, -1, -1):
        stage = cost[1:, 0, k, k + 1 :]  # [s - 1, i - k - 1]
        best[1:, k] = combine(stage, best[:-1, k + 1 :]).min(axis=1)
    s = np.arange(min(max_stages, table.shape[2] - 1) + 1)
    table[s, :, s] = best[s, :]
    return table


def stage_counts(table: np.ndarray, num_stages: int | None) -> range:
    return range(1, table.shape[0]) if num_stages is None else range(num_stages, num_stages + 1)


def best_total(table: np.ndarray, num_stages: int | None, num_devices: int) -> tuple[float, int]:
    best = (math.inf, 0)
    for s in stage_counts(table, num_stages):
        best = min(best, (float(table[s, 0, num_devices]), s))
    return best


def trace_back(
    table: np.ndarray, cost: np.ndarray, sizes: Sequence[int], num_stages: int, num_devices: int
) -> list[tuple[int, int, int, int]]:
    """Recover ``(s, j, k, i)`` per stage of a DP optimum (first match in a fixed order)."""
    num_layers = cost.shape[2] - 1
    out, k, d = [], 0, num_devices
    for s in range(num_stages, 0, -1):
        target = table[s, k, d]
        match = next(
            (j, i)
            for j, size in enumerate(sizes)
            if size <= d
            for i in range(k + 1, num_layers + 1)
            if cost[s, j, k, i] + table[s - 1, i, d - size] == target
        )
        out.append((s, match[0], k, match[1]))
        k, d = match[1], d - sizes[match[0]]
    return out
