"""Operator clustering: cut a program-ordered operator list into ``L`` layers (jax-free).

For graphs whose equations carry no layer tags, Alpa groups operators into ``L``
contiguous "layers" before the stage DP.  This module takes

* ``flops``: per-operator FLOPs, in program order (``n`` operators);
* ``cut_bytes``: for each cut ``c`` between operator ``c`` and ``c + 1`` (``n - 1`` cuts),
  the bytes of tensors alive across it.  :func:`crossing_bytes` computes these from
  tensor live ranges ``(first_op, last_op, bytes)``: a tensor made (or first read) at
  ``first_op`` and last read at ``last_op`` crosses cuts ``first_op .. last_op - 1``;

and returns a :class:`LayerClustering` whose layers each carry at most
``(1 + delta) * total_flops / L`` FLOPs and which, among all such partitions, minimises
the largest crossing at a chosen cut, then the sum over the ``L - 1`` chosen cuts.

If no partition meets the ``delta`` balance (one huge operator, say), the FLOP cap is
relaxed to the least achievable maximum layer FLOPs, and the result says so.

Exact dynamic programs over ``(layers so far, end operator)``.  A layer can only span
operators whose FLOPs fit the cap, so each DP costs ``O(n w L)`` numpy element operations,
``w`` being the most operators one layer can hold (about ``(1 + delta) n / L`` when
operators are alike, ``n`` at worst): a few thousand operators take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerClustering:
    """``L`` contiguous layers: layer ``l`` holds operators ``boundaries[l]..boundaries[l+1]-1``.

    ``boundaries`` has ``L + 1`` entries from ``0`` to ``n``.  ``flops_cap`` is the bound
    every layer meets; ``delta`` is the imbalance it allows (``cap / mean - 1``), larger than
    requested when ``relaxed``.
    """

    boundaries: tuple[int, ...]
    layer_flops: tuple[float, ...]
    max_cut_bytes: float
    total_cut_bytes: float
    flops_cap: float
    delta: float
    relaxed: bool

    @property
    def num_layers(self) -> int:
        return len(self.boundaries) - 1

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.boundaries[:-1], self.boundaries[1:], strict=True))

    def layer_of_op(self) -> tuple[int, ...]:
        """The layer index of every operator."""
        return tuple(layer for layer, (a, b) in enumerate(self.ranges) for _ in range(a, b))


def crossing_bytes(num_ops: int, tensors: Iterable[tuple[int, int, float]]) -> np.ndarray:
    """Bytes alive across each of the ``num_ops - 1`` cuts, from ``(first_op, last_op, bytes)``."""
    diff = np.zeros(num_ops + 1)
    for first, last, size in tensors:
        if not 0 <= first <= last < num_ops:
            raise ValueError(
                f"tensor live range ({first}, {last}) is outside operators 0..{num_ops - 1} "
                f"or ends before it starts"
            )
        if size < 0:
            raise ValueError(f"tensor live range ({first}, {last}) has negative size {size}")
        diff[first] += size
        diff[last] -= size
    return np.cumsum(diff)[: max(num_ops - 1, 0)]


def _band(prefix: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate layer starts for every end offset ``j``: ``start[j, w] = j - 1 - w``, and
    the FLOPs of layer ``[start, j)`` (``inf`` where it is empty or exceeds ``cap``).

    Prefix sums are non-decreasing, so the layers within ``cap`` ending at ``j`` start in a
    window; the window is found with a little float slack and then checked exactly.
    """
    n1 = len(prefix)
    slack = cap + 8 * np.finfo(float).eps * prefix[-1]
    first = np.searchsorted(prefix, prefix - slack, side="left")
    width = max(1, int(np.max(np.arange(n1) - first)))
    start = np.arange(n1)[:, None] - 1 - np.arange(width)[None, :]
    span = prefix[:, None] - prefix[np.clip(start, 0, None)]
    span = np.where((start >= 0) & (span <= cap), span, np.inf)
    return np.clip(start, 0, None), span


