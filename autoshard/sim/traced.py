"""Pricing a Megatron grid on the traced JAX step (``program="traced"``).

``"traced"`` times the grid on the traced JAX step, exactly as the search sees it:
Megatron's stage split (:func:`megatron_stages`: the embedding with the first blocks, the
head with the last; ``layers / PP`` blocks each) on ``TP x DP``-device sub-meshes viewed as
the logical mesh ``(DP, TP)``, each stage's intra-op plan the ILP's on that mesh
(:class:`autoshard.inter.stage_cost.IntraStageCost`, the search's own stage costs, from
:func:`autoshard.sim.auto.search_stage_cost`), 1F1B memory, and step time
``sum(t) + (m - 1) max(t)``. So ``auto`` and the grid are compared on one program and one
cost model: the search's plan is never slower than a grid point priced this way at the
same number of micro-batches (tests/test_sim_auto.py). The micro-batch size is
Megatron's (per data-parallel replica), searched over powers of two when not given, as on
the Megatron-LM program; each number of micro-batches is one trace.
"""

from __future__ import annotations

import time
from types import MappingProxyType

from autoshard.hardware.clusters import Cluster
from autoshard.sim.auto import shared_stage_cost
from autoshard.sim.breakdown import pipeline_step_breakdown
from autoshard.sim.grid import GridPoint, Schedule, best_point, megatron_grid
from autoshard.sim.report import SimulationReport, utilisation


def megatron_stages(num_blocks: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Megatron's layer ranges over the traced layers (0: embedding, ``num_blocks + 1``:
    head): ``num_blocks / pp`` blocks per stage, the embedding in the first, the head in
    the last."""
    if num_blocks % pp:
        raise ValueError(f"PP={pp} must divide the {num_blocks} transformer blocks")
    per = num_blocks // pp
    return tuple(
        (0 if i == 0 else 1 + i * per, num_blocks + 2 if i == pp - 1 else 1 + (i + 1) * per)
        for i in range(pp)
    )


def _grad_reduce(cost, start, end, submesh, logical, recompute, grad_reduce):
    """``(where the stage reduces its gradients, its StageCost)`` under the choice
    ``grad_reduce`` (:data:`autoshard.inter.stages.GRAD_REDUCE_CHOICES`): ``"step"`` only where
    the stage has several data-parallel replicas; ``"auto"`` the faster (the reduction
    every micro-batch on a tie)."""
    every = cost(start, end, submesh, logical, recompute)
    if grad_reduce == "microbatch" or logical[0] < 2:
        return "microbatch", every
    once = cost(start, end, submesh, logical, recompute, grad_reduce="step")
    if grad_reduce == "step" or once.latency_s < every.latency_s:
        return "step", once
    return "microbatch", every


def _grid_submesh(devices: int, cluster: Cluster) -> tuple[int, int]:
    per_host = cluster.devices_per_node
    return (devices // per_host, per_host) if devices >= per_host else (1, devices)


def simulate_traced_grid(
    model, shape, cluster, batch, schedule: Schedule, grid, recompute, dtype, peak, time_limit,
    overrides, progress=None, grad_reduce: str = "microbatch",
) -> SimulationReport:  # fmt: skip
    """Each grid point of ``megatron_grid`` priced on the traced step (module docstring);
    ``progress`` (:class:`autoshard.inter.progress.Progress`) counts the points.
    ``grad_reduce="step"``: each stage with DP > 1 runs DP replicas of its plan over
    ``model`` and all-reduces its gradients once per step, as Megatron-LM does
    (:meth:`autoshard.inter.stage_cost.IntraStageCost.replica_range_cost`); ``"auto"``:
    each stage the faster of the two."""
    from autoshard.inter.progress import Progress
    from autoshard.inter.stages import microbatches_in_flight, pipeline_objective

    progress = progress or Progress(f"{model} traced grid")

    gpus = cluster.num_gpus
    if grid is not None and shape.layers % grid[1]:
        raise ValueError(f"PP={grid[1]} must divide the {shape.layers} transformer blocks")
    configs = megatron_grid(
        shape, cluster, batch, schedule.microbatch_size, recompute, dtype, grid,
        num_microbatches=schedule.num_microbatches,
    )  # fmt: skip
    if not configs:
        raise ValueError(
            f"no Megatron grid of {model} on {gpus} GPUs takes the global batch {batch}"
            + schedule.describe()
            + ": the batch must divide by DP x micro-batch, heads and vocabulary by TP, "
            "layers by PP"
        )
    t0 = time.perf_counter()
    hbm = cluster.device.hbm_bytes
    points, stages = [], {}
    # one trace (and one set of stage ILPs) per number of micro-batches
    phase = progress.phase("grid points (trace and stage ILPs)", len(configs))
    for cfg in sorted(configs, key=lambda c: (c.num_microbatches, c.tp, c.pp, c.dp)):
        m = cfg.num_microbatches
        cost = shared_stage_cost(model, cluster, batch, m, dtype, time_limit, overrides)
        submesh = _grid_submesh(cfg.tp * cfg.dp, cluster)
        ranges = megatron_stages(shape.layers, cfg.pp)
        reduces = [
            _grad_reduce(cost, a, b, submesh, (cfg.dp, cfg.tp), recompute, grad_reduce)
            for a, b in ranges
        ]
        stage_costs = [c for _, c in reduces]
        latencies = [c.latency_s for c in stage_costs]
        memory = [
            c.memory_bytes(microbatches_in_flight(i, cfg.pp, m, "1f1b"))
            for i, c in enumerate(stage_costs)
        ]
        step = pipeline_objective(latencies, m)
        fill = sum(latencies)
        breakdown = MappingProxyType({"pipeline_fill": fill, "pipeline_steady": step - fill})
        parts = pipeline_step_breakdown(
            cost,
            [
                (a, b, (cfg.dp, cfg.tp), recompute, lat, None, r)
                for (a, b), lat, (r, _) in zip(ranges, latencies, reduces, strict=True)
            ],
            m,
            step,
        )
        points.append(GridPoint(cfg, step, max(memory), max(memory) > hbm, breakdown, parts))
        names = cost.layer_names
        stages[cfg] = [
            {
                "layers": [names[a], names[b - 1]],
                "num_layers": b - a,
                "submesh": list(submesh),
                "logical_mesh_dp_tp": [cfg.dp, cfg.tp],
                "recompute": recompute,
                "grad_reduce": r,
                "latency_s": lat,
                "peak_bytes": mem,
            }
            for (a, b), lat, mem, (r, _) in zip(ranges, latencies, memory, reduces, strict=True)
        ]
        phase.advance()
    phase.__exit__(None, None, None)
    best = best_point(points)
    cfg = best.cfg
    plan_dict = {
        "kind": "megatron",
        "program": "traced",
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "microbatch_size": cfg.micro_batch,
        "num_microbatches": cfg.num_microbatches,
        "global_batch": batch,
        "recompute": recompute,
        "grad_reduce": grad_reduce,
        "dtype": dtype,
        "zero_stage": 0,
        "sequence_parallel": False,
        "virtual_stages": 1,
        "searched_grid": grid is None,
        "candidates_evaluated": len(points),
        "stages": stages[cfg],
        "grid_points": [
            {
                "tp": p.cfg.tp,
                "pp": p.cfg.pp,
                "dp": p.cfg.dp,
                "num_microbatches": p.cfg.num_microbatches,
                "step_time_s": p.step_time_s,
                "peak_bytes": p.memory_bytes,
            }
            for p in points
        ],
    }
    return SimulationReport(
        model=model,
        cluster=cluster.name,
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
