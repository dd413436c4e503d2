"""Trace a training step into flat, tagged records: the only module that reads jaxprs.

Takes a function and example arguments (``jax.ShapeDtypeStruct`` leaves, or arrays) and
returns a :class:`TracedProgram`:

* ``records`` -- plain Python (:class:`TraceRecords`): every equation of the step after
  differentiation, with nested ``jit``/``closed_call``/``custom_jvp_call``/
  ``custom_vjp_call``/``remat2`` inlined, each tagged with its **layer** (from the Flax
  linen name stack: the first module under the root, e.g. ``embedding``, ``block_3``,
  ``head``), its **phase** (``forward``, ``backward``, ``update``) and its module path.
  Optimizer-update equations carry the layer of the parameter they update (found by data
  flow from the updated outputs); equations shared by every parameter (Adam's step
  count) carry ``None``.  Nothing downstream of ``records`` imports jax.
* the jax side needed to run the same flat program again (:meth:`TracedProgram.evaluate`),
  which the runtime uses to insert sharding constraints equation by equation.

Tracing never allocates parameters: a 76B-parameter step traces on a laptop.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from autoshard.ir.records import INPUT_KINDS, EqnRecord, TensorRecord, TraceRecords

# Call-like primitives whose bodies are inlined; the key is where the body lives.
_INLINE_BODY = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


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
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"arguments have structure {tree}, traced with {self.in_tree}")
        env: dict[int, Any] = dict(self._consts)
        env.update(zip(self.records.inputs, flat))
        for eqn, (prim, params) in zip(self.records.eqns, self._impls):
            invals = [env[i] for i in eqn.inputs]
            if in_hook is not None:
                invals = in_hook(eqn.index, invals)
            outs = prim.bind(*invals, **params)
            outs = list(outs) if prim.multiple_results else [outs]
            if hook is not None:
                outs = hook(eqn.index, outs)
            env.update(zip(eqn.outputs, outs))
        return jax.tree_util.tree_unflatten(self.out_tree, [env[i] for i in self.records.outputs])


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


_WRAPPER = re.compile(r"^(?:[\w.]+\()+|\)+$")


def _module_path(name_stack: str) -> tuple[str, ...]:
    """``transpose(jvp(GPT))/block_1/attn`` -> ``("GPT", "block_1", "attn")``."""
    parts = []
    for part in name_stack.split("/"):
        part = _WRAPPER.sub("", part)
        if part:
            parts.append(part)
    return tuple(parts)


def _default_layer_of(module_path: tuple[str, ...]) -> str | None:
    """The first module under the root (``GPT/block_3/attn`` -> ``block_3``)."""
    return module_path[1] if len(module_path) >= 2 else None


@dataclass
class _Flattener:
    tensors: list[TensorRecord] = field(default_factory=list)
    eqns: list[tuple[str, tuple, tuple, Any, dict, str]] = field(default_factory=list)
    consts: dict[int, Any] = field(default_factory=dict)

    def new_tensor(self, aval, kind: str, path: str = "") -> int:
        tid = len(self.tensors)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = np.dtype(getattr(aval, "dtype", np.float32)).name
        self.tensors.append(TensorRecord(tid, shape, dtype, kind, path))
        return tid

    def read(self, env: dict, atom) -> int:
        if isinstance(atom, jcore.Literal):
            tid = self.new_tensor(atom.aval, "literal")
            self.consts[tid] = atom.val
            return tid
        return env[atom]

    def flatten(
        self, jaxpr: jcore.Jaxpr, consts: Sequence, in_ids: Sequence[int], stack: str
    ) -> list[int]:
        env: dict = {}
        for var, value in zip(jaxpr.constvars, consts):
            tid = self.new_tensor(var.aval, "const")
            self.consts[tid] = value
            env[var] = tid
        env.update(zip(jaxpr.invars, in_ids))
        for eqn in jaxpr.eqns:
            inner_stack = str(eqn.source_info.name_stack)
            full_stack = "/".join(s for s in (stack, inner_stack) if s)
            in_ids_e = [self.read(env, v) for v in eqn.invars]
            body_key = _INLINE_BODY.get(eqn.primitive.name)
            if body_key is not None and body_key in eqn.params:
                body = eqn.params[body_key]
                if isinstance(body, jcore.ClosedJaxpr):
                    out_ids = self.flatten(body.jaxpr, body.consts, in_ids_e, full_stack)
                else:
                    out_ids = self.flatten(body, (), in_ids_e, full_stack)
            else:
                out_ids = [self.new_tensor(v.aval, "intermediate") for v in eqn.outvars]
                params = eqn.primitive.get_bind_params(eqn.params)
                if isinstance(params, tuple):  # older jax returned (subfuns, params)
                    params = params[1]
                self.eqns.append(
                    (
                        eqn.primitive.name,
                        tuple(in_ids_e),
                        tuple(out_ids),
                        eqn.primitive,
                        params,
                        full_stack,
                    )
                )
            for var, tid in zip(eqn.outvars, out_ids):
                env[var] = tid
        return [self.read(env, v) for v in jaxpr.outvars]


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

    flat = _Flattener()
    in_ids: list[int] = []
    for argnum, (arg, kind) in enumerate(zip(args, arg_kinds)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            in_ids.append(flat.new_tensor(leaf, kind, f"[{argnum}]{jax.tree_util.keystr(path)}"))
    in_tree = jax.tree_util.tree_structure(args)
    out_ids = flat.flatten(closed.jaxpr, closed.consts, in_ids, "")
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
    paths = [_module_path(e[5]) for e in flat.eqns]
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
    layers: list[str | None] = [
        layer_of(p) if ph != "update" else None for p, ph in zip(paths, phases)
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
        EqnRecord(i, name, ins, outs, _plain(params), layers[i], phases[i], "/".join(paths[i]))
        for i, (name, ins, outs, _, params, _) in enumerate(flat.eqns)
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
