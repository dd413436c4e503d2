"""Trace a training step into flat, tagged records: with its inliner
(:mod:`autoshard.trace.flatten`), the only module that reads jaxprs.

Takes a function and example arguments (``jax.ShapeDtypeStruct`` leaves, or arrays) and
returns a :class:`TracedProgram`:

* ``records`` -- plain Python (:class:`TraceRecords`): every equation of the step after
  differentiation, with nested ``jit``/``closed_call``/``custom_jvp_call``/
  ``custom_vjp_call``/``remat2`` inlined and every ``scan`` (``nn.scan`` over layers,
  ``fori_loop`` with static bounds) unrolled, each tagged with its **layer** (from the Flax
  linen name stack: the first module under the root, e.g. ``embedding``, ``block_3``,
  ``head``), its **phase** (``forward``, ``backward``, ``update``) and its module path.
  Optimizer-update equations carry the layer of the parameter they update (found by data
  flow from the updated outputs); equations shared by every parameter (Adam's step
  count) carry ``None``.  Nothing downstream of ``records`` imports jax.
* the jax side needed to run the same flat program again (:meth:`TracedProgram.evaluate`),
  which the runtime uses to insert sharding constraints equation by equation.

Tracing never allocates parameters: a 76B-parameter step traces on a laptop.

Unrolling a scan: iteration ``i`` of the body is inlined with its own layer tag (the
scanned module's name with ``_i``: ``blocks/attn`` becomes ``blocks_3/attn``), so the
planner sees the same per-layer program as for the unrolled model, identical layers are
planned once, and the stage search can cut between iterations.  A stacked input (the
``[L, ...]`` parameters of ``nn.scan``) is sliced where each iteration reads it
(``slice`` and ``squeeze``, as XLA's loop does: no slice outlives its iteration);
stacked outputs are rebuilt with ``concatenate`` only where something reads them
(per-iteration values that the backward scan reads back are passed through, as XLA
keeps them).  A scan longer than :data:`~autoshard.trace.flatten.MAX_UNROLLED_EQNS`
equations unrolled stays one opaque equation (planned replicated, with a warning).  The
jaxpr is inlined by :class:`~autoshard.trace.flatten.Flattener`; this module tags it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from autoshard.ir.records import INPUT_KINDS, EqnRecord, TraceRecords
from autoshard.trace.flatten import Flattener, module_path


class TraceError(ValueError):
    """The function could not be traced into a jaxpr."""


@dataclass(frozen=True, eq=False)
class TracedProgram:
    records: TraceRecords
    in_tree: Any
    out_tree: Any
    _impls: tuple[tuple[Any, dict], ...] = field(repr=False)
    _consts: dict[int, Any] = field(repr=False)

    def evaluate(
        self,
        *args,
        hook: Callable[[int, list], list] | None = None,
        in_hook: Callable[[int, list], list] | None = None,
    ):
        """Run the flat program on ``args`` (same pytree structure as traced).

        ``hook(eqn_index, outputs)`` may replace an equation's outputs (the runtime uses
        it to apply ``with_sharding_constraint``); ``in_hook(eqn_index, inputs)`` may
        replace the operands an equation reads (per use, the producer's value is kept).
        """
        env = self.evaluate_env(args, hook=hook, in_hook=in_hook)
        return jax.tree_util.tree_unflatten(self.out_tree, [env[i] for i in self.records.outputs])

    def evaluate_env(
        self,
        args: tuple,
        order: Sequence[int] | None = None,
        hook: Callable[[int, list], list] | None = None,
        in_hook: Callable[[int, list], list] | None = None,
        before: Callable[[int, dict], None] | None = None,
    ) -> dict[int, Any]:
        """:meth:`evaluate`'s values, by tensor id: the equations at positions ``order``
        (a topological order of all of them; default: as traced), ``before(position,
        env)`` called before each (it may replace values in ``env``)."""
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"arguments have structure {tree}, traced with {self.in_tree}")
        env: dict[int, Any] = dict(self._consts)
        env.update(zip(self.records.inputs, flat))
        eqns = self.records.eqns
        for pos in range(len(eqns)) if order is None else order:
            eqn, (prim, params) = eqns[pos], self._impls[pos]
            if before is not None:
                before(pos, env)
            invals = [env[i] for i in eqn.inputs]
            if in_hook is not None:
                invals = in_hook(eqn.index, invals)
            outs = prim.bind(*invals, **params)
            outs = list(outs) if prim.multiple_results else [outs]
            if hook is not None:
                outs = hook(eqn.index, outs)
            env.update(zip(eqn.outputs, outs))
        return env


def _plain(value: Any) -> Any:
    """Equation params as plain Python (ints, strs, tuples, dicts)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "_asdict"):  # NamedTuples such as GatherDimensionNumbers
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        return "<jaxpr>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return tuple(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def _default_layer_of(module_path: tuple[str, ...]) -> str | None:
    """The first module under the root (``GPT/block_3/attn`` -> ``block_3``)."""
    return module_path[1] if len(module_path) >= 2 else None


