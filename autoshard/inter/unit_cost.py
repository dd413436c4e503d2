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
    owned_state_bytes: float  # params + gradients + optimizer state the unit updates
    borrowed_param_bytes: Mapping[int, float]  # owner layer index -> bytes read from it
    activation_bytes: float
    # per recompute mode: seconds it adds per microbatch, activation bytes it keeps
    recompute_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    kept_activation_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # offload (IntraStageCost's ``offload``): seconds a step pays for the unit's transfers
    # and host update, the device's staging buffers, the state held in host memory
    offload_s: float = 0.0
    staging_bytes: float = 0.0
    host_bytes: float = 0.0


def with_activations_offloaded(u: UnitCost, latency, kept, working, recompute_s, cluster):
    """``--offload activations``: what the unit keeps per microbatch in flight goes to
    host memory after its forward and comes back for its backward. Each copy runs at
    the host link's per-GPU rate (all GPUs of the node copying at once) and overlaps
    the unit's own compute in that pass (the forward for the copy out; the backward,
    recompute included, for the copy back): only the excess is exposed, per
    microbatch. HBM keeps no kept activations per microbatch in flight; it stages
    twice the unit's (the copy under way and the next), held once. Returns (latency,
    kept bytes, working bytes) as ``IntraStageCost._mode_terms`` does."""
    exposed = activation_exposed_s(u, kept, recompute_s, cluster)
    return latency + exposed, 0.0, working + 2.0 * kept


def activation_exposed_s(u: UnitCost, kept: float, recompute_s: float, cluster) -> float:
    """Seconds per microbatch the copies of ``kept`` bytes out and back are not hidden
    behind the unit's forward and backward (plus ``recompute_s``)."""
    phases = (u.plan.solver if u.plan is not None else {}).get("compute_s_by_phase", {})
    bandwidth = cluster.host.link_bandwidth(cluster.devices_per_node)
    copy_s = kept / bandwidth
    return max(copy_s - phases.get("forward", 0.0), 0.0) + max(
        copy_s - phases.get("backward", 0.0) - recompute_s, 0.0
    )
