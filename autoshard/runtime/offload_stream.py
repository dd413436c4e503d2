"""Stream offloaded optimizer state through the device a group at a time (docs/offload.md),
and copy master weights resting in host memory to the device in their narrow dtype.

With the state's memory kind ``pinned_host`` and a ``jax.device_put`` of every state tensor
where the step starts (the form before this module), XLA:GPU copied the whole state into
device buffers live at once: on one H100 (jax 0.11.2) gpt-1.3b's 10.5 GB of Adam moments
left the arguments and came back as 10.56 GB more temporaries, the allocator's peak
unchanged. JAX's memory-spaces guide says as much: with a Python loop (a flat program, as
ours is) offloaded values "continuously occupy device memory", and the transfers' live
ranges are the scheduler's to stretch.

:func:`stream_plan` splits the update into **groups**: the equations downstream of the
offloaded inputs (the *region*; nothing outside it reads what it makes) taken apart into
connected pieces, in practice one parameter's update with its moments. The step then runs
everything outside the region first, in program order, and the groups one after another,
each fetching its state where it starts and storing its updated state where it ends.
An ``optimization_barrier`` makes group ``k``'s fetch wait for the stores of group
``k - window`` (and for the values the group reads from the rest of the step, its
gradients): data dependences that no scheduler can reorder, so at most ``window`` groups'
state is on the device at once. Groups run in the order their gradients are made (by
their last-made operand), so the first fetches may still overlap the backward pass.

XLA:CPU ignores memory kinds (a ``device_put`` inside ``jit`` lowers to nothing there, and
its ``memory_analysis`` reports no host bytes): :func:`autoshard.verify.state_window.
state_window` reads the bound from the step lowered for GPU, which this machine can do
(``ShardedStep.lowered_for("cuda")``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from autoshard.inter.program_cut import StageProgram
from autoshard.trace.jaxpr import TracedProgram

STREAM_WINDOW = 1  # groups on the device at once: the planner's staging of two tensors
# (one parameter's moments) is one Adam group


@dataclass(frozen=True)
class StreamGroup:
    """One connected piece of the update: its equations (positions in the program, in
    program order), the offloaded inputs it fetches and the offloaded outputs it stores
    (flat positions), and the tensors from outside the region it reads (its gradients)."""

    eqns: tuple[int, ...]
    fetch: tuple[int, ...]
    store: tuple[int, ...]
    waits_on: tuple[int, ...]


@dataclass(frozen=True)
class StreamPlan:
    """The evaluation order of a streamed step: ``prefix`` (the equations outside the
    update region, program order) and then each group's equations."""

    prefix: tuple[int, ...]
    groups: tuple[StreamGroup, ...]
    window: int

    @property
    def order(self) -> tuple[int, ...]:
        return self.prefix + tuple(p for g in self.groups for p in g.eqns)


def stream_plan(
    records, host_inputs: Sequence[int], host_outputs: Sequence[int], window: int = STREAM_WINDOW
) -> StreamPlan:
    """Groups of ``records``' update for offloaded inputs ``host_inputs`` and outputs
    ``host_outputs`` (flat positions); ``window`` >= 1 groups on the device at once."""
    if window < 1:
        raise ValueError(f"a stream window is at least one group, got {window}")
    eqns = records.eqns
    host_tids = {records.inputs[i] for i in host_inputs}
    producer = {t: pos for pos, e in enumerate(eqns) for t in e.outputs}
    region_tensors, region = set(host_tids), []
    for pos, e in enumerate(eqns):  # forward closure: every reader of a region tensor
        if any(t in region_tensors for t in e.inputs):
            region.append(pos)
            region_tensors.update(e.outputs)
    in_region = set(region)
    parent: dict[Any, Any] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pos in region:  # an equation joins its region operands' producers (or input)
        for t in eqns[pos].inputs:
            if t in region_tensors:
                a, b = find(pos), find(producer.get(t, ("input", t)))
                if a != b:
                    parent[a] = b
    members: dict[Any, list[int]] = {}
    for pos in region:
        members.setdefault(find(pos), []).append(pos)
    fetch_of = {records.inputs[i]: i for i in host_inputs}
    groups = []
    for eq in members.values():
        read = {t for p in eq for t in eqns[p].inputs}
        made = {t for p in eq for t in eqns[p].outputs}
        waits = sorted(t for t in read if t in producer and producer[t] not in in_region)
        groups.append(
            (
                max((producer[t] for t in waits), default=-1),  # when its gradients are made
                StreamGroup(
                    eqns=tuple(eq),
                    fetch=tuple(sorted(fetch_of[t] for t in read if t in fetch_of)),
                    store=tuple(j for j in host_outputs if records.outputs[j] in made),
                    waits_on=tuple(waits),
                ),
            )
        )
    groups.sort(key=lambda rg: (rg[0], rg[1].eqns[0]))
    prefix = tuple(p for p in range(len(eqns)) if p not in in_region)
    return StreamPlan(prefix, tuple(g for _, g in groups), window)


