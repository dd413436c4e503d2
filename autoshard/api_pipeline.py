"""The pipeline's public entry points: trace a step, search its stages, build the runtime.

The inter-operator pass chained as :mod:`autoshard.api` chains the intra-operator one:

* :func:`trace_microbatch`: a preset model's training step traced at the microbatch size;
* :func:`auto_stage_plan`: trace, then Alpa's stage search
  (:func:`autoshard.inter.search.search_stages`) with
  :class:`~autoshard.inter.options.StageSearchOptions`: an
  :class:`~autoshard.inter.plan.InterPlan`, nothing allocated;
* :func:`auto_pipeline`: trace a loss function's step, choose stages (the search, or the
  FLOPs cost model for the data-parallel layout), cut the program
  (:func:`autoshard.inter.program_cut.split_stages`) and return the runtime's
  :class:`~autoshard.runtime.pipeline.PipelineTrainer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from autoshard.api_replicas import (
    Replicas,
    check_grad_reduce,
    check_replica_batch,
    replica_layouts,
)
from autoshard.api_stage_plan import (  # noqa: F401 - re-exported: the search's entry points
    _offload_request,
    auto_stage_plan,
    microbatch_graph,
    trace_microbatch,
)
from autoshard.inter.flops_cost import LayerStats, flops_stage_cost, layer_stats
from autoshard.inter.options import STAGE_METHODS, StageSearchOptions
from autoshard.inter.plan import Stage
from autoshard.inter.program_cut import StageProgram, check_layer_ranges, split_stages
from autoshard.inter.search import search_stages
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stages import (
    RECOMPUTE_MODES,
    StageCostFn,
    equal_flops_stages,
    equal_layer_stages,
    grad_reduces_for,
    microbatches_in_flight,
    optimal_stage_plan,
    place_submeshes,
)
from autoshard.inter.submesh import cluster_for, logical_mesh_costs
from autoshard.ir.graph import build_graph
from autoshard.models import make_train_step
from autoshard.runtime.pipeline import (
    LayoutFn,
    PipelineTrainer,
    check_virtual_stages,
    data_parallel_layout,
    divisibility_message,
)
from autoshard.runtime.stage import Probe
from autoshard.runtime.stage_layout import (
    SpecFn,
    StageLayout,
    data_parallel_spec,
    intra_op_layout,
    loss_program,
)
from autoshard.trace.jaxpr import trace_train_step

LAYOUTS = ("intra-op", "data-parallel")


# ----------------------------------------------------------------------------- the runtime


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_size(batch) -> int:
    sizes = {leaf.shape[0] if leaf.shape else None for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading (batch) dimension to be split into "
            f"microbatches; got leading sizes {sorted(map(str, sizes))}"
        )
    return sizes.pop()


def _check_stage_count(
    num_stages: int, num_layers: int, num_devices: int, equal_submeshes: bool = True
) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages for {num_layers} layers: a stage needs at least one layer; "
            f"use num_stages <= {num_layers}"
        )
    if num_stages > num_devices:
        raise ValueError(
            f"{num_stages} stages for {num_devices} devices: a stage needs at least one device; "
            f"use num_stages <= {num_devices}"
        )
    if equal_submeshes and num_devices % num_stages:
        fits = [d for d in _divisors(num_devices) if d <= num_layers]
        raise ValueError(
            f"{num_devices} devices cannot be split evenly among {num_stages} stages; use "
            f"num_stages in {fits}, or stages='auto' for sub-meshes of different sizes"
        )


def auto_pipeline(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    params,
    batch,
    devices: Sequence[Any] | None = None,
    num_microbatches: int = 4,
    stages: str | Sequence[tuple[int, int]] = "auto",
    num_stages: int | None = None,
    schedule: str = "1f1b",
    layout: str = "intra-op",
    logical_meshes: Sequence[tuple[int, int]] | None = None,
    spec_fn: SpecFn = data_parallel_spec,
    stage_cost: Callable[[LayerStats], StageCostFn] = flops_stage_cost,
    memory_budget_bytes: float | None = None,
    intra_cost: IntraStageCost | None = None,
    solver: str = "highs",
    cluster=None,
    recompute: str = "none",
    virtual_stages: int = 1,
    probe: Probe | None = None,
    offload=None,
    grad_reduce: str = "microbatch",
    cast_once: bool = True,
) -> PipelineTrainer:
    """Pipeline ``loss_fn(params, batch) -> mean loss`` over ``devices`` (default: all).

    ``batch`` is one global batch (arrays or ``jax.ShapeDtypeStruct`` leaves, all with the
    batch size as leading dim); it is split into ``num_microbatches`` equal microbatches.
    ``stages``: ``"auto"`` (Alpa's stage DP over sub-meshes, any number of stages unless
    ``num_stages`` is given), ``"equal-layer"`` or ``"equal-flops"`` (``num_stages``
    stages, equal sub-meshes), or explicit ``[(start, end), ...]`` ranges over the traced
    layers (in ``plan``; for the GPT ``embedding, block_0, ..., head``).  ``schedule``:
    ``"1f1b"`` or ``"gpipe"``.

    ``layout="intra-op"`` (default): stage costs come from intra-op ILPs
    (:func:`autoshard.inter.search.search_stages`, on ``cluster``'s costs, with ``solver``;
    ``intra_cost`` reuses the ILPs of an earlier call on the same step) and every stage
    runs under its own plan on its sub-mesh viewed as a ``(dp, tp)`` logical mesh (axes
    ``data``, ``model``); ``logical_meshes`` fixes each explicit range's view.
    ``layout="data-parallel"``: stage costs from FLOPs (``stage_cost``) and every stage
    lays its tensors out with ``spec_fn`` on a ``(devices, 1)`` mesh.

    ``recompute``: ``"none"`` (every stage keeps its forward's residuals), ``"selective"``
    or ``"full"`` (every stage recomputes so in its inner layers, see
    :mod:`autoshard.runtime.stage`), or ``"auto"`` (intra-op layout: the stage search
    chooses per stage, the fastest mode that fits ``memory_budget_bytes``).
    ``schedule="interleaved"`` with ``virtual_stages = V``: the stages are chosen as for
    1F1B (the search prices 1F1B; with ``stages="auto"`` it runs once per stage count ``S``
    that interleaving allows, ``S * V <= layers`` and ``S`` dividing the microbatches, and
    keeps the fastest), then the layers are cut into ``S * V`` equal-layer chunks, chunk
    ``c * S + s`` on stage ``s``'s devices, logical mesh and recompute mode.
    ``probe(stage, layer)`` is called each time a layer's forward runs (for counting).
    ``offload`` (intra-op layout, with ``cluster``): a placement every stage takes, or
    ``"auto"`` (:func:`auto_stage_plan`); the runtime keeps the optimizer state, the
    master weights and the forward's saved activations in ``pinned_host`` memory
    (:mod:`autoshard.runtime.stage`).
    ``grad_reduce``: ``"microbatch"`` (default: every microbatch's backward reduces its
    data-parallel gradient) or ``"step"``: every stage whose logical mesh has ``dp > 1``
    runs ``dp`` replicas, each on ``1/dp`` of the microbatch's rows, of a plan over
    ``model`` only, made on the loss traced at ``1/dp`` of the microbatch (intra-op: the
    range's ILP plan on the ``(1, tp)`` mesh; data-parallel: replicated), and reduces the
    gradient once, in the update (:mod:`autoshard.runtime.stage`).  The batch must then
    divide by ``num_microbatches * dp``; not with ``offload``, a custom ``spec_fn``, nor
    (intra-op) ``stages="auto"``, whose search prices the per-microbatch reduction.
    ``cast_once`` (default): each f32 weight a stage reads once, through a convert to 16
    bits, is cast once a step, its microbatches reading the 16-bit copy (the same values;
    :mod:`autoshard.runtime.stage`); the stage search prices it so. False: every
    microbatch casts it, as the traced step does.
    """
    check_virtual_stages(schedule, virtual_stages)
    offload = _offload_request(offload)
    check_grad_reduce(grad_reduce, layout, stages, offload, spec_fn)
    if offload is not None and (layout != "intra-op" or virtual_stages > 1):
        raise ValueError(
            "offload in the pipeline runtime needs layout='intra-op' and one model chunk per "
            "stage (virtual_stages=1): drop offload or use the 1f1b/gpipe schedule"
        )
    if recompute not in (*RECOMPUTE_MODES, "auto"):
        raise ValueError(
            f"unknown recompute {recompute!r}; choose one of {(*RECOMPUTE_MODES, 'auto')}"
        )
    if recompute == "auto" and layout != "intra-op":
        raise ValueError(
            "recompute='auto' lets the stage search choose: it needs layout='intra-op'"
        )
    search_schedule = "1f1b" if schedule == "interleaved" else schedule
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or (num_microbatches < 1)
    ):
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("no devices given")
    batch_size = _batch_size(batch)
    if batch_size % num_microbatches:
        raise ValueError(divisibility_message(batch_size, num_microbatches))
    if isinstance(stages, str) and stages not in STAGE_METHODS:
        raise ValueError(
            f"unknown stages={stages!r}; use one of {STAGE_METHODS} or a list of "
            "(start, end) layer ranges"
        )
    if logical_meshes is not None and layout != "intra-op":
        raise ValueError("logical_meshes needs layout='intra-op'")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    mb_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype),
        batch,
    )
    # the train step of one microbatch; the pipeline runs its forward (same tensor ids as
    # the intra-op plans) and differentiates it per stage
    step = trace_train_step(
        make_train_step(loss_fn, optimizer),
        abstract,
        jax.eval_shape(optimizer.init, abstract),
        mb_batch,
    )
    loss = loss_program(step)
    program = loss.program
    stats = layer_stats(program.records)
    num_layers, n = len(stats.layers), len(devices)

    if stages == "auto":
        if num_stages is not None:
            _check_stage_count(num_stages, num_layers, n, equal_submeshes=False)
    elif isinstance(stages, str):
        if num_stages is None:
            raise ValueError(f"stages={stages!r} needs num_stages")
        _check_stage_count(num_stages, num_layers, n)
    else:
        stages = [tuple(r) for r in stages]
        if num_stages is not None and num_stages != len(stages):
            raise ValueError(f"num_stages={num_stages} but {len(stages)} layer ranges were given")
        check_layer_ranges(stages, num_layers)
        _check_stage_count(len(stages), num_layers, n)

    stage_plan = inter_plan = None
    host_params: frozenset[int] = frozenset()  # master weights resting in host memory
    layout_fn: LayoutFn = data_parallel_layout
    # the replicas of a grad_reduce="step" stage: the step traced at 1/dp of the
    # microbatch (what each replica binds) and its stage cost (what the search prices and
    # the replica's layout is planned from: one ILP for both)
    replicas = Replicas(
        loss_fn, optimizer, abstract, batch, num_microbatches, program,
        strict=grad_reduce == "step",
    )  # fmt: skip
    if layout == "intra-op":
        options = StageSearchOptions(
            num_microbatches,
            stages=stages,
            num_stages=num_stages,
            logical_meshes=logical_meshes,
            schedule=search_schedule,
            recompute_modes=RECOMPUTE_MODES if recompute == "auto" else (recompute,),
            memory_budget_bytes=memory_budget_bytes,
            solver=solver,
            grad_reduces=grad_reduces_for(grad_reduce),
        )
        graph = build_graph(step.records)
        if intra_cost is None:
            intra_cost = IntraStageCost(
                graph,
                logical_mesh_costs(cluster_for(cluster, 1, n)),
                solver=options.solver,
                time_limit_s=options.time_limit_s,
                granularity=options.granularity,
                num_microbatches=num_microbatches,
                cast_once=cast_once,
            )
        if grad_reduce != "microbatch" and intra_cost.replicas is None:
            intra_cost.replicas = replicas.priced_like(intra_cost)  # the search prices them
        if virtual_stages > 1 and stages == "auto" and num_stages is None:
            # the DP over the stage counts interleaving allows: S * V <= layers, and the
            # microbatches a multiple of S (Megatron's schedule); the fastest plan wins
            counts = [
                s
                for s in range(1, min(num_layers // virtual_stages, n) + 1)
                if num_microbatches % s == 0
            ]
            if not counts:
                raise ValueError(
                    f"interleaved 1F1B with {virtual_stages} virtual stages needs at least "
                    f"{virtual_stages} layers; the model has {num_layers}"
                )
            inter_plan = min(
                (
                    search_stages(
                        graph,
                        1,
                        n,
                        dataclasses.replace(options, num_stages=s),
                        cluster=cluster,
                        cost=intra_cost,
                        offload=offload,
                    )
                    for s in counts
                ),
                key=lambda plan: plan.objective_s,
            )
        else:
            inter_plan = search_stages(
                graph, 1, n, options, cluster=cluster, cost=intra_cost, offload=offload
            )
        stage_plan = inter_plan.stage_plan
        if inter_plan.offload and "master" in inter_plan.offload["classes"]:  # some stages
            from autoshard.intra.offload.placement import tensor_classes

            host_params = tensor_classes(graph)["master"] & frozenset(graph.inputs)
        planned = list(inter_plan.stages)
        if virtual_stages > 1:
            planned = _chunks(planned, virtual_stages, stats)
            chunk_specs = [
                intra_cost.stage_specs(s.start_layer, s.end_layer, s.logical_mesh) for s in planned
            ]
        else:
            chunk_specs = list(inter_plan.stage_specs)

        def layout_fn(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
            return intra_op_layout(loss, chunk_specs[sp.index], sp.eqns, mesh)

    elif stages == "auto":
        stage_plan = optimal_stage_plan(
            num_layers,
            1,
            n,
            stage_cost(stats),
            num_microbatches,
            memory_budget_bytes=memory_budget_bytes,
            schedule=search_schedule,
            num_stages=num_stages,
        )
        ids = place_submeshes([a.submesh for a in stage_plan.stages], 1, n)
        planned = [
            dataclasses.replace(
                a, layers=stats.layers[a.start_layer : a.end_layer], device_ids=tuple(group)
            )
            for a, group in zip(stage_plan.stages, ids, strict=True)
        ]
    else:
        if stages == "equal-layer":
            ranges = list(equal_layer_stages(num_layers, num_stages))
        elif stages == "equal-flops":
            ranges = list(equal_flops_stages(stats.forward_flops, num_stages))
        else:
            ranges = stages
        planned = _equal_data_parallel_stages(
            ranges, n, stage_cost(stats), stats, num_microbatches, search_schedule
        )
    if layout == "data-parallel":
        planned = [dataclasses.replace(s, recompute=recompute) for s in planned]
        if virtual_stages > 1:
            planned = _chunks(planned, virtual_stages, stats)

        def layout_fn(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
            return StageLayout(spec_fn)

    replica_programs = None
    if grad_reduce == "step" and layout == "data-parallel":  # FLOPs costs: every dp > 1
        planned = [
            dataclasses.replace(s, grad_reduce="step") if s.logical_mesh[0] > 1 else s
            for s in planned
        ]
    if any(s.grad_reduce == "step" for s in planned):  # intra-op: as the search chose
        check_replica_batch(batch_size, num_microbatches, planned)
        losses = {
            dp: replicas.trace(dp)
            for dp in sorted({s.logical_mesh[0] for s in planned if s.grad_reduce == "step"})
        }
        replica_programs = [
            losses[s.logical_mesh[0]].program if s.grad_reduce == "step" else None for s in planned
        ]
        priced = intra_cost.replicas if intra_cost is not None else None
        layout_fn = replica_layouts(layout_fn, layout, planned, losses, priced)
    programs = split_stages(program.records, [(s.start_layer, s.end_layer) for s in planned])
    return PipelineTrainer(
        program,
        programs,
        planned,
        devices,
        params,
        optimizer,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        layout_fn=layout_fn,
        stage_plan=stage_plan,
        inter_plan=inter_plan,
        intra_cost=intra_cost,
        probe=probe,
        host_params=host_params,
        replica_programs=replica_programs,
        cast_once=cast_once,
    )


def _chunks(stages: Sequence[Stage], virtual_stages: int, stats: LayerStats) -> list[Stage]:
    """Interleaved 1F1B's model chunks: the layers cut into ``S * V`` equal-layer ranges,
    chunk ``v`` on stage ``v % S`` (its devices, logical mesh and recompute mode)."""
    num_stages, num_layers = len(stages), len(stats.layers)
    count = num_stages * virtual_stages
    if count > num_layers:
        fits = [v for v in range(1, num_layers + 1) if num_stages * v <= num_layers]
        raise ValueError(
            f"{num_stages} stages x {virtual_stages} virtual stages = {count} model chunks "
            f"for {num_layers} layers: a chunk needs a layer; use virtual_stages in {fits} "
            "or fewer stages"
        )
    return [
        dataclasses.replace(
            stages[v % num_stages], start_layer=a, end_layer=b, layers=stats.layers[a:b]
        )
        for v, (a, b) in enumerate(equal_layer_stages(num_layers, count))
    ]


def _equal_data_parallel_stages(
    ranges: Sequence[tuple[int, int]],
    num_devices: int,
    cost: StageCostFn,
    stats: LayerStats,
    num_microbatches: int,
    schedule: str,
) -> list[Stage]:
    """Stages on equal slices of the devices, each data parallel over its slice, with the
    latency and memory ``cost`` predicts for them."""
    per = num_devices // len(ranges)
    stages = []
    for i, (start, end) in enumerate(ranges):
        submesh, logical = (1, per), (per, 1)
        in_flight = microbatches_in_flight(i, len(ranges), num_microbatches, schedule)
        c = cost(start, end, submesh, logical)
        stages.append(
            Stage(
                start,
                end,
                submesh,
                logical,
                c.latency_s,
                c.memory_bytes(in_flight),
                in_flight,
                layers=stats.layers[start:end],
                device_ids=tuple(range(i * per, (i + 1) * per)),
            )
        )
    return stages
