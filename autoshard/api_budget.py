"""Memory budgets in :func:`autoshard.api.auto_shard`: the cluster's HBM as the default
budget, refusals proven before any solve, the slow solve under a budget that binds (said
on stderr first), and the closed loop that re-plans until XLA's compiled peak fits."""

from __future__ import annotations

import dataclasses

from autoshard.intra.problem.options import IntraOptions


def plan_under_binding_budget(graph, dmesh, options, pinned, baseline, free, progress):
    """The plan under a budget the unbudgeted plan ``free`` peaks over: a line on
    ``progress`` first (these solves list every resharded copy and can take minutes), and a
    refusal that says how far the budget is from the least peak found."""
    from autoshard.intra.ilp import InfeasibleBudgetError, SolverTimeLimitError
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.ir.units import format_bytes

    budget = options.memory_budget_bytes
    limit = options.time_limit_s
    if progress is not None:
        progress.write(
            f"the plan without the budget peaks at {format_bytes(free.predicted_peak_bytes)}, "
            f"over the budget of {format_bytes(budget)} per device; planning under the budget "
            "(and, if no plan fits, finding the least peak): "
            + (f"each solve stops at {limit:g} s" if limit is not None else "no time limit")
        )
    try:
        return auto_shard_graph(
            graph, dmesh, options, pinned_inputs=pinned, name=baseline or "auto"
        )
    except SolverTimeLimitError as err:  # say what fits for sure
        err.args = (
            f"{err}; a budget of {format_bytes(free.predicted_peak_bytes)} per device fits "
            "(the plan without the budget)",
        )
        raise
    except InfeasibleBudgetError as err:
        least = min(err.min_feasible_bytes, free.predicted_peak_bytes)
        floor = err.lower_bound_bytes
        found = (
            "the least peak is"
            if err.proven and err.min_feasible_bytes <= free.predicted_peak_bytes
            else "the least peak found is"
        )
        between = (
            f" (and no plan peaks under {format_bytes(floor)})"
            if floor is not None and floor < least and found != "the least peak is"
            else ""
        )
        out = InfeasibleBudgetError(budget, least, err.proven)
        out.lower_bound_bytes = floor
        out.args = (
            f"no sharding plan fits a budget of {format_bytes(budget)} per device (proven by "
            f"the solver): {found} {format_bytes(least, exact=True)}{between}; raise the "
            "budget to at least that, or shrink the model or batch",
        )
        raise out from err


def refuse_budget_below_the_state(graph, dmesh, budget: float) -> None:
    """A proven-infeasible budget, refused before any solve: the parameters and optimizer
    state are live at the start of the step, and no plan holds less of them per device
    than their bytes split evenly over every device."""
    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.ir.units import format_bytes

    kinds = ("param", "opt_state")
    state = sum(graph.tensors[t].nbytes for k in kinds for t in graph.inputs_of_kind(k))
    least = state / dmesh.mesh.num_devices
    if budget >= least:
        return
    err = InfeasibleBudgetError(budget, least, True)
    err.args = (
        f"no sharding plan fits a budget of {format_bytes(budget, exact=True)} per device: the "
        f"parameters and optimizer state alone take {format_bytes(least, exact=True)} per "
        f"device even split evenly over all {dmesh.mesh.num_devices} devices; raise the "
        "budget to at least that (more for activations), or shrink the model or batch",
    )
    raise err


def cluster_memory_budget(options: IntraOptions, dmesh, cluster) -> tuple[IntraOptions, tuple]:
    """With a cluster preset, its HBM per device is the default memory budget; returns the
    options to plan with and the notes that say where the budget comes from."""
    import math

    if cluster is None:
        return options, ()
    where = "checked against the predicted peak only (compiling here is not the GPU's compile)"
    budget = options.memory_budget_bytes
    if budget is not None:
        return options, (f"memory budget: {_gib(budget)} per device, {where}",)
    hbm = dmesh.memory_bytes
    if not math.isfinite(hbm):
        return options, ()
    source = f"the {cluster} preset's HBM" if isinstance(cluster, str) else "the cluster's HBM"
    note = f"memory budget: {_gib(hbm)} per device, {source}, {where}"
    return options.replace(memory_budget_bytes=float(hbm)), (note,)


def _gib(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib:.3g} GiB"


def fit_compiled_budget(bound, dmesh, options: IntraOptions, *, pinned=None, max_rounds: int = 4):
    """Close the loop on memory: compile the plan, and while XLA's peak exceeds the budget,
    re-plan with the model's budget scaled by budget / compiled peak.

    The memory model in the ILP estimates XLA's buffers; this loop turns the budget into a
    promise about the compiled executable. Each round is recorded in the plan's notes.
    Raises InfeasibleBudgetError when a tighter model budget fits no plan.
    """

    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.ir.units import format_bytes

    memory_budget = options.memory_budget_bytes
    notes = list(bound.plan.notes)
    target = memory_budget
    for round_ in range(max_rounds + 1):
        report = bound.verify()
        compiled = report.compiled_peak_bytes
        notes.append(
            f"memory round {round_}: model budget {target:.4g} B, predicted "
            f"{bound.plan.predicted_peak_bytes:.4g} B, compiled {compiled:.4g} B"
        )
        if compiled <= memory_budget:
            return dataclasses.replace(
                bound, plan=dataclasses.replace(bound.plan, notes=tuple(notes)), report=report
            )
        if round_ == max_rounds:
            break
        target = min(target, bound.plan.predicted_peak_bytes) * memory_budget / compiled * 0.99
        try:
            plan = auto_shard_graph(
                bound.graph,
                dmesh,
                options.replace(memory_budget_bytes=target),
                pinned_inputs=pinned,
                name=bound.plan.name,
            )
        except InfeasibleBudgetError as err:
            ratio = compiled / bound.plan.predicted_peak_bytes
            estimate = err.min_feasible_bytes * ratio
            out = InfeasibleBudgetError(memory_budget, estimate, False)
            out.args = (
                f"no plan compiles within {format_bytes(memory_budget, exact=True)} per "
                f"device: the smallest plan the memory model finds needs "
                f"{format_bytes(err.min_feasible_bytes)} predicted, and XLA compiled the last "
                f"plan at {ratio:.2f}x its prediction, so about {format_bytes(estimate)}; "
                "raise the budget to about that",
            )
            raise out from err
        bound = dataclasses.replace(bound, plan=plan)
    raise ValueError(
        f"after {max_rounds} re-plans the compiled peak is still {format_bytes(compiled)} per "
        f"device, over the budget of {format_bytes(memory_budget)}; raise the budget or pass "
        "check_compiled_memory=False"
    )
