"""Alpa's plan-level options applied around the ILP (jax-free).

* :func:`prefer_reduce_scatter` -- Alpa's ``prefer_reduce_scatter``. Alpa solves its ILP
  and then, in a post-process, replaces a gradient all-reduce with a reduce-scatter, the
  optimizer update on the scattered shards and an all-gather of the updated parameter,
  "if no communication overhead is introduced": ZeRO-2's memory (optimizer state split
  over the data-parallel devices) for the same bytes on the wire. Here the rewrite is a
  second solve: every optimizer-state input the first plan keeps replicated over its
  data-parallel axes (the axes splitting the batch dim of a data input) is pinned
  split over them, on its first dimension they divide, and the ILP re-plans everything
  else around those pins -- so the second plan is an ordinary ILP plan (its objective is
  its predicted cost, its collectives and peak predicted as for any plan). It is kept
  when it sends no more bytes per device than the first (ring volume of its predicted
  collectives; the alpha term of one more collective per weight is the only overhead
  Alpa's rule ignores, too) and fits the memory budget; otherwise the first plan stays.
  The plan's notes say which, with both peaks and both volumes.
* :func:`checked_forbidden` -- a plan that holds a collective kind the options forbid
  (``allow_all_gather=False`` and the like) says so in a warning and a note: the exact
  per-value program never picks one, but the per-demand program (``exact_values=False``)
  and a solver's fallback plan can.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping

from autoshard.intra.cost.collectives import ring_volume
from autoshard.intra.problem.options import IntraOptions, held_forbidden
from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Mesh, ShardingSpec

MIB = 2**20


def data_parallel_axes(graph: Graph, plan: ParallelPlan) -> tuple[str, ...]:
    """The mesh axes (longer than 1) that split the batch dim of a data input of
    ``plan``, in mesh order (the plan may read an input it only indexes with, such as
    the tokens of an embedding lookup, whole); () where none does."""
    batch_axes = [
        set(spec.dims[0])
        for tid, spec in zip(graph.inputs, plan.input_specs, strict=True)
        if graph.tensors[tid].kind == "data" and graph.tensors[tid].shape
    ]
    if not batch_axes:
        return ()
    split = set.union(*batch_axes)
    return tuple(a for a in plan.mesh.axis_names if a in split and plan.mesh.size(a) > 1)


def split_state_spec(
    spec: ShardingSpec,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    mesh: Mesh,
    allow_mixed: bool = True,
) -> ShardingSpec | None:
    """``spec`` with the ``axes`` it does not use added to one dim they divide: the first
    unsplit dim, else (``allow_mixed``: a dim may be split over several axes) the first
    split dim whose shard they divide (its axes in mesh order, as the strategies list
    them); None where no dim takes them (or ``spec`` uses them all already)."""
    used = {a for d in spec.dims for a in d}
    new = tuple(a for a in axes if a not in used)
    if not new or not shape:
        return None
    n = mesh.size(new)
    for unsplit_first in (True, False) if allow_mixed else (True,):
        for d, size in enumerate(shape):
            if bool(spec.dims[d]) == unsplit_first:
                continue
            shard = size // mesh.size(spec.dims[d]) if spec.dims[d] else size
            if shard % n == 0 and shard >= n:
                both = set(spec.dims[d]) | set(new)
                return spec.with_dim(d, tuple(a for a in mesh.axis_names if a in both))
    return None


def communication_volume(plan: ParallelPlan) -> float:
    """Bytes each device sends for ``plan``'s predicted collectives (ring volumes)."""
    return math.fsum(
        ring_volume(c.kind, plan.mesh.size(c.axes), c.bytes) for c in plan.predicted_collectives
    )


def prefer_reduce_scatter(
    graph: Graph,
    mesh: Mesh,
    plan: ParallelPlan,
    pinned: Mapping[int, ShardingSpec],
    replan: Callable[[dict[int, ShardingSpec]], ParallelPlan],
    allow_mixed: bool = True,
) -> ParallelPlan:
    """``plan`` re-planned with its optimizer state split over its data-parallel axes
    where that moves no more bytes (see the module docstring). ``pinned``: the caller's
    pins (a baseline's), which win; ``replan(pins)`` solves the ILP with ``pins``;
    ``allow_mixed``: the options' ``allow_mixed_mesh_shape`` (where False, no state is
    pinned split over several axes on one dim: the ILP would have no strategy for it)."""
    from autoshard.intra.ilp import InfeasibleBudgetError, InfeasibleProblemError

    axes = data_parallel_axes(graph, plan)
    pins = dict(pinned)
    moved = 0
    for pos, (tid, spec) in enumerate(zip(graph.inputs, plan.input_specs, strict=True)):
        t = graph.tensors[tid]
        if t.kind != "opt_state" or pos in pinned:
            continue
        split = split_state_spec(spec, t.shape, axes, mesh, allow_mixed) if axes else None
        pins[pos] = spec if split is None else split
        moved += split is not None

    def said(text: str, kept: ParallelPlan) -> ParallelPlan:
        note = f"prefer_reduce_scatter: {text}"
        return dataclasses.replace(kept, notes=kept.notes + (note,))

    if not axes:
        return said("no data-parallel axis in the plan (no data input's batch dim is split)", plan)
    if not moved:
        return said(
            f"every optimizer-state input is already split over {axes} or pinned, or no "
            "dim of it is divisible: the plan is unchanged",
            plan,
        )
    try:
        second = replan(pins)
    except (InfeasibleProblemError, InfeasibleBudgetError) as err:
        return said(f"the plan with the state split over {axes} is infeasible ({err})", plan)
    before, after = communication_volume(plan), communication_volume(second)
    figures = (
        f"peak {plan.predicted_peak_bytes / MIB:.4g} -> {second.predicted_peak_bytes / MIB:.4g} "
        f"MiB per device, {before / MIB:.4g} -> {after / MIB:.4g} MiB sent per device"
    )
    if after > before * (1 + 1e-9) + 1.0:
        return said(
            f"kept the first plan: splitting {moved} optimizer-state inputs over {axes} "
            f"would send more ({figures})",
            plan,
        )
    return said(
        f"{moved} optimizer-state inputs split over {axes}, gradients reduce-scattered "
        f"and updated parameters all-gathered ({figures})",
        second,
    )


def checked_forbidden(plan: ParallelPlan, options: IntraOptions, exact: bool) -> ParallelPlan:
    """``plan``, with a warning and a note where it holds a collective kind ``options``
    forbid (``exact``: whether it was priced per value): its reshardings as the ILP priced
    them (``solver["forbidden_held"]``; an all-reduce that XLA reads as a reduce-scatter
    because only slices of it are used is an all-reduce here), else its predicted ones."""
    forbidden = options.forbidden_collectives()
    held = plan.solver.get("forbidden_held")
    if held is None:
        held = held_forbidden({(c.kind, c.axes) for c in plan.predicted_collectives}, forbidden)
    if not held:
        return plan
    said = [
        f"{k}={getattr(options, k)}"
        for k, default in (
            ("all_reduce_only", False), ("allow_all_gather", True), ("allow_all_to_all", True),
            ("force_batch_dim_to_mesh_axis", None),
        )
        if getattr(options, k) != default
    ]  # fmt: skip
    why = (
        f"the plan holds {', '.join(held)} collectives that the options forbid "
        f"({', '.join(said)}): "
        + (
            "the solver kept a fallback plan; give it more time"
            if exact
            else "the per-demand program priced them; plan with exact_values=True"
        )
    )
    warnings.warn(why, stacklevel=3)
    return dataclasses.replace(plan, notes=plan.notes + (why,))
