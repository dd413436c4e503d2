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
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

from autoshard.api import TracedWorkload, trace_workload
from autoshard.inter import unit_pool
from autoshard.inter.flops_cost import LayerStats, flops_stage_cost, layer_stats
from autoshard.inter.options import STAGE_METHODS, StageSearchOptions
from autoshard.inter.plan import InterPlan, Stage, StageSpecs
from autoshard.inter.program_cut import StageProgram, check_layer_ranges, split_stages
from autoshard.inter.progress import Progress
from autoshard.inter.search import check_positive_int, search_stages
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stages import (
    GRAD_REDUCE_CHOICES,
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
from autoshard.inter.unit_cache import UnitCache
from autoshard.ir.graph import Graph, build_graph
from autoshard.ir.repeat import SHALLOW_BLOCKS, repeat_blocks
from autoshard.ir.spec import ShardingSpec
from autoshard.models import GPT_PRESETS, Workload, get_workload, make_train_step
from autoshard.runtime.pipeline import (
    LayoutFn,
    PipelineTrainer,
    check_virtual_stages,
    data_parallel_layout,
    divisibility_message,
)
from autoshard.runtime.stage import Probe, ReplicaShapes
from autoshard.runtime.stage_layout import (
    LossProgram,
    SpecFn,
    StageLayout,
    data_parallel_spec,
    intra_op_layout,
    loss_program,
)
from autoshard.trace.jaxpr import TracedProgram, trace_train_step

LAYOUTS = ("intra-op", "data-parallel")


# ----------------------------------------------------------------------------- the search


def trace_microbatch(workload, num_microbatches: int, optimizer: str = "adamw", **overrides):
    """Trace ``workload`` (a preset name or a Workload) at the microbatch size.

    The global batch is the workload's (or ``overrides["batch_size"]``); raises if
    ``num_microbatches`` does not divide it, listing the counts that would.
    """
    if isinstance(workload, Workload):
        cfg = workload.config
        keep = (
            "seq_len", "vocab_size", "num_layers", "hidden", "num_heads", "num_experts", "dtype"
        )  # fmt: skip
        base = {k: getattr(cfg, k) for k in keep if hasattr(cfg, k)}
        name = workload.name
    else:
        name, base = str(workload), {}
        cfg = get_workload(name, **overrides).config
    base.update({k: v for k, v in overrides.items() if v is not None})
    batch = int(base.pop("batch_size", None) or cfg.batch_size)
    if batch % num_microbatches:
        fits = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"num_microbatches={num_microbatches} does not divide the global batch size "
            f"{batch}; use one of {fits}"
        )
    return trace_workload(name, optimizer, batch_size=batch // num_microbatches, **base)


def microbatch_graph(
    workload: str, num_microbatches: int, optimizer: str = "adamw", **overrides
) -> tuple[str, Graph]:
    """``(name, graph)`` of :func:`trace_microbatch` for a preset name; with
    ``AUTOSHARD_CACHE_DIR`` set, read from or kept in the on-disk cache
    (:mod:`autoshard.inter.unit_cache`: keyed by the arguments, jax's version and
    autoshard's source), so a repeated search does not trace again."""
    cache = UnitCache.from_env()
    key = None
    if cache is not None:
        settings = (workload, num_microbatches, optimizer, sorted(overrides.items()))
        key = cache.key("microbatch-graph", settings, jax.__version__)
        found = cache.get(key)
        if found is not None:
            return found
    found = _repeated_graph(workload, num_microbatches, optimizer, overrides)
    if found is None:
        traced = trace_microbatch(workload, num_microbatches, optimizer, **overrides)
        found = (traced.workload.name, traced.graph)
    if cache is not None:
        cache.put(key, found)
    return found


def _repeated_graph(workload: str, num_microbatches: int, optimizer: str, overrides: dict):
    """``(name, graph)`` of a deep GPT preset from the trace of its 3-block twin
    (:func:`autoshard.ir.repeat.repeat_blocks`: the same records as the deep trace, at a
    tenth of the JAX work on gpt-39b), or None where that does not apply (another model,
    too few layers, a scanned trace, a trace repeat_blocks refuses)."""
    if workload not in GPT_PRESETS or overrides.get("scan_layers"):
        return None
    layers = overrides.get("num_layers") or get_workload(workload).config.num_layers
    if layers <= SHALLOW_BLOCKS + 1:
        return None
    shallow = {**overrides, "num_layers": SHALLOW_BLOCKS}
    traced = trace_microbatch(workload, num_microbatches, optimizer, **shallow)
    try:
        records = repeat_blocks(traced.program.records, layers)
    except ValueError:
        return None
    return traced.workload.name, build_graph(records)


def auto_stage_plan(
    workload,
    num_hosts: int,
    devices_per_host: int,
    options: StageSearchOptions,
    *,
    cluster=None,
    optimizer: str = "adamw",
    progress: Progress | None = None,
    offload=None,
    **overrides,
) -> InterPlan:
    """Alpa's inter-operator search with stage costs from intra-op ILPs.

    ``workload``: a preset name (``overrides`` such as ``batch_size`` = the global batch
    apply), a :class:`~autoshard.models.Workload`, or a
    :class:`~autoshard.api.TracedWorkload` already traced at the microbatch size.
    ``options``: how to search (:class:`~autoshard.inter.options.StageSearchOptions`:
    ``"auto"``, ``"equal-layer"`` or ``"equal-flops"`` stages, microbatches, schedule,
    recompute modes, memory budget, ILP settings).  ``cluster``: a preset name
    (``alpa-v100``, ...), a Cluster, or None (abstract links, see
    :func:`~autoshard.inter.submesh.cluster_for`).  Raises ``ValueError`` for
    microbatches that do not divide the batch, more stages than layers or devices, and a
    model that fits no stage configuration (with the smallest budget that would).
    ``progress``: where the phases report (default: stderr once the search has run 2 s,
    :class:`~autoshard.inter.progress.Progress`).
    ``offload``: None, a placement (``"optimizer"``, ... or an
    :class:`~autoshard.intra.offload.placement.Offload`) every stage takes, or ``"auto"``
    (:mod:`autoshard.inter.stage_offload`; needs ``cluster``); ``plan.offload`` says what
    lives where per stage.
    """
    offload = _offload_request(offload)
    t_start = time.perf_counter()
    progress = progress or Progress()
    num_microbatches = options.num_microbatches
    check_positive_int("num_microbatches", num_microbatches)
    if (
        options.stages == "auto"
    ):  # the stage ILPs' workers start now, their imports beside the trace
        unit_pool.prestart()
    try:
        if isinstance(workload, TracedWorkload):
            name, graph = workload.workload.name, workload.graph
        elif isinstance(workload, str):
            with progress.phase("trace"):
                name, graph = microbatch_graph(workload, num_microbatches, optimizer, **overrides)
        else:
            with progress.phase("trace"):
                traced = trace_microbatch(workload, num_microbatches, optimizer, **overrides)
            name, graph = traced.workload.name, traced.graph
        t_trace = time.perf_counter() - t_start
        replica_graphs = None
        if options.grad_reduces != ("microbatch",):
            replica_graphs = _replica_graphs(workload, num_microbatches, optimizer, overrides)
        plan = search_stages(
            graph,
            num_hosts,
            devices_per_host,
            options,
            cluster=cluster,
            model=name,
            progress=progress,
            offload=offload,
            replica_graphs=replica_graphs,
        )
    finally:
        unit_pool.release()
    return dataclasses.replace(
        plan,
        search_seconds=time.perf_counter() - t_start,
        phase_seconds={**plan.phase_seconds, "trace": t_trace},
    )


def _replica_graphs(workload, num_microbatches: int, optimizer: str, overrides: dict):
    """``dp -> graph`` of ``workload`` traced at 1/dp of the microbatch (what each replica
    of a ``grad_reduce="step"`` stage runs), None where the batch does not split so."""
    if isinstance(workload, TracedWorkload):
        raise ValueError(
            "grad_reduces with 'step' traces the step again at 1/dp of the microbatch: give "
            "the workload by preset name or as a Workload, not already traced"
        )

    def graph(dp: int):
        try:
            if isinstance(workload, str):
                return microbatch_graph(workload, num_microbatches * dp, optimizer, **overrides)[1]
            return trace_microbatch(workload, num_microbatches * dp, optimizer, **overrides).graph
        except ValueError:  # the microbatch does not split into dp (or cuts expert groups)
            return None

    return graph


def _offload_request(offload):
    """None, ``"auto"`` or a non-empty :class:`~autoshard.intra.offload.placement.Offload`."""
    from autoshard.intra.offload.placement import Offload, parse_offload

    if offload is None:
        return None
    request = offload if isinstance(offload, Offload) else parse_offload(offload)
    return request if request == "auto" or request else None


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
    """
    check_virtual_stages(schedule, virtual_stages)
    offload = _offload_request(offload)
    _check_grad_reduce(grad_reduce, layout, stages, offload, spec_fn)
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
    replica_traces: dict[int, ReplicaTrace | None] = {}
    replica_costs: dict[int, IntraStageCost | None] = {}

    def replica_trace(dp: int) -> ReplicaTrace | None:
        """None where ``dp`` replicas cannot run (the microbatch does not split so, or its
        trace at 1/dp is another program, e.g. a batch dim squeezed at one row): not
        offered to the search under "auto"; an error with "step", which asked for them."""
        if dp not in replica_traces:
            parts = num_microbatches * dp
            found = None
            if batch_size % parts == 0:
                found = _replica_loss(loss_fn, optimizer, abstract, batch, parts)
                try:
                    ReplicaShapes.compare(program, found.program, dp)
                except ValueError:
                    if grad_reduce == "step":
                        raise
                    found = None
            replica_traces[dp] = found
        return replica_traces[dp]

    def replica_cost(dp: int) -> IntraStageCost | None:
        if dp not in replica_costs:
            trace = replica_trace(dp)
            replica_costs[dp] = (
                None
                if trace is None
                else IntraStageCost(
                    build_graph(trace.step.records),
                    logical_mesh_costs(cluster_for(cluster, 1, n)),
                    solver=solver,
                    granularity=intra_cost.granularity,
                    time_limit_s=intra_cost.time_limit_s,
                    num_microbatches=num_microbatches,
                )
            )
        return replica_costs[dp]

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
            )
        if grad_reduce != "microbatch" and intra_cost.replicas is None:
            intra_cost.replicas = replica_cost  # the search prices the replicas' plans
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
        _check_replica_batch(batch_size, num_microbatches, planned)
        losses = {
            dp: replica_trace(dp)
            for dp in sorted({s.logical_mesh[0] for s in planned if s.grad_reduce == "step"})
        }
        replica_programs = [
            losses[s.logical_mesh[0]].program if s.grad_reduce == "step" else None for s in planned
        ]
        layout_fn = _replica_layouts(layout_fn, layout, planned, losses, replica_cost)
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
    )


# ------------------------------------------------- data-parallel replicas (grad_reduce="step")


def _check_grad_reduce(grad_reduce, layout, stages, offload, spec_fn) -> None:
    """ValueError for a ``grad_reduce`` the pipeline cannot run."""
    if grad_reduce not in GRAD_REDUCE_CHOICES:
        raise ValueError(
            f"unknown grad_reduce {grad_reduce!r}; choose one of {GRAD_REDUCE_CHOICES}"
        )
    if grad_reduce == "microbatch":
        return
    if grad_reduce == "auto" and layout != "intra-op":
        raise ValueError(
            "grad_reduce='auto' lets the stage search choose per stage: it needs "
            "layout='intra-op' (the data-parallel layout's FLOPs costs price no reduction); "
            "use grad_reduce='step'"
        )
    if offload is not None:
        raise ValueError(
            "grad_reduce='step' with offload: a stage running data-parallel replicas keeps "
            "its state on the device; drop offload or use grad_reduce='microbatch'"
        )
    if spec_fn is not data_parallel_spec:
        raise ValueError(
            "grad_reduce='step' lays each replica out itself (replicated on a (dp, 1) "
            "mesh); a custom spec_fn needs grad_reduce='microbatch'"
        )


def _check_replica_batch(batch_size: int, num_microbatches: int, planned) -> None:
    """ValueError unless each replica stage's ``dp`` splits every microbatch evenly."""
    for i, st in enumerate(planned):
        dp = st.logical_mesh[0]
        if st.grad_reduce != "step" or batch_size % (num_microbatches * dp) == 0:
            continue
        fits = [m for m in _divisors(batch_size) if batch_size % (m * dp) == 0]
        raise ValueError(
            f"grad_reduce='step': stage {i} runs {dp} data-parallel replicas, so the batch "
            f"size {batch_size} must divide by num_microbatches * dp = {num_microbatches} * "
            f"{dp}; use num_microbatches in {fits}, a batch size that is a multiple of "
            f"{num_microbatches * dp}, or grad_reduce='microbatch'"
        )


def _replica_loss(loss_fn, optimizer, abstract, batch, parts: int) -> ReplicaTrace:
    """The train step and loss of ``batch / parts`` rows, traced as :func:`auto_pipeline`
    traces the microbatch's (the same equations and tensor ids at a smaller batch)."""
    rows = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype), batch
    )
    step = trace_train_step(
        make_train_step(loss_fn, optimizer),
        abstract,
        jax.eval_shape(optimizer.init, abstract),
        rows,
    )
    return ReplicaTrace(step, loss_program(step))


