"""Can a pipeline stage accumulate *unreduced* data-parallel gradients under jax.sharding,
and reduce them once per step as Megatron-LM does? (docs/weak_scaling.md, cause 1.)

The pipeline runtime (:class:`autoshard.runtime.stage.StageExecutable`) jits each
micro-batch's backward with ``out_shardings`` = the parameters' shardings, so XLA reduces the
data-parallel gradient inside every micro-batch's backward. This study compiles one small
stage -- a GPT-style MLP block, ``x + W2 gelu(W1 x + b1) + b2`` with Megatron's column /
row split over ``model``, batch over ``data``, a squared-error loss -- in the runtime's
shape (a jitted backward per micro-batch that adds into an accumulator, then a jitted AdamW
update) by each mechanism:

* ``reduced``: what the runtime does today (Auto axes, ``with_sharding_constraint`` s naming
  ``data`` on batch dims, the accumulator in the parameters' shardings);
* ``vmap``: candidate (a): each micro-batch reshaped to ``(D, b/D, ...)``, the gradient
  ``jax.vmap(..., spmd_axis_name="data")``: a ``(D, *shape)`` accumulator sharded over
  ``data``, summed over D in the update. The stage's constraints must lose ``data``
  (``vmap-constrained`` tries them as the layout has them);
* ``shard_map``: candidate (b): ``jax.shard_map`` manual over ``data`` only (``model``
  left to GSPMD), the parameters made varying inside (``jax.lax.pcast(..., to="varying")``)
  so the gradient is each device's own; returned stacked ``(D, *shape)`` as ``vmap``
  (``shard_map-invariant``: without the cast);
* ``unreduced``: candidate (c): the mesh all Explicit, parameters typed
  ``reduced={"data"}`` so their gradients come out ``unreduced={"data"}``, the accumulator
  unreduced, one ``jax.reshard`` to the plain spec in the update (the all-reduce);
  constraints become ``jax.reshard`` and the row-parallel dot gets an ``out_sharding``;
* ``unreduced-mixed``: (c) with ``data`` Explicit and ``model`` Auto (the stage's
  ``model`` constraints left as ``with_sharding_constraint``);
* ``reduced-zero2``: today's path with the accumulator sharded over ``data`` (a
  reduce-scatter per micro-batch, ZeRO-2's way); ``*-zero``: (a), (b), (c) with the update
  sharded over ``data`` (one reduce-scatter and one all-gather a step);
* ``shard_map-split``, ``unreduced-split``: (b), (c) as the runtime splits a micro-batch, a
  jitted forward returning the ``jax.vjp`` residuals and a jitted backward applying them.

Per mesh (4x2, 2x4 and 8x1 over ``data`` x ``model``) and mechanism it reads the compiled
HLO's collectives (:func:`autoshard.verify.collectives.analyze_collectives`) of the
backward (per micro-batch) and of the update (per step), the accumulator's bytes per device
(its first addressable shard), and runs one step of 4 micro-batches from the same weights:
the largest difference of the summed gradient and of the updated parameters from
``reduced`` 's. The losses are sums
over the step's global batch divided by its size, so a local gradient summed over the D
data shards is the global one (a traced program's ``mean`` over a micro-batch would have to
become that, see the docs). Prints a table; writes JSON::

    python benchmarks/studies/grad_reduce_once.py [--out FILE]

``--models``: (b) on the project's gpt-tiny and moe-tiny (:func:`model_check`);
``--traced``: (b) binding a stage's traced equations, as the runtime does
(:func:`traced_check`); ``--where-priced``: where the planner charges a gradient's data reduction
(:func:`where_priced`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "")
os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")  # to say where a failure is raised
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autoshard.ir.spec import Mesh  # noqa: E402
from autoshard.verify.collectives import analyze_collectives  # noqa: E402

AXES = ("data", "model")
MESHES = ((4, 2), (2, 4), (8, 1))
MICROBATCHES = 4
BATCH, SEQ, WIDTH, HIDDEN = 16, 8, 64, 256  # one micro-batch: 16 sequences of 8 tokens
TOL = 1e-6

# the stage's layout: parameter specs and its forward constraints (stage_layout's role)
PARAM_SPECS = {
    "w1": (None, "model"),
    "b1": ("model",),
    "w2": ("model", None),
    "b2": (None,),
}
HIDDEN_SPEC = ("data", None, "model")  # after the column-parallel dot
OUT_SPEC = ("data", None, None)  # after the row-parallel dot (reduced over model)
OPTIMIZER = optax.adamw(1e-3)


def init_params(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {
        "w1": jax.random.normal(k[0], (WIDTH, HIDDEN)) / np.sqrt(WIDTH),
        "b1": 0.1 * jax.random.normal(k[1], (HIDDEN,)),
        "w2": jax.random.normal(k[2], (HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
        "b2": 0.1 * jax.random.normal(k[3], (WIDTH,)),
    }


def step_batches(seed: int = 1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    shape = (MICROBATCHES, BATCH, SEQ, WIDTH)
    return np.asarray(jax.random.normal(k1, shape)), np.asarray(jax.random.normal(k2, shape))


NORM = float(MICROBATCHES * BATCH * SEQ * WIDTH)  # the step's mean squared error


@dataclasses.dataclass(frozen=True)
class Ops:
    """How the stage's forward binds its sharded operations under one mechanism:
    ``constrain(value, spec)`` (the layout's constraint), the row-parallel dot (a
    contraction over ``model``) and a bias add (a broadcast to the activation's spec)."""

    constrain: Callable
    row_dot: Callable = lambda h, w: jnp.einsum("bsh,hd->bsd", h, w)
    bias: Callable = lambda v, b, spec: v + b


def block(p, x, ops: Ops):
    """The stage's forward: a GPT MLP block with a residual."""
    h = ops.constrain(
        ops.bias(jnp.einsum("bsd,dh->bsh", x, p["w1"]), p["b1"], HIDDEN_SPEC), HIDDEN_SPEC
    )
    y = ops.constrain(ops.bias(ops.row_dot(jax.nn.gelu(h), p["w2"]), p["b2"], OUT_SPEC), OUT_SPEC)
    return x + y


def loss_fn(p, x, t, ops: Ops):
    return jnp.sum((block(p, x, ops) - t) ** 2) / NORM


def wsc(drop=()):
    """The layout's constraints as ``with_sharding_constraint`` (axes in ``drop`` removed)."""

    def constrain(v, spec):
        spec = tuple(None if a in drop else a for a in spec)[-v.ndim :]
        return jax.lax.with_sharding_constraint(v, P(*spec))

    return constrain


def explicit_ops() -> Ops:
    """All axes Explicit: a constraint is a ``jax.reshard`` and every operation whose
    output sharding is not determined by its operands' types says it (as the runtime would
    have to set each bound equation's ``out_sharding`` from the plan)."""
    return Ops(
        constrain=lambda v, spec: jax.reshard(v, P(*spec)),
        row_dot=lambda h, w: jnp.einsum("bsh,hd->bsd", h, w, out_sharding=P(*OUT_SPEC)),
        bias=lambda v, b, spec: (
            v + jax.lax.broadcast_in_dim(b, v.shape, (v.ndim - 1,), out_sharding=P(*spec))
        ),
    )


def mixed_ops() -> Ops:
    """``data`` Explicit, ``model`` Auto: constraints over ``model`` only; a bias broadcast
    names its ``data`` sharding (a reduced bias cannot meet a data-sharded operand)."""

    def data_only(spec):
        return P(*(a if a == "data" else None for a in spec))

    return Ops(
        constrain=wsc(drop=("data",)),
        bias=lambda v, b, spec: (
            v + jax.lax.broadcast_in_dim(b, v.shape, (v.ndim - 1,), out_sharding=data_only(spec))
        ),
    )


# ---- the compiled programs' collectives ---------------------------------------------


def collectives(programs, mesh) -> list[dict]:
    """Kind, axes, count and bytes per device of each kind of collective in the compiled
    ``programs`` together."""
    logical = Mesh(AXES, tuple(mesh.devices.shape))
    ids = [d.id for d in mesh.devices.flat]
    found = [c for p in programs for c in analyze_collectives(p.as_text(), logical, ids).compared()]
    rows: dict[tuple, dict] = {}
    for c in found:
        key = (c.kind, tuple(c.axes))
        row = rows.setdefault(key, {"kind": c.kind, "axes": list(c.axes), "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += int(c.bytes)
    return sorted(rows.values(), key=lambda r: (r["kind"], r["axes"]))


def on_axis(rows, axis: str) -> dict:
    picked = [r for r in rows if axis in r["axes"]]
    return {
        "count": sum(r["count"] for r in picked),
        "bytes": sum(r["bytes"] for r in picked),
        "kinds": sorted({r["kind"] for r in picked}),
    }


def shard_bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


# ---- the mechanisms ---------------------------------------------------------------------


@dataclasses.dataclass
class Stage:
    """One mechanism's stage on one mesh: ``backward(params, x, t, acc) -> acc`` (one
    micro-batch), ``update(params, opt_state, acc) -> (params, opt_state)`` (once a step),
    ``reduce(acc)`` (the step's gradient, for the comparison only) and ``feed(x, t)``, which
    puts one micro-batch where the backward takes it."""

    mesh: Any
    backward: Any
    update: Any
    reduce: Any
    acc: Any
    params: Any
    opt_state: Any
    feed: Callable


class SplitStep:
    """A micro-batch as the runtime runs it: a jitted forward that returns the ``jax.vjp``'s
    residuals (its leaves) and a jitted backward that applies them and adds into the
    accumulator (:class:`autoshard.runtime.stage.StageExecutable`'s ``forward`` /
    ``backward``)."""

    def __init__(self, forward, backward):
        self.forward, self.backward = forward, backward

    def __call__(self, p, x, t, acc):
        return self.backward(self.forward(p, x, t), acc)

    def compiled(self, p, x, t, acc) -> list:
        res = self.forward(p, x, t)
        return [
            self.forward.lower(p, x, t).compile(),
            self.backward.lower(res, acc).compile(),
        ]


def auto_mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2)


def ns(mesh, spec, **kw):
    return NamedSharding(mesh, P(*spec, **kw))


def param_shardings(mesh, specs=None, **kw):
    return {k: ns(mesh, s, **kw) for k, s in (specs or PARAM_SPECS).items()}


def zero_spec(spec: tuple, shape: tuple, mesh_shape: dict) -> tuple:
    """``spec`` with ``data`` added where it divides: ZeRO's data-sharded gradient/state."""
    out = list(spec)
    for i, (axis, n) in enumerate(zip(spec, shape)):
        axes = () if axis is None else (axis,)
        size = int(np.prod([mesh_shape[a] for a in axes])) if axes else 1
        if n % (size * mesh_shape["data"]) == 0:
            out[i] = (*axes, "data") if axes else "data"
            return tuple(out)
    raise ValueError(f"no dim of {shape} takes data on top of {spec}")


def zero_specs(mesh) -> dict:
    shapes = {k: v.shape for k, v in init_params().items()}
    return {k: zero_spec(s, shapes[k], dict(mesh.shape)) for k, s in PARAM_SPECS.items()}


def adamw_update(params, opt_state, grads):
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def opt_init(state_shardings):
    """AdamW's state made on ``state_shardings`` (ZeRO: sharded over data): each moment as
    its parameter's entry, the step count replicated (left to XLA, Auto mode replicates
    the moments: zeros do not take their argument's sharding)."""
    replicated = NamedSharding(next(iter(state_shardings.values())).mesh, P())

    def pick(path, _leaf):
        keys = [getattr(k, "key", None) for k in path]
        return next((state_shardings[k] for k in keys if k in state_shardings), replicated)

    abstract = jax.eval_shape(OPTIMIZER.init, init_params())
    out = jax.tree_util.tree_map_with_path(pick, abstract)
    init = jax.jit(OPTIMIZER.init, out_shardings=out)
    return init(jax.device_put(init_params(), state_shardings))


def plain_feed(mesh):
    sh = ns(mesh, ("data", None, None))
    return lambda x, t: (jax.device_put(x, sh), jax.device_put(t, sh))


def split_feed(mesh, d):
    sh = ns(mesh, ("data", None, None, None))

    def feed(x, t):
        def split(a):
            return jax.device_put(a.reshape(d, BATCH // d, *a.shape[1:]), sh)

        return split(x), split(t)

    return feed


def updater(reduce, psh, state_sh):
    """The step's update: the gradient reduced by ``reduce`` into ``state_sh`` (the
    optimizer state's shardings: ``psh``, or ZeRO's data-sharded ones, where the reduction
    is a reduce-scatter and the updated weights are all-gathered back to ``psh``)."""

    def update(params, opt_state, acc):
        grads = jax.lax.with_sharding_constraint(reduce(acc), state_sh)
        params = jax.lax.with_sharding_constraint(params, state_sh)
        return adamw_update(params, opt_state, grads)

    return jax.jit(update, out_shardings=(psh, None))


def mech_reduced(shape, zero=False):
    """Today's runtime: each micro-batch's gradient reduced in its backward (``zero``: into
    a data-sharded accumulator, ZeRO-2's reduce-scatter)."""
    mesh = auto_mesh(shape)
    psh = param_shardings(mesh)
    gsh = param_shardings(mesh, zero_specs(mesh)) if zero else psh
    ops = Ops(wsc())

    def backward(p, x, t, acc):
        return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(p, x, t, ops))

    acc = jax.jit(lambda: jax.tree.map(jnp.zeros_like, init_params()), out_shardings=gsh)()
    return Stage(
        mesh,
        jax.jit(backward, out_shardings=gsh),
        updater(lambda a: a, psh, gsh),
        jax.jit(lambda a: a, out_shardings=psh),
        acc,
        jax.device_put(init_params(), psh),
        opt_init(gsh),
        plain_feed(mesh),
    )


def stacked(mesh):
    return {k: ns(mesh, ("data", *s)) for k, s in PARAM_SPECS.items()}


def split_stage(mesh, grads_fn, zero):
    """A stage whose backward makes ``(D, *shape)`` per-device gradients (``vmap``,
    ``shard_map``): accumulated sharded over data, summed over D once a step."""
    d = mesh.shape["data"]
    psh, ash = param_shardings(mesh), stacked(mesh)
    state_sh = param_shardings(mesh, zero_specs(mesh)) if zero else psh

    def backward(p, x, t, acc):
        return jax.tree.map(jnp.add, acc, grads_fn(p, x, t))

    def total(acc):
        return jax.tree.map(lambda a: a.sum(0), acc)  # the step's one reduction

    zeros = jax.tree.map(lambda a: jnp.zeros((d, *a.shape), a.dtype), init_params())
    return Stage(
        mesh,
        jax.jit(backward, out_shardings=ash),
        updater(total, psh, state_sh),
        jax.jit(total, out_shardings=psh),
        jax.device_put(zeros, ash),
        jax.device_put(init_params(), psh),
        opt_init(state_sh),
        split_feed(mesh, d),
    )


def mech_vmap(shape, keep_data_in_constraints=False, zero=False):
    mesh = auto_mesh(shape)
    ops = Ops(wsc() if keep_data_in_constraints else wsc(drop=("data",)))

    def grads(p, x, t):
        return jax.vmap(lambda xs, ts: jax.grad(loss_fn)(p, xs, ts, ops), spmd_axis_name="data")(
            x, t
        )

    return split_stage(mesh, grads, zero)


def mech_shard_map(shape, zero=False, varying=True):
    mesh = auto_mesh(shape)
    ops = Ops(wsc(drop=("data",)))

    def local(p, x, t):
        # a varying copy: its gradient is this device's own (an invariant one's is psum'd:
        # ``shard_map-invariant``, each device then holds the whole sum)
        if varying:
            p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
        g = jax.grad(loss_fn)(p, x[0], t[0], ops)
        return jax.tree.map(lambda a: a[None], g)

    grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
    )
    return split_stage(mesh, grads, zero)


def mech_shard_map_split(shape):
    """``shard_map`` with the runtime's forward / backward split: the forward's residuals
    leave it stacked ``(D, ...)`` over data (whatever dim of theirs holds the batch) and
    the backward takes them back the same way."""
    mesh = auto_mesh(shape)
    ops = Ops(wsc(drop=("data",)))
    layout = {}

    def fwd_local(p, x, t):
        p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
        _, vjp = jax.vjp(lambda q: loss_fn(q, x[0], t[0], ops), p)
        leaves, layout["tree"] = jax.tree.flatten(vjp)
        return [leaf[None] for leaf in leaves]

    def bwd_local(leaves):
        vjp = jax.tree.unflatten(layout["tree"], [leaf[0] for leaf in leaves])
        # the local loss is a sum over this device's rows / the step's size: cotangent 1
        (g,) = vjp(jax.lax.pcast(jnp.ones((), jnp.float32), "data", to="varying"))
        return jax.tree.map(lambda a: a[None], g)

    def manual(f, in_specs):
        return jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=P("data"), axis_names={"data"}
        )

    forward = jax.jit(manual(fwd_local, (P(), P("data"), P("data"))))

    def backward(leaves, acc):
        return jax.tree.map(jnp.add, acc, manual(bwd_local, (P("data"),))(leaves))

    st = split_stage(mesh, lambda p, x, t: None, zero=False)
    st.backward = SplitStep(forward, jax.jit(backward, out_shardings=stacked(mesh)))
    return st


def mech_unreduced(shape, mixed=False, zero=False, split=False):
    types = (AxisType.Explicit, AxisType.Auto) if mixed else (AxisType.Explicit,) * 2
    mesh = jax.make_mesh(shape, AXES, axis_types=types)
    rsh = param_shardings(mesh, reduced={"data"})  # the weights at rest: free cast of replicated
    ush = param_shardings(mesh, unreduced={"data"})  # their gradients and the accumulator
    state_specs = zero_specs(mesh) if zero else PARAM_SPECS
    # mixed: data typed Explicit (the types carry it, a broadcast says it); the model
    # constraints stay with_sharding_constraint
    ops = mixed_ops() if mixed else explicit_ops()

    def backward(p, x, t, acc):
        return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(p, x, t, ops))

    layout = {}

    def split_forward(p, x, t):
        _, vjp = jax.vjp(lambda q: loss_fn(q, x, t, ops), p)
        leaves, layout["tree"] = jax.tree.flatten(vjp)
        return leaves

    def split_backward(leaves, acc):
        (g,) = jax.tree.unflatten(layout["tree"], leaves)(jnp.ones((), jnp.float32))
        return jax.tree.map(jnp.add, acc, g)

    def to(specs):
        return lambda tree: jax.tree.map(lambda a, s: jax.reshard(a, P(*s)), tree, specs)

    def update(params, opt_state, acc):
        grads = to(state_specs)(acc)  # the step's one reduction (ZeRO: a reduce-scatter)
        params = to(state_specs)(params)  # free: a cast, or a slice of the local copy
        return adamw_update(params, opt_state, grads)

    with jax.set_mesh(mesh):
        micro = (
            SplitStep(jax.jit(split_forward), jax.jit(split_backward, out_shardings=ush))
            if split
            else jax.jit(backward, out_shardings=ush)
        )
        return Stage(
            mesh,
            micro,
            jax.jit(update, out_shardings=(rsh, None)),
            jax.jit(to(PARAM_SPECS)),
            jax.jit(lambda: jax.tree.map(jnp.zeros_like, init_params()), out_shardings=ush)(),
            jax.device_put(init_params(), rsh),
            opt_init(param_shardings(mesh, state_specs)),
            plain_feed(mesh),
        )


