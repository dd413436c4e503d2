"""Pricing the baseline plans on Megatron-LM's program: Megatron grids, DP and ZeRO.

:func:`megatron_grid` lists the Megatron configurations a plan may take on a cluster (TP
a power of two up to the GPUs per node, PP dividing the layers, DP the rest, micro-batch
sizes that are powers of two dividing the per-replica batch, unless one is given); each
is timed by :func:`autoshard.sim.megatron.simulate_megatron`, and :func:`best_point` keeps
the one with the most tokens/s among those that fit in memory (if none fits: the one that
needs the least memory, flagged ``oom``).

``dp``, ``zero2``, ``zero3`` are the grid ``1 x 1 x gpus`` (micro-batch searched as above)
with the ZeRO stage's model-state division (:func:`formulas.model_state_bytes`) and
communication (:func:`zero_point`): with ``m`` micro-batches per step, ZeRO-2
reduce-scatters each micro-batch's gradients (it keeps only its gradient shard), so
``m - 1`` reduce-scatters come on top of the step's all-reduce (= one reduce-scatter + one
all-gather); ZeRO-3 also all-gathers the 16-bit weights before every forward and every
backward, ``2 m - 1`` more all-gathers (``m = 1``: the familiar 1.5x of data parallel's
volume; frameworks that gather again for a recomputed forward pay one more per
micro-batch, not modelled). ZeRO runs the optimizer on the ``1/DP`` shard it owns, so its
memory-bound time is divided by DP. ZeRO-3 holds one gathered block (the larger of a
transformer layer and the embedding, 16-bit) on top of its shards. Nothing is overlapped
with compute, as in :mod:`~autoshard.sim.megatron`.

Two Megatron-LM programs (``PROGRAM_ATTENTION``): ``"megatron-lm"``, its 2021 kernels
(attention as two batched GEMMs and the fused softmax), and ``"megatron-lm-flash"``, today's
Megatron-LM with flash attention (``MegatronConfig.attention="flash"``: the fused kernel
timed from the device's attention table). Every grid point and ZeRO point of a search runs
the one program.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from autoshard.hardware.clusters import Cluster
from autoshard.hardware.gemm import GemmTable
from autoshard.hardware.mesh import to_device_mesh
from autoshard.intra.cost.resharding import all_gather_cost, reduce_scatter_cost
from autoshard.sim import formulas
from autoshard.sim.breakdown import step_breakdown
from autoshard.sim.megatron import (
    GRAD_ALLREDUCE_BYTES_PER_PARAM,
    MESH_AXES,
    NO_TIE_BREAKERS,
    GPTShape,
    MegatronConfig,
    SimResult,
    simulate_megatron,
)
from autoshard.sim.report import SimulationReport, utilisation

ZERO_STAGES = {"dp": 0, "zero2": 2, "zero3": 3}
# Megatron-LM's programs -> MegatronConfig.attention
PROGRAM_ATTENTION = {"megatron-lm": "softmax", "megatron-lm-flash": "flash"}


@dataclass(frozen=True)
class Schedule:
    """How a step is cut into micro-batches and pipelined (what ``simulate`` was asked).

    ``microbatch_size``: sequences per micro-batch *per data-parallel replica*
    (Megatron-LM's ``--micro-batch-size``); ``num_microbatches``: micro-batches per step,
    the same on every plan; at most one of the two, or neither (then searched).
    ``sequence_parallel`` and ``virtual_stages`` (interleaved 1F1B) are Megatron-LM's.
    """

    microbatch_size: int | None = None
    num_microbatches: int | None = None
    sequence_parallel: bool = False
    virtual_stages: int = 1

    def describe(self) -> str:
        """The micro-batch request in words (for error messages)."""
        if self.microbatch_size is not None:
            return f" in micro-batches of {self.microbatch_size} per replica"
        if self.num_microbatches is not None:
            return f" in {self.num_microbatches} micro-batches"
        return ""


def _powers_of_two_dividing(n: int, cap: int | None = None) -> list[int]:
    out, p = [], 1
    while p <= n and (cap is None or p <= cap):
        if n % p == 0:
            out.append(p)
        p *= 2
    return out


def megatron_grid(
    shape: GPTShape,
    cluster: Cluster,
    global_batch: int,
    microbatch_size: int | None = None,
    recompute: str = "none",
    dtype: str | None = None,
    grid: tuple[int, int, int] | None = None,
    *,
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    num_microbatches: int | None = None,
    attention: str = "softmax",
) -> tuple[MegatronConfig, ...]:
    """The Megatron configurations ``plan="megatron"`` simulates on all of ``cluster``.

    TP: powers of two up to ``cluster.devices_per_node`` dividing heads and vocabulary;
    PP: divisors of the layers that divide the rest; DP: the rest. Micro-batch (sequences
    per data-parallel replica, Megatron-LM's ``--micro-batch-size``): powers of two
    dividing ``global_batch / DP``; only ``microbatch_size`` if given, only
    ``global_batch / (DP x num_microbatches)`` if ``num_microbatches`` is given. ``grid``
    pins ``(tp, pp, dp)`` and leaves only the micro-batch to choose. With
    ``virtual_stages`` v > 1 (interleaved 1F1B) only grids with PP > 1, layers divisible
    by PP x v and a number of micro-batches divisible by PP are kept (a pinned grid that
    breaks this is kept, and :func:`~autoshard.sim.megatron.simulate_megatron` says why).
    ``sequence_parallel`` applies to every grid (it is a no-op at TP = 1), and
    ``attention`` (``MegatronConfig.attention``: ``"softmax"`` or ``"flash"``) to every point.
    """
    gpus = cluster.num_gpus
    if grid is not None:
        grids = [grid]
    else:
        grids = [
            (tp, pp, gpus // (tp * pp))
            for tp in _powers_of_two_dividing(gpus, cluster.devices_per_node)
            if shape.heads % tp == 0 and shape.vocab % tp == 0
            for pp in range(1, gpus // tp + 1)
            if (gpus // tp) % pp == 0
            and shape.layers % (pp * virtual_stages) == 0
            and (virtual_stages == 1 or pp > 1)
        ]
    configs = []
    for tp, pp, dp in grids:
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        sizes = _powers_of_two_dividing(per_replica)
        if microbatch_size is not None:
            sizes = [microbatch_size] if per_replica % microbatch_size == 0 else []
        if num_microbatches is not None:
            sizes = [per_replica // num_microbatches] if per_replica % num_microbatches == 0 else []
        if virtual_stages > 1 and grid is None:
            sizes = [b for b in sizes if (per_replica // b) % pp == 0]
        configs += [
            MegatronConfig(
                tp, pp, dp, b, global_batch, recompute, sequence_parallel, virtual_stages, dtype
            )
            for b in sizes
        ]
    return tuple(dataclasses.replace(c, attention=attention) for c in configs)


@dataclass(frozen=True)
class GridPoint:
    """One simulated Megatron/ZeRO configuration."""

    cfg: MegatronConfig
    step_time_s: float
    memory_bytes: float
    oom: bool
    breakdown: Mapping[str, float]
    step_breakdown: Mapping[str, float] = field(default_factory=dict)


def zero_point(
    shape: GPTShape, cfg: MegatronConfig, cluster: Cluster, result: SimResult, zero_stage: int
) -> GridPoint:
    """A data-parallel Megatron result with ZeRO-``zero_stage`` memory and communication."""
    if zero_stage == 0:
        return GridPoint(
            cfg,
            result.step_time_s,
            result.memory_bytes_per_device,
            result.oom,
            result.breakdown,
            result.step_breakdown,
        )
    if cfg.tp != 1 or cfg.pp != 1:
        raise ValueError(f"ZeRO is modelled on a pure data-parallel grid, got {cfg}")
    h, n_layers, v = shape.hidden, shape.layers, shape.vocab
    params = formulas.gpt_params(h, n_layers, v, shape.seq_len) + 2 * h  # Megatron's count
    memory = (
        result.memory_bytes_per_device
        - formulas.model_state_bytes(params)
        + formulas.model_state_bytes(params, cfg.dp, zero_stage)
    )
    if zero_stage == 3:
        memory += 2 * max(12 * h * h + 13 * h, v * h)  # one gathered block, 16-bit
    mesh = to_device_mesh(cluster, (1, cfg.dp, 1), MESH_AXES, cfg.dtype)
    grad_bytes = params * GRAD_ALLREDUCE_BYTES_PER_PARAM
    m = cfg.num_microbatches
    breakdown = dict(result.breakdown)
    breakdown["optimizer"] /= cfg.dp
    breakdown["zero_reduce_scatter"] = (m - 1) * reduce_scatter_cost(
        mesh, "data", grad_bytes, NO_TIE_BREAKERS
    )
    if zero_stage == 3:
        breakdown["zero3_all_gather"] = (2 * m - 1) * all_gather_cost(
            mesh, "data", grad_bytes, NO_TIE_BREAKERS
        )
    step = sum(breakdown.values())
    parts = dict(result.step_breakdown)
    parts["optimizer"] = breakdown["optimizer"]
    parts["comm_data"] += breakdown["zero_reduce_scatter"] + breakdown.get("zero3_all_gather", 0)
    return GridPoint(
        cfg,
        step,
        memory,
        memory > cluster.device.hbm_bytes,
        MappingProxyType(breakdown),
        step_breakdown(step, parts),
    )


def grid_points(shape: GPTShape, configs, cluster: Cluster, zero_stage: int) -> list[GridPoint]:
    """Every Megatron configuration simulated on ``cluster`` (with ZeRO's memory and
    communication for ``zero_stage`` > 0)."""
    table = GemmTable.load(cluster.device.gemm_table) if cluster.device.gemm_table else None
    return [
        zero_point(shape, cfg, cluster, simulate_megatron(shape, cfg, cluster, table), zero_stage)
        for cfg in configs
    ]


def best_point(points: list[GridPoint]) -> GridPoint:
    """Most tokens/s among points that fit; if none fits, the one needing least memory."""
    fitting = [p for p in points if not p.oom]
    if fitting:
        return min(fitting, key=lambda p: p.step_time_s)
    return min(points, key=lambda p: p.memory_bytes)


def simulate_grid(
    model, shape, the_cluster, gpus, request, batch, schedule: Schedule, recompute, dtype, peak,
    program: str = "megatron-lm",
) -> SimulationReport:  # fmt: skip
    """``plan`` = ``dp``, ``zero2``, ``zero3``, ``megatron`` or ``megatron:TPxPPxDP`` (the
    parsed ``request``) on Megatron-LM's ``program`` (a key of ``PROGRAM_ATTENTION``): every
    configuration of :func:`megatron_grid` timed, the best one reported (module docstring)."""
    if program not in PROGRAM_ATTENTION:
        raise ValueError(f"program must be one of {tuple(PROGRAM_ATTENTION)}, got {program!r}")
    t0 = time.perf_counter()
    zero_stage = ZERO_STAGES.get(request.kind, 0)
    grid = request.grid if request.kind == "megatron" else (1, 1, gpus)
    configs = megatron_grid(
        shape, the_cluster, batch, schedule.microbatch_size, recompute, dtype, grid,
        sequence_parallel=schedule.sequence_parallel, virtual_stages=schedule.virtual_stages,
        num_microbatches=schedule.num_microbatches, attention=PROGRAM_ATTENTION[program],
    )  # fmt: skip
    if not configs:
        raise ValueError(
            f"no {request.kind} configuration of {model} fits {gpus} GPUs with global batch "
            f"{batch}{schedule.describe()}"
            + (
                f" and {schedule.virtual_stages} virtual stages"
                if schedule.virtual_stages > 1
                else ""
            )
            + ": the batch must divide by DP x micro-batch, heads and vocabulary by TP, "
            "layers by PP (x virtual stages, which need PP > 1 and micro-batches divisible by PP)"
        )
    points = grid_points(shape, configs, the_cluster, zero_stage)
    best = best_point(points)
    cfg = best.cfg
    plan_dict = {
        "kind": request.kind,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "microbatch_size": cfg.micro_batch,
        "num_microbatches": cfg.num_microbatches,
        "global_batch": batch,
        "recompute": recompute,
        "dtype": dtype,
        "zero_stage": zero_stage,
        "sequence_parallel": cfg.sequence_parallel,
        "virtual_stages": cfg.virtual_stages,
        "program": program,
        "searched_grid": request.kind == "megatron" and request.grid is None,
        "candidates_evaluated": len(points),
    }
    return SimulationReport(
        model=model,
        cluster=the_cluster.name,
        gpus=gpus,
        step_time_s=best.step_time_s,
        **utilisation(shape, batch, recompute, best.step_time_s, gpus, peak),
        peak_bytes_per_device=best.memory_bytes,
        oom=best.oom,
        plan=MappingProxyType(plan_dict),
        breakdown=best.breakdown,
        search_seconds=time.perf_counter() - t0,
        step_breakdown=best.step_breakdown,
    )
