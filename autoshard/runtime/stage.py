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

``probe(stage, layer)``, when given, is called through ``jax.debug.callback`` each time
a layer's forward equations run (inside the checkpoint, so a recomputed layer reports
twice): it counts forward executions without changing what runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from autoshard.inter.program_cut import StageProgram
from autoshard.inter.stage_memory import is_attention_sized
from autoshard.inter.stages import RECOMPUTE_MODES
from autoshard.ir.records import TensorRecord
from autoshard.runtime.distributed import to_host
from autoshard.runtime.offload_stream import STREAM_WINDOW, streamed_update
from autoshard.runtime.sharded import HOST_MEMORY
from autoshard.runtime.stage_layout import StageLayout
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


def recompute_policy(mode: str):
    """The ``jax.checkpoint`` policy of a recompute mode (None: no checkpoint)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "selective":
        return _save_all_but_attention
    return jax.checkpoint_policies.nothing_saveable


def _save_all_but_attention(prim, *avals, **params) -> bool:
    """Selective recompute's policy: keep a value unless it is attention-sized or made
    from one (scores, softmax and their masks are rebuilt from the saved Q, K, V)."""
    if any(is_attention_sized(getattr(a, "shape", ())) for a in avals):
        return False
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(lambda *xs: prim.bind(*xs, **params), *structs)
    return not any(is_attention_sized(o.shape) for o in jax.tree.leaves(out))


def _narrow_dtype(prog: TracedProgram, sp: StageProgram, tid: int):
    """The dtype the stage's equations convert master weight ``tid`` to (every reader of
    a master is a convert to one narrow dtype, :func:`~autoshard.intra.offload.placement.
    tensor_classes`)."""
    dtypes = set()
    for i in sp.eqns:
        eqn, (prim, params) = prog.records.eqns[i], prog._impls[i]
        if tid in eqn.inputs:
            if prim.name != "convert_element_type":
                raise ValueError(
                    f"master weight {tid} is read by {prim.name}, not only through a convert "
                    "to 16 bits: it cannot rest in host memory as a master"
                )
            dtypes.add(jnp.dtype(params["new_dtype"]))
    if len(dtypes) != 1:
        raise ValueError(f"master weight {tid} is converted to {sorted(map(str, dtypes))} here")
    return dtypes.pop()


@functools.cache
def _narrow_copy(sharding: NamedSharding, dtype):
    """A jitted copy of one host-resting weight to the device, converted to ``dtype``."""
    return jax.jit(lambda x: jax.device_put(x, sharding).astype(dtype), out_shardings=sharding)


def _layer_groups(eqns, recomputed: Callable[[str | None], bool]):
    """Consecutive runs of equations of one layer: ``[(layer, recomputed, eqns)]``."""
    groups: list[tuple[str | None, bool, list]] = []
    for item in eqns:
        layer = item[0].layer
        if groups and groups[-1][0] == layer:
            groups[-1][2].append(item)
        else:
            groups.append((layer, recomputed(layer), [item]))
    return groups


class StageExecutable:
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
    ):
        self.offload = tuple(offload)
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
            return NamedSharding(mesh, spec_fn(sp.index, tensors[t], role, mesh))

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
        # per parameter: the dtype it lives in on the device during a step (a master
        # resting in host memory: the narrow dtype every reader converts it to)
        self.live_dtypes = [
            _narrow_dtype(prog, sp, t) if t in host_params else jnp.dtype(tensors[t].dtype)
            for t in self.param_ids
        ]
        self.params = jax.tree.unflatten(
            treedef,
            [
                jax.device_put(to_host(values[t]), sh)
                for t, sh in zip(self.param_ids, jax.tree.leaves(self.rest_shardings), strict=True)
            ],
        )
        abstract_state = jax.eval_shape(optimizer.init, self.params)
        device_state = layout.opt_state_sharding(mesh, abstract_state)
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

        eqns = [(prog.records.eqns[i], prog._impls[i]) for i in sp.eqns]
        needed = {t for e, _ in eqns for t in e.inputs}
        consts = {t: v for t, v in prog._consts.items() if t in needed}
        param_ids = self.param_ids
        constraints = layout.constraints
        groups = _layer_groups(eqns, lambda layer: policy is not None and layer in inner)
        self.recomputed_layers = tuple(layer for layer, r, _ in groups if r)
        # per group: the tensors it reads from outside and those read after it
        later_reads: list[set[int]] = []
        reads_after = set(sp.outputs)
        for _, _, group in reversed(groups):
            later_reads.append(set(reads_after))
            reads_after.update(t for e, _ in group for t in e.inputs)
        later_reads.reverse()

        def run_eqns(group, env) -> None:
            memo: dict = {}  # one reshard per value and spec within the group (one trace)
            for eqn, (prim, bind_params) in group:
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
            return vjp(list(out_cts))

        def backward(params, received, data, residuals, out_cts, grad_acc):
            grads, in_cts = gradients(params, received, data, residuals, out_cts)
            return jax.tree.map(jnp.add, grad_acc, grads), in_cts

        def apply(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def update(params, opt_state, grads):
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
            # masters resting in host memory (None: the weights as they rest)
            grads, in_cts = gradients(
                params if live is None else live, received, data, residuals, out_cts
            )
            params, opt_state = update(params, opt_state, grads)
            return params, opt_state, in_cts

        self.forward = jax.jit(forward)
        self.backward = jax.jit(
            backward,
            out_shardings=(self.param_shardings, [self.received_shardings[i] for i in float_in]),
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
        shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), self.params)
        self.zero_grads = jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
            out_shardings=self.param_shardings,
        )

    def live_params(self):
        """The stage's parameters on the device for one step: each master weight resting in
        host memory as its 16-bit copy, made once per step (every microbatch reads it),
        one weight at a time (copied in, converted); the rest as they are."""
        if not self.masters_on_host:
            return self.params
        leaves, treedef = jax.tree.flatten(self.params)
        shardings = jax.tree.leaves(self.param_shardings)
        live = [
            x if x.dtype == dt else _narrow_copy(sh, dt)(x)
            for x, sh, dt in zip(leaves, shardings, self.live_dtypes, strict=True)
        ]
        return jax.tree.unflatten(treedef, live)

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
