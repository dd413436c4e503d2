"""Pricing ``plan="auto"``: Alpa's search on a cluster preset, reported as a simulation.

:func:`simulate_auto` runs :func:`autoshard.inter.search.search_stages` (intra-op ILPs
with HiGHS on abstract shapes, then the stage DP) over the stage costs of
:func:`search_stage_cost`. The step time *is* the search objective
``sum(t) + (m - 1) max(t)``, the memory the chosen stages' peak bytes; with
``recompute="none"`` the search gets the device's HBM as its budget.

Recompute under ``auto``: a plan dimension of the stage DP. Every stage candidate is
costed with no, selective and full recompute of its transformer blocks
(:func:`autoshard.inter.stage_memory.recompute_costs`: the forward or attention-core time of the chosen
intra-op plans added to the latency, the activations Korthikanti et al.'s scheme keeps);
with ``recompute="auto"`` (the default for ``plan="auto"``) the DP takes, per stage, the
fastest mode whose memory fits the device's HBM, and records it in ``plan["stages"]``;
``none`` / ``selective`` / ``full`` force one mode on every stage. If no plan fits, the
fastest is reported, flagged ``oom``.

Frontier scale: a GPT deeper than :data:`FOLD_MIN_BLOCKS` blocks is traced with
:data:`FOLD_BLOCKS` and its stage costs folded to the full depth (exact: identical blocks
plan identically, :func:`search_stage_cost`), and where one run of Alpa's stage DP
would exceed 2e9 element operations (GPT-175B on 512 GPUs already does) it keeps one
sub-mesh shape per pipeline (``StageSearchOptions.submesh_search``).

Micro-batches under ``auto``: one count (:func:`_default_microbatches`, or the caller's),
or searched (:func:`microbatch_candidates`, :func:`search_microbatches`): the whole search
above runs once per candidate count and the fastest report that fits the HBM wins (none
fits: the one with the least peak memory), the candidates tried recorded in
``plan["microbatch_search"]``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from types import MappingProxyType

from autoshard.hardware.clusters import Cluster
from autoshard.sim import formulas
from autoshard.sim.breakdown import pipeline_step_breakdown
from autoshard.sim.grid import best_point, grid_points, megatron_grid
from autoshard.sim.megatron import GPTShape
from autoshard.sim.report import SimulationReport

DEFAULT_AUTO_MICROBATCHES = 64  # the most micro-batches ``auto`` uses unless told


def _default_microbatches(
    batch: int, shape: GPTShape | None = None, cluster: Cluster | None = None, dtype=None
) -> int:
    """Micro-batches of ``plan="auto"`` when none are given: the largest divisor of the
    batch up to ``DEFAULT_AUTO_MICROBATCHES``; but if no Megatron layout fits the HBM at
    that micro-batch size (full recompute), as many as the fastest Megatron layout that
    fits uses -- smaller micro-batches, so that the search has plans that fit. The grid
    takes about 0.1 s to simulate; the search itself would take a minute per count."""
    m = max(d for d in range(1, min(batch, DEFAULT_AUTO_MICROBATCHES) + 1) if batch % d == 0)
    if shape is None or cluster is None:
        return m
    configs = megatron_grid(shape, cluster, batch, None, "full", dtype)
    fitting = [p for p in grid_points(shape, configs, cluster, 0) if not p.oom]
    # Megatron's micro-batch is per data-parallel replica; ours is the global micro-batch
    if not fitting or any(p.cfg.micro_batch == batch // m for p in fitting):
        return m
    return max(m, best_point(fitting).cfg.num_microbatches)


MICROBATCH_SEARCH = "search"  # num_microbatches="search": the default candidates


def microbatch_candidates(batch: int, default: int | None, extra=(), valid=None) -> tuple[int, ...]:
    """The micro-batch counts ``plan="auto"`` searches, ascending: ``default``, a quarter
    and half of it, twice and four times it, each kept only if it is whole, divides
    ``batch`` (a micro-batch at least one sequence) and ``valid(count)`` holds (a
    GPT-MoE's micro-batch holds whole expert groups); plus every count of ``extra`` (e.g.
    Megatron-LM's best point's), which must divide the batch and pass ``valid``, else a
    ValueError naming the count. ``default`` None: ``extra`` only."""
    for c in extra:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"a micro-batch count to search must be a positive int, got {c!r}")
        if batch % c:
            raise ValueError(
                f"micro-batch count {c} to search does not divide the global batch {batch}"
            )
        if valid is not None and not valid(c):
            raise ValueError(f"micro-batch count {c} to search is not valid for this model")
    found = set(extra)
    if default is not None:
        # a quarter: where the default's micro-batch is small, 4x larger ones can win
        # (docs/weak_scaling.md, cause 5: 16 of 1,024 sequences at 1-16 GPUs)
        around = [default * 2, default * 4] + [default // k for k in (2, 4) if default % k == 0]
        found |= {default} | {c for c in around if batch % c == 0 and (valid is None or valid(c))}
    if not found:
        raise ValueError("no micro-batch count to search")
    return tuple(sorted(found))


def search_microbatches(price, candidates, label: str = "auto") -> SimulationReport:
    """``price(m)`` (a :class:`SimulationReport` of ``plan="auto"`` at ``m`` micro-batches)
    for each of ``candidates``; returns the fastest report that fits the HBM (none fits:
    the one with the least peak memory per device), its ``plan["microbatch_search"]`` the
    list of candidates tried (count, micro-batch, step time, peak bytes, fits, search
    seconds, chosen) and its ``search_seconds`` the sum over them. One stderr line per
    candidate says how far the search has got (each is a whole search)."""
    if not candidates:
        raise ValueError("no micro-batch count to search")
    reports = []
    for i, m in enumerate(candidates):
        print(f"{label}: micro-batch search {i + 1}/{len(candidates)}: m={m} ...",
              file=sys.stderr, flush=True)  # fmt: skip
        r = price(m)
        reports.append(r)
        print(f"{label}:   m={m}: step {r.step_time_s:.4g} s, "
              f"{'out of memory' if r.oom else 'fits'}, searched in {r.search_seconds:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    fits = [r for r in reports if not r.oom]
    best = (
        min(fits, key=lambda r: r.step_time_s)
        if fits
        else min(reports, key=lambda r: r.peak_bytes_per_device)
    )
    tried = [
        {
            "num_microbatches": r.plan["num_microbatches"],
            "microbatch_size": r.plan["microbatch_size"],
            "step_time_s": r.step_time_s,
            "peak_bytes_per_device": r.peak_bytes_per_device,
            "fits": not r.oom,
            "search_seconds": r.search_seconds,
            "chosen": r is best,
        }
        for r in reports
    ]
    plan = dict(best.plan, microbatch_search=tried)
    return dataclasses.replace(
        best,
        plan=MappingProxyType(plan),
        search_seconds=sum(r.search_seconds for r in reports),
    )


def _hardware_flops(shape: GPTShape, batch: int, stages, layers_per_stage) -> int:
    """Model FLOPs plus what each stage's recompute mode adds for its transformer blocks."""
    s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    flops = formulas.model_flops_per_step(batch, s, n_layers, h, v)
    for stage, blocks in zip(stages, layers_per_stage, strict=True):
        flops += formulas.recompute_flops_per_step(batch, s, blocks, h, stage.recompute)
    return flops


