"""Run a :class:`ParallelPlan` on a ``jax.sharding.Mesh`` of real or fake devices.

Takes a :class:`TracedProgram` (the flat step from ``trace``), a plan for it and a device
mesh, and returns a :class:`ShardedStep`: the traced program evaluated equation by
equation, with ``jax.lax.with_sharding_constraint`` on every node output the plan gives
a spec to, compiled by ``jax.jit`` with the plan's input and output shardings and the
state arguments (those that alias outputs) donated.

Guarantees:

* the plan is checked against the program before anything compiles: one spec per input
  and output, ranks that match, even splits, mesh axes that exist; a mismatch raises a
  ``ValueError`` that names the tensor;
* partial-sum ("unreduced") specs are never constrained: JAX has no way to say "this
  value is a partial sum", so XLA is left to place the reduction where the next
  constraint needs it; program inputs and outputs may not be partial;
* what runs is exactly what :meth:`ShardedStep.compiled_text` shows (one executable,
  compiled from abstract ``jax.ShapeDtypeStruct`` arguments, so a 39B-parameter step
  compiles without allocating it).

:func:`check_against_single_device` runs a plan next to the plain single-device program
and reports the largest relative errors of the loss, the first parameter update (for
SGD that is ``-lr * grad``, so it checks gradients) and every output after N steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.ir import spec as aspec
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.records import EqnRecord
from autoshard.runtime.distributed import to_host
from autoshard.runtime.offload_stream import STREAM_WINDOW, evaluate_streamed, stream_plan
from autoshard.trace.jaxpr import TracedProgram

HOST_MEMORY = "pinned_host"  # JAX's memory kind of offloaded state (docs/offload.md)


def make_mesh(plan_mesh: aspec.Mesh, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` with the logical mesh's axis names and shape (Auto axes).

    ``devices`` defaults to ``jax.devices()``; their number must equal the mesh size.
    """
    devices = list(jax.devices() if devices is None else devices)
    needed = plan_mesh.num_devices
    if len(devices) != needed:
        hint = (
            f" To use a subset, pass devices=jax.devices()[:{needed}]."
            if len(devices) > needed
            else ""
        )
        raise ValueError(
            f"mesh {plan_mesh} needs {needed} devices but {len(devices)} were given "
            f"({jax.default_backend()} backend).{hint} For fake CPU devices, run the CLI with "
            f"`--devices {needed}` or call jax.config.update('jax_num_cpu_devices', {needed}) "
            "before JAX starts its backend."
        )
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return jax.sharding.Mesh(grid.reshape(plan_mesh.shape), plan_mesh.axis_names)


def to_partition_spec(spec: aspec.ShardingSpec) -> PartitionSpec:
    """``ShardingSpec`` -> ``PartitionSpec``: None, one axis name or a tuple per dim.

    Raises ValueError for specs with partial-sum axes, which a PartitionSpec cannot say.
    """
    if spec.partial:
        raise ValueError(
            f"spec {spec} is a partial sum over {spec.partial}; a PartitionSpec cannot express "
            "unreduced values: leave such values unconstrained"
        )
    entries: list[Any] = []
    for axes in spec.dims:
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    return PartitionSpec(*entries)


def named_sharding(mesh: jax.sharding.Mesh, spec: aspec.ShardingSpec) -> NamedSharding:
    """The ``NamedSharding`` of ``spec`` on ``mesh``."""
    return NamedSharding(mesh, to_partition_spec(spec))


