"""Alpa's inter-operator pass: slice layers into pipeline stages on sub-meshes (jax-free).

Takes ``num_layers`` layers, a cluster of ``num_hosts x devices_per_host`` devices, a
``stage_cost(start_layer, end_layer, submesh_shape, logical_shape) -> StageCost`` callback
(one microbatch, forward + backward, on that sub-mesh viewed as a ``dp x tp`` logical mesh)
and the number of microbatches ``B``.  Returns a :class:`StagePlan` minimising Alpa's
pipeline latency (OSDI'22, eq. 2)::

    sum_i t_i + (B - 1) * max_i t_i

subject to: stages cover the layers contiguously and in order; every stage runs on one
sub-mesh from :func:`submesh_shapes`; the sub-meshes use all devices exactly once; each
stage's per-device memory fits ``memory_budget_bytes``.

Recompute (optional): with ``recompute_modes`` (a subset of ``none``, ``selective``,
``full``) the callback takes a fifth argument, the mode, and each stage chooses its
``(logical mesh, recompute mode)`` pair: the fastest that fits the budget.  Recompute costs
latency and saves activation bytes, so the DP recomputes only where memory is tight.
Offload placements (optional, ``placements``: labels such as ``"none"``,
``"optimizer"``; :mod:`autoshard.inter.stage_offload`) are a third choice the same way:
the callback then takes the placement as a sixth argument and each stage takes the
fastest fitting ``(logical mesh, recompute mode, placement)``, so a stage holding many
microbatches in flight may offload while the others do not.

Memory is schedule-aware.  The callback reports ``param_bytes`` (weights, gradients and
optimizer state per device) and ``activation_bytes`` (per microbatch in flight, per
device); stage ``i`` of ``S`` holds ``min(S - i, B)`` microbatches under 1F1B and all ``B``
under GPipe.  For each (layer range, sub-mesh, in-flight count) the fastest logical mesh
that fits is used.

Search (Alpa's Algorithm 1): for a cap ``t_max`` on stage latency, a dynamic program over
``F(s, k, d)`` = least total latency of layers ``k..L-1`` in ``s`` stages on ``d`` devices
(the first of those stages has ``s`` microbatches in flight under 1F1B); the answer is
``min over t_max of min_s F(s, 0, N*M) + (B - 1) * t_max``.  ``t_max_search="alpa"`` walks
the sorted distinct stage latencies upwards and stops once ``(B - 1) * t_max >= best``;
the default ``"frontier"`` walks them downwards, jumping below the slowest stage of each
DP solution, which visits only the corners of the (sum, max) trade-off and returns the
same optimum with far fewer DP runs.  One DP run costs about ``L^2 * S * J * D`` numpy
element operations (``J`` sub-mesh shapes, ``D`` devices): fine for Alpa-sized problems
(tens of layers, tens of devices), not for a thousand devices.  There
:func:`~autoshard.inter.uniform_stages.uniform_stage_plan` runs the same DP once per sub-mesh shape with every stage on
that shape (``L^2 * S`` each, :func:`autoshard.inter.stage_dp.one_size_dp`).  Ranges whose costs the callback says
are equal (``range_key``: identical layers) are costed once, whatever their position.

Sub-meshes are ``(1, 1), (1, 2), (1, 4), ..., (1, M)`` and ``(k, M)``; as in Alpa, any
multiset of them whose sizes add up to ``N * M`` tiles the cluster, and
:func:`place_submeshes` returns such a tiling as device ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.inter.plan import Shape2, Stage, StagePlan
from autoshard.inter.progress import Progress, quiet
from autoshard.inter.stage_dp import best_total, suffix_dp, trace_back
from autoshard.inter.stage_variants import (  # noqa: F401 - re-exported: the DP's vocabulary
    GRAD_REDUCE_CHOICES,
    GRAD_REDUCES,
    NO_GRAD_REDUCE,
    NO_PLACEMENT,
    NO_RECOMPUTE,
    RECOMPUTE_MODES,
    StageCost,
    StageCostFn,
    _CostTable,
    _leanest,
    grad_reduces_for,
)
from autoshard.inter.submesh import (  # noqa: F401 - re-exported: the stage DP's sub-meshes
    check_cluster,
    logical_mesh_shapes,
    place_submeshes,
    submesh_shapes,
)

SCHEDULES = ("1f1b", "gpipe")


class StageBudgetError(ValueError):
    """No stage plan fits the memory budget: ``budget_bytes`` per device, and
    ``least_bytes``, the smallest budget that admits one."""

    def __init__(self, message: str, budget_bytes: float, least_bytes: float) -> None:
        super().__init__(message)
        self.budget_bytes, self.least_bytes = budget_bytes, least_bytes


def pipeline_objective(stage_latencies: Sequence[float], num_microbatches: int) -> float:
    """Alpa's pipeline latency: ``sum(t) + (B - 1) * max(t)``."""
    return float(sum(stage_latencies)) + (num_microbatches - 1) * float(max(stage_latencies))