def _traced_flops(graph, m: int, stages) -> tuple[float, float]:
    """(model, hardware) FLOPs per step read off the traced step of one micro-batch, for
    models with no closed form (GPT-MoE): model = forward + backward equations, times
    ``m``, less what a node recomputes itself (a fused attention backward's scores,
    :func:`~autoshard.ir.graph.recomputed_flops`); hardware adds those back and, per stage,
    the forward FLOPs its recompute mode runs again in its blocks (full: their forward;
    selective: their attention-sized equations, none with fused attention) -- not the
    first layer (embedding) nor the last (logits and loss), as for GPT."""
    from autoshard.inter.stage_memory import is_attention_sized
    from autoshard.ir.graph import recomputed_flops

    learn = ("forward", "backward")
    model_flops = m * graph.model_flops_where(phases=learn)
    extra = sum(recomputed_flops(n) for n in graph.nodes if n.phase in learn)
    last = len(graph.layers) - 1
    for st in stages:
        names = {graph.layers[i] for i in range(st.start_layer, st.end_layer) if 0 < i < last}
        forward = [n for n in graph.nodes if n.phase == "forward" and n.layer in names]
        if st.recompute == "full":
            extra += sum(n.flops for n in forward)
        elif st.recompute == "selective":
            extra += sum(
                n.flops
                for n in forward
                if any(is_attention_sized(graph.tensors[t].shape) for t in (*n.inputs, *n.outputs))
            )
    return model_flops, model_flops + m * extra


