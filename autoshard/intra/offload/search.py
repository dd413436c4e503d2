"""Offload as a planning choice: plan one mesh with a placement, or let ``auto`` pick the
cheapest placement that fits (jax-free).

Takes a graph, a priced mesh on a cluster preset with a ``host`` section, the planner's
options (with the device's HBM as ``memory_budget_bytes``), optional pinned inputs, and an
offload request (:func:`autoshard.intra.offload.placement.parse_offload`); returns the plan with its
``offload`` record (:class:`~autoshard.intra.offload.placement.OffloadCost` as JSON, plus
``step_time_s``: the ILP's device time and the exposed offload seconds) and a note saying
what lives where.

``auto``: the plan without offload when it fits; otherwise each of
:data:`~autoshard.intra.offload.placement.AUTO_CANDIDATES` the program has is planned under the
budget (the ILP sees the offloaded tensors out of HBM, so it may choose other shardings
than without), those that fit the HBM and the node's host memory are priced, and the
fastest step wins; ``offload["candidates"]`` lists every one tried. None fits: the
``InfeasibleBudgetError`` of the leanest, saying what each needed.
"""

from __future__ import annotations

import dataclasses

from autoshard.intra.ilp import InfeasibleBudgetError
from autoshard.intra.offload.placement import (
    AUTO_CANDIDATES,
    NO_OFFLOAD,
    Offload,
    offload_cost,
    offload_tensors,
    tensor_classes,
)
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions

# baselines that model a system with CPU offload (DeepSpeed's ZeRO-Offload); the others
# (PyTorch DDP, Megatron-LM, Alpa's heuristic) have none
OFFLOAD_BASELINES = ("zero2", "zero3", "expert-zero2")


def check_offload_request(offload, baseline: str | None, cluster) -> None:
    """Refuse an offload the request cannot take: no cluster host, or a baseline that
    models a system without offload."""
    if offload == "auto" or offload:
        if baseline is not None and baseline not in OFFLOAD_BASELINES:
            raise ValueError(
                f"baseline {baseline!r} models a system without CPU offload; offload is for "
                f"autoshard's own plans and the baselines {', '.join(OFFLOAD_BASELINES)} "
                "(DeepSpeed's ZeRO-Offload): drop --offload or the baseline"
            )
        if cluster is None or getattr(cluster, "host", None) is None:
            name = getattr(cluster, "name", cluster)
            raise ValueError(
                "offload prices host memory and PCIe transfers from a cluster preset's 'host' "
                f"section; {'no cluster was given' if name is None else f'{name} has none'}: "
                "pass --cluster alpa-v100 (or dgx-a100, dgx-h100, dgx2h-v100)"
            )


def _priced(graph, dmesh, options, pinned, name, offload: Offload, cluster):
    """The plan with ``offload``, and its record; raises InfeasibleBudgetError."""
    tensors = offload_tensors(graph, offload)  # first: says what the program cannot offload
    plan = auto_shard_graph(
        graph, dmesh, options.replace(offload=offload.classes), pinned_inputs=pinned, name=name
    )
    spec_of = plan.specs_by_tensor(graph.inputs)
    backward_s = float(plan.solver.get("compute_s_by_phase", {}).get("backward", 0.0))
    cost = offload_cost(graph, tensors, spec_of, dmesh.mesh, cluster, backward_s)
    aliased = dict(graph.aliases)
    host_in = [i for i, t in enumerate(graph.inputs) if t in tensors.host]
    host_out = {aliased[graph.inputs[i]] for i in host_in if graph.inputs[i] in aliased}
    record = cost.to_json() | {
        # what the runtime places in host memory (pinned_host): flat argument / output
        # positions of the state at rest
        "host_inputs": host_in,
        "host_outputs": [j for j, t in enumerate(graph.outputs) if t in host_out],
        "staging_bytes": tensors.staging_bytes,  # what the plan's peak counts (whole)
        "device_step_s": plan.objective,
        "step_time_s": plan.objective + cost.exposed_s,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
    }
    return plan, record