@dataclass(frozen=True)
class SpecConstraints:
    """The ``with_sharding_constraint`` s a plan puts inside a program, by equation index.

    ``outputs[eqn]`` pins node outputs to their planned specs; ``operands[eqn]`` reshards
    an operand where the plan reads it in another spec than its producer made it.
    Partial-sum specs are left out (JAX cannot say "unreduced"; XLA places the reduction
    where the next constraint needs it).  :meth:`outputs_hook` and :meth:`operands_hook`
    are the ``hook`` / ``in_hook`` of :meth:`TracedProgram.evaluate` (the latter with a
    memo per trace); the pipeline runtime uses them on each stage's equations too.
    """

    outputs: Mapping[int, tuple[tuple[int, NamedSharding], ...]]
    operands: Mapping[int, tuple[tuple[int, NamedSharding], ...]]

    @staticmethod
    def build(
        eqns: Sequence[EqnRecord],
        tensor_specs: Mapping[int, aspec.ShardingSpec],
        operand_specs: Mapping[int, Mapping[int, aspec.ShardingSpec]],
        mesh: jax.sharding.Mesh,
        tensors: Sequence[Any] | None = None,
        input_specs: Mapping[int, aspec.ShardingSpec] | None = None,
    ) -> SpecConstraints:
        """Constraints for ``eqns`` (records whose ``index`` keys ``operand_specs``).

        With ``tensors`` (the program's tensor records, for shapes and dtypes), an operand
        read in another spec than its (not partial) producer made it, or than the program
        input it is (``input_specs``), is constrained to every spec of the route the
        planner priced for that reshard, one after the other (:func:`reshard_route`):
        XLA's partitioner then moves it one priced collective at a time. Left to itself it
        takes other routes for a reshard of several steps (all-to-alls and all-gathers
        over parts of an axis, collective-permutes), which the plan neither priced nor
        predicted (docs/truth.md, moe-1.3b and wresnet-1b on 2x4)."""
        outputs: dict[int, tuple[tuple[int, NamedSharding], ...]] = {}
        for eqn in eqns:
            found = tuple(
                (pos, named_sharding(mesh, tensor_specs[tid]))
                for pos, tid in enumerate(eqn.outputs)
                if tid in tensor_specs and not tensor_specs[tid].partial
            )
            if found:
                outputs[eqn.index] = found
        operands: dict[int, tuple[tuple[int, NamedSharding], ...]] = {}
        by_index = {eqn.index: eqn for eqn in eqns}
        made_by = {tid: eqn.primitive for eqn in eqns for tid in eqn.outputs}
        plan_mesh = aspec.Mesh(tuple(mesh.axis_names), tuple(int(n) for n in mesh.devices.shape))
        held = dict(input_specs or {})
        held.update(tensor_specs)
        for node, ops in operand_specs.items():
            if node not in by_index:
                continue
            found: list[tuple[int, NamedSharding]] = []
            for k, spec in sorted(ops.items()):
                if spec.partial:
                    continue
                tid = by_index[node].inputs[k]
                made = tensor_specs.get(tid)
                if made_by.get(tid) == "gather" and made is not None and _scatters(made, spec):
                    # reduced in the gather's own layout first (an all-reduce), then split
                    # (a slice): XLA:CPU reads it as the reduce-scatter the plan priced, and
                    # XLA:GPU's ReduceScatterCreator makes it one. Without this XLA
                    # propagates the split back into the gather, whose partitioner splits
                    # the indices over the mesh axis the table leaves free (data), all-
                    # reduces that half over the table's axis and moves the rows it keeps
                    # with a collective-permute (docs/truth.md, gpt-1.3b auto 2x4)
                    reduced = aspec.ShardingSpec(made.dims)
                    found.append((k, named_sharding(mesh, reduced)))
                source = held.get(tid)
                if tensors is not None and source is not None and not source.partial:
                    t = tensors[tid]
                    for step in reshard_route(source, spec, t.shape, t.dtype, plan_mesh):
                        found.append((k, named_sharding(mesh, step)))
                found.append((k, named_sharding(mesh, spec)))
            if found:
                operands[node] = tuple(found)
        return SpecConstraints(outputs, operands)

    @property
    def num_outputs(self) -> int:
        return sum(len(c) for c in self.outputs.values())

    def outputs_hook(self, eqn_index: int, outs: list) -> list:
        for pos, sharding in self.outputs.get(eqn_index, ()):
            outs[pos] = jax.lax.with_sharding_constraint(outs[pos], sharding)
        return outs

    def operands_hook(self, eqn_index: int, invals: list, memo: dict | None = None) -> list:
        """Constrain the operands ``eqn_index`` reads in another spec than their producer's.

        ``memo`` (a fresh dict per trace) shares each constraint among the readers of one
        value: a value read in one spec by several equations is resharded once, as the
        planner prices it and the memory model holds it. Without it (None) each reader
        gets its own chain, and XLA's partitioner shares only a route's first step (it
        reshards one instruction to one sharding once): the next step's source is each
        reader's own constraint, so it is emitted once per reader (test_intra's MLP on
        2x2: five all-gathers over ``model`` where four were predicted)."""
        for pos, sharding in self.operands.get(eqn_index, ()):
            value = invals[pos]
            if memo is None:
                invals[pos] = jax.lax.with_sharding_constraint(value, sharding)
                continue
            key = (id(value), sharding)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = (value, jax.lax.with_sharding_constraint(value, sharding))
            invals[pos] = hit[1]
        return invals