def microbatches_in_flight(
    stage_index: int, num_stages: int, num_microbatches: int, schedule: str
) -> int:
    """Microbatches whose activations stage ``stage_index`` (0-based) holds at its peak."""
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b":
        return min(num_stages - stage_index, num_microbatches)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def equal_layer_stages(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges of equal size (the first ``L mod S`` get one more)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


def equal_flops_stages(
    layer_flops: Sequence[float], num_stages: int
) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges minimising the largest stage's FLOPs (exact DP)."""
    n = len(layer_flops)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(layer_flops, dtype=float))])
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            starts = np.arange(s - 1, j)
            vals = np.maximum(best[s - 1, starts], prefix[j] - prefix[starts])
            cut[s, j] = starts[int(np.argmin(vals))]
            best[s, j] = vals.min()
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(int(cut[s, bounds[-1]]))
    bounds.reverse()
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


def _check_problem(num_layers: int, num_microbatches: int, schedule: str) -> None:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def cost_stage_choices(
    choices: Sequence[tuple[tuple[int, int], Shape2]],
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    stage_cost: StageCostFn,
    num_microbatches: int,
    memory_budget_bytes: float | None = None,
    schedule: str = "1f1b",
    recompute_modes: Sequence[str] = NO_RECOMPUTE,
    placements: Sequence[str] = NO_PLACEMENT,
    grad_reduces: Sequence[str] = NO_GRAD_REDUCE,
) -> StagePlan:
    """Cost hand-chosen ``((start, end), submesh_shape)`` stages with the DP's objective.

    Each stage gets its fastest logical mesh (and recompute mode, among
    ``recompute_modes``, offload placement, among ``placements``, and where it reduces
    its data-parallel gradients, among ``grad_reduces``) that fits the budget; raises if
    the ranges do
    not cover ``0..num_layers`` contiguously, the sub-meshes do not tile the cluster, or a
    stage fits no logical mesh (saying how much memory its leanest one needs).
    """
    t0 = time.perf_counter()
    _check_problem(num_layers, num_microbatches, schedule)
    if not choices:
        raise ValueError("no stages given")
    if len(choices) > num_layers:
        raise ValueError(f"{len(choices)} stages for {num_layers} layers: at most one per layer")
    if len(choices) > num_hosts * devices_per_host:
        raise ValueError(f"{len(choices)} stages for {num_hosts * devices_per_host} devices")
    expected_start = 0
    for (start, end), _ in choices:
        if start != expected_start or end <= start:
            raise ValueError(
                f"stage ranges {[c[0] for c in choices]} must be non-empty and contiguous "
                f"from 0 to {num_layers}"
            )
        expected_start = end
    if expected_start != num_layers:
        raise ValueError(f"stage ranges end at layer {expected_start}, not {num_layers}")
    place_submeshes([c[1] for c in choices], num_hosts, devices_per_host)
    budget = math.inf if memory_budget_bytes is None else memory_budget_bytes
    costs = _CostTable(
        stage_cost, recompute_modes, placements=placements, grad_reduces=grad_reduces
    )
    stages = []
    for index, ((start, end), submesh) in enumerate(choices):
        in_flight = microbatches_in_flight(index, len(choices), num_microbatches, schedule)
        found = costs.best_logical(start, end, submesh, in_flight, budget)
        if found is None:
            need = _leanest(costs, start, end, submesh, in_flight)
            message = (
                f"stage {index} (layers {start}..{end} on {submesh}) fits no logical mesh in "
                f"{budget:.4g} bytes per device; its leanest needs {need:.4g}"
            )
            if not math.isfinite(need):  # no variant runs at all: not the budget's
                raise ValueError(message)
            least = max(
                _leanest(
                    costs,
                    a,
                    b,
                    m,
                    microbatches_in_flight(i, len(choices), num_microbatches, schedule),
                )
                for i, ((a, b), m) in enumerate(choices)
            )
            raise StageBudgetError(message, budget, least)
        (logical, mode, placement, grad_reduce), cost = found
        stages.append(
            Stage(
                start,
                end,
                submesh,
                logical,
                cost.latency_s,
                cost.memory_bytes(in_flight),
                in_flight,
                mode,
                offload=placement,
                grad_reduce=grad_reduce,
            )
        )
    objective = pipeline_objective([s.latency_s for s in stages], num_microbatches)
    return StagePlan(
        tuple(stages),
        objective,
        time.perf_counter() - t0,
        len(costs.table),
        num_microbatches,
        schedule,
    )