MECHANISMS = {
    "reduced": mech_reduced,
    "reduced-zero2": lambda s: mech_reduced(s, zero=True),
    "vmap": mech_vmap,
    "vmap-zero": lambda s: mech_vmap(s, zero=True),
    "vmap-constrained": lambda s: mech_vmap(s, keep_data_in_constraints=True),
    "shard_map": mech_shard_map,
    "shard_map-zero": lambda s: mech_shard_map(s, zero=True),
    "shard_map-invariant": lambda s: mech_shard_map(s, varying=False),
    "unreduced": mech_unreduced,
    "unreduced-zero": lambda s: mech_unreduced(s, zero=True),
    "unreduced-mixed": lambda s: mech_unreduced(s, mixed=True),
    "shard_map-split": mech_shard_map_split,
    "unreduced-split": lambda s: mech_unreduced(s, split=True),
}


def describe(e: BaseException) -> str:
    """The error's first line, and where it was raised (JAX's own frame: an assertion has
    no message)."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return f"{type(e).__name__}: {first} [{where}]" if first else f"{type(e).__name__} [{where}]"


def as_numpy(tree) -> dict:
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


def run_one(name: str, shape, xs, ts):
    """Compile and run one step of ``name`` on ``shape``: its collectives, accumulator bytes
    per device, the step's reduced gradient and updated parameters (numpy)."""
    st: Stage = MECHANISMS[name](shape)
    with jax.set_mesh(st.mesh):
        x0, t0 = st.feed(xs[0], ts[0])
        if isinstance(st.backward, SplitStep):
            mb_c = st.backward.compiled(st.params, x0, t0, st.acc)
        else:
            mb_c = [st.backward.lower(st.params, x0, t0, st.acc).compile()]
        upd_c = st.update.lower(st.params, st.opt_state, st.acc).compile()
        acc = st.acc
        for m in range(MICROBATCHES):
            acc = st.backward(st.params, *st.feed(xs[m], ts[m]), acc)
        grads = as_numpy(st.reduce(acc))
        new_params = as_numpy(st.update(st.params, st.opt_state, acc)[0])
    per_mb, per_step = collectives(mb_c, st.mesh), collectives([upd_c], st.mesh)
    return (
        {
            "backward_collectives": per_mb,
            "update_collectives": per_step,
            "data_axis_per_microbatch": on_axis(per_mb, "data"),
            "data_axis_per_update": on_axis(per_step, "data"),
            "model_axis_per_microbatch": on_axis(per_mb, "model"),
            "accumulator_bytes_per_device": shard_bytes(acc),
            "optimizer_state_bytes_per_device": shard_bytes(st.opt_state),
        },
        grads,
        new_params,
    )