def simulate_auto(
    model, shape, cluster, batch, num_microbatches, recompute, dtype, peak, time_limit, overrides,
    seq_len: int | None = None, optimizer: str = "adamw", progress=None, offload=None,
    grad_reduce: str = "microbatch",
) -> SimulationReport:  # fmt: skip
    """``plan="auto"`` with ``num_microbatches`` micro-batches per step (``None``: see
    :func:`_default_microbatches`); ``plan["microbatch_size"]`` in the report is the
    global micro-batch ``batch / m``, which each stage splits over its own DP degree.
    ``shape=None`` (a GPT-MoE): FLOPs come from the traced step (:func:`_traced_flops`)
    and ``seq_len`` gives the tokens per sequence. ``optimizer``: the traced step's
    (:data:`autoshard.models.OPTIMIZERS`). ``progress``: where the phases report
    (:class:`autoshard.inter.progress.Progress`; default: stderr once past 2 s).
    ``offload``: an :class:`~autoshard.intra.offload.placement.Offload` every stage takes (its state
    out of HBM, its transfers and host update priced per step, :class:`autoshard.inter.
    stage_cost.IntraStageCost`), or ``"auto"``: where memory binds, each stage chooses its
    placement (none or one of :func:`~autoshard.inter.stage_offload.auto_placements`) with
    its logical mesh and recompute mode, the fastest that fits its HBM, kept where nothing
    fits without offload or it gains ``AUTO_MIN_GAIN`` (:mod:`autoshard.inter.stage_offload`);
    ``plan["offload"]`` then says what lives where (absent when no stage offloads).
    ``grad_reduce`` (:data:`autoshard.inter.stages.GRAD_REDUCE_CHOICES`): where a stage with several data-parallel
    replicas reduces its gradients: ``"microbatch"`` (every micro-batch's backward, as the
    pipeline runtime's default), ``"step"`` (once per step: replicas of a plan over
    ``model``) or ``"auto"`` (each stage chooses, with its logical mesh and recompute
    mode); each stage's ``grad_reduce`` in ``plan["stages"]`` says which it takes."""
    from autoshard.inter.options import StageSearchOptions
    from autoshard.inter.progress import Progress
    from autoshard.inter.search import search_stages
    from autoshard.inter.stage_offload import offload_summary
    from autoshard.inter.stages import StageBudgetError, grad_reduces_for

    progress = progress or Progress(f"{model} auto")

    if num_microbatches is None:
        m = _default_microbatches(batch, shape, cluster, dtype)
    elif batch % num_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} does not divide the global batch {batch}"
        )
    else:
        m = num_microbatches
    b = batch // m
    hosts, per_host = cluster.num_nodes, cluster.devices_per_node
    t0 = time.perf_counter()
    # one set of intra-op ILPs, shared by the search under the HBM budget and, when
    # nothing fits, by the unconstrained search that reports the fastest plan as OOM
    choose = offload == "auto"  # each stage chooses: the plain cost, offloaded in the search
    with progress.phase(f"trace (m={m})"):
        cost = shared_stage_cost(
            model, cluster, batch, m, dtype, time_limit, overrides, optimizer=optimizer,
            offload=None if choose else offload,
        )  # fmt: skip
    ilp_seconds_before = cost.seconds  # the cost may come from an earlier call
    traced_graph = cost.graph
    t_trace = time.perf_counter()
    modes = formulas.RECOMPUTE_MODES if recompute == "auto" else (recompute,)
    options = StageSearchOptions(
        m, recompute_modes=modes, grad_reduces=grad_reduces_for(grad_reduce)
    )
    hbm = cluster.device.hbm_bytes
    try:
        inter = search_stages(
            traced_graph,
            hosts,
            per_host,
            dataclasses.replace(options, memory_budget_bytes=hbm),
            cluster=cluster if choose else None,
            cost=cost,
            model=model,
            progress=progress,
            offload="auto" if choose else None,
        )
    except StageBudgetError:  # nothing fits (with offload too, when each stage chooses)
        inter = search_stages(
            traced_graph, hosts, per_host, options, cost=cost, model=model, progress=progress
        )
    total = time.perf_counter() - t0
    phases = {  # over both searches when the fallback ran (the ILPs are solved once)
        "trace": t_trace - t0,  # trace and stage-cost set-up
        "intra_op_ilps": cost.seconds - ilp_seconds_before,
        "stage_dp": max(total - (t_trace - t0) - (cost.seconds - ilp_seconds_before), 0.0),
    }
    inter = dataclasses.replace(inter, search_seconds=total, phase_seconds=phases)

    last = cost.num_layers - 1
    blocks = [
        sum(1 for i in range(st.start_layer, st.end_layer) if 0 < i < last) for st in inter.stages
    ]
    stages = [
        {
            "layers": [st.layers[0], st.layers[-1]],
            "num_layers": len(st.layers),
            "submesh": list(st.submesh),
            "logical_mesh_dp_tp": list(st.logical_mesh),
            "recompute": st.recompute,
            "offload": st.offload,
            "grad_reduce": st.grad_reduce,
            "latency_s": st.latency_s,
            "peak_bytes": st.peak_bytes,
            "microbatches_in_flight": assigned.microbatches_in_flight,
        }
        for st, assigned in zip(inter.stages, inter.stage_plan.stages, strict=True)
    ]
    step = inter.objective_s
    fill = sum(st.latency_s for st in inter.stages)
    logical = {tuple(st.logical_mesh) for st in inter.stages}
    dp, tp = next(iter(logical)) if len(logical) == 1 else (None, None)
    plan_dict = {
        "kind": "auto",
        "tp": tp,
        "pp": len(inter.stages),
        "dp": dp,
        "microbatch_size": b,
        "num_microbatches": m,
        "global_batch": batch,
        "recompute": recompute,
        "dtype": dtype,
        "optimizer": optimizer,
        "zero_stage": None,
        "sequence_parallel": False,
        "virtual_stages": 1,
        "program": "traced",
        "stages": stages,
        "search_objective_s": inter.objective_s,
        "num_ilps": inter.num_ilps,
        "phase_seconds": dict(inter.phase_seconds),
    }
    peak_bytes = max(st.peak_bytes for st in inter.stages)
    if inter.offload:  # each stage chose (auto)
        plan_dict["offload"] = dict(inter.offload)
    elif offload and not choose:
        plan_dict["offload"] = offload_summary(cost, inter.stages, cluster)
    gpus = cluster.num_gpus
    if shape is None:
        s = seq_len
        model_flops, hw_flops = _traced_flops(traced_graph, m, inter.stages)
    else:
        s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
        model_flops = formulas.model_flops_per_step(batch, s, n_layers, h, v)
        hw_flops = _hardware_flops(shape, batch, inter.stages, blocks)
    return SimulationReport(
        model=model,
        cluster=cluster.name,
        gpus=gpus,
        step_time_s=step,
        tokens_per_s=batch * s / step,
        tflops_per_device=hw_flops / step / gpus / 1e12,
        mfu=formulas.flops_utilization(model_flops, step, gpus, peak),
        hfu=formulas.flops_utilization(hw_flops, step, gpus, peak),
        peak_bytes_per_device=peak_bytes,
        oom=peak_bytes > hbm,
        plan=MappingProxyType(plan_dict),
        breakdown=MappingProxyType({"pipeline_fill": fill, "pipeline_steady": step - fill}),
        search_seconds=inter.search_seconds,
        step_breakdown=pipeline_step_breakdown(
            cost,
            [
                (st.start_layer, st.end_layer, st.logical_mesh, st.recompute, st.latency_s)
                + (st.offload, st.grad_reduce)
                for st in inter.stages
            ],
            m,
            step,
        ),
    )