def reshard_route(
    src: aspec.ShardingSpec, dst: aspec.ShardingSpec, shape, dtype, mesh: aspec.Mesh
) -> tuple[aspec.ShardingSpec, ...]:
    """The specs between ``src`` and ``dst`` on the route the planner prices for this
    reshard (:func:`autoshard.intra.cost.resharding.reshard`'s ``steps``): XLA's route, taken one
    collective at a time. Priced on a uniform mesh: the route of a reshard XLA's way
    depends on the specs alone (where it falls back to gathering everything, it does so
    on any mesh)."""
    from autoshard.hardware.mesh import uniform_mesh
    from autoshard.intra.cost.resharding import reshard

    if src == dst:
        return ()
    priced = _uniform_meshes.get(mesh)
    if priced is None:
        priced = _uniform_meshes[mesh] = uniform_mesh(mesh.shape, mesh.axis_names, 1e-5, 1e-10)
    return reshard(src, dst, tuple(shape), np.dtype(dtype).itemsize, priced).steps


_uniform_meshes: dict = {}


def _scatters(made: aspec.ShardingSpec, read: aspec.ShardingSpec) -> bool:
    """Whether reading the partial sum ``made`` as ``read`` splits a dim over an axis the
    sum is partial over (a reduce-scatter, not only an all-reduce)."""
    split = {a for axes in read.dims for a in axes}
    return made.partial_op == "sum" and bool(split & set(made.partial))


def _check_mesh(plan: ParallelPlan, mesh: jax.sharding.Mesh) -> None:
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.devices.shape)
    if names != plan.mesh.axis_names or shape != plan.mesh.shape:
        raise ValueError(
            f"plan {plan.name!r} is for mesh {plan.mesh} but the device mesh has axes {names} "
            f"with shape {shape}; build it with make_mesh(plan.mesh)"
        )


def _check_spec(plan: ParallelPlan, program: TracedProgram, tid: int, spec, where: str) -> None:
    rec = program.records.tensors[tid]
    label = f"{where} {rec.path or f'tensor {tid}'} ({rec.dtype}{list(rec.shape)})"
    if where != "node output" and spec.partial:
        raise ValueError(
            f"{label} has the partial-sum spec {spec}; program inputs and outputs "
            "must be sharded or replicated"
        )
    try:
        spec.validate(plan.mesh, rec.shape)
    except ValueError as err:
        raise ValueError(f"plan {plan.name!r}: bad spec for {label}: {err}") from None


def _alias_positions(program: TracedProgram) -> dict[int, int]:
    """{flat input position: flat output position} for state the step returns updated."""
    records = program.records
    in_pos = {tid: i for i, tid in enumerate(records.inputs)}
    # an output tensor may appear twice: each alias takes its first unused position
    out_pos: dict[int, list[int]] = {}
    for j, t in reversed(list(enumerate(records.outputs))):
        out_pos.setdefault(t, []).append(j)
    return {in_pos[in_id]: out_pos[out_id].pop() for in_id, out_id in records.aliases}


def _donated_argnums(program: TracedProgram) -> tuple[int, ...]:
    """Positional arguments whose every leaf is state aliased by an output."""
    aliased = set(_alias_positions(program))
    num_leaves = [tree.num_leaves for tree in program.in_tree.children()]
    out, start = [], 0
    for argnum, n in enumerate(num_leaves):
        if n and all(p in aliased for p in range(start, start + n)):
            out.append(argnum)
        start += n
    return tuple(out)


