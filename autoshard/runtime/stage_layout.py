"""How a pipeline stage lays out its tensors: its intra-op plan, made runnable.

Takes a traced **train step** (forward, backward, update; traced at the microbatch size)
and, per stage, the intra-op plan the inter-operator search chose for it
(:class:`autoshard.inter.plan.StageSpecs`, on the step's tensor ids); returns what the
pipeline runtime (:mod:`autoshard.runtime.pipeline`) needs:

* :func:`loss_program`: the step's forward equations as a program
  ``(params, batch) -> loss``, with the step's tensor ids, so a spec the ILP chose for a
  forward tensor applies to the same tensor when the pipeline runs it;
* :class:`StageLayout`: the partition spec of every tensor a stage places (parameters,
  batch leaves, tensors it receives and sends), the ``with_sharding_constraint`` s on its
  forward node outputs (:class:`autoshard.runtime.sharded.SpecConstraints`, as for a single-mesh
  plan) and the specs of its optimizer state (matched by pytree path).

Guarantees: specs apply only where they fit (every spec was validated against the
tensor's shape on the logical mesh by the search); anything the plan does not cover is
replicated; partial-sum specs are never constraints, and where one would be a stage's
output layout its partial axes are reduced (replicated).  The backward is the
``jax.vjp`` of the constrained forward, so cotangents follow the forward's shardings
(the transpose of a sharding constraint is the same constraint); the plan's own specs for
backward tensors are not applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec

from autoshard.ir.records import TensorRecord, TraceRecords
from autoshard.ir.spec import ShardingSpec
from autoshard.runtime.sharded import SpecConstraints, to_partition_spec
from autoshard.trace.jaxpr import TracedProgram

# spec_fn(stage index, tensor, role, stage mesh) -> PartitionSpec; role is "param",
# "activation" (sent between stages) or "data" (a batch leaf)
SpecFn = Callable[[int, TensorRecord, str, jax.sharding.Mesh], PartitionSpec]
OPT_STATE_ARG = "[1]"  # the path prefix of optimizer state in a traced train step


@dataclass(frozen=True)
class LossProgram:
    """The forward of a train step as ``(params, batch) -> loss``; ``step_eqn[i]`` is the
    train step's index of equation ``i`` (tensor ids are the step's)."""

    program: TracedProgram
    step_eqn: tuple[int, ...]


def loss_program(step: TracedProgram) -> LossProgram:
    """Cut the loss computation out of a traced ``(params, opt_state, batch) ->
    (params, opt_state, loss)`` step: the equations the loss depends on, in order."""
    records = step.records
    kinds = [records.tensors[t].kind for t in records.inputs]
    if "opt_state" not in kinds and len(step.in_tree.children()) != 3:
        raise ValueError("expected a traced train step (params, opt_state, batch)")
    loss = records.outputs[-1]
    if records.tensors[loss].shape != ():
        raise ValueError("the train step's last output must be the scalar loss")
    needed, keep = {loss}, []
    for eqn in reversed(records.eqns):
        if needed.intersection(eqn.outputs):
            keep.append(eqn.index)
            needed.update(eqn.inputs)
    keep.reverse()
    for i in keep:
        if records.eqns[i].phase != "forward":
            raise ValueError(f"the loss depends on {records.eqns[i].phase} equation {i}")
    eqns = tuple(dataclasses.replace(records.eqns[i], index=k) for k, i in enumerate(keep))
    inputs = tuple(t for t, k in zip(records.inputs, kinds, strict=True) if k != "opt_state")
    sub = TraceRecords(records.tensors, eqns, inputs, (loss,), (), records.layers)
    params_tree, _, batch_tree = step.in_tree.children()
    program = TracedProgram(
        sub,
        jax.tree_util.treedef_tuple([params_tree, batch_tree]),
        step.out_tree.children()[2],
        tuple(step._impls[i] for i in keep),
        {t: v for t, v in step._consts.items() if t in needed},
    )
    return LossProgram(program, tuple(keep))


def _reduced(spec: ShardingSpec) -> ShardingSpec:
    return dataclasses.replace(spec, partial=()) if spec.partial else spec


@dataclass(frozen=True)
class StageLayout:
    """Shardings of one stage on its mesh: ``spec_fn`` for what it places, the
    constraints inside its forward, and its optimizer state's specs by pytree path."""

    spec_fn: SpecFn
    name: str = "data-parallel"  # or "intra-op"
    constraints: SpecConstraints | None = None
    opt_state_specs: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)
    tensor_parallel: bool = False  # whether the plan splits anything over "model"

    def opt_state_sharding(self, mesh: jax.sharding.Mesh, abstract_state):
        """``NamedSharding`` per leaf of a stage's optimizer state (replicated if unplanned)."""

        def one(path, leaf):
            spec = self.opt_state_specs.get(jax.tree_util.keystr(path), PartitionSpec())
            return jax.sharding.NamedSharding(mesh, spec)

        return jax.tree_util.tree_map_with_path(one, abstract_state)


def data_parallel_spec(
    stage: int, tensor: TensorRecord, role: str, mesh: jax.sharding.Mesh
) -> PartitionSpec:
    """Default layout inside a stage: parameters replicated; batch and activations split
    on dim 0 over all the stage's devices when that divides evenly, else replicated."""
    if role == "param" or not tensor.shape or tensor.shape[0] % mesh.size:
        return PartitionSpec()
    return PartitionSpec(tuple(mesh.axis_names))


def intra_op_layout(
    loss: LossProgram, specs, stage_eqns: tuple[int, ...], mesh: jax.sharding.Mesh
) -> StageLayout:
    """The layout of a stage running equations ``stage_eqns`` (of ``loss``) under the
    intra-op plan ``specs`` (:class:`autoshard.inter.plan.StageSpecs`) on ``mesh``.

    Node outputs keep the plan's spec (sent ones with partial axes reduced); tensors the
    stage places (parameters, batch leaves, received tensors) take the spec the plan's
    layers read them in.
    """
    records = loss.program.records
    placed: dict[int, ShardingSpec] = dict(specs.input_specs)
    placed.update({t: _reduced(s) for t, s in specs.tensor_specs.items()})

    def spec_fn(stage: int, tensor: TensorRecord, role: str, _mesh) -> PartitionSpec:
        spec = placed.get(tensor.id)
        return PartitionSpec() if spec is None else to_partition_spec(spec)

    index_of = {step: i for i, step in enumerate(loss.step_eqn)}
    operand_specs = {
        index_of[node]: ops for node, ops in specs.operand_specs.items() if node in index_of
    }
    constraints = SpecConstraints.build(
        [records.eqns[i] for i in stage_eqns],
        specs.tensor_specs,
        operand_specs,
        mesh,
        tensors=records.tensors,
        input_specs=specs.input_specs,
    )
    opt_state_specs = {}
    for tid, spec in specs.input_specs.items():
        t = records.tensors[tid]
        if t.kind == "opt_state" and t.path.startswith(OPT_STATE_ARG):
            opt_state_specs[t.path[len(OPT_STATE_ARG) :]] = to_partition_spec(spec)
    tensor_parallel = any(
        "model" in s.used_axes and mesh.shape["model"] > 1
        for s in (*specs.input_specs.values(), *specs.tensor_specs.values())
    )
    return StageLayout(spec_fn, "intra-op", constraints, opt_state_specs, tensor_parallel)