def _range_classes(stage_cost, num_layers: int, max_len: int) -> dict:
    """Layer ranges ``[k, i)`` grouped by what their cost depends on: the callback's
    ``range_key(k, i)`` where it has one (ranges of identical layers cost the same and
    are costed once), else each range alone. Ranges longer than ``max_len`` are left out
    (no stage may hold them)."""
    key_of = getattr(stage_cost, "range_key", None)
    classes: dict = {}
    for k in range(num_layers):
        for i in range(k + 1, min(num_layers, k + max_len) + 1):
            key = (k, i) if key_of is None else key_of(k, i)
            classes.setdefault(key, []).append((k, i))
    return classes


@dataclass(frozen=True)
class _Tables:
    """Per ``[s, j, k, i]`` (stage ``[k, i)`` on sub-mesh ``j``, first of ``s`` remaining):
    the fastest fitting (logical mesh, recompute, placement)'s latency, the leanest one's memory
    (fitting or not) and the chosen variant's index in ``costs.variants(submesh)``
    (-1: none fits)."""

    latency: np.ndarray
    min_memory: np.ndarray
    variant: np.ndarray

    def choice(self, costs: _CostTable, submeshes, s: int, j: int, k: int, i: int):
        """``((logical_shape, recompute, placement), StageCost)`` chosen for ``[s, j, k, i]``."""
        v = costs.variants(submeshes[j])[int(self.variant[s, j, k, i])]
        return v, costs(k, i, submeshes[j], *v)


def _stage_tables(
    costs: _CostTable,
    num_layers: int,
    submeshes: Sequence[Shape2],
    sizes: Sequence[int],
    num_devices: int,
    max_stages: int,
    num_microbatches: int,
    schedule: str,
    budget: float,
    classes: dict,
    progress: Progress,
) -> _Tables:
    """The tables of :class:`_Tables`; each class of ``classes`` (see
    :func:`_range_classes`) is costed once per variant and fills all its ranges."""
    shape = (max_stages + 1, len(submeshes), num_layers + 1, num_layers + 1)
    latency = np.full(shape, np.inf)
    min_memory = np.full(shape, np.inf)
    variant = np.full(shape, -1, dtype=np.int32)
    # the first of s remaining stages is stage S - s of S: 1F1B keeps min(s, B) in flight
    in_flight = np.array(
        [microbatches_in_flight(0, s, num_microbatches, schedule) for s in range(max_stages + 1)],
        dtype=float,
    )[1:, None]
    usable = [j for j, n in enumerate(sizes) if n <= num_devices]
    with progress.phase("stage spans", len(usable) * len(classes)) as phase:
        for j in usable:
            submesh = submeshes[j]
            variants = costs.variants(submesh)
            for ranges in classes.values():
                k, i = ranges[0]
                found = [costs(k, i, submesh, *v) for v in variants]
                lat = np.array([c.latency_s for c in found])
                runnable = np.isfinite(lat)
                phase.advance()
                if not runnable.any():
                    continue
                param = np.array([c.param_bytes for c in found])
                work = np.array([c.working_bytes for c in found])
                act = np.array([c.activation_bytes for c in found])
                memory = param + work + in_flight * act  # [s - 1, variant]
                lean = np.where(runnable, memory, np.inf).min(axis=1)
                fitting = np.where(runnable & (memory <= budget), lat, np.inf)
                best = fitting.argmin(axis=1)  # fastest, first variant on ties
                fastest = fitting[np.arange(len(best)), best]
                best = np.where(np.isfinite(fastest), best, -1)
                ks, is_ = np.array(ranges).T
                min_memory[1:, j, ks, is_] = lean[:, None]
                latency[1:, j, ks, is_] = fastest[:, None]
                variant[1:, j, ks, is_] = best[:, None]
    return _Tables(latency, min_memory, variant)


