"""Offload in the stage search: a placement per stage, chosen by the stage DP (jax-free).

Takes the plain stage cost (:class:`~autoshard.inter.stage_cost.IntraStageCost`, built
without offload), a search to run on a stage cost (``search(cost) -> InterPlan``) and the
request (an :class:`~autoshard.intra.offload.placement.Offload` or ``"auto"``); returns the
plan with its ``offload`` record (:func:`offload_summary`: what each stage keeps where, its
host bytes and exposed seconds).

* A placement given outright: every stage takes it (the plain cost under it,
  :meth:`IntraStageCost.with_offload`); a plan whose host state exceeds the node's usable
  RAM: ``ValueError`` saying so.
* ``auto``: first the search without offload, under the budget and without one (the
  same ILPs). Where a plan fits and the one without a budget is less than
  :data:`AUTO_MIN_GAIN` faster, that plan is the answer: no placement can beat it by
  that much (a device update's placement and offloaded activations price each stage
  variant on the same plan as without offload, plus their transfers, so never faster;
  the host update would have to gain more from taking the update off the device than
  CPU Adam costs on the host, docs/offload.md). Otherwise the stage DP chooses per stage
  among (logical mesh x recompute mode x placement) -- ``none`` and each placement of
  :func:`auto_placements` the program can take (:class:`PlacementChoice`; only the host
  update solves ILPs of its own) -- the fastest that fits the stage's HBM, so a stage
  holding many microbatches in flight (the first ones under 1F1B) may offload while the
  others do not. A plan whose host memory per node is over the node's usable RAM: the
  placement it used that holds the most host bytes is dropped and the DP runs again. The
  offloaded plan is kept where no plan fits without offload or it is at least
  :data:`AUTO_MIN_GAIN` faster than the plan without (the record's ``why``); else the
  plan without offload, which comes without a record. Nothing fits: the DP's
  ``ValueError`` (the smallest budget that would). The plan's ``num_ilps`` counts the
  ILPs of every placement.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from autoshard.inter.stages import StageBudgetError
from autoshard.intra.offload.placement import (
    AUTO_CANDIDATES,
    HOST_USABLE_FRACTION,
    OFFLOAD_CLASSES,
    Offload,
    offload_tensors,
    parse_offload,
)

# ``auto`` offloads where no plan fits without it, or where the plan it finds is at least
# this fraction of the step faster than the best without offload: a smaller gain is inside
# the simulator's own error against measured steps (docs/validation.md: validation rows
# within 12% and 15%, mean 8% on A100s and 10% on H100s), and offload adds host-link and
# CPU Adam figures no GPU run has yet checked (docs/offload.md)
AUTO_MIN_GAIN = 0.10


class PlacementChoice:
    """A stage cost offering several placements to the stage DP:
    ``(start, end, submesh, logical, recompute, placement) -> StageCost`` of that
    placement's :class:`~autoshard.inter.stage_cost.IntraStageCost` (``costs``: label ->
    cost, in the DP's order of preference on ties: ``none`` first). The rest of the
    stage-cost interface the search reads (the traced step, range keys, ILP counters,
    each stage's plan) comes from the costs."""

    def __init__(self, costs: Mapping[str, object]) -> None:
        if not costs:
            raise ValueError("a placement choice needs at least one placement")
        self.costs = dict(costs)
        self.placements = tuple(self.costs)
        base = next(iter(self.costs.values()))
        self.base = base
        for name in ("graph", "num_microbatches", "layer_names", "folded", "granularity"):
            setattr(self, name, getattr(base, name))
        self.num_layers = base.num_layers
        self.mesh_for = base.mesh_for

    def cost_of(self, placement: str):
        """The :class:`IntraStageCost` of a stage that took ``placement``."""
        if placement not in self.costs:
            raise ValueError(f"placement {placement!r} is not one of {self.placements}")
        return self.costs[placement]

    def __call__(self, start, end, submesh, logical, recompute="none", placement="none"):
        return self.cost_of(placement)(start, end, submesh, logical, recompute)

    def range_key(self, start: int, end: int):
        return self.base.range_key(start, end)  # the same layers under every placement

    def prepare(self, logicals, progress=None) -> None:
        for cost in self.costs.values():
            cost.prepare(logicals, progress)

    def stage_specs(self, start: int, end: int, logical, placement: str = "none"):
        return self.cost_of(placement).stage_specs(start, end, logical)

    @property
    def refusals(self) -> list[str]:
        out: list[str] = []
        for cost in self.costs.values():
            out.extend(r for r in cost.refusals if r not in out)
        return out

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.costs.values())

    @property
    def num_ilps(self) -> int:
        return sum(c.num_ilps for c in self.costs.values())

    @property
    def num_cache_hits(self) -> int:
        return sum(c.num_cache_hits for c in self.costs.values())


