"""Offload in the stage search: a placement per stage, chosen by the stage DP (jax-free).

Takes the plain stage cost (:class:`~autoshard.inter.stage_cost.IntraStageCost`, built
without offload), a search to run on a stage cost (``search(cost) -> InterPlan``) and the
request (an :class:`~autoshard.intra.offload.placement.Offload` or ``"auto"``); returns the
plan with its ``offload`` record (:func:`offload_summary`: what each stage keeps where, its
host bytes and exposed seconds).

* A placement given outright: every stage takes it (the plain cost under it,
  :meth:`IntraStageCost.with_offload`); a plan whose host state exceeds the node's usable
  RAM: ``ValueError`` saying so.
* ``auto``: the stage DP chooses per stage among (logical mesh x recompute mode x
  placement) -- ``none`` and each placement of
  :data:`~autoshard.intra.offload.placement.AUTO_CANDIDATES` the program can take
  (:class:`PlacementChoice`) -- the fastest that fits the stage's HBM, so a stage holding
  many microbatches in flight (the first ones under 1F1B) may offload while the others do
  not. A plan whose host memory per node is over the node's usable RAM: the placement it
  used that holds the most host bytes is dropped and the DP runs again. No stage offloads:
  the plan comes without a record. Nothing fits: the DP's ``ValueError`` (the smallest
  budget that would).
"""

from __future__ import annotations

import dataclasses
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
    latency); per node, the sum over the stages of each device's host bytes (stages without
    device ids: the stage holding most on every GPU of the node). ``offload``, ``classes``
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
        host_bytes.append(sum(u.host_bytes for u in units))
        mode = getattr(st, "recompute", "none")
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


def search_with_offload(search, request, base, cluster):
    """The plan of ``search(cost)`` under ``request`` (an :class:`Offload` or ``"auto"``)
    with its ``offload`` record (module docstring). ``base``: the plain stage cost (no
    offload); ``cluster``: the cluster with a ``host`` section the placements are priced
    on."""
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
        return dataclasses.replace(plan, offload=record)
    candidates = list(auto_candidates(base.graph))
    dropped = []
    while True:
        choice = PlacementChoice(
            {"none": base} | {p.label: base.with_offload(p, cluster) for p in candidates}
        )
        try:
            plan = search(choice)
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
            return plan
        record = offload_summary(choice, plan.stages, cluster)
        if record["fits_host"]:
            extra = {"chosen_by": "auto", "candidates": list(choice.placements)}
            return dataclasses.replace(plan, offload=record | extra | {"dropped": dropped})
        # the node's RAM is short: drop the placement holding most host bytes, search again
        used = zip(record["offload_per_stage"], record["host_bytes_per_stage"], strict=True)
        worst = max((nbytes, label) for label, nbytes in used if label != "none")[1]
        dropped.append(
            f"{worst} ({record['host_bytes_per_node'] / gib:.1f} GiB per node of "
            f"{record['host_memory_bytes'] / gib:.0f} usable)"
        )
        candidates = [p for p in candidates if p.label != worst]


__all__ = [
    "PlacementChoice",
    "auto_candidates",
    "offload_summary",
    "search_with_offload",
]
