"""Alpa's inter-operator search on a model preset or workload, costed by intra-op ILPs:
:func:`auto_stage_plan` (``plan --pipeline``), and the traced microbatch it searches
(:func:`trace_microbatch`, :func:`microbatch_graph`: on-disk cache, deep GPTs from a
3-block trace). :mod:`autoshard.api_pipeline` runs what it finds."""

from __future__ import annotations

import dataclasses
import time

import jax

from autoshard.api import TracedWorkload, trace_workload
from autoshard.inter import unit_pool
from autoshard.inter.options import StageSearchOptions
from autoshard.inter.plan import InterPlan
from autoshard.inter.progress import Progress
from autoshard.inter.search import check_positive_int, search_stages
from autoshard.inter.unit_cache import UnitCache
from autoshard.ir.graph import Graph, build_graph
from autoshard.ir.repeat import SHALLOW_BLOCKS, repeat_blocks
from autoshard.models import GPT_PRESETS, Workload, get_workload

LAYOUTS = ("intra-op", "data-parallel")


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