class ShardedStep:
    """A traced program compiled for one plan on one device mesh.

    ``step(*args)`` places the arguments with the plan's input shardings and runs the
    compiled executable; with ``donate=True`` the state arguments passed in (params and
    optimizer state of a train step) are consumed.
    """

    def __init__(
        self,
        program: TracedProgram,
        plan: ParallelPlan,
        mesh: jax.sharding.Mesh,
        donate: bool = True,
        stream_window: int | None = STREAM_WINDOW,
    ):
        _check_mesh(plan, mesh)
        records = program.records
        if len(plan.input_specs) != len(records.inputs):
            raise ValueError(
                f"plan {plan.name!r} has {len(plan.input_specs)} input specs, the "
                f"program has {len(records.inputs)} inputs"
            )
        if len(plan.output_specs) != len(records.outputs):
            raise ValueError(
                f"plan {plan.name!r} has {len(plan.output_specs)} output specs, the "
                f"program has {len(records.outputs)} outputs"
            )
        for tid, s in zip(records.inputs, plan.input_specs, strict=True):
            _check_spec(plan, program, tid, s, "input")
        for tid, s in zip(records.outputs, plan.output_specs, strict=True):
            _check_spec(plan, program, tid, s, "output")
        for tid, s in plan.tensor_specs.items():
            if not 0 <= tid < len(records.tensors):
                raise ValueError(
                    f"plan {plan.name!r} gives a spec to tensor {tid}, but the "
                    f"program has tensors 0..{len(records.tensors) - 1}"
                )
            _check_spec(plan, program, tid, s, "node output")

        self.program, self.plan, self.mesh, self.donate = program, plan, mesh, donate
        flat_in = [named_sharding(mesh, s) for s in plan.input_specs]
        flat_out = [named_sharding(mesh, s) for s in plan.output_specs]
        # offload (plan.offload): the state at rest lives in host memory; the step copies
        # it in where it starts and the updated state out where it ends (JAX memory kinds)
        offload = getattr(plan, "offload", None) or {}
        self.host_inputs = tuple(offload.get("host_inputs", ()))
        self.host_outputs = tuple(offload.get("host_outputs", ()))
        self._device_in = {i: flat_in[i] for i in self.host_inputs}
        self._device_out = {j: flat_out[j] for j in self.host_outputs}
        for i in self.host_inputs:
            flat_in[i] = flat_in[i].with_memory_kind(HOST_MEMORY)
        for j in self.host_outputs:
            flat_out[j] = flat_out[j].with_memory_kind(HOST_MEMORY)
        self._flat_in, self._flat_out = tuple(flat_in), tuple(flat_out)
        # streamed (offload_stream): each group of the update fetches its state where it
        # starts and stores it where it ends, ``stream_window`` groups on the device at
        # once; None: every fetch where the step starts, every store where it ends (the
        # form that held all the state on an H100, kept to measure against). Offloaded
        # master weights are fetched where the step starts (the forward reads them: the
        # whole step would be one group), stored as their group ends.
        self._streamed_in = tuple(
            i for i in self.host_inputs if records.tensors[records.inputs[i]].kind == "opt_state"
        )
        self.stream = (
            stream_plan(records, self._streamed_in, self.host_outputs, stream_window)
            if self._streamed_in and stream_window is not None
            else None
        )
        self.in_shardings = jax.tree_util.tree_unflatten(program.in_tree, flat_in)
        self.out_shardings = jax.tree_util.tree_unflatten(program.out_tree, flat_out)
        self.donate_argnums = _donated_argnums(program) if donate else ()
        self.constraints = SpecConstraints.build(
            records.eqns,
            plan.tensor_specs,
            getattr(plan, "operand_specs", {}),
            mesh,
            tensors=records.tensors,
            input_specs=dict(zip(records.inputs, plan.input_specs)),
        )
        self._jitted = jax.jit(
            self._evaluate,
            in_shardings=tuple(self.in_shardings),
            out_shardings=self.out_shardings,
            donate_argnums=self.donate_argnums,
        )
        self._compiled = None

    @property
    def num_constraints(self) -> int:
        """How many node outputs get a ``with_sharding_constraint``."""
        return self.constraints.num_outputs

    def _evaluate(self, *args):
        c = self.constraints
        memo: dict = {}
        if self.stream is not None:
            streamed = set(self._streamed_in)
            flat = jax.tree_util.tree_leaves(args)
            for i, sharding in self._device_in.items():
                if i not in streamed:  # the masters: host -> device where the step starts
                    flat[i] = jax.device_put(flat[i], sharding)
            args = jax.tree_util.tree_unflatten(self.program.in_tree, flat)
            host_out = {j: s.with_memory_kind(HOST_MEMORY) for j, s in self._device_out.items()}
            return evaluate_streamed(
                self.program,
                self.stream,
                args,
                {i: self._device_in[i] for i in self._streamed_in},
                host_out,
                hook=c.outputs_hook,
                in_hook=lambda i, v: c.operands_hook(i, v, memo),
            )
        if self.host_inputs:  # host -> device at the start of the step
            flat = jax.tree_util.tree_leaves(args)
            for i, sharding in self._device_in.items():
                flat[i] = jax.device_put(flat[i], sharding)
            args = jax.tree_util.tree_unflatten(self.program.in_tree, flat)
        out = self.program.evaluate(
            *args, hook=c.outputs_hook, in_hook=lambda i, v: c.operands_hook(i, v, memo)
        )
        if self.host_outputs:  # device -> host (out_shardings say pinned_host too)
            flat = jax.tree_util.tree_leaves(out)
            for j, sharding in self._device_out.items():
                flat[j] = jax.device_put(flat[j], sharding.with_memory_kind(HOST_MEMORY))
            out = jax.tree_util.tree_unflatten(self.program.out_tree, flat)
        return out

    def lower(self, *args) -> jax.stages.Lowered:
        """Lower for ``args`` (arrays or ``jax.ShapeDtypeStruct``; default: abstract_args)."""
        if not args:
            args = abstract_args(self.program, self.plan, self.mesh)
        return self._jitted.lower(*args)

    def lowered_for(self, platform: str) -> jax.stages.Lowered:
        """The step lowered for ``platform`` (``"cuda"``, ``"tpu"``) from its abstract
        arguments, on any machine: memory-kind transfers lower to nothing on CPU, so what
        an offloaded step asks of a GPU is read here (``verify.state_window``)."""
        args = abstract_args(self.program, self.plan, self.mesh)
        return self._jitted.trace(*args).lower(lowering_platforms=(platform,))

    def compile(self, compiler_options: dict | None = None) -> jax.stages.Compiled:
        """The executable for the plan's abstract arguments (compiled once, then cached;
        ``compiler_options``: XLA options, compiled anew and cached in its place)."""
        if self._compiled is None or compiler_options:
            self._compiled = self.lower().compile(compiler_options=compiler_options)
        return self._compiled

    def compiled_text(self) -> str:
        """The optimized, SPMD-partitioned HLO of the executable ``__call__`` runs."""
        return self.compile().as_text()

    def place(self, *args, copy: bool = False):
        """``args`` put on the mesh with the plan's input shardings.

        An array already laid out that way (or one that holds one of the shards) may be
        reused, and is then consumed by a donating call; ``copy=True`` copies first.
        """
        if copy:
            # device_put(may_alias=False) still reuses a single-device array as a shard of
            # a replicated one (jax 0.10), so copy on the source device first.
            args = jax.tree_util.tree_map(
                lambda a: a.copy() if isinstance(a, jax.Array) else a, args
            )
        if jax.process_count() > 1:
            # across processes JAX puts host values on a global sharding, not a local array
            args = jax.tree_util.tree_map(
                lambda a: (
                    np.asarray(a) if isinstance(a, jax.Array) and a.is_fully_addressable else a
                ),
                args,
            )
        return jax.device_put(args, tuple(self.in_shardings))

    def __call__(self, *args):
        return self.compile()(*self.place(*args))

    def feeds_back_in_place(self) -> bool:
        """Whether every updated state output comes out in its input's sharding (memory
        kind included), so that a train loop may pass it straight back in."""
        pairs = _alias_positions(self.program)
        return all(self._flat_out[j] == self._flat_in[i] for i, j in pairs.items())