def _placement(label: str) -> Offload:
    return parse_offload(label)


def _where(offload: Offload) -> dict:
    where = {c: ("host" if c in offload.classes else "device") for c in OFFLOAD_CLASSES}
    where["activations"] = "host" if offload.activations else "device"
    where["update"] = "host" if offload.host_update else "device"
    return where


def offload_summary(cost, stages, cluster) -> dict:
    """What lives where in a searched plan, and what it costs per step. ``cost``: the
    search's stage cost (an :class:`IntraStageCost` or a :class:`PlacementChoice`; its
    ``cost_of(stage.offload)`` priced each stage). Per stage: its placement
    (``offload_per_stage``, ``where_per_stage``), the host bytes per device and the exposed
    transfer/host-update seconds per step (spread over the microbatches in the stage
    latency; offloaded activations: what its microbatches in flight keep); per node, the sum
    over the stages of each device's host bytes (stages without device ids: the stage
    holding most on every GPU of the node). ``offload``, ``classes``
    and ``where`` say the same for the whole plan: one stage's placement when every stage
    took it, else ``offload`` is ``"per stage"``, ``classes`` the classes any stage
    offloads and a class offloaded by some stages only is ``"some stages"`` in ``where``."""
    host_bytes, exposed, labels = [], [], []
    for st in stages:
        label = getattr(st, "offload", "none")
        labels.append(label)
        if label == "none":
            host_bytes.append(0.0)
            exposed.append(0.0)
            continue
        c = cost.cost_of(label)
        logical = tuple(st.logical_mesh)
        units = [c.unit(i, i + 1, logical) for i in range(st.start_layer, st.end_layer)]
        mode = getattr(st, "recompute", "none")
        kept = 0.0  # offloaded activations: what each microbatch in flight keeps, on the host
        if "activations" in _placement(label).classes:
            in_flight = getattr(st, "microbatches_in_flight", 1)
            kept = in_flight * sum(
                u.kept_activation_bytes[mode]
                if mode != "none" and c.recomputes(i)
                else u.activation_bytes
                for i, u in zip(range(st.start_layer, st.end_layer), units, strict=True)
            )
        host_bytes.append(sum(u.host_bytes for u in units) + kept)
        activations = sum(
            c.activation_offload_s(i, logical, mode) for i in range(st.start_layer, st.end_layer)
        )  # per microbatch: every one copies its own
        exposed.append(sum(u.offload_s for u in units) + activations * c.num_microbatches)
    placements = [_placement(label) for label in labels]
    per_node: dict[int, float] = {}
    if all(getattr(st, "device_ids", ()) for st in stages):
        for st, nbytes in zip(stages, host_bytes, strict=True):
            for d in st.device_ids:
                node = d // cluster.devices_per_node
                per_node[node] = per_node.get(node, 0.0) + nbytes
        node_bytes = max(per_node.values())
    else:
        node_bytes = max(host_bytes) * cluster.devices_per_node
    usable = cluster.host.memory_bytes * HOST_USABLE_FRACTION
    wheres = [_where(p) for p in placements]
    uniform = len(set(labels)) == 1
    every = (*OFFLOAD_CLASSES, "activations")
    classes = [c for c in every if any(c in p.classes for p in placements)]
    where = {
        k: wheres[0][k] if all(w[k] == wheres[0][k] for w in wheres) else "some stages"
        for k in wheres[0]
    }
    return {
        "offload": labels[0] if uniform else "per stage",
        "classes": classes,
        "where": where,
        "offload_per_stage": labels,
        "where_per_stage": wheres,
        "host_bytes_per_device": max(host_bytes),
        "host_bytes_per_stage": host_bytes,  # per device of that stage
        "host_bytes_per_node": node_bytes,
        "host_memory_bytes": usable,
        "fits_host": node_bytes <= usable,
        # per step (state: spread over the microbatches; activations: each microbatch's)
        "exposed_s_per_stage": exposed,
    }


def auto_candidates(graph) -> tuple[Offload, ...]:
    """The placements of :data:`AUTO_CANDIDATES` the traced step can take (``master``
    needs f32 weights read through a convert to 16 bits: not on an f32 model)."""
    out = []
    for placement in AUTO_CANDIDATES:
        try:
            offload_tensors(graph, placement.state)
        except ValueError:
            continue
        out.append(placement)
    return tuple(out)


def auto_placements(graph) -> tuple[Offload, ...]:
    """What ``auto`` offers each stage besides ``none``: the state placements of
    :func:`auto_candidates`, then saved activations alone and with each of them (the
    pipeline runtime places every combination per stage)."""
    state = auto_candidates(graph)
    with_activations = tuple(Offload((*p.classes, "activations")) for p in state)
    return (*state, Offload(("activations",)), *with_activations)