def max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in b)


SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A"}


def fmt_coll(c: dict) -> str:
    kinds = "+".join(SHORT.get(k, k) for k in c["kinds"])
    return f"{c['count']} {kinds} {c['bytes']:,} B" if c["count"] else "-"


def sharding_params(preset: str = "gpt-tiny") -> dict:
    """Equations of a GPT's ``value_and_grad`` jaxpr (nested ones included) whose primitive
    carries an ``out_sharding`` / ``sharding`` parameter, by primitive: what an all-Explicit
    stage would have to set from the plan when it binds them (the runtime binds the traced
    equations with the Auto-mode value, None)."""
    from autoshard.models.gpt import GPT_PRESETS, gpt_batch_spec, gpt_init_fn, gpt_loss_fn

    cfg = GPT_PRESETS[preset]
    params = jax.eval_shape(gpt_init_fn(cfg), jax.random.PRNGKey(0))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(gpt_loss_fn(cfg)))(params, gpt_batch_spec(cfg))
    total, found = 0, {}

    def walk(j):
        nonlocal total
        for e in j.eqns:
            total += 1
            if "out_sharding" in e.params or "sharding" in e.params:
                found[e.primitive.name] = found.get(e.primitive.name, 0) + 1
            for v in e.params.values():
                inner = getattr(v, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    return {"model": preset, "attention": cfg.attention, "equations": total, "by_primitive": found}


def where_priced(model: str = "gpt-tiny", mesh: str = "8") -> list[dict]:
    """Where the planner charges data-axis reductions of backward values: ``model``'s
    default plan on ``mesh``, its predicted collectives over ``data`` of values a backward
    equation makes, grouped by (kind, producer, readers) -- the phase of each reader says
    whether ``amortise_update`` scales it (update) or not (backward)."""
    from autoshard.api import device_mesh_for, plan_workload
    from autoshard.intra.problem import predict

    asked = []
    original = predict.collectives_by_value

    def listen(ip, choice, relabelled=None):
        asked.append((ip, choice))
        return original(ip, choice, relabelled)

    predict.collectives_by_value = listen
    try:
        plan_workload(model, device_mesh_for(mesh))
    finally:
        predict.collectives_by_value = original
    ip, choice = asked[-1]
    producer = {t: n for n in ip.graph.nodes for t in n.outputs}
    readers: dict[int, set] = {}
    for n in ip.graph.nodes:
        for t in n.inputs:
            readers.setdefault(t, set()).add(f"{n.primitive} ({n.phase})")
    rows: dict[tuple, dict] = {}
    for tid, cols in original(ip, choice):
        node = producer.get(tid)
        if node is None or node.phase != "backward":
            continue
        for c in cols:
            if c.kind not in ("all-reduce", "reduce-scatter") or "data" not in c.axes:
                continue
            key = (c.kind, node.primitive, tuple(sorted(readers.get(tid, ()))))
            row = rows.setdefault(
                key,
                {"kind": c.kind, "producer": node.primitive, "readers": list(key[2]), "count": 0,
                 "bytes": 0},
            )  # fmt: skip
            row["count"] += 1
            row["bytes"] += int(c.bytes)
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def model_check(preset: str, shape, batch_size: int | None = None) -> dict:
    """(b) on one of the project's models, unconstrained (GSPMD lays it out): a micro-batch's
    gradient as today (``jax.grad`` of the mean loss, batch over ``data``) against
    ``shard_map`` over ``data``: each device's gradient of the mean over its own rows,
    scaled by 1/D (the cotangent of a mean), summed over D. Returns the data-axis
    collectives of each backward and the largest gradient difference, absolute and
    relative to the largest gradient."""
    from autoshard.models.gpt import GPT as GPTModel
    from autoshard.models.gpt import GPT_PRESETS, gpt_random_batch, token_init_fn, token_loss_fn
    from autoshard.models.moe import MOE_PRESETS, GPTMoE

    cfg = GPT_PRESETS.get(preset) or MOE_PRESETS[preset]
    if batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=batch_size)
    model = GPTModel(cfg) if preset in GPT_PRESETS else GPTMoE(cfg)
    loss = token_loss_fn(model)
    mesh = auto_mesh(shape)
    d = shape[0]
    params = jax.jit(token_init_fn(model, cfg))(jax.random.PRNGKey(0))
    batch = gpt_random_batch(cfg, jax.random.PRNGKey(1))
    with jax.set_mesh(mesh):
        params = jax.device_put(params, ns(mesh, ()))
        batch = jax.device_put(batch, ns(mesh, ("data", None)))
        today = jax.jit(jax.grad(loss), out_shardings=ns(mesh, ()))

        def local(p, b):
            p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
            g = jax.grad(loss)(p, b)
            return jax.tree.map(lambda a: a[None] / d, g)

        stacked_grads = jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), P("data")),
                out_specs=P("data"),
                axis_names={"data"},
            )
        )
        ref = as_numpy(today(params, batch))
        once = as_numpy(jax.tree.map(lambda a: a.sum(0), stacked_grads(params, batch)))
        compiled = {
            "today": today.lower(params, batch).compile(),
            "shard_map": stacked_grads.lower(params, batch).compile(),
        }
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), once, ref))
    scale = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(ref))
    return {
        "model": preset,
        "batch_size": cfg.batch_size,
        "mesh": f"{shape[0]}x{shape[1]}",
        "data_axis_per_microbatch": {
            k: on_axis(collectives([c], mesh), "data") for k, c in compiled.items()
        },
        "max_abs_grad_diff": max(diffs),
        "max_abs_grad": scale,
    }


