"""How the pipeline runtime plans the stages it runs as data-parallel replicas
(``auto_pipeline(..., grad_reduce="step" | "auto")``, docs/distributed.md): the loss
traced again at 1/dp of the microbatch (:class:`Replicas`, shared by the stage search's
pricing and the runtime), each replica stage's layout (its plan on ``(1, tp)``, ``model``
only) and the requests refused."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from autoshard.inter.plan import StageSpecs
from autoshard.inter.program_cut import StageProgram
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stages import GRAD_REDUCE_CHOICES
from autoshard.ir.graph import build_graph
from autoshard.ir.row_coupling import coupled_rows_error, row_couplings, row_literals
from autoshard.ir.spec import ShardingSpec
from autoshard.models import make_train_step
from autoshard.runtime.stage import ReplicaShapes
from autoshard.runtime.stage_layout import (
    LossProgram,
    StageLayout,
    data_parallel_spec,
    intra_op_layout,
    loss_program,
)
from autoshard.trace.jaxpr import TracedProgram, trace_train_step


class Replicas:
    """The traces and stage costs of ``dp`` replicas, per ``dp``, made when first asked.

    :meth:`trace`: the train step and loss at 1/dp of the microbatch, or None where
    ``dp`` replicas cannot run (the microbatch does not split so, or its trace at 1/dp is
    another program, e.g. a batch dim squeezed at one row): not offered to the search
    under "auto"; with ``strict`` (``grad_reduce="step"``, which asked for them) the
    error, and the error where the loss couples rows (a batch statistic; under "auto"
    the search prices such a stage's replicas at infinity,
    :meth:`~autoshard.inter.stage_cost.IntraStageCost.replica_coupling`).
    :meth:`priced_like`: ``dp -> IntraStageCost`` of that trace with a stage cost's
    meshes and ILP settings (the stage search's ``replicas``)."""

    def __init__(self, loss_fn, optimizer, abstract, batch, num_microbatches, program, *, strict):
        self._loss_fn, self._optimizer, self._abstract = loss_fn, optimizer, abstract
        self._batch, self._program, self._strict = batch, program, strict
        self._num_microbatches = num_microbatches
        self._batch_size = jax.tree.leaves(batch)[0].shape[0]
        self._traces: dict[int, ReplicaTrace | None] = {}

    def trace(self, dp: int) -> ReplicaTrace | None:
        if dp not in self._traces:
            parts = self._num_microbatches * dp
            found = None
            if self._batch_size % parts == 0:
                found = _replica_loss(
                    self._loss_fn, self._optimizer, self._abstract, self._batch, parts
                )
                try:
                    shapes = ReplicaShapes.compare(self._program, found.program, dp)
                except ValueError:
                    if self._strict:
                        raise
                    found = None
                else:
                    if self._strict:  # "auto": the search keeps replicas off coupled stages
                        refuse_row_coupling(self._program, found.program, shapes, dp)
            self._traces[dp] = found
        return self._traces[dp]

    def priced_like(self, cost: IntraStageCost):
        """``dp -> IntraStageCost`` of :meth:`trace` (None where it is None), priced on
        ``cost``'s meshes with its solver, ILP time limit, granularity, microbatches and
        casts (``cast_once``)."""
        costs: dict[int, IntraStageCost | None] = {}

        def replica_cost(dp: int) -> IntraStageCost | None:
            if dp not in costs:
                found = self.trace(dp)
                costs[dp] = (
                    None
                    if found is None
                    else IntraStageCost(
                        build_graph(found.step.records),
                        cost.mesh_for,
                        solver=cost.solver,
                        granularity=cost.granularity,
                        time_limit_s=cost.time_limit_s,
                        num_microbatches=cost.num_microbatches,
                        cast_once=cost.cast_once,
                    )
                )
            return costs[dp]

        return replica_cost


def refuse_row_coupling(full: TracedProgram, local: TracedProgram, shapes, dp: int) -> None:
    """ValueError naming the first equation where the loss program ``full`` couples rows
    (:func:`~autoshard.ir.row_coupling.row_couplings`; ``local``: it at 1/dp of the
    microbatch, ``shapes`` their :class:`ReplicaShapes`), ``dp`` replicas asked for."""
    a, b = full.records, local.records
    operands = {t for e in a.eqns for t in e.inputs}
    found = row_couplings(
        a.eqns,
        shapes.batch_dims,
        a.layers,
        loss=a.outputs[-1],
        row_literals=row_literals(a, b, dp, operands),
    )
    if found:
        raise coupled_rows_error(found, dp)


def check_grad_reduce(grad_reduce, layout, stages, offload, spec_fn) -> None:
    """ValueError for a ``grad_reduce`` the pipeline cannot run."""
    if grad_reduce not in GRAD_REDUCE_CHOICES:
        raise ValueError(
            f"unknown grad_reduce {grad_reduce!r}; choose one of {GRAD_REDUCE_CHOICES}"
        )
    if grad_reduce == "microbatch":
        return
    if grad_reduce == "auto" and layout != "intra-op":
        raise ValueError(
            "grad_reduce='auto' lets the stage search choose per stage: it needs "
            "layout='intra-op' (the data-parallel layout's FLOPs costs price no reduction); "
            "use grad_reduce='step'"
        )
    if offload is not None:
        raise ValueError(
            "grad_reduce='step' with offload: a stage running data-parallel replicas keeps "
            "its state on the device; drop offload or use grad_reduce='microbatch'"
        )
    if spec_fn is not data_parallel_spec:
        raise ValueError(
            "grad_reduce='step' lays each replica out itself (replicated on a (dp, 1) "
            "mesh); a custom spec_fn needs grad_reduce='microbatch'"
        )


def check_replica_batch(batch_size: int, num_microbatches: int, planned) -> None:
    """ValueError unless each replica stage's ``dp`` splits every microbatch evenly."""
    for i, st in enumerate(planned):
        dp = st.logical_mesh[0]
        if st.grad_reduce != "step" or batch_size % (num_microbatches * dp) == 0:
            continue
        fits = [m for m in range(1, batch_size + 1) if batch_size % (m * dp) == 0]
        raise ValueError(
            f"grad_reduce='step': stage {i} runs {dp} data-parallel replicas, so the batch "
            f"size {batch_size} must divide by num_microbatches * dp = {num_microbatches} * "
            f"{dp}; use num_microbatches in {fits}, a batch size that is a multiple of "
            f"{num_microbatches * dp}, or grad_reduce='microbatch'"
        )


def _replica_loss(loss_fn, optimizer, abstract, batch, parts: int) -> ReplicaTrace:
    """The train step and loss of ``batch / parts`` rows, traced as :func:`auto_pipeline`
    traces the microbatch's (the same equations and tensor ids at a smaller batch)."""
    rows = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype), batch
    )
    step = trace_train_step(
        make_train_step(loss_fn, optimizer),
        abstract,
        jax.eval_shape(optimizer.init, abstract),
        rows,
    )
    return ReplicaTrace(step, loss_program(step))