def optimal_stage_plan(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    stage_cost: StageCostFn,
    num_microbatches: int,
    memory_budget_bytes: float | None = None,
    schedule: str = "1f1b",
    num_stages: int | None = None,
    t_max_search: str = "frontier",
    recompute_modes: Sequence[str] = NO_RECOMPUTE,
    progress: Progress | None = None,
    submeshes: Sequence[Shape2] | None = None,
    logical_meshes: Callable[[Shape2], Sequence[Shape2]] | None = None,
    placements: Sequence[str] = NO_PLACEMENT,
    grad_reduces: Sequence[str] = NO_GRAD_REDUCE,
) -> StagePlan:
    """Alpa's stage DP: the stage plan minimising ``sum(t) + (B - 1) max(t)``.

    ``num_stages`` fixes the stage count (default: any).  ``recompute_modes``: the modes
    each stage may choose from (the callback then takes the mode as a fifth argument);
    ``placements``: the offload placements likewise (a sixth argument); ``grad_reduces``:
    where a stage with data-parallel replicas reduces its gradients (:data:`GRAD_REDUCES`;
    a ``grad_reduce=`` keyword argument for ``"step"``).  Raises if the problem has no
    plan; if only memory is the obstacle, the error gives the smallest per-device budget
    that would admit one; where every plan needs an infinite-latency stage, it quotes the
    callback's ``refusals`` (if it has that attribute: why it refused a stage).
    ``progress``: where the phases report (:class:`~autoshard.inter.progress.Progress`).
    A callback with a ``prepare(logical_meshes, progress)`` method is told every logical
    mesh first (it may plan them all at once); one with ``range_key(start, end)`` is asked
    once per class of ranges with equal keys (equal costs).  ``submeshes`` narrows the
    sub-mesh shapes (default :func:`submesh_shapes`; they must still tile the cluster),
    ``logical_meshes(submesh)`` the logical meshes of each (default
    :func:`logical_mesh_shapes`); the DP counts devices in units of the sizes' gcd.
    """
    progress = progress or quiet()
    t0 = time.perf_counter()
    _check_problem(num_layers, num_microbatches, schedule)
    check_cluster(num_hosts, devices_per_host)
    if t_max_search not in ("frontier", "alpa"):
        raise ValueError(f"t_max_search must be 'frontier' or 'alpa', got {t_max_search!r}")
    num_devices = num_hosts * devices_per_host
    max_stages = min(num_layers, num_devices)
    if num_stages is not None and not 1 <= num_stages <= max_stages:
        raise ValueError(
            f"num_stages={num_stages} is impossible with {num_layers} layers and {num_devices} "
            f"devices; use 1..{max_stages}"
        )
    if num_stages is not None:
        max_stages = num_stages
    if submeshes is None:
        submeshes = submesh_shapes(num_hosts, devices_per_host)
    submeshes = tuple(tuple(m) for m in submeshes)
    unit = math.gcd(*(r * c for r, c in submeshes))
    if num_devices % unit:
        raise ValueError(f"sub-meshes {submeshes} cannot tile {num_devices} devices")
    sizes = [r * c // unit for r, c in submeshes]
    num_devices //= unit  # in units of `unit` devices from here on
    budget = math.inf if memory_budget_bytes is None else float(memory_budget_bytes)
    costs = _CostTable(stage_cost, recompute_modes, logical_meshes, placements, grad_reduces)
    usable = [m for m, n in zip(submeshes, sizes, strict=True) if n <= num_devices]
    prepare = getattr(stage_cost, "prepare", None)
    if prepare is not None:
        prepare([g for m in usable for g in costs.logical_meshes(m)], progress)
    # a stage leaves at least one layer to each of the others
    max_len = num_layers - (num_stages - 1 if num_stages is not None else 0)
    classes = _range_classes(stage_cost, num_layers, max_len)
    tables = _stage_tables(
        costs, num_layers, submeshes, sizes, num_devices, max_stages, num_microbatches,
        schedule, budget, classes, progress,
    )  # fmt: skip
    latency, min_memory = tables.latency, tables.min_memory
    dp_runs = progress.phase("stage DP runs")
    unconstrained = suffix_dp(latency, sizes, num_devices, np.add)
    dp_runs.advance()
    total, _ = best_total(unconstrained, num_stages, num_devices)
    if not math.isfinite(total):
        need, _ = best_total(
            suffix_dp(min_memory, sizes, num_devices, np.maximum), num_stages, num_devices
        )
        count = "any number of" if num_stages is None else str(num_stages)
        if math.isfinite(need):
            raise StageBudgetError(
                f"no plan of {count} stages fits {budget:.4g} bytes per device "
                f"({budget / 2**30:.3g} GiB); the smallest budget that admits one is "
                f"{need:.4g} bytes ({need / 2**30:.3g} GiB)",
                budget,
                need,
            )
        refusals = list(getattr(stage_cost, "refusals", ()))
        why = "; the stage costs were refused because: " + " | ".join(refusals) if refusals else ""
        raise ValueError(
            f"no plan of {count} stages exists for {num_layers} layers on a "
            f"{num_hosts}x{devices_per_host} cluster with sub-meshes {submeshes}: every "
            f"split needs a stage whose stage_cost latency is infinite or a sub-mesh mix "
            f"that does not add up to {num_devices * unit} devices{why}"
        )

    def capped_dp(t_max: float) -> tuple[np.ndarray, np.ndarray]:
        capped = np.where(latency <= t_max, latency, np.inf)
        table = suffix_dp(capped, sizes, num_devices, np.add)
        dp_runs.advance()
        return capped, table

    candidates = np.unique(latency[np.isfinite(latency)])
    slack = num_microbatches - 1
    num_dp_runs = 1
    best = (math.inf, math.inf, latency, unconstrained)  # (objective bound, t_max, cost, F)
    if t_max_search == "alpa":
        for t_max in map(float, candidates):
            if slack * t_max >= best[0]:
                break
            num_dp_runs += 1
            capped, table = capped_dp(t_max)
            total, _ = best_total(table, num_stages, num_devices)
            if total + slack * t_max < best[0]:
                best = (total + slack * t_max, t_max, capped, table)
    else:
        # no plan's slowest stage beats the bottleneck optimum: a bound for pruning
        num_dp_runs += 1
        fastest_max, _ = best_total(
            suffix_dp(latency, sizes, num_devices, np.maximum), num_stages, num_devices
        )
        capped, table = latency, unconstrained
        while True:
            total, s = best_total(table, num_stages, num_devices)
            if not math.isfinite(total):
                break
            slowest = float(
                max(capped[p] for p in trace_back(table, capped, sizes, s, num_devices))
            )
            if total + slack * slowest < best[0]:
                best = (total + slack * slowest, slowest, capped, table)
            below = candidates[candidates < slowest]
            # every cap below `slowest` gives a total >= `total`, a slowest stage >= fastest_max
            if not below.size or total + slack * fastest_max >= best[0]:
                break
            num_dp_runs += 1
            capped, table = capped_dp(float(below[-1]))
    dp_runs.__exit__(None, None, None)

    _, _, capped, table = best
    _, s = best_total(table, num_stages, num_devices)
    stages = []
    for index, (s_left, j, k, i) in enumerate(trace_back(table, capped, sizes, s, num_devices)):
        (logical, mode, placement, grad_reduce), cost = tables.choice(
            costs, submeshes, s_left, j, k, i
        )
        in_flight = microbatches_in_flight(index, s, num_microbatches, schedule)
        stages.append(
            Stage(
                k,
                i,
                submeshes[j],
                logical,
                cost.latency_s,
                cost.memory_bytes(in_flight),
                in_flight,
                mode,
                offload=placement,
                grad_reduce=grad_reduce,
            )
        )
    return StagePlan(
        tuple(stages),
        pipeline_objective([st.latency_s for st in stages], num_microbatches),
        time.perf_counter() - t0,
        len(costs.table),
        num_microbatches,
        schedule,
        num_dp_runs,
    )