@dataclasses.dataclass(frozen=True)
class ReplicaTrace:
    """A replica's train step (its graph is what the ILP plans) and its loss program
    (what the stage binds)."""

    step: TracedProgram
    loss: LossProgram

    @property
    def program(self) -> TracedProgram:
        return self.loss.program


def _model_only(specs: StageSpecs) -> StageSpecs:
    """A replica's plan made on the ``(1, tp)`` mesh with its ``data`` entries (an axis
    of one device, so nothing) dropped; ValueError for a plan that splits over ``data``."""
    if specs.logical_mesh[0] != 1:
        raise ValueError(
            f"a replica's plan must be made on a (1, tp) mesh, not {tuple(specs.logical_mesh)}"
        )

    def strip(spec: ShardingSpec) -> ShardingSpec:
        dims = tuple(tuple(a for a in d if a != "data") for d in spec.dims)
        partial = tuple(a for a in spec.partial if a != "data")
        return dataclasses.replace(spec, dims=dims, partial=partial)

    def table(m):
        return {k: strip(v) for k, v in m.items()}

    return StageSpecs(
        specs.logical_mesh,
        table(specs.tensor_specs),
        table(specs.input_specs),
        {n: table(o) for n, o in specs.operand_specs.items()},
    )


def replicated_spec(stage: int, tensor, role: str, mesh: jax.sharding.Mesh) -> PartitionSpec:
    """A replica's layout under ``layout="data-parallel"``: everything replicated (the
    runtime splits the batch over ``data`` itself)."""
    return PartitionSpec()


def _replica_layouts(layout_fn, layout, planned, losses, replica_cost):
    """``layout_fn`` with each replica stage laid out as one replica: under
    ``"intra-op"`` the range's ILP plan on ``(1, tp)`` of the loss traced at ``1/dp`` of
    the microbatch (``replica_cost(dp)``'s, the plan the stage search priced; model
    only), under ``"data-parallel"`` replicated."""
    layouts: dict[int, StageLayout] = {}

    def replica_layout(index: int, sp: StageProgram, mesh) -> StageLayout:
        st = planned[index]
        if layout == "data-parallel":
            return StageLayout(replicated_spec)
        dp, tp = st.logical_mesh
        specs = _model_only(replica_cost(dp).stage_specs(st.start_layer, st.end_layer, (1, tp)))
        return intra_op_layout(losses[dp].loss, specs, sp.eqns, mesh)

    def laid_out(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
        if planned[sp.index].grad_reduce != "step":
            return layout_fn(sp, mesh)
        if sp.index not in layouts:
            layouts[sp.index] = replica_layout(sp.index, sp, mesh)
        return layouts[sp.index]

    return laid_out


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
