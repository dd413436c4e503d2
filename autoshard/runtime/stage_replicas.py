"""A pipeline stage run as data-parallel replicas (``grad_reduce="step"``,
:class:`~autoshard.runtime.stage.StageExecutable`): each tensor's batch dim between the
microbatch's trace and the replicas' (:class:`ReplicaShapes`), the ZeRO layout of their
optimizer state (:func:`zero_spec`), and the checks and helpers the stage's ``shard_map``
needs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.inter.stage_memory import zero_dim
from autoshard.trace.jaxpr import TracedProgram


@dataclasses.dataclass(frozen=True)
class ReplicaShapes:
    """Per tensor, the dim that holds the microbatch's rows, found by comparing the
    program traced at the microbatch (``full``) with its trace at ``1/replicas`` of it
    (``local``): the dim that shrank by ``replicas``; None where no dim shrank (the
    tensor is the same in every replica: a loss scalar, a weight)."""

    replicas: int
    batch_dims: Mapping[int, int | None]

    @staticmethod
    def compare(full: TracedProgram, local: TracedProgram, replicas: int) -> ReplicaShapes:
        """The batch dims of the tensors ``full``'s equations read and write; ValueError
        where ``local`` is not the same program at ``1/replicas`` of the rows."""
        a, b = full.records, local.records
        differ = next(
            (
                x
                for x, y in zip(a.eqns, b.eqns)
                if (x.primitive, x.inputs, x.outputs) != (y.primitive, y.inputs, y.outputs)
            ),
            None,
        )
        if len(a.eqns) != len(b.eqns) or differ is not None or a.inputs != b.inputs:
            where = f" (equation {differ.index}, {differ.primitive})" if differ else ""
            raise ValueError(
                f"the loss traced at 1/{replicas} of the microbatch has other equations than "
                f"at the microbatch{where}: it cannot run as data-parallel replicas; use "
                "grad_reduce='microbatch' or more rows per replica"
            )
        ids = {*a.inputs, *a.outputs, *(t for e in a.eqns for t in (*e.inputs, *e.outputs))}
        dims: dict[int, int | None] = {}
        for t in sorted(ids):
            big, small = a.tensors[t], b.tensors[t]
            shrunk = [
                d for d, (m, n) in enumerate(zip(big.shape, small.shape, strict=False)) if m != n
            ]
            if (
                len(big.shape) != len(small.shape)
                or len(shrunk) > 1
                or any(big.shape[d] != small.shape[d] * replicas for d in shrunk)
            ):
                raise ValueError(
                    f"tensor {big.path or big.id} is {list(big.shape)} at the microbatch and "
                    f"{list(small.shape)} at 1/{replicas} of it: not one batch dim split "
                    f"{replicas} ways, so the stage cannot run as data-parallel replicas"
                )
            dims[t] = shrunk[0] if shrunk else None
        return ReplicaShapes(replicas, dims)

    def manual_spec(self, t: int) -> PartitionSpec:
        """``shard_map``'s spec of a tensor: ``data`` on its batch dim (None: replicated)."""
        d = self.batch_dims[t]
        return PartitionSpec() if d is None else PartitionSpec(*[None] * d, "data")

    def placed_spec(self, t: int, spec: PartitionSpec, rank: int) -> PartitionSpec:
        """The full tensor's spec: the replica plan's ``spec`` with ``data`` added (major)
        on its batch dim."""
        d = self.batch_dims[t]
        if d is None:
            return spec
        entries = list(spec) + [None] * (rank - len(spec))
        held = entries[d]
        held = () if held is None else (held,) if isinstance(held, str) else tuple(held)
        entries[d] = ("data", *held)
        return PartitionSpec(*entries)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """A replica stage's ``spec`` (on ``model`` only) of a tensor of ``shape`` with
    ``data`` added, minor (after the dim's ``model`` axes: each replica's share lies inside
    its own ``model`` shard, so nothing moves but the reduce-scatter and all-gather), on
    its ZeRO dim (:func:`~autoshard.inter.stage_memory.zero_dim`): how its optimizer state
    rests and its update runs; ``spec`` itself where it has none."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    split = tuple(math.prod(mesh.shape[a] for a in _axes(e)) for e in entries)
    d = zero_dim(tuple(shape), split, mesh.shape["data"])
    if d is None:
        return spec
    entries[d] = (*_axes(entries[d]), "data")
    return PartitionSpec(*entries)


def _names_data(spec: PartitionSpec) -> bool:
    for entry in spec:
        if entry == "data" or (isinstance(entry, tuple) and "data" in entry):
            return True
    return False


def _check_model_only(stage: int, constraints) -> None:
    """ValueError where a replica stage's constraints name ``data``."""
    for table in (constraints.outputs, constraints.operands):
        for eqn, found in table.items():
            for _, sharding in found:
                if _names_data(sharding.spec):
                    raise ValueError(
                        f"stage {stage} runs as data-parallel replicas but its plan constrains "
                        f"equation {eqn} to {sharding.spec}: a replica's plan may use only "
                        "'model'"
                    )


def _replica_shapes(prog, replica_prog, mesh, offload) -> ReplicaShapes | None:
    """The stage's :class:`ReplicaShapes`, or None where it runs as one (no
    ``replica_prog``, or a ``data`` axis of 1)."""
    if replica_prog is None or mesh.shape["data"] == 1:
        return None
    if offload:
        raise ValueError(
            f"a stage offloading {', '.join(offload)} cannot run as data-parallel replicas "
            "(grad_reduce='step'): the offloaded update and residuals are not built for the "
            "stacked gradients; drop offload or use grad_reduce='microbatch'"
        )
    return ReplicaShapes.compare(prog, replica_prog, mesh.shape["data"])


def _on_mesh(constraints, mesh):
    """``constraints`` with each sharding's spec on ``mesh`` (a replica's: the trace's
    context inside its ``shard_map``, ``data`` manual, ``model`` left to GSPMD)."""

    def rebased(table):
        return {
            k: tuple((pos, NamedSharding(mesh, sh.spec)) for pos, sh in found)
            for k, found in table.items()
        }

    return dataclasses.replace(
        constraints, outputs=rebased(constraints.outputs), operands=rebased(constraints.operands)
    )


def _combine(stacked):
    """One value from the replicas' stacked copies of an output without a batch dim: the
    mean of a floating-point one (the microbatch's mean loss is the mean of its equal
    shares' means), the first of another (the same in every replica)."""
    if jnp.issubdtype(stacked.dtype, jnp.inexact):
        return stacked.mean(0)
    return stacked[0]
