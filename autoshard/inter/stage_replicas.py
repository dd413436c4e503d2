"""A stage run as data-parallel replicas that reduce their gradients once per step
(``grad_reduce="step"``): the methods of :class:`~autoshard.inter.stage_cost.IntraStageCost`
that price it (a mixin of it, which owns every attribute they read: ``replicas``,
``mesh_for``, ``num_microbatches``, the ``_replica_layers`` memo). Jax-free."""

from __future__ import annotations

import dataclasses
import math

from autoshard.inter.plan import Shape2
from autoshard.inter.stage_memory import spec_fraction as _spec_fraction
from autoshard.inter.stage_memory import zero_dim
from autoshard.inter.stages import StageCost
from autoshard.intra.cost.collectives import (
    all_gather_cost,
    all_reduce_cost,
    reduce_scatter_cost,
)
from autoshard.intra.cost.resharding import CostOptions
from autoshard.ir.row_coupling import (
    RowCoupling,
    common_forward,
    coupled_rows_error,
    first_coupling_within,
    row_couplings,
)

_NO_TIES = CostOptions(tie_breakers=False)


class ReplicaCosts:
    """Replica methods of :class:`~autoshard.inter.stage_cost.IntraStageCost`."""

    # -- data-parallel replicas: the gradients reduced once per step
    def replica_cost(self, logical: Shape2):
        """The cost each of ``logical = (dp, tp)``'s ``dp`` replicas runs: this step traced
        at 1/dp of the microbatch (``replicas(dp)``), planned on ``(1, tp)``."""
        if self.replicas is None:
            raise ValueError(
                "this stage cost has no replica traces: build it with replicas=dp -> the "
                "cost of the step traced at 1/dp of the microbatch to price grad_reduce='step'"
            )
        if self.baseline is not None or self.offload:
            raise ValueError(
                "grad_reduce='step' is priced without a baseline and without offload "
                f"(this cost has baseline={self.baseline!r}, offload={self.offload.label!r})"
            )
        return self.replicas(logical[0])  # None: the microbatch does not split so

    def replica_couplings(self, dp: int) -> tuple[RowCoupling, ...] | None:
        """Where this step's forward couples rows (:func:`~autoshard.ir.row_coupling.
        row_couplings`), each tensor's batch dim read off the trace at 1/dp of the
        microbatch (``replicas(dp)``; where that forward is another program, one row a
        replica, the part of it that is the same, :func:`~autoshard.ir.row_coupling.
        common_forward`). None where there is no such trace."""
        if dp not in self._replica_couplings:
            replica = self.replica_cost((dp, 1))
            found = None
            if replica is not None:
                eqns, dims, literals = common_forward(self.graph, replica.graph, dp)
                found = row_couplings(
                    eqns,
                    dims,
                    self.graph.layers,
                    loss=self.graph.outputs[-1],
                    row_literals=literals,
                )
            self._replica_couplings[dp] = found
        return self._replica_couplings[dp]

    def replica_coupling(self, start: int, end: int, dp: int) -> RowCoupling | None:
        """The first equation where layers ``[start, end)`` run as ``dp`` replicas would
        couple rows (compute a batch statistic per replica): such a stage is not offered
        as replicas. A folded cost (its layers stand for a deeper model's) with any
        coupling counts every range coupled."""
        found = self.replica_couplings(dp) or ()
        if self.folded:
            return found[0] if found else None
        return first_coupling_within(found, start, end)

    def replica_layer(self, layer: int, logical: Shape2) -> ReplicaLayer:
        """What layer ``layer``'s replicas on ``logical = (dp, tp)`` hold and reduce, under
        their plan on ``(1, tp)`` (per device, per step), their optimizer update sharded
        over ``data`` (ZeRO-1, Megatron-LM's distributed optimizer): each gradient and
        optimizer-state leaf with a dim :func:`~autoshard.inter.stage_memory.zero_dim`
        finds is reduce-scattered over ``data`` (its weight all-gathered after the update,
        the same bytes) and its state and update kept at 1/dp; the others all-reduced and
        updated whole on every replica, as the runtime runs them."""
        replica = self.replica_cost(logical)
        dp, tp = logical
        inner = (1, tp)
        key = (replica.signatures[layer], logical, id(replica))
        if key not in self._replica_layers:
            unit = replica.unit(layer, layer + 1, inner)
            if unit.plan is None:
                self._replica_layers[key] = ReplicaLayer(math.inf, 0.0, 0.0, 0.0)
            else:
                self._replica_layers[key] = _replica_layer(replica, layer, inner, unit, dp)
        return self._replica_layers[key]

    def replica_reduce_s(self, start: int, end: int, logical: Shape2) -> float:
        """Seconds per step of the replicas' gradient reductions over ``data`` for layers
        ``[start, end)`` on ``logical`` (:meth:`replica_layer`): per layer (its bucket) one
        ring reduce-scatter and all-gather of the sharded leaves and one all-reduce of the
        others, not overlapped with compute."""
        mesh = self.mesh_for(logical)
        total = 0.0
        for layer in range(start, end):
            found = self.replica_layer(layer, logical)
            if found.sharded_grad_bytes > 0:
                total += reduce_scatter_cost(mesh, "data", found.sharded_grad_bytes, _NO_TIES)
                total += all_gather_cost(mesh, "data", found.sharded_grad_bytes, _NO_TIES)
            if found.whole_grad_bytes > 0:
                total += all_reduce_cost(mesh, "data", found.whole_grad_bytes, _NO_TIES)
        return total

    def replica_range_cost(
        self, start: int, end: int, logical: Shape2, mode: str = "none"
    ) -> StageCost:
        """Layers ``[start, end)`` on ``logical = (dp, tp)`` run as ``dp`` data-parallel
        replicas (``grad_reduce="step"``), each on 1/dp of the microbatch's rows under the
        plan of the step traced at that size on ``(1, tp)`` (:meth:`replica_cost`), their
        gradients accumulated unreduced and reduced over ``data`` once per step, the
        update sharded over ``data`` (Megatron-LM's data parallelism with its distributed
        optimizer; the pipeline runtime's ``grad_reduce="step"``).
        Latency: a replica's (its update amortised as in every stage, less what sharding
        it over ``data`` saves, :meth:`replica_layer`), plus the step's reductions
        (:meth:`replica_reduce_s`) spread over the microbatches; memory: a replica's, its
        optimizer state sharded over ``data`` where a dim divides.
        Infinite with one replica or one microbatch a step (nothing to save: the runtime's
        one-microbatch step reduces as it updates), and where the replicas would run
        another program: their forward at 1/dp is not this one's, or the range couples
        rows (:meth:`replica_coupling`: a batch statistic computed per replica)."""
        dp, tp = logical
        if dp < 2 or self.num_microbatches < 2:
            return StageCost(math.inf, 0.0, 0.0)
        replica = self.replica_cost(logical)
        if replica is None or self.replica_coupling(start, end, dp) is not None:
            return StageCost(math.inf, 0.0, 0.0)
        if replica.num_microbatches != self.num_microbatches:
            raise ValueError(
                f"the replica cost amortises over {replica.num_microbatches} microbatches, "
                f"this one over {self.num_microbatches}: build it with the same count"
            )
        base = replica.range_cost(start, end, (1, tp), mode)
        if not math.isfinite(base.latency_s):
            return base
        layers = [self.replica_layer(i, logical) for i in range(start, end)]
        per_step = self.replica_reduce_s(start, end, logical)
        per_step -= sum(x.update_saved_s for x in layers)  # the sharded update
        return dataclasses.replace(
            base,
            latency_s=base.latency_s + per_step / self.num_microbatches,
            param_bytes=base.param_bytes - sum(x.state_saved_bytes for x in layers),
        )


