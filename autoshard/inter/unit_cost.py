"""One planned sub-graph's costs (:class:`UnitCost`, what
:class:`~autoshard.inter.stage_cost.IntraStageCost` memoises per layer range and logical
mesh), and what offloading its saved activations (``--offload activations``) does to them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.ir.plan import ParallelPlan


@dataclass(frozen=True)
class UnitCost:
    """One planned sub-graph (a layer or a range) on one logical mesh."""

    plan: ParallelPlan | None  # None: the ILP found no finite plan
    flops: float
    compute_s: float
    communication_s: float
    # params + gradients (held all step: more than one microbatch, or XLA:CPU) + optimizer
    # state the unit updates
    owned_state_bytes: float
    borrowed_param_bytes: Mapping[int, float]  # owner layer index -> bytes read from it
    activation_bytes: float
    # per recompute mode: seconds it adds per microbatch, activation bytes it keeps
    recompute_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    kept_activation_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # offload (IntraStageCost's ``offload``): seconds a step pays for the unit's transfers
    # and host update, the device's staging buffers (and, one microbatch a step, its
    # gradients while they are made: stage_memory.unit_state), the state in host memory
    offload_s: float = 0.0
    staging_bytes: float = 0.0
    host_bytes: float = 0.0
    # communication_s over the mesh axes: each resharded value's collectives priced per
    # microbatch (the update's divided by the microbatches, as the ILP does), summing to
    # communication_s; a collective over several axes is split evenly over them
    communication_by_axis: Mapping[str, float] | None = None


def with_activations_offloaded(u: UnitCost, latency, kept, working, recompute_s, cluster):
    """``--offload activations``: what the unit keeps per microbatch in flight goes to
    host memory after its forward and comes back for its backward. Each copy runs at
    the host link's per-GPU rate (all GPUs of the node copying at once) and the preset's
    ``copy_overlap`` share of it hides behind the unit's own compute in that pass (the
    forward for the copy out; the backward, recompute included, for the copy back; at
    most that compute): the rest is exposed, per microbatch. HBM keeps no kept
    activations per microbatch in flight; it stages twice the unit's (the copy under way
    and the next), held once. Returns (latency, kept bytes, working bytes) as
    ``IntraStageCost._mode_terms`` does."""
    exposed = activation_exposed_s(u, kept, recompute_s, cluster)
    return latency + exposed, 0.0, working + 2.0 * kept


def activation_exposed_s(u: UnitCost, kept: float, recompute_s: float, cluster) -> float:
    """Seconds per microbatch the copies of ``kept`` bytes out and back are not hidden
    behind the unit's forward and backward (plus ``recompute_s``):
    :func:`autoshard.intra.offload.placement.hidden_s` of each."""
    from autoshard.intra.offload.placement import hidden_s

    phases = (u.plan.solver if u.plan is not None else {}).get("compute_s_by_phase", {})
    host = cluster.host
    copy_s = kept / host.link_bandwidth(cluster.devices_per_node)
    forward, backward = phases.get("forward", 0.0), phases.get("backward", 0.0) + recompute_s
    return 2 * copy_s - hidden_s(copy_s, forward, host) - hidden_s(copy_s, backward, host)


def read_specs(graph, plan: ParallelPlan, k: int) -> list:
    """The specs ``plan``'s equations read input ``k`` of ``graph`` in: an operand's own
    spec where the plan reshards it (``operand_specs``), else the input's spec."""
    tid, held = graph.inputs[k], plan.input_specs[k]
    reads = []
    for n in graph.tensors[tid].consumers:
        for slot, t in enumerate(graph.nodes[n].inputs):
            if t == tid:
                reads.append(plan.operand_specs.get(n, {}).get(slot, held))
    return list(dict.fromkeys(reads)) or [held]


def crossing_seconds(src, held, reads, shape, itemsize, mesh, options) -> float:
    """Seconds a tensor made in ``src`` by one unit and read by the next adds to a stage,
    beyond what the reading unit's plan already charged.

    The reading unit's plan holds the tensor in ``held`` (its input spec, which the ILP
    chose freely: an input costs nothing, so a replicated one -- from which every read is
    a free slice -- ties with the spec the reads want) and charges the reshards from
    ``held`` to the specs its equations read it in (``reads``). Inside a stage the tensor
    is never held in ``held``: the stage's program keeps the producer's spec and reshards
    from it straight to each read (:func:`autoshard.runtime.sharded.SpecConstraints.build`,
    from the producer's spec). So the junction adds ``src -> reads`` and takes back the
    ``held -> reads`` the unit charged (negative where the unit charged more)."""
    from autoshard.intra.cost.consumers import reshard_to_consumers

    direct = reshard_to_consumers(src, reads, shape, itemsize, mesh, options).cost
    charged = reshard_to_consumers(held, reads, shape, itemsize, mesh, options).cost
    return direct - charged


def communication_by_axis(ip, strategy, mesh, amortise: float, options) -> dict:
    """:attr:`UnitCost.communication_by_axis` of the solved ``ip``: the seconds of the
    collectives its plan predicts (:func:`~autoshard.intra.problem.predict.collectives_by_value`:
    each value resharded once per distinct spec its readers want, as XLA compiles it), by
    mesh axis, a value read only by update equations counted ``amortise`` times (once per
    step); a collective over several axes split evenly over them. Their sum is the unit's
    communication: the stage ILPs solve the per-demand program, which pays a spec that
    two readers of a value want twice (gpt-39b's block on (4, 2): 1.318 ms per
    micro-batch against the 1.168 ms of its plan's collectives), so their objective is not
    the plan's price (docs/weak_scaling.md, cause 3)."""
    from autoshard.intra.cost.collectives import collective_cost
    from autoshard.intra.problem.predict import collectives_by_value

    graph = ip.graph
    phases: dict[int, set] = {}
    for op in ip.operands:
        if op.slot >= 0 and op.dst >= ip.num_inputs:
            phases.setdefault(op.tensor, set()).add(graph.nodes[op.dst - ip.num_inputs].phase)
    seconds: dict[str, float] = {}
    for tid, cols in collectives_by_value(ip, strategy):
        scale = amortise if phases.get(tid) == {"update"} else 1.0
        for c in cols:
            for axis in c.axes:
                share = collective_cost(mesh, c, options) * scale / len(c.axes)
                seconds[axis] = seconds.get(axis, 0.0) + share
    return {axis: sec for axis, sec in seconds.items() if sec > 0}