def traced_check(shape=(4, 2)) -> list[dict]:
    """(b) as the runtime would run it: gpt-tiny's loss traced by :func:`autoshard.trace.
    jaxpr.trace` and its equations bound (``TracedProgram.evaluate``, what a stage does)
    inside ``shard_map`` over ``data``. Tried with the trace at the micro-batch size (what
    the runtime holds) and at its 1/D share, with ``check_vma`` on and off; each row: whether
    it runs, and its gradient (local means / D, summed) against ``jax.grad`` of the loss."""
    from autoshard.models.gpt import (
        GPT_PRESETS,
        gpt_batch_spec,
        gpt_init_fn,
        gpt_loss_fn,
        gpt_random_batch,
    )
    from autoshard.trace.jaxpr import trace

    cfg = GPT_PRESETS["gpt-tiny"]
    d = shape[0]
    loss = gpt_loss_fn(cfg)
    params = jax.jit(gpt_init_fn(cfg))(jax.random.PRNGKey(0))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    local_cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // d)
    traces = {
        f"batch {cfg.batch_size}": trace(loss, abstract, gpt_batch_spec(cfg), arg_kinds=("param", "data")),
        f"batch {local_cfg.batch_size}": trace(
            loss, abstract, gpt_batch_spec(local_cfg), arg_kinds=("param", "data")
        ),
    }  # fmt: skip
    whole, part = traces.values()
    same = len(whole.records.eqns) == len(part.records.eqns) and all(
        a.inputs == b.inputs and a.outputs == b.outputs and p[0] is q[0]
        for a, b, p, q in zip(whole.records.eqns, part.records.eqns, whole._impls, part._impls)
    )
    mesh = auto_mesh(shape)
    batch = gpt_random_batch(cfg, jax.random.PRNGKey(1))
    ref = as_numpy(jax.grad(loss)(params, batch))
    rows = [{"check": "traces alike", "equations": len(whole.records.eqns), "same_ids": same}]
    for name, prog in traces.items():
        for vma in (True, False):

            def local(p, b, prog=prog, vma=vma):
                if vma:  # the parameters varying, as in the study's own shard_map
                    p = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), p)
                g = jax.grad(lambda q: prog.evaluate(q, b))(p)
                return jax.tree.map(lambda x: x[None] / d, g)

            row = {"check": f"trace at {name}, check_vma={vma}", "mesh": f"{shape[0]}x{shape[1]}"}
            try:
                f = jax.shard_map(
                    local,
                    mesh=mesh,
                    in_specs=(P(), P("data")),
                    out_specs=P("data"),
                    axis_names={"data"},
                    check_vma=vma,
                )
                with jax.set_mesh(mesh):
                    got = as_numpy(jax.tree.map(lambda a: a.sum(0), jax.jit(f)(params, batch)))
                    compiled = jax.jit(f).lower(params, batch).compile()
                row["works"] = True
                # a psum'd gradient would sum to the same: the collectives tell them apart
                row["data_axis_collectives"] = on_axis(collectives([compiled], mesh), "data")
                row["max_abs_grad_diff"] = max(
                    float(np.max(np.abs(a - b)))
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
                )
            except Exception as e:
                row["works"] = False
                row["error"] = describe(e)
            rows.append(row)
    rows.append(explicit_traced(whole, params, batch, shape, ref))
    return rows


