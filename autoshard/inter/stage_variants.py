"""What one stage of the stage DP may be and what each choice costs: the cost of a
candidate stage (:class:`StageCost`), the variants a stage on a sub-mesh may take --
logical mesh, activation recompute, offload placement, where it reduces its data-parallel
gradients -- and the memoised table the DP (:mod:`autoshard.inter.stages`) asks them from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autoshard.inter.plan import GRAD_REDUCE_MODES, Shape2
from autoshard.inter.submesh import logical_mesh_shapes


@dataclass(frozen=True)
class StageCost:
    """What one candidate stage costs: latency of one microbatch and per-device memory.

    ``latency_s`` may be ``math.inf`` to say this (range, sub-mesh, logical mesh) cannot run.
    ``working_bytes``: held once, whatever the microbatches in flight (under full
    recompute, one layer's activations rebuilt for its backward).
    """

    latency_s: float
    param_bytes: float
    activation_bytes: float
    working_bytes: float = 0.0

    def memory_bytes(self, microbatches_in_flight: int) -> float:
        return (
            self.param_bytes + self.working_bytes + microbatches_in_flight * self.activation_bytes
        )


StageCostFn = Callable[..., StageCost]  # (start, end, submesh, logical[, recompute[, placement]])
NO_RECOMPUTE = ("none",)
NO_PLACEMENT = ("none",)  # no offload choice: the callback takes no placement argument
RECOMPUTE_MODES = ("none", "selective", "full")
# where a stage reduces its data-parallel gradients: in every microbatch's backward (one
# plan over the whole logical mesh), or once per step ("step": ``dp`` replicas of a plan
# over ``model``, each on 1/dp of the microbatch; Megatron-LM's data parallelism)
GRAD_REDUCES = GRAD_REDUCE_MODES
NO_GRAD_REDUCE = ("microbatch",)  # the callback takes no grad_reduce argument
# what a user asks for: one of GRAD_REDUCES for every stage, or "auto" (each stage chooses)
GRAD_REDUCE_CHOICES = (*GRAD_REDUCES, "auto")


def grad_reduces_for(choice: str) -> tuple[str, ...]:
    """The stage DP's ``grad_reduces`` for a user's ``choice`` (:data:`GRAD_REDUCE_CHOICES`)."""
    if choice not in GRAD_REDUCE_CHOICES:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_CHOICES}, got {choice!r}")
    return GRAD_REDUCES if choice == "auto" else (choice,)


def _check_modes(recompute_modes) -> tuple[str, ...]:
    modes = tuple(recompute_modes)
    if not modes or len(set(modes)) != len(modes) or any(m not in RECOMPUTE_MODES for m in modes):
        raise ValueError(
            f"recompute_modes must be distinct values of {RECOMPUTE_MODES}, got {recompute_modes!r}"
        )
    return modes


def _check_grad_reduces(grad_reduces) -> tuple[str, ...]:
    values = tuple(grad_reduces)
    if not values or len(set(values)) != len(values) or any(v not in GRAD_REDUCES for v in values):
        raise ValueError(
            f"grad_reduces must be distinct values of {GRAD_REDUCES}, got {grad_reduces!r}"
        )
    return values


def _check_placements(placements) -> tuple[str, ...]:
    labels = tuple(placements)
    if not labels or len(set(labels)) != len(labels) or not all(isinstance(p, str) for p in labels):
        raise ValueError(f"placements must be distinct labels (str), got {placements!r}")
    return labels


class _CostTable:
    """Memoised callback: each (range, sub-mesh, logical mesh, recompute, placement,
    gradient reduction) is costed once."""

    def __init__(
        self,
        stage_cost: StageCostFn,
        recompute_modes=NO_RECOMPUTE,
        logical_meshes=None,
        placements=NO_PLACEMENT,
        grad_reduces=NO_GRAD_REDUCE,
    ) -> None:
        self.stage_cost = stage_cost
        self.modes = _check_modes(recompute_modes)
        self.placements = _check_placements(placements)
        self.grad_reduces = _check_grad_reduces(grad_reduces)
        self.logical_meshes = logical_meshes or logical_mesh_shapes
        self.table: dict[tuple, StageCost] = {}

    def variants(self, submesh: Shape2) -> list[tuple[Shape2, str, str, str]]:
        """(logical mesh, recompute mode, placement, gradient reduction) a stage on
        ``submesh`` may take, in order (on equal latencies the first wins: no recompute,
        then no offload, then the reduction every microbatch); a logical mesh with one
        data-parallel replica has only the reduction every microbatch (there is none)."""
        return [
            (g, m, p, r)
            for g in self.logical_meshes(submesh)
            for m in self.modes
            for p in self.placements
            for r in (self.grad_reduces if g[0] > 1 else NO_GRAD_REDUCE)
        ]

    def __call__(
        self,
        start: int,
        end: int,
        submesh: Shape2,
        logical: Shape2,
        mode: str = "none",
        placement: str = "none",
        grad_reduce: str = "microbatch",
    ) -> StageCost:
        key = (start, end, submesh, logical, mode, placement, grad_reduce)
        if key not in self.table:
            if grad_reduce != "microbatch":
                cost = self.stage_cost(
                    start, end, submesh, logical, mode, placement, grad_reduce=grad_reduce
                )
            elif self.placements != NO_PLACEMENT:
                cost = self.stage_cost(start, end, submesh, logical, mode, placement)
            elif self.modes == NO_RECOMPUTE:
                cost = self.stage_cost(start, end, submesh, logical)
            else:
                cost = self.stage_cost(start, end, submesh, logical, mode)
            values = (cost.latency_s, cost.param_bytes, cost.activation_bytes, cost.working_bytes)
            if any(math.isnan(v) or v < 0 for v in values):
                raise ValueError(f"stage_cost{key} returned {cost}; values must be >= 0")
            self.table[key] = cost
        return self.table[key]

    def best_logical(
        self, start: int, end: int, submesh: Shape2, in_flight: int, budget: float
    ) -> tuple[tuple[Shape2, str, str, str], StageCost] | None:
        """The fastest (logical mesh, recompute, placement, gradient reduction) whose memory
        fits ``budget`` (first on ties)."""
        best = None
        for variant in self.variants(submesh):
            cost = self(start, end, submesh, *variant)
            if cost.memory_bytes(in_flight) <= budget and math.isfinite(cost.latency_s):
                if best is None or cost.latency_s < best[1].latency_s:
                    best = (variant, cost)
        return best


def _leanest(costs: _CostTable, start: int, end: int, submesh: Shape2, in_flight: int) -> float:
    """The least memory any runnable variant of stage ``[start, end)`` needs (inf: none
    runs)."""
    return min(
        (
            c.memory_bytes(in_flight)
            for c in (costs(start, end, submesh, *v) for v in costs.variants(submesh))
            if math.isfinite(c.latency_s)
        ),
        default=math.inf,
    )