_STAGE_COSTS: dict = {}  # the last few IntraStageCosts, by request: their ILPs are reused
# a micro-batch search's candidates (5 around the default, and weak_scaling.py's two
# Megatron-LM counts) and one more
_STAGE_COSTS_KEPT = 8


def shared_stage_cost(
    model, cluster, batch, m, dtype, time_limit, overrides, optimizer="adamw", offload=None
):
    """:func:`search_stage_cost`, kept for the next call with the same arguments, so that
    ``plan="auto"`` and a Megatron grid on the traced program (:mod:`autoshard.sim.traced`)
    at the same micro-batches price the same plans from the same ILPs (each logical mesh's
    ILPs are solved once per process). The last ``_STAGE_COSTS_KEPT`` used are kept, so
    that a micro-batch search's chosen count is still there for the restricted searches
    of ``experiments/weak_scaling.py``."""
    key = (model, repr(cluster), batch, m, dtype, time_limit, tuple(sorted(overrides.items())))
    key += (optimizer, offload)
    if key in _STAGE_COSTS:  # least recently used goes first
        _STAGE_COSTS[key] = _STAGE_COSTS.pop(key)
    else:
        if len(_STAGE_COSTS) >= _STAGE_COSTS_KEPT:
            _STAGE_COSTS.pop(next(iter(_STAGE_COSTS)))
        _STAGE_COSTS[key] = search_stage_cost(
            model, cluster, batch, m, dtype, time_limit, overrides, optimizer=optimizer,
            offload=offload,
        )  # fmt: skip
    return _STAGE_COSTS[key]


