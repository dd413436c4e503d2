"""The stage DP at frontier scale (jax-free): every stage on one sub-mesh shape.

Alpa's DP (:func:`autoshard.inter.stages.optimal_stage_plan`) costs about ``L^2 * S * J *
D`` element operations a run; past :data:`ALPA_DP_WORK_LIMIT` (GPT-175B on 512 GPUs
already is) ``search="auto"`` runs :func:`uniform_stage_plan`, the same DP once per
sub-mesh shape with every stage on that shape, over Megatron-LM's logical meshes
(:func:`megatron_logical_meshes`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from autoshard.inter.plan import Shape2, StagePlan
from autoshard.inter.progress import Progress, quiet
from autoshard.inter.stages import (
    NO_PLACEMENT,
    NO_RECOMPUTE,
    StageBudgetError,
    StageCostFn,
    optimal_stage_plan,
)
from autoshard.inter.submesh import check_cluster, logical_mesh_shapes, submesh_shapes

ALPA_DP_WORK_LIMIT = 2e9  # element operations of one Alpa DP run beyond which "auto" goes uniform


def alpa_dp_work(num_layers: int, num_hosts: int, devices_per_host: int) -> float:
    """Element operations of one run of Alpa's DP: ``L^2 * S * J * D`` (the docstring of :mod:`autoshard.inter.stages`)."""
    devices = num_hosts * devices_per_host
    shapes = len(submesh_shapes(num_hosts, devices_per_host))
    return float(num_layers) ** 2 * min(num_layers, devices) * shapes * devices


def megatron_logical_meshes(devices_per_host: int, microbatch: int):
    """``submesh -> logical meshes`` keeping Megatron-LM's grid rules: the tensor-parallel
    axis inside a host (``tp <= devices_per_host``) and a data-parallel degree that divides
    the micro-batch (whole sequences per replica; ``microbatch`` 0: any)."""

    def allowed(submesh: Shape2) -> tuple[Shape2, ...]:
        return tuple(
            (dp, tp)
            for dp, tp in logical_mesh_shapes(submesh)
            if tp <= devices_per_host and (microbatch == 0 or microbatch % dp == 0)
        )

    return allowed


def uniform_stage_plan(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    stage_cost: StageCostFn,
    num_microbatches: int,
    memory_budget_bytes: float | None = None,
    schedule: str = "1f1b",
    num_stages: int | None = None,
    recompute_modes: Sequence[str] = NO_RECOMPUTE,
    progress: Progress | None = None,
    logical_meshes: Callable[[Shape2], Sequence[Shape2]] | None = None,
    placements: Sequence[str] = NO_PLACEMENT,
) -> StagePlan:
    """The stage DP restricted to pipelines whose stages all take one sub-mesh shape.

    For every shape of :func:`submesh_shapes` whose size ``n`` divides the ``D`` devices
    with ``D / n`` stages no more than the layers (or exactly ``num_stages``), the DP of
    :func:`optimal_stage_plan` splits the layers into ``D / n`` stages on that shape alone
    (each stage still takes its fastest fitting logical mesh, recompute mode and offload
    placement among ``placements``); the best
    of these plans wins.  One DP run costs ``L^2 * S`` instead of ``L^2 * S * J * D``: the
    search for thousands of devices, where Megatron-LM's grids (equal stages) live.
    Raises ``ValueError`` when no shape gives a plan (quoting why, e.g. the memory budget).
    """
    progress = progress or quiet()
    check_cluster(num_hosts, devices_per_host)
    devices = num_hosts * devices_per_host
    candidates = [
        (shape, devices // (shape[0] * shape[1]))
        for shape in submesh_shapes(num_hosts, devices_per_host)
        if devices % (shape[0] * shape[1]) == 0
        and devices // (shape[0] * shape[1]) <= num_layers
        and (num_stages is None or devices // (shape[0] * shape[1]) == num_stages)
    ]
    if not candidates:
        raise ValueError(
            f"no sub-mesh shape of {submesh_shapes(num_hosts, devices_per_host)} splits "
            f"{devices} devices into equal stages of >= 1 of the {num_layers} layers"
            + ("" if num_stages is None else f" in {num_stages} stages")
        )
    t0 = time.perf_counter()
    prepare = getattr(stage_cost, "prepare", None)
    if prepare is not None:  # every candidate's ILPs, counted on one phase
        meshes = logical_meshes or logical_mesh_shapes
        prepare([g for shape, _ in candidates for g in meshes(shape)], progress)
    best, errors, runs, calls = None, [], 0, 0
    budgets: list[float] = []  # the least budget of each shape the budget alone refused
    with progress.phase("equal-stage pipelines", len(candidates)) as phase:
        for shape, count in candidates:
            try:
                plan = optimal_stage_plan(
                    num_layers, num_hosts, devices_per_host, stage_cost, num_microbatches,
                    memory_budget_bytes, schedule, count, recompute_modes=recompute_modes,
                    submeshes=(shape,), logical_meshes=logical_meshes, placements=placements,
                )  # fmt: skip
            except ValueError as err:
                errors.append(f"{count} stages on {shape}: {err}")
                if isinstance(err, StageBudgetError):
                    budgets.append(err.least_bytes)
                continue
            finally:
                phase.advance()
            runs += plan.num_dp_runs
            calls += plan.num_cost_calls
            if best is None or plan.objective_s < best.objective_s:
                best = plan
    if best is None:
        message = "no plan of equal sub-meshes: " + " | ".join(errors)
        if budgets:  # some shape failed on the budget alone: the least budget of those
            raise StageBudgetError(message, memory_budget_bytes, min(budgets))
        raise ValueError(message)
    return dataclasses.replace(
        best, search_seconds=time.perf_counter() - t0, num_cost_calls=calls, num_dp_runs=runs
    )