def refuse_coupled_replicas(cost, devices: int) -> None:
    """``grad_reduce="step"`` (every stage with ``dp > 1`` runs as replicas): ValueError
    naming the first equation where ``cost``'s step couples rows, read at the first ``dp``
    in ``2 .. devices`` whose replicas can run (the coupling is the forward's, whatever
    the ``dp``)."""
    for dp in range(2, devices + 1):
        found = cost.replica_couplings(dp)
        if found is None:
            continue
        if found:
            raise coupled_rows_error(found, dp)
        return


@dataclasses.dataclass(frozen=True)
class ReplicaLayer:
    """One layer of a data-parallel replica stage, per device and step
    (:meth:`ReplicaCosts.replica_layer`): the gradient bytes reduce-scattered over
    ``data`` (their weights all-gathered back) and all-reduced whole, and what sharding
    the update over ``data`` saves (update seconds, optimizer-state bytes)."""

    sharded_grad_bytes: float
    whole_grad_bytes: float
    update_saved_s: float
    state_saved_bytes: float


def _replica_layer(replica, layer: int, inner: Shape2, unit, dp: int):
    """:class:`ReplicaLayer` of ``layer`` under ``unit`` (its plan on ``inner``)."""
    rep = replica._rep[replica.signatures[layer]]
    g = replica.subgraph(rep, rep + 1).graph
    mesh = replica.mesh_for(inner)
    aliased = {src for src, _ in g.aliases}
    sharded = whole = state_saved = 0.0
    for tid, spec in zip(g.inputs, unit.plan.input_specs, strict=True):
        t = g.tensors[tid]
        if t.kind not in ("param", "opt_state") or tid not in aliased:
            continue  # a borrowed weight is its owner's to reduce and update
        split = tuple(math.prod(mesh.mesh.size(a) for a in axes) for axes in spec.dims)
        nbytes = t.nbytes * _spec_fraction(spec, mesh)
        on = zero_dim(t.shape, split, dp) is not None
        if t.kind == "param":
            sharded, whole = (sharded + nbytes, whole) if on else (sharded, whole + nbytes)
        elif on:
            state_saved += nbytes * (1 - 1 / dp)
    phases = unit.plan.solver.get("compute_s_by_phase", {})
    share = sharded / (sharded + whole) if sharded + whole > 0 else 0.0
    update_saved = phases.get("update", 0.0) * share * (1 - 1 / dp)
    return ReplicaLayer(sharded, whole, update_saved, state_saved)