def _jax_says_elementwise(prim) -> bool | None:
    """JAX's own word on whether ``prim`` is elementwise: True when its batching rule is
    the one ``jax.lax`` gives its elementwise ops (``defvectorized``, ``defbroadcasting``),
    False for another rule, None for none (a primitive made outside ``jax.lax`` with no
    batching rule: then the shapes decide, :func:`autoshard.ir.primitives.is_elementwise`)."""
    try:
        from jax._src.interpreters import batching

        rule = batching.fancy_primitive_batchers.get(prim)
        kinds = (batching.vectorized_batcher, batching.broadcast_batcher)
    except (ImportError, AttributeError):  # a JAX that moved them: the shapes decide
        return None
    if rule is None:
        return None
    return getattr(rule, "func", None) in kinds


def _layer_of_path(keys, layers: set[str]) -> str | None:
    for k in keys:
        name = getattr(k, "key", None)
        if isinstance(name, str) and name in layers:
            return name
    return None


def trace(
    fn: Callable,
    *args,
    arg_kinds: Sequence[str] | None = None,
    aliases: dict[int, int] | None = None,
    layer_of: Callable[[tuple[str, ...]], str | None] = _default_layer_of,
) -> TracedProgram:
    """Trace ``fn(*args)`` into a flat, tagged program.

    Args:
      fn: the step to trace; it must be traceable by JAX with abstract shapes.
      args: pytrees of ``jax.ShapeDtypeStruct`` (or arrays).
      arg_kinds: for each positional argument, ``param``, ``opt_state`` or ``data``
        (default: all ``data``).
      aliases: ``{argument index: output index}`` for state the step returns updated
        (a train step returns new params and optimizer state): leaves are paired by path.
      layer_of: maps a module path to its layer tag (default: first module under root).
    """
    arg_kinds = tuple(arg_kinds or ("data",) * len(args))
    if len(arg_kinds) != len(args):
        raise ValueError(f"arg_kinds has {len(arg_kinds)} entries for {len(args)} arguments")
    for k in arg_kinds:
        if k not in INPUT_KINDS:
            raise ValueError(f"unknown argument kind {k!r}; expected one of {INPUT_KINDS}")
    for leaf in jax.tree_util.tree_leaves(args):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TraceError(
                f"argument leaf {leaf!r} is not an array or jax.ShapeDtypeStruct; pass shapes "
                "as jax.ShapeDtypeStruct(shape, dtype)"
            )
    name = getattr(fn, "__name__", repr(fn))
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # noqa: BLE001 - we re-raise with a readable message
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TraceError(
            f"could not trace {name!r} with abstract arguments: {type(err).__name__}: {first}. "
            "autoshard needs a function JAX can trace with jax.ShapeDtypeStruct inputs "
            "(no Python control flow on array values, no conversion of traced values to "
            "Python numbers)."
        ) from err

    flat = Flattener()
    in_ids: list[int] = []
    for argnum, (arg, kind) in enumerate(zip(args, arg_kinds)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            in_ids.append(flat.new_tensor(leaf, kind, f"[{argnum}]{jax.tree_util.keystr(path)}"))
    in_tree = jax.tree_util.tree_structure(args)
    out_ids = flat.flatten(closed.jaxpr, closed.consts, in_ids, "")
    flat.drop_unread_stacks(out_ids)
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    # Give outputs their paths (an output may also be an input or a repeated tensor).
    for tid, (path, _) in zip(out_ids, out_leaves):
        rec = flat.tensors[tid]
        if not rec.path:
            flat.tensors[tid] = dataclasses.replace(rec, path=jax.tree_util.keystr(path))

    records = _tag(flat, tuple(in_ids), tuple(out_ids), out_leaves, args, aliases or {}, layer_of)
    impls = tuple((prim, params) for (_, _, _, prim, params, _) in flat.eqns)
    return TracedProgram(
        records, in_tree, jax.tree_util.tree_structure(out_shape), impls, flat.consts
    )


def _tag(flat, in_ids, out_ids, out_leaves, args, aliases, layer_of) -> TraceRecords:
    n = len(flat.eqns)
    paths = [module_path(e[5]) for e in flat.eqns]
    phases: list[str] = []
    seen_backward = False
    for _, _, _, _, _, stack in flat.eqns:
        if "transpose(" in stack:
            seen_backward = True
            phases.append("backward")
        elif "jvp(" in stack or not seen_backward:
            phases.append("forward")
        else:
            phases.append("update")
    # a path through a scanned module under its own name is a loop invariant that JAX
    # hoisted out of the scan: it belongs to no one iteration (it inherits, below)
    layers: list[str | None] = [
        layer_of(p) if ph != "update" and not flat.scanned.intersection(p) else None
        for p, ph in zip(paths, phases)
    ]
    order: list[str] = []
    for layer, phase in zip(layers, phases):
        if phase == "forward" and layer is not None and layer not in order:
            order.append(layer)
    # Untagged forward equations (the loss) belong to the layer before them; untagged
    # backward equations to the layer after them (backward runs in reverse).
    _inherit(layers, phases, "forward", range(n))
    _inherit(layers, phases, "forward", reversed(range(n)))
    _inherit(layers, phases, "backward", reversed(range(n)))
    _inherit(layers, phases, "backward", range(n))

    # Update equations: the layer of the parameter whose updated value they feed.
    layer_set = set(order)
    out_layer: dict[int, set[str]] = {}
    for tid, (path, _) in zip(out_ids, out_leaves):
        layer = _layer_of_path(path, layer_set)
        if layer is not None:
            out_layer.setdefault(tid, set()).add(layer)
    reach: dict[int, set[str]] = {tid: set(s) for tid, s in out_layer.items()}
    for i in reversed(range(n)):
        if phases[i] != "update":
            continue
        _, ins, outs, _, _, _ = flat.eqns[i]
        tags: set[str] = set()
        for t in outs:
            tags |= reach.get(t, set())
        layers[i] = next(iter(tags)) if len(tags) == 1 else None
        for t in ins:
            reach.setdefault(t, set()).update(tags)

    eqns = tuple(
        EqnRecord(
            i,
            name,
            ins,
            outs,
            _plain(params),
            layers[i],
            phases[i],
            "/".join(paths[i]),
            _jax_says_elementwise(prim),
        )
        for i, (name, ins, outs, prim, params, _) in enumerate(flat.eqns)
    )
    alias_pairs = []
    arg_offsets = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
    out_top = [p[0].idx if p and hasattr(p[0], "idx") else None for p, _ in out_leaves]
    for argnum, outnum in aliases.items():
        arg_ids = in_ids[arg_offsets[argnum] : arg_offsets[argnum + 1]]
        outs = [tid for tid, top in zip(out_ids, out_top) if top == outnum]
        if len(outs) != len(arg_ids):
            raise ValueError(
                f"argument {argnum} has {len(arg_ids)} leaves but output {outnum} has {len(outs)}; "
                "aliased state must keep its structure"
            )
        alias_pairs.extend(zip(arg_ids, outs))
    return TraceRecords(
        tuple(flat.tensors), eqns, in_ids, tuple(out_ids), tuple(alias_pairs), tuple(order)
    )


def _inherit(layers: list, phases: list, phase: str, indices) -> None:
    current = None
    for i in indices:
        if phases[i] != phase:
            continue
        if layers[i] is None:
            layers[i] = current
        else:
            current = layers[i]


def trace_train_step(step: Callable, params, opt_state, batch, **kw) -> TracedProgram:
    """Trace ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""
    return trace(
        step,
        params,
        opt_state,
        batch,
        arg_kinds=("param", "opt_state", "data"),
        aliases={0: 0, 1: 1},
        **kw,
    )