def build_sharded_step(
    program: TracedProgram,
    plan: ParallelPlan,
    mesh: jax.sharding.Mesh,
    donate: bool = True,
    stream_window: int | None = STREAM_WINDOW,
) -> ShardedStep:
    """Compile-ready step running ``plan`` on ``mesh`` (see :class:`ShardedStep`)."""
    return ShardedStep(program, plan, mesh, donate, stream_window)


def abstract_args(program: TracedProgram, plan: ParallelPlan, mesh: jax.sharding.Mesh):
    """The step's arguments as ``jax.ShapeDtypeStruct`` leaves carrying the plan's shardings."""
    _check_mesh(plan, mesh)
    on_host = set((getattr(plan, "offload", None) or {}).get("host_inputs", ()))
    leaves = []
    for i, (tid, s) in enumerate(zip(program.records.inputs, plan.input_specs, strict=True)):
        rec = program.records.tensors[tid]
        sharding = named_sharding(mesh, s)
        if i in on_host:
            sharding = sharding.with_memory_kind(HOST_MEMORY)
        leaves.append(jax.ShapeDtypeStruct(rec.shape, np.dtype(rec.dtype), sharding=sharding))
    return jax.tree_util.tree_unflatten(program.in_tree, leaves)


def _next_args(program: TracedProgram, args, outputs):
    """Feed the updated state back in: the aliased outputs replace their inputs."""
    flat_in = jax.tree_util.tree_leaves(args)
    flat_out = jax.tree_util.tree_leaves(outputs)
    for i, j in _alias_positions(program).items():
        flat_in[i] = flat_out[j]
    return jax.tree_util.tree_unflatten(program.in_tree, flat_in)