def explicit_traced(prog, params, batch, shape, ref) -> dict:
    """(c) as the runtime would run it: the traced equations bound as they are (their
    sharding parameters None) on an all-Explicit mesh, the weights ``reduced={"data"}``."""
    mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Explicit,) * 2)
    row = {"check": "trace at the micro-batch, all-Explicit, reduced weights"}
    row["mesh"] = f"{shape[0]}x{shape[1]}"
    try:
        with jax.set_mesh(mesh):
            p = jax.device_put(params, ns(mesh, (), reduced={"data"}))
            b = jax.device_put(batch, ns(mesh, ("data",)))
            grad = jax.jit(jax.grad(lambda q, x: prog.evaluate(q, x)))
            compiled = grad.lower(p, b).compile()
            got = as_numpy(
                jax.jit(lambda t: jax.tree.map(lambda a: jax.reshard(a, P()), t))(grad(p, b))
            )
        row["works"] = True
        row["max_abs_grad_diff"] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
        )
        row["data_axis_collectives"] = on_axis(collectives([compiled], mesh), "data")
    except Exception as e:
        row["works"] = False
        row["error"] = describe(e)
    return row


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results JSON here")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument(
        "--models",
        action="store_true",
        help="only: shard_map over data on gpt-tiny and moe-tiny against today's gradient",
    )
    ap.add_argument(
        "--traced",
        action="store_true",
        help="only: gpt-tiny's traced equations bound inside shard_map, as a stage binds them",
    )
    ap.add_argument(
        "--where-priced",
        action="store_true",
        help="only: where gpt-tiny's default plan on 8 charges its backward's data reductions",
    )
    args = ap.parse_args(argv)
    if args.where_priced:
        found = where_priced()
        print("gpt-tiny on 8, default plan: predicted data-axis reductions of backward values")
        for r in found:
            print(f"{r['count']:3d} {r['kind']:15s} {r['bytes']:>9,} B  {r['producer']} -> "
                  + ", ".join(r["readers"]))  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"jax": jax.__version__, "where_priced": found}, f, indent=1)
        return 0
    if args.traced:
        found = traced_check()
        head = found[0]
        print(
            f"gpt-tiny traced at the micro-batch and at 1/D of it: {head['equations']} equations "
            f"each, the same equations and tensor ids: {head['same_ids']}"
        )
        for r in found[1:]:
            what = (
                f"works, data collectives {fmt_coll(r['data_axis_collectives'])}, "
                f"max |dg| {r['max_abs_grad_diff']:.1e}"
                if r["works"]
                else f"FAILS {r['error'][:140]}"
            )
            print(f"{r['mesh']} {r['check']}: {what}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"jax": jax.__version__, "traced": found}, f, indent=1)
        return 0
    if args.models:
        found = [model_check(m, s) for m in ("gpt-tiny", "moe-tiny") for s in ((8, 1), (4, 2))]
        try:  # 8 sequences of 32 tokens on 8 devices: a device holds half an expert group
            found.append(model_check("moe-tiny", (8, 1), batch_size=8))
        except Exception as e:
            found.append(
                {"model": "moe-tiny", "batch_size": 8, "mesh": "8x1", "error": describe(e)}
            )
        print("one micro-batch's gradient: today's against shard_map over data (1/D, summed)")
        for r in found:
            if "error" in r:
                print(
                    f"{r['model']:9s} {r['mesh']} batch {r['batch_size']}: FAILS {r['error'][:150]}"
                )
                continue
            per = r["data_axis_per_microbatch"]
            print(
                f"{r['model']:9s} {r['mesh']} batch {r['batch_size']}: data collectives today {fmt_coll(per['today'])}, "
                f"shard_map {fmt_coll(per['shard_map'])}; max |dg| {r['max_abs_grad_diff']:.1e} "
                f"(max |g| {r['max_abs_grad']:.1e})"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"jax": jax.__version__, "models": found}, f, indent=1)
        return 0
    names = args.mechanisms.split(",")
    xs, ts = step_batches()
    params_bytes = sum(a.nbytes for a in jax.tree.leaves(init_params()))
    rows, t0 = [], time.time()
    for shape in MESHES:
        reference = None
        for name in ["reduced"] + [n for n in names if n != "reduced"]:
            row = {"mesh": f"{shape[0]}x{shape[1]}", "mechanism": name}
            try:
                found, grads, new_params = run_one(name, shape, xs, ts)
                row.update(found)
                if name == "reduced":
                    reference = grads, new_params
                row["max_abs_grad_diff_vs_reduced"] = max_diff(grads, reference[0])
                row["max_abs_param_diff_vs_reduced"] = max_diff(new_params, reference[1])
                row["equal"] = row["max_abs_param_diff_vs_reduced"] <= TOL
                row["works"] = True
            except Exception as e:  # what the mechanism hit, as the record
                row["works"] = False
                row["error"] = describe(e)
                if os.environ.get("GRAD_ONCE_TRACE"):
                    traceback.print_exc()
            rows.append(row)
    wall = time.time() - t0
    print(
        f"jax {jax.__version__}, python {sys.version.split()[0]}; {MICROBATCHES} micro-batches of "
        f"{BATCH}x{SEQ}x{WIDTH}; parameters {params_bytes:,} B; data-axis collectives "
        "(count, kinds, bytes per device)"
    )
    print(
        f"{'mesh':5} {'mechanism':19} {'data/micro-batch':>18} {'data/update':>18} "
        f"{'model/micro-batch':>18} {'acc B/device':>12} {'max |dg|':>9} {'max |dp|':>9}  ok"
    )
    for r in rows:
        if not r["works"]:
            print(f"{r['mesh']:5} {r['mechanism']:19} FAILS: {r['error'][:140]}")
            continue
        print(
            f"{r['mesh']:5} {r['mechanism']:19} {fmt_coll(r['data_axis_per_microbatch']):>18} "
            f"{fmt_coll(r['data_axis_per_update']):>18} "
            f"{fmt_coll(r['model_axis_per_microbatch']):>18} "
            f"{r['accumulator_bytes_per_device']:>12,} "
            f"{r['max_abs_grad_diff_vs_reduced']:>9.1e} "
            f"{r['max_abs_param_diff_vs_reduced']:>9.1e}  {'yes' if r['equal'] else 'NO'}"
        )
    counted = sharding_params()
    print(
        f"{counted['model']} ({counted['attention']} attention) value_and_grad: "
        f"{sum(counted['by_primitive'].values())} of {counted['equations']} equations carry a "
        f"sharding parameter: {counted['by_primitive']}"
    )
    print(f"wall {wall:.1f} s")
    if args.out:
        result = {
            "study": "grad_reduce_once",
            "command": "python benchmarks/studies/grad_reduce_once.py --out " + args.out,
            "commit": git_commit(),
            "jax": jax.__version__,
            "python": sys.version.split()[0],
            "microbatches": MICROBATCHES,
            "microbatch_shape": [BATCH, SEQ, WIDTH],
            "hidden": HIDDEN,
            "param_bytes": params_bytes,
            "tolerance": TOL,
            "wall_s": round(wall, 1),
            "rows": rows,
            "sharding_params": counted,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