def _note(record: dict) -> str:
    where = record["where"]
    on_host = [c for c, w in where.items() if w == "host" and c != "update"]
    gib = 2**30
    return (
        f"offload {record['offload']}: {', '.join(on_host)} in host memory "
        f"({record['host_bytes_per_device'] / gib:.2f} GiB per GPU, "
        f"{record['host_bytes_per_node'] / gib:.1f} GiB per node of "
        f"{record['host_memory_bytes'] / gib:.0f} usable), update on {where['update']}; "
        f"{record['to_device_bytes'] / gib:.2f} GiB in and {record['to_host_bytes'] / gib:.2f} "
        f"GiB out per step at {record['link_bandwidth'] / 1e9:.1f} GB/s, "
        f"{record['exposed_s'] * 1e3:.1f} ms exposed (host Adam "
        f"{record['host_update_s'] * 1e3:.1f} ms); step {record['step_time_s'] * 1e3:.1f} ms"
    )


def plan_with_offload(
    graph,
    dmesh,
    options: IntraOptions,
    offload,
    cluster,
    *,
    pinned=None,
    name: str = "auto",
    fits_plan=None,
):
    """Plan under ``options.memory_budget_bytes`` with ``offload`` (an :class:`Offload` or
    ``"auto"``) on ``cluster``; module docstring. ``fits_plan``: a plan already made
    without offload (``auto`` keeps it when it fits the budget)."""
    budget = options.memory_budget_bytes
    if offload != "auto":
        if not offload:
            raise ValueError("plan_with_offload: give an offload placement or 'auto'")
        plan, record = _priced(graph, dmesh, options, pinned, name, offload, cluster)
        if record["host_bytes_per_node"] > record["host_memory_bytes"]:
            raise ValueError(
                f"offload {offload.label} needs {record['host_bytes_per_node'] / 2**30:.1f} GiB "
                f"of host memory per node but {cluster.name} has "
                f"{record['host_memory_bytes'] / 2**30:.0f} GiB usable: offload less, or use "
                "more GPUs so each holds less"
            )
        return _with_record(plan, record)
    if fits_plan is not None and (budget is None or fits_plan.predicted_peak_bytes <= budget):
        return fits_plan
    classes = tensor_classes(graph)
    inputs = set(graph.inputs)
    tried, best, errors = [], None, []
    for cand in AUTO_CANDIDATES:
        if any(c != "gradients" and not classes[c] & inputs for c in cand.classes):
            tried.append({"offload": cand.label, "fits": False, "why": "nothing of a class"})
            continue
        try:
            plan, record = _priced(graph, dmesh, options, pinned, name, cand, cluster)
        except InfeasibleBudgetError as err:
            errors.append((cand, err))
            tried.append(
                {"offload": cand.label, "fits": False, "least_peak_bytes": err.min_feasible_bytes}
            )
            continue
        fits_host = record["host_bytes_per_node"] <= record["host_memory_bytes"]
        tried.append(
            {
                "offload": cand.label,
                "fits": fits_host,
                "step_time_s": record["step_time_s"],
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "host_bytes_per_node": record["host_bytes_per_node"],
            }
        )
        if fits_host and (best is None or record["step_time_s"] < best[1]["step_time_s"]):
            best = (plan, record)
    if best is None:
        least = min(errors, key=lambda e: e[1].min_feasible_bytes, default=None)
        lines = "; ".join(
            f"{t['offload']}: "
            + (
                f"least peak {t['least_peak_bytes'] / 2**30:.2f} GiB"
                if "least_peak_bytes" in t
                else ("host memory short" if "step_time_s" in t else t.get("why", ""))
            )
            for t in tried
        )
        err = InfeasibleBudgetError(
            budget, least[1].min_feasible_bytes if least else float("inf"), False
        )
        err.args = (f"{err} -- with offload as well: {lines}",)
        raise err
    plan, record = best
    return _with_record(plan, record | {"candidates": tried, "chosen_by": "auto"})


def _with_record(plan, record: dict):
    return dataclasses.replace(plan, offload=record, notes=plan.notes + (_note(record),))


__all__ = ["NO_OFFLOAD", "OFFLOAD_BASELINES", "check_offload_request", "plan_with_offload"]