def evaluate_streamed(
    program,
    plan: StreamPlan,
    args,
    device_shardings: dict[int, Any],
    host_shardings: dict[int, Any],
    hook: Callable | None = None,
    in_hook: Callable | None = None,
):
    """``program.evaluate`` in ``plan``'s order with each group's fetch and store: inputs
    at ``device_shardings``' positions arrive in host memory and are fetched with that
    sharding where their group starts; outputs at ``host_shardings``' positions leave with
    that sharding (``pinned_host``) where their group ends."""
    records = program.records
    starts = {g.eqns[0]: k for k, g in enumerate(plan.groups)}
    stored: dict[int, Any] = {}  # flat output position -> its value in host memory
    tokens: list[list] = []  # per group stored so far: what the next fetches wait on
    fetched: list[list] = []  # per group fetched so far (device values)

    def store(k: int, env: dict) -> None:
        vals = []
        for j in plan.groups[k].store:
            stored[j] = jax.device_put(env[records.outputs[j]], host_shardings[j])
            vals.append(stored[j])
        tokens.append(vals)

    def fetch(k: int, env: dict) -> None:
        g = plan.groups[k]
        host = [env[records.inputs[i]] for i in g.fetch]
        waits = [env[t] for t in g.waits_on]
        if k >= plan.window:
            waits += tokens[k - plan.window]
        if k and plan.window > 1:  # and after the previous group's: one order of fetches
            waits += fetched[k - 1]
        if host and waits:  # the fetch can start no earlier than these are done
            host, _ = jax.lax.optimization_barrier((host, waits))
        fetched.append([])
        for i, v in zip(g.fetch, host, strict=True):
            env[records.inputs[i]] = jax.device_put(v, device_shardings[i])
            fetched[-1].append(env[records.inputs[i]])

    def before(pos: int, env: dict) -> None:
        k = starts.get(pos)
        if k is not None:
            if k:
                store(k - 1, env)
            fetch(k, env)

    env = program.evaluate_env(args, order=plan.order, hook=hook, in_hook=in_hook, before=before)
    if plan.groups:
        store(len(plan.groups) - 1, env)
    flat = [env[t] for t in records.outputs]
    for j, sharding in host_shardings.items():
        if j not in stored:  # made outside the region (or state passed through unread)
            stored[j] = jax.device_put(flat[j], sharding)
        flat[j] = stored[j]
    fetched = {records.inputs[i] for g in plan.groups for i in g.fetch}
    for i, sharding in device_shardings.items():  # offloaded, unread, returned on device
        t = records.inputs[i]
        if t not in fetched:
            for j, out in enumerate(records.outputs):
                if out == t and j not in host_shardings:
                    flat[j] = jax.device_put(flat[j], sharding)
    return jax.tree_util.tree_unflatten(program.out_tree, flat)


def streamed_update(
    update: Callable,
    params,
    state,
    grads,
    device_state,
    host_state,
    window: int = STREAM_WINDOW,
):
    """``update(params, state, grads) -> (params, state)`` (an optax update and its
    ``apply_updates``) with the leaves of ``state`` whose ``host_state`` sharding is in
    host memory streamed as :func:`evaluate_streamed` does: traced flat (optax's inner
    ``jit`` s inlined, so each parameter's moments are a group of their own) and run a
    group at a time, each fetched with its ``device_state`` sharding. Called inside a
    ``jit`` (the pipeline runtime's stage update)."""
    from autoshard.trace.jaxpr import trace

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, grads)
    )
    program = trace(update, *abstract)
    n_params = len(jax.tree.leaves(params))
    host_leaves = jax.tree.leaves(host_state)
    device_leaves = jax.tree.leaves(device_state)
    on_host = [k for k, s in enumerate(host_leaves) if s.memory_kind == "pinned_host"]
    host_in = [n_params + k for k in on_host]
    host_out = [len(jax.tree.leaves(params)) + k for k in on_host]
    plan = stream_plan(program.records, host_in, host_out, window)
    out = evaluate_streamed(
        program,
        plan,
        (params, state, grads),
        {n_params + k: device_leaves[k] for k in on_host},
        {j: host_leaves[j - n_params] for j in host_out},
    )
    return out


# ---------------------------------------------- master weights resting in host memory


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


def cast_once_params(prog: TracedProgram, sp: StageProgram) -> dict[int, Any]:
    """Parameter id -> the narrow dtype, for each f32 parameter of stage ``sp`` that the
    stage's equations read exactly once, through a convert to 16 bits, and that the stage
    does not send on: the weights a step may cast once, not once per microbatch
    (:class:`~autoshard.runtime.stage.StageExecutable`'s ``cast_once``).  One reader only:
    with two, each convert's transpose casts its cotangent to f32 before they are summed,
    which a narrow copy read twice would sum in 16 bits.  The graph's rule is
    :func:`autoshard.intra.offload.placement.cast_once_params`."""
    readers: dict[int, list[int]] = {}
    for i in sp.eqns:
        for t in set(prog.records.eqns[i].inputs):
            readers.setdefault(t, []).append(i)
    sent = set(sp.outputs)
    out: dict[int, Any] = {}
    for t in sp.params:
        if t in sent or prog.records.tensors[t].dtype != "float32":
            continue
        reads = readers.get(t, [])
        if len(reads) != 1:
            continue
        prim, params = prog._impls[reads[0]]
        if prim.name == "convert_element_type":
            dtype = jnp.dtype(params["new_dtype"])
            if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
                out[t] = dtype
    return out


@functools.cache
def _narrow_copy(sharding: NamedSharding, dtype):
    """A jitted copy of one host-resting weight to the device, converted to ``dtype``."""
    return jax.jit(lambda x: jax.device_put(x, sharding).astype(dtype), out_shardings=sharding)