def search_stage_cost(
    model, cluster, batch, m, dtype, time_limit, overrides, baseline=None, optimizer="adamw",
    graph=None, offload=None, trace_m=None,
):  # fmt: skip
    """The stage costs ``plan="auto"``'s search uses: intra-op ILPs (HiGHS) over the
    traced step of ``m`` micro-batches, priced at ``dtype``'s peak and GEMM efficiency on
    ``cluster`` (an :class:`autoshard.inter.stage_cost.IntraStageCost`; its ``graph`` is the step).
    ``baseline``: every stage's inputs pinned the way that intra-op baseline does (a
    restricted search, e.g. ZeRO data parallelism). ``optimizer``: the traced step's.
    ``graph``: that traced step, already traced with these arguments (another baseline's
    ``IntraStageCost.graph``), so it is not traced again. ``offload``: the
    :class:`~autoshard.intra.offload.placement.Offload` every stage takes (None: none).

    Depth folding: a GPT of more than :data:`FOLD_MIN_BLOCKS` blocks (no baseline, no
    ``graph`` given) is traced with :data:`FOLD_BLOCKS` blocks only and the cost stands
    for the whole depth (``IntraStageCost(deep_layers=...)``: identical blocks plan the
    same, so the deep step's stage costs are the shallow one's units and junctions); a
    trace that is not such a chain is traced again whole."""
    from autoshard.api_pipeline import microbatch_graph  # lazy: traces with jax
    from autoshard.inter.stage_cost import IntraStageCost
    from autoshard.inter.submesh import cluster_for, logical_mesh_costs
    from autoshard.models import get_workload
    from autoshard.models.gpt import GPTConfig

    search_cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, default_dtype=dtype)
    )
    mesh_for = logical_mesh_costs(
        cluster_for(search_cluster, cluster.num_nodes, cluster.devices_per_node)
    )
    trace_dtype = "float32" if dtype == "fp32" else "bfloat16"

    trace_m = m if trace_m is None else trace_m
    replicas = None
    if baseline is None and not offload and trace_m == m:
        replicas = _replica_costs(model, cluster, batch, m, dtype, time_limit, overrides, optimizer)

    def cost_of(g, deep_layers=None):
        return IntraStageCost(
            g, mesh_for, solver="highs", time_limit_s=time_limit, num_microbatches=m,
            baseline=baseline, deep_layers=deep_layers, replicas=replicas,
            **({"offload": offload, "cluster": cluster} if offload else {}),
        )  # fmt: skip

    if graph is None and baseline is None:
        config = get_workload(model, **{k: v for k, v in overrides.items() if k != "batch_size"})
        blocks = config.config.num_layers
        if type(config.config) is GPTConfig and blocks > FOLD_MIN_BLOCKS:  # not MoE, ResNet
            _, shallow = microbatch_graph(
                model, trace_m, optimizer, batch_size=batch, dtype=trace_dtype,
                **{**overrides, "num_layers": FOLD_BLOCKS},
            )  # fmt: skip
            if len(shallow.layers) == FOLD_BLOCKS + 2:
                try:
                    return cost_of(shallow, deep_layers=blocks + 2)
                except ValueError:
                    pass  # not a chain of identical blocks: trace it whole
    if graph is None:
        _, graph = microbatch_graph(
            model, trace_m, optimizer, batch_size=batch, dtype=trace_dtype, **overrides
        )
    return cost_of(graph)


def _replica_costs(model, cluster, batch, m, dtype, time_limit, overrides, optimizer):
    """``dp -> IntraStageCost`` of the step traced at ``1/dp`` of the micro-batch, amortised
    over the same ``m`` micro-batches (the replicas a ``grad_reduce="step"`` stage runs,
    :meth:`autoshard.inter.stage_cost.IntraStageCost.replica_range_cost`); None where the
    micro-batch does not split into ``dp`` equal parts (or a GPT-MoE's expert groups
    would be cut: the trace refuses). Each traced once, when first asked."""
    memo: dict = {}

    def replicas(dp: int):
        if dp not in memo:
            memo[dp] = None
            if batch % (m * dp) == 0:
                try:
                    memo[dp] = search_stage_cost(
                        model, cluster, batch, m, dtype, time_limit, overrides,
                        optimizer=optimizer, trace_m=m * dp,
                    )  # fmt: skip
                except ValueError:
                    memo[dp] = None
        return memo[dp]

    return replicas


FOLD_BLOCKS = 3  # blocks traced when a deep GPT is folded (first, middle, last)
FOLD_MIN_BLOCKS = 8  # fold GPTs deeper than this