def _loss_of(program: TracedProgram, outputs) -> float:
    flat_out = jax.tree_util.tree_leaves(outputs)
    state_out = set(_alias_positions(program).values())
    rest = [v for j, v in enumerate(flat_out) if j not in state_out]
    if len(rest) != 1 or np.shape(rest[0]) != ():
        raise ValueError(
            "run_steps needs a step whose only output besides the updated state is a scalar "
            f"loss, e.g. (params, opt_state, batch) -> (params, opt_state, loss); this one has "
            f"{len(rest)} other outputs with shapes {[np.shape(v) for v in rest]}"
        )
    return float(to_host(rest[0]))


def run_steps(
    step, args, num_steps: int, seconds: list[float] | None = None, copy: bool = True
) -> tuple[Any, list[float]]:
    """Run a train step ``num_steps`` times, feeding the updated state back in.

    ``step`` is a :class:`ShardedStep` (or any callable on the same program's arguments
    with a ``program`` attribute).  The caller's ``args`` are copied, not donated
    (``copy=False``: consumed; for state already placed by
    :func:`autoshard.runtime.init_state.init_placed` that would not fit twice).
    Returns the final arguments (updated params and optimizer state, the same batch)
    and the loss of every step; ``seconds``, when given, gets each step's wall time
    (up to its loss on the host; the first step's includes compilation).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    program = step.program
    if not program.records.aliases:
        raise ValueError(
            "run_steps needs a step that returns updated state (the traced "
            "program has no aliases); trace it with trace_train_step"
        )
    call = step
    if isinstance(step, ShardedStep):  # never consume the caller's arrays (unless told)
        args = step.place(*args, copy=copy)
        if step.feeds_back_in_place():
            # placed once: the updated state comes back as the step takes it, so each step
            # runs the executable without placing its arguments again (device_put of every
            # leaf: 12 ms a step for those 879 leaves); compiled within the first step
            def call(*placed):
                return step.compile()(*placed)

    losses = []
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = call(*args)
        losses.append(_loss_of(program, outputs))
        if seconds is not None:
            seconds.append(time.perf_counter() - start)
        args = _next_args(program, args, outputs)
    return args, losses