def _all_ilps(base) -> int:
    """ILPs solved by ``base`` and every placement made of it (:meth:`with_offload`)."""
    return base.num_ilps + sum(c.num_ilps for c in base._offloaded.values())


def search_with_offload(search, request, base, cluster):
    """The plan of ``search(cost)`` under ``request`` (an :class:`Offload` or ``"auto"``)
    with its ``offload`` record (module docstring). ``search(cost, bounded=True)``: the
    stage search on ``cost``, under the memory budget or (``bounded=False``) without one;
    ``base``: the plain stage cost (no offload); ``cluster``: the cluster with a ``host``
    section the placements are priced on."""
    gib = 2**30
    if request != "auto":
        cost = base.with_offload(request, cluster)
        plan = search(cost)
        record = offload_summary(cost, plan.stages, cluster)
        if not record["fits_host"]:
            raise ValueError(
                f"offload {request.label} needs {record['host_bytes_per_node'] / gib:.1f} GiB "
                f"of host memory per node but {cluster.name} has "
                f"{record['host_memory_bytes'] / gib:.0f} GiB usable: offload less, or use "
                "more GPUs so each holds less"
            )
        return dataclasses.replace(plan, offload=record, num_ilps=_all_ilps(base))
    t0 = time.perf_counter()
    runs: list = []  # every search made, for the plan's phase seconds

    def counted(plan, record=None):
        phases: dict[str, float] = {}
        for p in runs:
            for k, v in p.phase_seconds.items():
                phases[k] = phases.get(k, 0.0) + v
        return dataclasses.replace(
            plan,
            offload=record,
            num_ilps=_all_ilps(base),
            search_seconds=time.perf_counter() - t0,
            phase_seconds=phases,
        )

    # 1. without offload, under the budget and without one (the same ILPs). A device
    # update's placement and offloaded activations price every stage variant on the same
    # plan plus their transfers, so none beats the plan without a budget (the host update
    # is assumed not to: docs/offload.md): where that plan gains less than AUTO_MIN_GAIN,
    # nothing else is searched
    try:
        plain = search(base)
        runs.append(plain)
    except StageBudgetError:
        plain = None
    if plain is not None:
        free = search(base, bounded=False)
        runs.append(free)
        if free.objective_s > (1.0 - AUTO_MIN_GAIN) * plain.objective_s:
            return counted(plain)
    # 2. memory binds: every stage chooses among the placements
    candidates = list(auto_placements(base.graph))
    dropped = []
    while True:
        choice = PlacementChoice(
            {"none": base} | {p.label: base.with_offload(p, cluster) for p in candidates}
        )
        try:
            plan = search(choice)
            runs.append(plan)
        except ValueError as err:
            tried = ", ".join(choice.placements)
            message = (
                f"{err} (each stage could offload: {tried}"
                + (f"; dropped for host memory: {', '.join(dropped)}" if dropped else "")
                + ")"
            )
            if isinstance(err, StageBudgetError):  # still the budget's: callers fall back on it
                raise StageBudgetError(message, err.budget_bytes, err.least_bytes) from err
            raise ValueError(message) from err
        if all(st.offload == "none" for st in plan.stages):
            return counted(plain if plain is not None else plan)
        record = offload_summary(choice, plan.stages, cluster)
        if record["fits_host"]:
            break
        # the node's RAM is short: drop the placement holding most host bytes, search again
        used = zip(record["offload_per_stage"], record["host_bytes_per_stage"], strict=True)
        worst = max((nbytes, label) for label, nbytes in used if label != "none")[1]
        dropped.append(
            f"{worst} ({record['host_bytes_per_node'] / gib:.1f} GiB per node of "
            f"{record['host_memory_bytes'] / gib:.0f} usable)"
        )
        candidates = [p for p in candidates if p.label != worst]
    if plain is None:
        why = "no plan fits the HBM without offload"
    else:
        gain = 1.0 - plan.objective_s / plain.objective_s
        if gain < AUTO_MIN_GAIN:
            return counted(plain)
        why = f"{gain:.1%} faster than without offload (at least {AUTO_MIN_GAIN:.0%})"
    extra = {
        "chosen_by": "auto",
        "candidates": list(choice.placements),
        "dropped": dropped,
        "why": why,
        "without_offload_s": None if plain is None else plain.objective_s,
        "min_gain": AUTO_MIN_GAIN,
    }
    return counted(plan, record | extra)


__all__ = [
    "AUTO_MIN_GAIN",
    "PlacementChoice",
    "auto_candidates",
    "auto_placements",
    "offload_summary",
    "search_with_offload",
]