@dataclasses.dataclass(frozen=True)
class ReplicaTrace:
    """A replica's train step (its graph is what the ILP plans) and its loss program
    (what the stage binds)."""

    step: TracedProgram
    loss: LossProgram

    @property
    def program(self) -> TracedProgram:
        return self.loss.program


def _model_only(specs: StageSpecs) -> StageSpecs:
    """A replica's plan made on the ``(1, tp)`` mesh with its ``data`` entries (an axis
    of one device, so nothing) dropped; ValueError for a plan that splits over ``data``."""
    if specs.logical_mesh[0] != 1:
        raise ValueError(
            f"a replica's plan must be made on a (1, tp) mesh, not {tuple(specs.logical_mesh)}"
        )

    def strip(spec: ShardingSpec) -> ShardingSpec:
        dims = tuple(tuple(a for a in d if a != "data") for d in spec.dims)
        partial = tuple(a for a in spec.partial if a != "data")
        return dataclasses.replace(spec, dims=dims, partial=partial)

    def table(m):
        return {k: strip(v) for k, v in m.items()}

    return StageSpecs(
        specs.logical_mesh,
        table(specs.tensor_specs),
        table(specs.input_specs),
        {n: table(o) for n, o in specs.operand_specs.items()},
    )


def replicated_spec(stage: int, tensor, role: str, mesh: jax.sharding.Mesh) -> PartitionSpec:
    """A replica's layout under ``layout="data-parallel"``: everything replicated (the
    runtime splits the batch over ``data`` itself)."""
    return PartitionSpec()


def replica_layouts(layout_fn, layout, planned, losses, replica_cost):
    """``layout_fn`` with each replica stage laid out as one replica: under
    ``"intra-op"`` the range's ILP plan on ``(1, tp)`` of the loss traced at ``1/dp`` of
    the microbatch (``replica_cost(dp)``'s, the plan the stage search priced; model
    only), under ``"data-parallel"`` replicated."""
    layouts: dict[int, StageLayout] = {}

    def replica_layout(index: int, sp: StageProgram, mesh) -> StageLayout:
        st = planned[index]
        if layout == "data-parallel":
            return StageLayout(replicated_spec)
        dp, tp = st.logical_mesh
        specs = _model_only(replica_cost(dp).stage_specs(st.start_layer, st.end_layer, (1, tp)))
        return intra_op_layout(losses[dp].loss, specs, sp.eqns, mesh)

    def laid_out(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
        if planned[sp.index].grad_reduce != "step":
            return layout_fn(sp, mesh)
        if sp.index not in layouts:
            layouts[sp.index] = replica_layout(sp.index, sp, mesh)
        return layouts[sp.index]

    return laid_out
