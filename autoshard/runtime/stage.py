"""One pipeline stage as it runs: a jitted forward that keeps its residuals, a backward
that uses them, recompute per stage as the plan chose.

Takes the traced forward of one microbatch (:class:`~autoshard.trace.jaxpr.TracedProgram`),
one stage's sub-program (:class:`~autoshard.inter.program_cut.StageProgram`), the stage's
mesh and layout, its parameters, an optax optimizer and the stage's recompute mode; builds
:class:`StageExecutable`, whose

* ``forward(params, received, data) -> (sent tensors, residuals)`` runs the stage's
  equations once under ``jax.vjp`` and returns the backward's residuals (the forward's
  saved activations) next to what it sends on.  Residuals that are the forward's own
  arguments (weights, received activations, batch leaves) are not copied out: the
  backward takes the arguments again and puts them back in place;
* ``backward(params, received, data, residuals, output cotangents, grad accumulator)``
  applies the stored ``vjp``: no second forward unless the plan asked for recompute;
* ``update`` applies the optimizer to the accumulated gradient;
* ``backward_update`` (one microbatch a step): the backward and the update as one
  program, with no accumulator, the state donated: XLA may update each weight as soon as
  its gradient is made, as in the one-mesh step (the stage search prices a step of one
  microbatch so: :func:`autoshard.inter.stage_memory.unit_state`).

Offload (``offload``: the plan's host classes, docs/offload.md): with ``optimizer`` the
floating-point optimizer state rests in ``pinned_host`` memory between steps (its
sharding's memory kind); ``update`` streams it through the device a parameter's state at
a time (:func:`autoshard.runtime.offload_stream.streamed_update`, as the one-mesh runtime
does; ``stream_window=None``: all of it copied in where the update starts and back where
it ends, the form that held the whole state on an H100). With ``master`` the f32 master
weights (``host_params``) rest in ``pinned_host`` too: :meth:`StageExecutable.live_params` makes
their 16-bit copies on the device once per step (one weight at a time: copied in,
converted to the dtype the stage's equations convert it to), which every microbatch
reads, so the device holds the 16-bit copies during the step, as the stage search
prices; the gradients still accumulate in f32 (the transpose of that convert), and the
update copies the f32 masters in and writes them back. With ``activations`` the
forward's residuals (what each layer keeps for its backward, after recompute) leave the
device where the forward ends (``jax.device_put(..., jax.memory.Space.Host)``: the
forward's results are in ``pinned_host``) and come back where the backward starts; the
received activations and batch slices the backward takes again stay on the device. A
host-update placement (``gradients``) still runs its update on the device.

Weights cast once a step (``cast_once``, docs/distributed.md): each f32 weight the stage's
equations read once, through a convert to 16 bits, and that the stage does not send on
(:func:`~autoshard.runtime.offload_stream.cast_once_params`) rests on the device in f32
and :meth:`StageExecutable.live_params` makes its 16-bit copy once a step (one program for
all of them), which every microbatch reads: its convert, where the plan keeps the weight's
layout, passes the copy through (no residual copy per microbatch in flight); its gradient
is cast to f32 as the convert's transpose did, and accumulated in f32.

Recompute modes (the values of :data:`autoshard.inter.stages.RECOMPUTE_MODES`), applied
to each **inner** layer (not the first, the embedding, nor the last, the head and loss:
the same layers :meth:`autoshard.inter.stage_cost.IntraStageCost.recomputes` prices):

* ``none``: every residual kept;
* ``selective`` (Korthikanti et al., Megatron-LM): the layer runs under
  ``jax.checkpoint`` with a policy that saves every value except attention-sized ones
  (:func:`~autoshard.inter.stage_memory.is_attention_sized`: scores, softmax, masks) and
  those computed from them: the attention core is recomputed, everything else is kept;
* ``full``: the layer runs under ``jax.checkpoint`` with nothing saveable: only its
  inputs are kept and its forward runs again in the backward.

Data-parallel replicas (``replica_prog``: the stage's loss traced at ``1/D`` of the
microbatch, ``D`` the size of the mesh's ``data`` axis; :class:`ReplicaShapes`): the
stage runs ``D`` replicas of a plan that uses only ``model``, each on ``1/D`` of the
microbatch's rows, its forward and backward inside ``jax.shard_map`` manual over ``data``
(``model`` left to GSPMD; ``check_vma=False``: the traced equations carry no varying
casts).  Each replica's parameter gradient is its own (no reduction over ``data`` in the
backward); the accumulator holds them stacked ``(D, *shape)`` over ``data`` (per device the
bytes of today's accumulator of a parameter replicated over ``data``) and ``update`` sums
that dim once a step (not once a microbatch) into each gradient's ZeRO layout
(:func:`zero_spec`: a reduce-scatter), updates each replica's ``1/D`` of the weights with
its ``1/D`` of the optimizer state (which rests so: ZeRO-1) and returns the weights whole
(an all-gather).  A stage
output without a batch dim (the loss, a parameter sent on) is the mean of the replicas'
(a microbatch's mean loss is the mean of its equal shares' means) and its cotangent is
split ``1/D`` to each; a received tensor without one gets the sum of the replicas'
cotangents.  Math that couples rows across replicas (a batch statistic) is not what the
microbatch computes: such a stage keeps today's path (the search does not offer it as
replicas and ``grad_reduce="step"`` refuses it, :mod:`autoshard.ir.row_coupling`).  Not with offload.

``probe(stage, layer)``, when given, is called through ``jax.debug.callback`` each time
a layer's forward equations run (inside the checkpoint, so a recomputed layer reports
twice): it counts forward executions without changing what runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.inter.program_cut import StageProgram
from autoshard.ir.records import TensorRecord
from autoshard.runtime.distributed import to_host
from autoshard.runtime.offload_stream import (
    STREAM_WINDOW,
    _narrow_dtype,
    cast_once_params,
    streamed_update,
)
from autoshard.runtime.sharded import HOST_MEMORY
from autoshard.runtime.stage_cast import CastOnce
from autoshard.runtime.stage_layout import StageLayout
from autoshard.runtime.stage_recompute import _layer_groups, recompute_policy
from autoshard.runtime.stage_replicas import (  # noqa: F401 - re-exported
    ReplicaShapes,
    _check_model_only,
    _combine,
    _names_data,
    _on_mesh,
    _replica_shapes,
    zero_spec,
)
from autoshard.runtime.stage_replicated import ReplicatedRun
from autoshard.trace.jaxpr import TracedProgram

Probe = Callable[[int, str], None]


def _path_key(entry) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def nest(items) -> dict:
    """Nested dict from (pytree path, value): a sub-tree that keeps the original keys."""
    root: dict = {}
    for path, value in items:
        node = root
        for entry in path[:-1]:
            node = node.setdefault(_path_key(entry), {})
        node[_path_key(path[-1])] = value
    return root


def inexact(rec: TensorRecord) -> bool:
    return jnp.issubdtype(jnp.dtype(rec.dtype), jnp.inexact)


class StageExecutable(CastOnce, ReplicatedRun):
    """The jitted functions and state of one stage (see the module docstring)."""

    def __init__(
        self,
        prog: TracedProgram,
        sp: StageProgram,
        mesh,
        layout: StageLayout,
        param_items: list[tuple[tuple, int]],
        values: dict[int, Any],
        optimizer,
        recompute: str = "none",
        probe: Probe | None = None,
        offload: tuple[str, ...] = (),
        host_params: frozenset[int] = frozenset(),
        stream_window: int | None = STREAM_WINDOW,
        replica_prog: TracedProgram | None = None,
        cast_once: bool = False,
    ):
        self.offload = tuple(offload)
        # data-parallel replicas (module docstring): None where the stage runs as one
        self.replicas = replicas = _replica_shapes(prog, replica_prog, mesh, self.offload)
        run = prog if replicas is None else replica_prog  # the equations bound
        # the forward's residuals rest in pinned_host between its forward and backward
        self.activations_on_host = "activations" in self.offload
        self.sp, self.mesh, self.layout, self.recompute = sp, mesh, layout, recompute
        policy = recompute_policy(recompute)
        spec_fn = layout.spec_fn
        self.tensors = tensors = prog.records.tensors
        self.loss = prog.records.outputs[0]
        layers = prog.records.layers
        inner = set(layers[1:-1])

        def sharding(t: int, role: str) -> NamedSharding:
            role = "param" if tensors[t].kind == "param" else role
            spec = spec_fn(sp.index, tensors[t], role, mesh)
            if replicas is not None:
                if _names_data(spec):
                    raise ValueError(
                        f"stage {sp.index} runs as data-parallel replicas but its plan puts "
                        f"{tensors[t].path or f'tensor {t}'} in {spec}: a replica's plan may "
                        "use only 'model' (plan it on the (1, tp) mesh)"
                    )
                spec = replicas.placed_spec(t, spec, len(tensors[t].shape))
            return NamedSharding(mesh, spec)

        tid_tree = nest(param_items)
        self.param_ids = jax.tree.leaves(tid_tree)
        treedef = jax.tree.structure(tid_tree)
        self.param_shardings = jax.tree.map(lambda t: sharding(t, "param"), tid_tree)
        self.received_shardings = [sharding(t, "activation") for t in sp.received]
        self.data_shardings = [sharding(t, "data") for t in sp.data]
        self.output_shardings = [sharding(t, "activation") for t in sp.outputs]
        # at rest: the master weights offloaded (``host_params``) in pinned_host
        self.rest_shardings = jax.tree.map(
            lambda t: (
                sharding(t, "param").with_memory_kind(HOST_MEMORY)
                if t in host_params
                else sharding(t, "param")
            ),
            tid_tree,
        )
        self.masters_on_host = bool(set(self.param_ids) & set(host_params))
        # cast once a step: the f32 weights the stage reads once, through a convert to 16
        # bits (resting on the device); the microbatches read their 16-bit copies
        once = cast_once_params(run, sp) if cast_once else {}
        self.cast_once = frozenset(t for t in once if t not in host_params)
        # the weights read once as 16-bit copies made once a step (cast once, or masters
        # resting in host memory read once): their converts may pass the copy through
        self._read_once_narrow = frozenset(once)
        # per parameter: the dtype it lives in on the device during a step (a master
        # resting in host memory, or one cast once: the narrow dtype its readers convert
        # it to)
        self.live_dtypes = [
            _narrow_dtype(prog, sp, t)
            if t in host_params
            else once[t]
            if t in self.cast_once
            else jnp.dtype(tensors[t].dtype)
            for t in self.param_ids
        ]
        self.rest_dtypes = [jnp.dtype(tensors[t].dtype) for t in self.param_ids]
        self.params = jax.tree.unflatten(
            treedef,
            [
                jax.device_put(to_host(values[t]), sh)
                for t, sh in zip(self.param_ids, jax.tree.leaves(self.rest_shardings), strict=True)
            ],
        )
        abstract_state = jax.eval_shape(optimizer.init, self.params)
        device_state = layout.opt_state_sharding(mesh, abstract_state)
        if replicas is not None:  # ZeRO-1: each replica holds and updates 1/D of the state
            device_state = jax.tree.map(
                lambda sh, a: NamedSharding(mesh, zero_spec(sh.spec, a.shape, mesh)),
                device_state,
                abstract_state,
            )
        # replicas: where each parameter's gradient is reduced to and its update runs
        self.zero_shardings = (
            None
            if replicas is None
            else jax.tree.map(
                lambda sh, p: NamedSharding(mesh, zero_spec(sh.spec, p.shape, mesh)),
                self.param_shardings,
                self.params,
            )
        )
        state_on_host = "optimizer" in self.offload
        # at rest: the floating-point state in pinned_host when offloaded (a step count stays)
        self.opt_state_shardings = (
            jax.tree.map(
                lambda sh, a: (
                    sh.with_memory_kind(HOST_MEMORY) if jnp.issubdtype(a.dtype, jnp.inexact) else sh
                ),
                device_state,
                abstract_state,
            )
            if state_on_host
            else device_state
        )
        self.opt_state = jax.device_put(
            jax.jit(optimizer.init, out_shardings=device_state)(
                jax.device_put(self.params, self.param_shardings)  # the f32 weights
            ),
            self.opt_state_shardings,
        )

        eqns = [(run.records.eqns[i], run._impls[i]) for i in sp.eqns]
        needed = {t for e, _ in eqns for t in e.inputs}
        consts = {t: v for t, v in run._consts.items() if t in needed}
        param_ids = self.param_ids
        if replicas is not None and layout.constraints is not None:
            _check_model_only(sp.index, layout.constraints)
        rebased: dict = {}  # replicas: the constraints per context mesh (one a shard_map)
        groups = _layer_groups(eqns, lambda layer: policy is not None and layer in inner)
        self.recomputed_layers = tuple(layer for layer, r, _ in groups if r)
        # per group: the tensors it reads from outside and those read after it
        later_reads: list[set[int]] = []
        reads_after = set(sp.outputs)
        for _, _, group in reversed(groups):
            later_reads.append(set(reads_after))
            reads_after.update(t for e, _ in group for t in e.inputs)
        later_reads.reverse()

        passthrough = self._passthrough(run, sp, layout.constraints)

        def run_eqns(group, env) -> None:
            memo: dict = {}  # one reshard per value and spec within the group (one trace)
            # replicas: on the context's mesh, whose data axis is manual (a sharding on the
            # stage mesh as such fails in the transposes that build from a cotangent's)
            constraints = layout.constraints
            if replicas is not None and constraints is not None:
                context = jax.sharding.get_abstract_mesh()
                if context not in rebased:
                    rebased[context] = _on_mesh(constraints, context)
                constraints = rebased[context]
            for eqn, (prim, bind_params) in group:
                if eqn.index in passthrough:  # a 16-bit copy read as it is
                    env[eqn.outputs[0]] = env[eqn.inputs[0]]
                    continue
                invals = [env[t] for t in eqn.inputs]
                if constraints is not None:  # the plan's reshards and node output specs
                    invals = constraints.operands_hook(eqn.index, invals, memo)
                outs = prim.bind(*invals, **bind_params)
                outs = list(outs) if prim.multiple_results else [outs]
                if constraints is not None:
                    outs = constraints.outputs_hook(eqn.index, outs)
                env.update(zip(eqn.outputs, outs, strict=True))

        def run_group(index: int, layer, recomputed: bool, group, env) -> None:
            def body(group_env):
                if probe is not None:
                    jax.debug.callback(probe, sp.index, str(layer))
                run_eqns(group, group_env)
                return group_env

            if not recomputed:
                body(env)
                return
            made = {t for e, _ in group for t in e.outputs}
            ins = sorted({t for e, _ in group for t in e.inputs if t not in made and t in env})
            outs = sorted(made & later_reads[index])

            def f(*in_values):
                local = dict(zip(ins, in_values, strict=True))
                local.update((t, v) for t, v in consts.items() if t not in local)
                body(local)
                return [local[t] for t in outs]

            values_out = jax.checkpoint(f, policy=policy)(*[env[t] for t in ins])
            env.update(zip(outs, values_out, strict=True))

        def evaluate(params, received, data):
            env = dict(consts)
            env.update(zip(param_ids, jax.tree.leaves(params), strict=True))
            env.update(zip(sp.received, received, strict=True))
            env.update(zip(sp.data, data, strict=True))
            for i, (layer, recomputed, group) in enumerate(groups):
                run_group(i, layer, recomputed, group, env)
            return [env[t] for t in sp.outputs]

        float_out = [i for i, t in enumerate(sp.outputs) if inexact(tensors[t])]
        self.float_out = [sp.outputs[i] for i in float_out]
        float_in = [i for i, t in enumerate(sp.received) if inexact(tensors[t])]
        self.float_in = float_in
        self._residual_layout = None  # (vjp treedef, per leaf: argument slot or None)

        def forward(params, received, data):
            def f(p, diff_received):
                full = list(received)
                for i, v in zip(float_in, diff_received, strict=True):
                    full[i] = v
                outs = evaluate(p, full, data)
                return [outs[i] for i in float_out], outs

            _, vjp, outs = jax.vjp(f, params, [received[i] for i in float_in], has_aux=True)
            if replicas is None:  # (replicas: constrained outside their shard_map)
                outs = [
                    jax.lax.with_sharding_constraint(o, sh)
                    for o, sh in zip(outs, self.output_shardings, strict=True)
                ]
            # residuals that are arguments go back in place in the backward, not copied
            args = {id(x): k for k, x in enumerate(jax.tree.leaves((params, received, data)))}
            leaves, vjp_tree = jax.tree.flatten(vjp)
            slots = tuple(args.get(id(leaf)) for leaf in leaves)
            self._residual_layout = (vjp_tree, slots)
            kept = [leaf for leaf, s in zip(leaves, slots, strict=True) if s is None]
            if self.activations_on_host:  # out to the host where the forward ends
                kept = [jax.device_put(r, jax.memory.Space.Host) for r in kept]
            return outs, kept

        def gradients(params, received, data, residuals, out_cts):
            vjp_tree, slots = self._residual_layout
            if self.activations_on_host:  # back to the device where the backward starts
                residuals = [jax.device_put(r, jax.memory.Space.Device) for r in residuals]
            args = jax.tree.leaves((params, received, data))
            kept = iter(residuals)
            leaves = [next(kept) if s is None else args[s] for s in slots]
            vjp = jax.tree.unflatten(vjp_tree, leaves)
            grads, in_cts = vjp(list(out_cts))
            # the gradient of a 16-bit copy (a weight cast once, a master on the host) in
            # its weight's dtype: the cast the convert's transpose makes in the traced step
            leaves, treedef = jax.tree.flatten(grads)
            leaves = [g.astype(dt) for g, dt in zip(leaves, self.rest_dtypes, strict=True)]
            return jax.tree.unflatten(treedef, leaves), in_cts

        if replicas is not None:
            forward, gradients = self._replicated(forward, gradients)

        def backward(params, received, data, residuals, out_cts, grad_acc):
            grads, in_cts = gradients(params, received, data, residuals, out_cts)
            return jax.tree.map(jnp.add, grad_acc, grads), in_cts

        def apply(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def update(params, opt_state, grads):
            if replicas is not None:
                # the step's one reduction over data, each replica left with its 1/D of
                # the gradient (a reduce-scatter), which it applies to its 1/D of the
                # weights and state; the weights leave whole (out_shardings: all-gather)
                zero = self.zero_shardings
                grads = jax.tree.map(
                    lambda g, sh: jax.lax.with_sharding_constraint(g.sum(0), sh), grads, zero
                )
                params = jax.lax.with_sharding_constraint(params, zero)
            if self.masters_on_host:  # the f32 masters in from the host (params: at rest)
                params = jax.device_put(params, self.param_shardings)
            if state_on_host and stream_window is not None:  # a parameter's state at a time
                params, opt_state = streamed_update(
                    apply,
                    params,
                    opt_state,
                    grads,
                    device_state,
                    self.opt_state_shardings,
                    stream_window,
                )
            elif state_on_host:  # all of it in where the update starts, out where it ends
                opt_state = jax.device_put(opt_state, device_state)
                params, opt_state = apply(params, opt_state, grads)
                opt_state = jax.device_put(opt_state, self.opt_state_shardings)
            else:
                params, opt_state = apply(params, opt_state, grads)
            if self.masters_on_host:  # the updated master weights back to the host
                params = jax.device_put(params, self.rest_shardings)
            return params, opt_state

        def backward_update(params, opt_state, received, data, residuals, out_cts, live):
            # one microbatch a step: its gradients go straight into the update, in one
            # program, so each weight can be updated as soon as its gradient is made (as the
            # one-mesh step is) and no accumulator is held; ``live``: the 16-bit copies of
            # masters resting in host memory and of weights cast once (None: the weights
            # as they rest)
            grads, in_cts = gradients(
                params if live is None else live, received, data, residuals, out_cts
            )
            params, opt_state = update(params, opt_state, grads)
            return params, opt_state, in_cts

        self.forward = jax.jit(forward)
        # the accumulator: each parameter's spec; replicas: stacked (D, *shape) over data
        self.grad_shardings = (
            self.param_shardings
            if replicas is None
            else jax.tree.map(
                lambda sh: NamedSharding(mesh, PartitionSpec("data", *sh.spec)),
                self.param_shardings,
            )
        )
        self.backward = jax.jit(
            backward,
            out_shardings=(self.grad_shardings, [self.received_shardings[i] for i in float_in]),
        )
        self.update = jax.jit(update, out_shardings=(self.rest_shardings, self.opt_state_shardings))
        self.backward_update = jax.jit(
            backward_update,
            out_shardings=(
                self.rest_shardings,
                self.opt_state_shardings,
                [self.received_shardings[i] for i in float_in],
            ),
            donate_argnums=(0, 1),  # the state is updated in place
        )
        # the gradient accumulator: the parameters' own dtypes (f32 for a master)
        stack = () if replicas is None else (replicas.replicas,)
        shapes = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct((*stack, *p.shape), p.dtype), self.params
        )
        self.zero_grads = jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
            out_shardings=self.grad_shardings,
        )

    def abstract_backward_args(self):
        """``(params, received, data, residuals, output cotangents, accumulator)`` of one
        microbatch's :attr:`backward` as abstract arrays with the shardings they run in
        (the residuals in those the compiled forward gives them)."""
        args = self.abstract_args()
        outs, kept = jax.eval_shape(self.forward, *args)  # also fixes the residual layout
        kept_shardings = self.forward.lower(*args).compile().output_shardings[1]
        residuals = [
            jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=sh)
            for r, sh in zip(kept, kept_shardings, strict=True)
        ]
        return (*args, residuals, self.abstract_cotangents(), self.abstract_grads())

    def abstract_cotangents(self):
        """The cotangents of the stage's floating-point outputs, as :attr:`backward` takes
        them: abstract arrays in the outputs' shardings."""
        return [
            jax.ShapeDtypeStruct(
                self.tensors[t].shape,
                jnp.dtype(self.tensors[t].dtype),
                sharding=self.output_shardings[self.sp.outputs.index(t)],
            )
            for t in self.float_out
        ]

    def abstract_grads(self):
        """The gradient accumulator as abstract arrays with its shardings."""
        stack = () if self.replicas is None else (self.replicas.replicas,)
        return jax.tree.map(
            lambda p, sh: jax.ShapeDtypeStruct((*stack, *p.shape), p.dtype, sharding=sh),
            self.params,
            self.grad_shardings,
        )

    def abstract_args(self):
        """``(params, received, data)`` of one microbatch as abstract arrays with the
        stage's shardings: what :meth:`compile_forward` compiles for."""

        def abstract(ids, shardings):
            return [
                jax.ShapeDtypeStruct(
                    self.tensors[t].shape, jnp.dtype(self.tensors[t].dtype), sharding=sh
                )
                for t, sh in zip(ids, shardings, strict=True)
            ]

        leaves, treedef = jax.tree.flatten(self.params)
        params = jax.tree.unflatten(
            treedef,
            [
                jax.ShapeDtypeStruct(p.shape, dt, sharding=sh)
                for p, dt, sh in zip(
                    leaves, self.live_dtypes, jax.tree.leaves(self.param_shardings), strict=True
                )
            ],
        )
        return (
            params,
            abstract(self.sp.received, self.received_shardings),
            abstract(self.sp.data, self.data_shardings),
        )
