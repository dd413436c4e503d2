"""Alpa's full inter-operator search: stages on sub-meshes, with intra-op stage costs.

Takes a traced training step (:class:`~autoshard.ir.graph.Graph` of forward, backward and
optimizer update, traced at the **microbatch** size), a cluster and the search's
settings (:class:`~autoshard.inter.options.StageSearchOptions`); returns an
:class:`~autoshard.inter.plan.InterPlan`: contiguous layer ranges, each on a sub-mesh
viewed as a ``(dp, tp)`` logical mesh, minimising Alpa's pipeline latency
``sum(t) + (B - 1) max(t)`` (the DP of :mod:`autoshard.inter.stages`), with stage costs
from intra-op ILPs (:class:`~autoshard.inter.stage_cost.IntraStageCost`) and each
stage's intra-op plan.  Jax-free: tracing the step is the API's
(:func:`autoshard.api_pipeline.auto_stage_plan`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping

from autoshard.inter.options import STAGE_METHODS, StageSearchOptions
from autoshard.inter.plan import InterPlan, Shape2
from autoshard.inter.progress import Progress
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stage_replicas import refuse_coupled_replicas
from autoshard.inter.stages import (
    NO_GRAD_REDUCE,
    NO_PLACEMENT,
    StageCost,
    cost_stage_choices,
    equal_flops_stages,
    equal_layer_stages,
    logical_mesh_shapes,
    optimal_stage_plan,
    place_submeshes,
    submesh_shapes,
)
from autoshard.inter.submesh import cluster_for, logical_mesh_costs
from autoshard.inter.uniform_stages import (
    ALPA_DP_WORK_LIMIT,
    alpa_dp_work,
    megatron_logical_meshes,
    uniform_stage_plan,
)
from autoshard.ir.graph import Graph


def check_positive_int(name: str, value) -> int:
    """``value`` if it is a positive int (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _equal_submesh(num_stages: int, num_hosts: int, devices_per_host: int) -> Shape2:
    n = num_hosts * devices_per_host
    per = n // num_stages
    shape = (1, per) if per <= devices_per_host else (per // devices_per_host, devices_per_host)
    if n % num_stages or shape not in submesh_shapes(num_hosts, devices_per_host):
        ok = [
            s
            for s in range(1, n + 1)
            if n % s == 0
            and (
                (1, n // s)
                if n // s <= devices_per_host
                else (n // s // devices_per_host, devices_per_host)
            )
            in submesh_shapes(num_hosts, devices_per_host)
        ]
        raise ValueError(
            f"{n} devices ({num_hosts}x{devices_per_host}) cannot be split into {num_stages} "
            f"equal sub-meshes of Alpa's shapes {submesh_shapes(num_hosts, devices_per_host)}; "
            f"use num_stages in {ok}, or stages='auto'"
        )
    return shape


def _microbatch(graph: Graph) -> int:
    """The micro-batch the step was traced at: the gcd of its data inputs' leading
    dimensions (0 if it has none)."""
    dims = [
        graph.tensors[t].shape[0] for t in graph.inputs_of_kind("data") if graph.tensors[t].shape
    ]
    return math.gcd(*dims) if dims else 0


def _same_graph(a: Graph, b: Graph) -> bool:
    """Whether two traces of a step are the same program (ids, primitives, shapes)."""
    return (
        a is b
        or a.layers == b.layers
        and len(a.nodes) == len(b.nodes)
        and len(a.tensors) == len(b.tensors)
        and all(x.primitive == y.primitive for x, y in zip(a.nodes, b.nodes))
        and all(x.shape == y.shape for x, y in zip(a.tensors, b.tensors))
    )


def _forced_logical(cost, forced: Mapping[tuple[int, int], Shape2]):
    """``cost`` restricted to one logical mesh per range (``inf`` for the others)."""

    def restricted(
        start: int, end: int, submesh: Shape2, logical: Shape2, *mode: str, **grad_reduce: str
    ) -> StageCost:
        want = forced[(start, end)]
        if tuple(logical) != want:
            return StageCost(math.inf, 0.0, 0.0)
        return cost(start, end, submesh, logical, *mode, **grad_reduce)

    return restricted


def _search_offloaded(
    graph, num_hosts, devices_per_host, options, cluster, cost, model, progress, offload
) -> InterPlan:
    """:func:`search_stages` under ``offload`` (a placement or ``"auto"``;
    :mod:`autoshard.inter.stage_offload`)."""
    from autoshard.inter.stage_offload import search_with_offload

    the_cluster = cluster_for(cluster, num_hosts, devices_per_host)
    if getattr(the_cluster, "host", None) is None:
        raise ValueError(
            "offload prices host memory and PCIe transfers from a cluster preset's 'host' "
            f"section; {'no cluster was given' if cluster is None else f'{the_cluster.name} has none'}"
            ": pass --cluster alpa-v100 (or dgx-a100, dgx-h100, dgx2h-v100)"
        )
    if offload != "auto":
        from autoshard.intra.offload.placement import offload_tensors

        if offload.state:  # says what the program cannot offload
            offload_tensors(graph, offload.state)
    if options.memory_budget_bytes is None:
        options = dataclasses.replace(options, memory_budget_bytes=the_cluster.device.hbm_bytes)
    if cost is None:
        cost = IntraStageCost(
            graph,
            logical_mesh_costs(the_cluster),
            solver=options.solver,
            time_limit_s=options.time_limit_s,
            granularity=options.granularity,
            num_microbatches=options.num_microbatches,
        )

    def run(stage_cost, bounded: bool = True):
        how = options if bounded else dataclasses.replace(options, memory_budget_bytes=None)
        return search_stages(
            graph, num_hosts, devices_per_host, how, cluster=cluster,
            cost=stage_cost, model=model, progress=progress,
        )  # fmt: skip

    return search_with_offload(run, offload, cost, the_cluster)


def search_stages(
    graph: Graph,
    num_hosts: int,
    devices_per_host: int,
    options: StageSearchOptions,
    *,
    cluster=None,
    cost: IntraStageCost | None = None,
    model: str = "model",
    progress: Progress | None = None,
    offload=None,
    replica_graphs: Callable[[int], Graph | None] | None = None,
) -> InterPlan:
    """Alpa's inter-operator search on a step already traced at the microbatch size.

    ``options`` (:class:`~autoshard.inter.options.StageSearchOptions`) says how to choose
    stages and set the ILPs.  ``cluster``: a preset name (``alpa-v100``, ...), a Cluster,
    or None (abstract links, see :func:`~autoshard.inter.submesh.cluster_for`).  ``cost``
    reuses an :class:`IntraStageCost` (and its solved ILPs) built for the same step (it
    then sets the ILPs, not ``options``).  ``model`` names the plan.  The returned plan
    carries each stage's intra-op plan (``stage_specs``).  Raises ``ValueError`` for more
    stages than layers or devices, equal sub-meshes that do not tile the cluster, and a
    model that fits no stage configuration (with the smallest budget that would).
    ``replica_graphs(dp)``: the same step traced at 1/dp of the microbatch (None where it
    does not split so), for ``options.grad_reduces`` with ``"step"`` when no ``cost`` is
    given. ``progress``: where a long search reports its phases (default: stderr after 2 s,
    :mod:`autoshard.inter.progress`).
    ``offload``: None, an :class:`~autoshard.intra.offload.placement.Offload` every stage
    takes, or ``"auto"``: each stage chooses its placement with its logical mesh and
    recompute mode (:mod:`autoshard.inter.stage_offload`; needs a ``cluster`` with a
    ``host`` section; without a budget in ``options``, the cluster's HBM per device is the
    budget; ``cost``, if given, must be built without offload); the plan's ``offload``
    says what lives where. A ``cost`` with several ``placements``
    (:class:`~autoshard.inter.stage_offload.PlacementChoice`) lets the stage DP choose
    among them; each stage's ``offload`` says which it took.
    """
    if offload is not None and (offload == "auto" or offload):
        if options.grad_reduces != NO_GRAD_REDUCE:
            raise ValueError(
                f"grad_reduces={options.grad_reduces} is priced without offload (a replica's "
                "state is not offloaded yet): search with offload or with the reduction every "
                "microbatch, not both"
            )
        return _search_offloaded(
            graph, num_hosts, devices_per_host, options, cluster, cost, model, progress, offload
        )
    progress = progress or Progress()
    num_microbatches, stages = options.num_microbatches, options.stages
    num_stages, logical_meshes = options.num_stages, options.logical_meshes
    schedule, recompute_modes = options.schedule, options.recompute_modes
    memory_budget_bytes, grad_reduces = options.memory_budget_bytes, options.grad_reduces
    t_start = time.perf_counter()
    check_positive_int("num_hosts", num_hosts)
    check_positive_int("devices_per_host", devices_per_host)
    check_positive_int("num_microbatches", num_microbatches)
    explicit = not isinstance(stages, str)
    if not explicit and stages not in STAGE_METHODS:
        raise ValueError(
            f"unknown stages={stages!r}; use one of {STAGE_METHODS} or (start, end) layer ranges"
        )
    layer_names = graph.layers if cost is None else cost.layer_names
    num_layers, num_devices = len(layer_names), num_hosts * devices_per_host
    if num_layers == 0:
        raise ValueError("the traced step has no layer tags; nothing to split into stages")
    if explicit:
        ranges = tuple((int(a), int(b)) for a, b in stages)
        if num_stages is not None and num_stages != len(ranges):
            raise ValueError(f"num_stages={num_stages} but {len(ranges)} layer ranges were given")
        num_stages = len(ranges)
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)
        if num_stages > num_layers or num_stages > num_devices:
            raise ValueError(
                f"num_stages={num_stages} is impossible: {num_layers} layers "
                f"({', '.join(layer_names)}) on {num_devices} devices; each stage needs a "
                f"layer and a device, so use 1..{min(num_layers, num_devices)}"
            )
    elif stages != "auto":
        raise ValueError(f"stages={stages!r} needs num_stages")
    if logical_meshes is not None and (not explicit or len(logical_meshes) != num_stages):
        raise ValueError(
            "logical_meshes fixes one (dp, tp) per stage: give it with explicit layer ranges, "
            f"one per range; got {len(logical_meshes)} for stages={stages!r}"
        )

    if cost is None:
        mesh_for = logical_mesh_costs(cluster_for(cluster, num_hosts, devices_per_host))

        def cost_of(g, replicas=None):
            return IntraStageCost(
                g,
                mesh_for,
                solver=options.solver,
                time_limit_s=options.time_limit_s,
                granularity=options.granularity,
                num_microbatches=num_microbatches,
                replicas=replicas,
            )

        replicas = None
        if replica_graphs is not None:
            memo: dict = {}

            def replicas(dp: int):
                if dp not in memo:
                    g = replica_graphs(dp)
                    memo[dp] = None if g is None else cost_of(g)
                return memo[dp]

        cost = cost_of(graph, replicas)
    elif not _same_graph(cost.graph, graph) or cost.num_microbatches != num_microbatches:
        raise ValueError(
            "the IntraStageCost given was built for another traced step or microbatch count"
        )
    if grad_reduces == ("step",) and getattr(cost, "replicas", None) is not None:
        refuse_coupled_replicas(cost, num_devices)  # replicas asked for: not another program
    placements = tuple(getattr(cost, "placements", NO_PLACEMENT))
    t0 = time.perf_counter()
    seconds_before = cost.seconds
    method = stages if not explicit else "manual"
    if stages == "auto":
        search = options.submesh_search
        if search == "auto":
            work = alpa_dp_work(num_layers, num_hosts, devices_per_host)
            search = "uniform" if work > ALPA_DP_WORK_LIMIT else "alpa"
        if search == "uniform" and grad_reduces != NO_GRAD_REDUCE:
            raise ValueError(
                "grad_reduces other than ('microbatch',) is priced by Alpa's stage DP; the "
                "uniform sub-mesh search (thousands of devices) does not offer it: use "
                "submesh_search='alpa'"
            )
        if search == "uniform":
            method = "auto-uniform"
            plan = uniform_stage_plan(
                num_layers, num_hosts, devices_per_host, cost, num_microbatches,
                memory_budget_bytes, schedule, num_stages, recompute_modes, progress,
                megatron_logical_meshes(devices_per_host, _microbatch(graph)), placements,
            )  # fmt: skip
        else:
            plan = optimal_stage_plan(
                num_layers,
                num_hosts,
                devices_per_host,
                cost,
                num_microbatches,
                memory_budget_bytes=memory_budget_bytes,
                schedule=schedule,
                num_stages=num_stages,
                recompute_modes=recompute_modes,
                progress=progress,
                placements=placements,
                grad_reduces=grad_reduces,
            )
    else:
        submesh = _equal_submesh(num_stages, num_hosts, devices_per_host)
        if stages == "equal-layer":
            ranges = equal_layer_stages(num_layers, num_stages)
        elif stages == "equal-flops":
            if cost.folded:
                raise ValueError("equal-flops stages need the whole traced step, not a folded one")
            layer_flops = [0.0] * num_layers
            for n in graph.nodes:
                if n.layer in graph.layers:
                    layer_flops[graph.layers.index(n.layer)] += n.flops
            ranges = equal_flops_stages(layer_flops, num_stages)
        stage_cost = cost
        if logical_meshes is not None:
            forced = {}
            for r, logical in zip(ranges, logical_meshes, strict=True):
                logical = tuple(int(x) for x in logical)
                if logical not in logical_mesh_shapes(submesh):
                    raise ValueError(
                        f"logical mesh {logical} for layers {r} does not view the sub-mesh "
                        f"{submesh}; use one of {list(logical_mesh_shapes(submesh))}"
                    )
                forced[r] = logical
            stage_cost = _forced_logical(cost, forced)
        plan = cost_stage_choices(
            [(r, submesh) for r in ranges],
            num_layers,
            num_hosts,
            devices_per_host,
            stage_cost,
            num_microbatches,
            memory_budget_bytes=memory_budget_bytes,
            schedule=schedule,
            recompute_modes=recompute_modes,
            placements=placements,
            grad_reduces=grad_reduces,
        )
    t_search = time.perf_counter() - t0
    ilp_seconds = cost.seconds - seconds_before
    ids = place_submeshes([s.submesh for s in plan.stages], num_hosts, devices_per_host)
    out_stages = tuple(
        dataclasses.replace(
            s, layers=layer_names[s.start_layer : s.end_layer], device_ids=tuple(group)
        )
        for s, group in zip(plan.stages, ids, strict=True)
    )
    phases = {
        "trace": 0.0,
        "intra_op_ilps": ilp_seconds,
        "stage_dp": max(t_search - ilp_seconds, 0.0),
    }
    return InterPlan(
        model=model,
        stages=out_stages,
        objective_s=plan.objective_s,
        search_seconds=time.perf_counter() - t_start,
        phase_seconds=phases,
        num_ilps=cost.num_ilps,
        num_cache_hits=cost.num_cache_hits,
        num_microbatches=num_microbatches,
        schedule=schedule,
        method=method,
        granularity=cost.granularity,
        stage_plan=plan,
        stage_specs=()
        if cost.folded
        else tuple(
            cost.cost_of(s.offload).stage_specs(s.start_layer, s.end_layer, s.logical_mesh)
            for s in plan.stages
        ),
    )