def _layer_dp(
    start: np.ndarray, cost: np.ndarray, edge: np.ndarray, num_layers: int, combine
) -> tuple[np.ndarray, np.ndarray]:
    """``value[l, j]``: best ``combine``-fold over ``l`` layers covering operators ``0..j-1``.

    A layer ``[start[j, w], j)`` contributes ``cost[j, w]`` and entering it at operator
    ``i`` contributes ``edge[i]``; the first layer ``[0, j)`` contributes ``cost[j, j-1]``
    (or ``inf`` outside the band).  ``arg[l, j]`` is where the last layer starts.
    """
    n1 = start.shape[0]
    rows = np.arange(n1)
    value = np.full((num_layers + 1, n1), np.inf)
    arg = np.zeros((num_layers + 1, n1), dtype=np.int64)
    first = rows - 1
    inside = (first >= 0) & (first < start.shape[1])
    value[1, inside] = cost[rows[inside], first[inside]]
    for layer in range(2, num_layers + 1):
        entering = combine(value[layer - 1], edge)
        candidates = combine(entering[start], cost)
        best = np.argmin(candidates, axis=1)
        arg[layer] = start[rows, best]
        value[layer] = candidates[rows, best]
    return value, arg


def _least_max_flops(prefix: np.ndarray, cap: float, num_layers: int) -> float:
    """The smallest possible largest-layer FLOPs, among partitions whose layers fit ``cap``."""
    start, span = _band(prefix, cap)
    no_edges = np.zeros(len(prefix))
    no_edges[0] = np.inf  # only the first layer starts at operator 0
    value, _ = _layer_dp(start, span, no_edges, num_layers, np.maximum)
    return float(value[num_layers, -1])


def cluster_layers(
    flops: Sequence[float], cut_bytes: Sequence[float], num_layers: int, delta: float = 0.25
) -> LayerClustering:
    """Balanced contiguous layers with the smallest worst (then total) crossing bytes."""
    flops_arr = np.asarray(flops, dtype=float)
    cuts = np.asarray(cut_bytes, dtype=float)
    n = len(flops_arr)
    if not isinstance(num_layers, int) or not 1 <= num_layers <= n:
        raise ValueError(f"cannot cut {n} operators into {num_layers!r} non-empty layers")
    if cuts.shape != (n - 1,):
        raise ValueError(f"need one cut_bytes entry per cut ({n - 1}), got {len(cut_bytes)}")
    if not (np.all(np.isfinite(flops_arr)) and np.all(flops_arr >= 0)):
        raise ValueError("flops must be finite and non-negative")
    if not (np.all(np.isfinite(cuts)) and np.all(cuts >= 0)):
        raise ValueError("cut_bytes must be finite and non-negative")
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")

    prefix = np.concatenate([[0.0], np.cumsum(flops_arr)])
    mean = prefix[-1] / num_layers
    cap = (1.0 + delta) * mean
    # 1. relax the cap to the least achievable largest layer if delta's is too tight
    relaxed = not np.isfinite(_least_max_flops(prefix, cap, num_layers))
    if relaxed:
        upper = max(2.0 * cap, float(flops_arr.max()))
        while not np.isfinite(_least_max_flops(prefix, upper, num_layers)):
            upper *= 2.0
        cap = _least_max_flops(prefix, upper, num_layers)
    start, span = _band(prefix, cap)
    allowed = np.where(np.isfinite(span), 0.0, np.inf)
    # edge[i]: bytes crossing the cut in front of operator i; no layer but the first starts at 0
    edge = np.concatenate([[np.inf], cuts, [0.0]])

    # 2. the smallest worst cut among balanced partitions
    worst, _ = _layer_dp(start, allowed, edge, num_layers, np.maximum)
    max_cut = float(worst[num_layers, n]) if num_layers > 1 else 0.0
    # 3. the smallest total among those, using only cuts no bigger than the worst
    total, arg = _layer_dp(
        start, allowed, np.where(edge <= max_cut, edge, np.inf), num_layers, np.add
    )

    boundaries = [n]
    for layer in range(num_layers, 1, -1):
        boundaries.append(int(arg[layer, boundaries[-1]]))
    boundaries.append(0)
    boundaries.reverse()
    layer_flops = tuple(
        float(prefix[b] - prefix[a]) for a, b in zip(boundaries, boundaries[1:], strict=False)
    )
    return LayerClustering(
        boundaries=tuple(boundaries),
        layer_flops=layer_flops,
        max_cut_bytes=max_cut,
        total_cut_bytes=float(total[num_layers, n]),
        flops_cap=float(cap),
        delta=float(cap / mean - 1.0) if mean > 0 else float(delta),
        relaxed=relaxed,
    )
