"""The settings of the inter-operator stage search, as one frozen object.

:class:`StageSearchOptions` holds what :func:`autoshard.inter.search.search_stages` needs
to know besides its input (the traced step, the cluster and an optional reused stage
cost): how to choose stages, how many microbatches, the schedule, the recompute modes a
stage may take, the memory budget, and the settings of the intra-op ILPs behind each
stage cost.  Defaults are the search's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.inter.plan import Shape2
from autoshard.inter.stages import NO_GRAD_REDUCE, NO_RECOMPUTE

STAGE_METHODS = ("auto", "equal-layer", "equal-flops")
GRANULARITIES = ("layer", "range")
SUBMESH_SEARCHES = ("auto", "alpa", "uniform")


@dataclass(frozen=True)
class StageSearchOptions:
    """How to search pipeline stages (validated by the search, which says what would fit).

    ``stages``: ``"auto"`` (Alpa's stage DP; any stage count unless ``num_stages``),
    ``"equal-layer"`` or ``"equal-flops"`` (``num_stages`` stages on equal sub-meshes,
    each on its fastest logical mesh), or explicit ``((start, end), ...)`` layer ranges
    (equal sub-meshes); ``logical_meshes`` then fixes each range's ``(dp, tp)`` view.
    ``recompute_modes``: the activation-recompute modes each stage may choose from; the
    DP takes the fastest that fits ``memory_budget_bytes`` (per device; None: unbounded).
    ``solver``, ``time_limit_s`` (per ILP) and ``granularity`` (``"layer"`` or
    ``"range"``, see :mod:`autoshard.inter.stage_cost`) set the intra-op ILPs.
    ``submesh_search`` (with ``stages="auto"``): ``"alpa"``, Alpa's DP over every mix of
    sub-meshes; ``"uniform"``, one sub-mesh shape for all stages and Megatron-LM's logical
    meshes (:func:`autoshard.inter.uniform_stages.uniform_stage_plan`); ``"auto"``, Alpa's unless one
    of its DP runs would exceed :data:`~autoshard.inter.uniform_stages.ALPA_DP_WORK_LIMIT` element
    operations (thousands of devices). ``grad_reduces``: where a stage with several
    data-parallel replicas may reduce its gradients (:data:`autoshard.inter.stages.GRAD_REDUCES`:
    ``"microbatch"``, every microbatch, one plan over the whole logical mesh; ``"step"``,
    once per step, replicas of a plan over ``model``: the stage cost needs ``replicas``,
    :class:`autoshard.inter.stage_cost.IntraStageCost`).
    """

    num_microbatches: int
    stages: str | Sequence[tuple[int, int]] = "auto"
    num_stages: int | None = None
    logical_meshes: Sequence[Shape2] | None = None
    schedule: str = "1f1b"
    recompute_modes: tuple[str, ...] = NO_RECOMPUTE
    memory_budget_bytes: float | None = None
    solver: str = "highs"
    time_limit_s: float = 60.0
    granularity: str = "layer"
    submesh_search: str = "auto"
    grad_reduces: tuple[str, ...] = NO_GRAD_REDUCE

    def __post_init__(self) -> None:
        if self.submesh_search not in SUBMESH_SEARCHES:
            raise ValueError(
                f"submesh_search must be one of {SUBMESH_SEARCHES}, got {self.submesh_search!r}"
            )
        # sequences become tuples, so options compare and hash by value
        if not isinstance(self.stages, str):
            object.__setattr__(self, "stages", tuple(tuple(r) for r in self.stages))
        if self.logical_meshes is not None:
            object.__setattr__(self, "logical_meshes", tuple(tuple(m) for m in self.logical_meshes))
        object.__setattr__(self, "recompute_modes", tuple(self.recompute_modes))
        object.__setattr__(self, "grad_reduces", tuple(self.grad_reduces))
