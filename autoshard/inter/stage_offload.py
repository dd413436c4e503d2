"""Offload in the stage search: one placement for every stage, and ``auto`` (jax-free).

Takes a search to run under a placement (``search(offload) -> InterPlan``, offload an
:class:`~autoshard.intra.offload.placement.Offload` or None) and the request (a placement or
``"auto"``); returns the plan with its ``offload`` record (:func:`offload_summary`: what
lives where, the host bytes and exposed seconds per stage). ``auto``: the search without
offload when it fits; else every placement of
:data:`~autoshard.intra.offload.placement.AUTO_CANDIDATES` is searched, and the fastest
plan (``objective_s``) that fits the HBM and the node's host memory wins; the record's
``candidates`` lists each one tried. None fits: the ``ValueError`` of the search without
offload, saying what each placement needed. A placement given outright whose host
state exceeds the node's usable RAM: ``ValueError`` saying so.
"""

from __future__ import annotations

import dataclasses

from autoshard.intra.offload.placement import (
    AUTO_CANDIDATES,
    HOST_USABLE_FRACTION,
    OFFLOAD_CLASSES,
    Offload,
)


def offload_summary(cost, stages, cluster, offload: Offload) -> dict:
    """What lives where in a searched plan, and what it costs per step: per stage the host
    bytes per device and the exposed transfer/host-update seconds per step (spread over
    the microbatches in the stage latency); per node, the stage holding most times the
    node's GPUs in use. ``cost``: the search's
    :class:`~autoshard.inter.stage_cost.IntraStageCost` (built with ``offload``)."""
    host_bytes, exposed = [], []
    for st in stages:
        units = [
            cost.unit(i, i + 1, tuple(st.logical_mesh)) for i in range(st.start_layer, st.end_layer)
        ]
        host_bytes.append(sum(u.host_bytes for u in units))
        mode = getattr(st, "recompute", "none")
        activations = sum(
            cost.activation_offload_s(i, tuple(st.logical_mesh), mode)
            for i in range(st.start_layer, st.end_layer)
        )  # per microbatch: every one copies its own
        exposed.append(sum(u.offload_s for u in units) + activations * cost.num_microbatches)
    where = {c: ("host" if c in offload.classes else "device") for c in OFFLOAD_CLASSES}
    where["activations"] = "host" if offload.activations else "device"
    where["update"] = "host" if offload.host_update else "device"
    per_node = max(host_bytes) * cluster.devices_per_node
    usable = cluster.host.memory_bytes * HOST_USABLE_FRACTION
    return {
        "offload": offload.label,
        "classes": list(offload.classes),
        "where": where,
        "host_bytes_per_device": max(host_bytes),
        "host_bytes_per_stage": host_bytes,  # per device of that stage
        "host_bytes_per_node": per_node,
        "host_memory_bytes": usable,
        "fits_host": per_node <= usable,
        # per step (state: spread over the microbatches; activations: each microbatch's)
        "exposed_s_per_stage": exposed,
    }


def search_with_offload(search, request, cost_for, cluster):
    """The plan of ``search`` under ``request`` (an :class:`Offload` or ``"auto"``) with its
    ``offload`` record (module docstring). ``cost_for(offload)``: the IntraStageCost that
    ``search(offload)`` used (for the record)."""

    def priced(placement: Offload):
        plan = search(placement)
        return plan, offload_summary(cost_for(placement), plan.stages, cluster, placement)

    gib = 2**30
    if request != "auto":
        plan, record = priced(request)
        if not record["fits_host"]:
            raise ValueError(
                f"offload {request.label} needs {record['host_bytes_per_node'] / gib:.1f} GiB "
                f"of host memory per node but {cluster.name} has "
                f"{record['host_memory_bytes'] / gib:.0f} GiB usable: offload less, or use "
                "more GPUs so each holds less"
            )
        return dataclasses.replace(plan, offload=record)
    try:
        return search(None)
    except ValueError as err:
        plain_error = err
    tried, best = [], None
    for placement in AUTO_CANDIDATES:
        try:
            plan, record = priced(placement)
        except ValueError as err:
            tried.append({"offload": placement.label, "fits": False, "why": str(err)[:200]})
            continue
        fits = record["fits_host"]
        tried.append(
            {
                "offload": placement.label,
                "fits": fits,
                "objective_s": plan.objective_s,
                "host_bytes_per_node": record["host_bytes_per_node"],
            }
        )
        if fits and (best is None or plan.objective_s < best[0].objective_s):
            best = (plan, record)
    if best is None:
        lines = "; ".join(
            f"{t['offload']}: " + ("host memory short" if "objective_s" in t else t["why"])
            for t in tried
        )
        raise ValueError(f"{plain_error} -- with offload as well: {lines}") from plain_error
    plan, record = best
    return dataclasses.replace(plan, offload=record | {"candidates": tried, "chosen_by": "auto"})


__all__ = ["offload_summary", "search_with_offload"]
