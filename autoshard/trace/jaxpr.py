"""Trace a training step into flat, tagged records: the only module that reads jaxprs.

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
keeps them).  A scan longer than :data:`MAX_UNROLLED_EQNS`
equations unrolled stays one opaque equation (planned replicated, with a warning).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from autoshard.ir.primitives import FUSED_ATTENTION_CALLS
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


# Named jits kept as one equation (their bodies differ by backend: cuDNN's kernels on a
# GPU, XLA's ops elsewhere), recorded under the op graph's name for them.
# A named jit read as the fused operator only with the operator's operands (forward q, k,
# v; backward q, k, v, out, lse, d_out: models/attention.py): under a scan's partial
# evaluation JAX can split one into a part with other operands (the causal mask, made from
# nothing), which is then inlined as its operations, with a warning.
_FUSED_OPERANDS = {"attention_fwd": 3, "attention_bwd": 6}


def _fused_call(eqn) -> str | None:
    if eqn.primitive.name not in ("jit", "pjit"):
        return None
    called = FUSED_ATTENTION_CALLS.get(str(eqn.params.get("name", "")))
    if called is None:
        return None
    kind = called[0]
    q_shape = tuple(getattr(eqn.invars[0].aval, "shape", ())) if eqn.invars else ()
    if len(eqn.invars) != _FUSED_OPERANDS[kind] or len(q_shape) != 4:
        warnings.warn(
            f"the fused attention {eqn.params.get('name')!r} reached the tracer split by JAX "
            f"({len(eqn.invars)} operands, not {_FUSED_OPERANDS[kind]}: a scan's partial "
            "evaluation does this); planned as its operations, not as one fused operator",
            stacklevel=2,
        )
        return None
    return kind + ("_causal" if called[1] else "")


# A scan whose unrolled body would exceed this many equations is left as one equation.
MAX_UNROLLED_EQNS = 200_000


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
    # a stacked tensor made by unrolling a scan -> its per-iteration slices
    stacked: dict[int, list[int]] = field(default_factory=dict)
    # indices into ``eqns`` of the equations that rebuild stacks (dropped if unread)
    stacking: set[int] = field(default_factory=set)
    # modules run by an unrolled scan (their iterations are tagged ``name_i``)
    scanned: set[str] = field(default_factory=set)

    def new_tensor(self, aval, kind: str, path: str = "", literal=None) -> int:
        tid = len(self.tensors)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = np.dtype(getattr(aval, "dtype", np.float32)).name
        self.tensors.append(TensorRecord(tid, shape, dtype, kind, path, literal))
        return tid

    def read(self, env: dict, atom) -> int:
        if isinstance(atom, jcore.Literal):
            value = np.asarray(atom.val)
            scalar = value.item() if value.ndim == 0 else None
            tid = self.new_tensor(atom.aval, "literal", literal=scalar)
            self.consts[tid] = atom.val
            return tid
        return env[atom]

    def flatten(
        self,
        jaxpr: jcore.Jaxpr,
        consts: Sequence,
        in_ids: Sequence[int],
        stack: str,
        iteration: int | None = None,
    ) -> list[int]:
        """Inline ``jaxpr`` reading ``in_ids``; returns its outputs' tensor ids.
        ``iteration``: the body of a scan being unrolled, whose name stacks get the
        iteration number on their first module (``blocks/fc`` -> ``blocks_3/fc``)."""
        env: dict = {}
        for var, value in zip(jaxpr.constvars, consts):
            tid = self.new_tensor(var.aval, "const")
            self.consts[tid] = value
            env[var] = tid
        env.update(zip(jaxpr.invars, in_ids))
        for eqn in jaxpr.eqns:
            inner_stack = str(eqn.source_info.name_stack)
            if iteration is not None:
                inner_stack = _iteration_stack(inner_stack, iteration)
            full_stack = "/".join(s for s in (stack, inner_stack) if s)
            in_ids_e = [self.read(env, v) for v in eqn.invars]
            body_key = _INLINE_BODY.get(eqn.primitive.name)
            fused = _fused_call(eqn)
            if fused is not None:  # one operator, whatever its body (models/attention.py)
                out_ids = [self.new_tensor(v.aval, "intermediate") for v in eqn.outvars]
                params = eqn.primitive.get_bind_params(eqn.params)
                if isinstance(params, tuple):
                    params = params[1]
                self.eqns.append(
                    (fused, tuple(in_ids_e), tuple(out_ids), eqn.primitive, params, full_stack)
                )
            elif eqn.primitive.name == "scan" and _unrollable(eqn):
                out_ids = self.unroll_scan(eqn, in_ids_e, full_stack)
            elif body_key is not None and body_key in eqn.params:
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

    def emit(self, fn: Callable, in_ids: Sequence[int], stack: str) -> list[int]:
        """Inline the equations JAX makes for ``fn`` on the tensors ``in_ids``."""
        avals = [
            jax.ShapeDtypeStruct(self.tensors[t].shape, np.dtype(self.tensors[t].dtype))
            for t in in_ids
        ]
        closed = jax.make_jaxpr(fn)(*avals)
        return self.flatten(closed.jaxpr, closed.consts, in_ids, stack)

    def iteration_slice(self, tid: int, i: int, stack: str) -> int:
        """Slice ``i`` of the stacked tensor ``tid`` along dim 0, made where iteration ``i``
        reads it (``slice`` and ``squeeze``): a short-lived buffer, as XLA's loop makes it
        -- the slices of a stack the unrolling itself built are passed through instead."""
        if tid in self.stacked:
            return self.stacked[tid][i]

        t = self.tensors[tid]
        closed = _slice_jaxpr(t.shape, t.dtype, i)
        return self.flatten(closed.jaxpr, closed.consts, [tid], stack)[0]

    def unroll_scan(self, eqn, in_ids: list[int], stack: str) -> list[int]:
        """Inline every iteration of a ``scan`` equation; returns its outputs' ids."""
        p = eqn.params
        body, length = p["jaxpr"], int(p["length"])
        n_consts, n_carry = _scan_counts(p)
        consts, carry = in_ids[:n_consts], in_ids[n_consts : n_consts + n_carry]
        xs = in_ids[n_consts + n_carry :]
        first = _body_module(body.jaxpr)
        if first:
            self.scanned.add(first)
        stacks = [
            "/".join(s for s in (stack, f"{first}_{i}" if first else "") if s)
            for i in range(length)
        ]
        ys_avals = [v.aval for v in eqn.outvars[n_carry:]]
        ys_slices: list[list[int]] = [[0] * length for _ in ys_avals]
        order = reversed(range(length)) if p["reverse"] else range(length)
        for i in order:
            outs = self.flatten(
                body.jaxpr,
                body.consts,
                [*consts, *carry, *(self.iteration_slice(t, i, stacks[i]) for t in xs)],
                stack,
                iteration=i,
            )
            carry = outs[:n_carry]
            for k, y in enumerate(outs[n_carry:]):
                ys_slices[k][i] = y
        ys = []
        for parts in ys_slices:
            start = len(self.eqns)
            (stacked,) = self.emit(_stack, parts, stack)
            self.stacking.update(range(start, len(self.eqns)))
            self.stacked[stacked] = list(parts)
            ys.append(stacked)
        return [*carry, *ys]

    def drop_unread_stacks(self, out_ids: Sequence[int]) -> None:
        """Drop the stack-rebuilding equations whose results nothing reads."""
        while self.stacking:
            read = set(out_ids)
            for _, ins, _, _, _, _ in self.eqns:
                read.update(ins)
            dead = {i for i in self.stacking if not any(t in read for t in self.eqns[i][2])}
            if not dead:
                break
            self.eqns = [e for i, e in enumerate(self.eqns) if i not in dead]
            # indices shift: recompute the stacking set on the new list
            kept = sorted(self.stacking - dead)
            shift = sorted(dead)
            self.stacking = {i - sum(1 for d in shift if d < i) for i in kept}


@functools.lru_cache(maxsize=4096)
def _slice_jaxpr(shape: tuple[int, ...], dtype: str, i: int):
    """The jaxpr of ``x[i]`` as ``slice`` + ``squeeze`` (traced once per shape and index:
    an unrolled scan reads every stacked input once per iteration, forward and backward)."""

    def take(x):
        return jax.lax.squeeze(jax.lax.slice_in_dim(x, i, i + 1, axis=0), (0,))

    return jax.make_jaxpr(take)(jax.ShapeDtypeStruct(shape, np.dtype(dtype)))


def _stack(*ys):
    """Stack along a new dim 0 with ``reshape`` and ``concatenate`` (primitives the planner
    has rules for)."""
    return jax.lax.concatenate([jax.lax.reshape(y, (1, *y.shape)) for y in ys], 0)


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


def _scan_counts(params: dict) -> tuple[int, int]:
    """How many of a ``scan`` equation's operands are loop constants and how many the
    carry (the rest are the scanned ``xs``).  jax 0.10 gives them as ``num_consts`` and
    ``num_carry``; jax 0.11 and 0.12 group the operands in a flat tree ``ft_in`` =
    (consts, carry, xs) instead, whose groups' lengths are the counts."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _unrollable(eqn) -> bool:
    """A scan whose unrolled body stays under :data:`MAX_UNROLLED_EQNS` equations."""
    length = int(eqn.params.get("length", 0))
    body = eqn.params.get("jaxpr")
    if length <= 0 or body is None:
        return False
    return length * max(1, _count_eqns(body.jaxpr)) <= MAX_UNROLLED_EQNS


def _count_eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        inner = [v for v in e.params.values() if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]
        n += sum(_count_eqns(getattr(b, "jaxpr", b)) for b in inner) or 1
    return n


def _body_module(jaxpr) -> str | None:
    """The module a scan body runs in: the first part of its equations' name stacks
    (``blocks`` for an ``nn.scan`` named ``blocks``), or None outside a module."""
    for e in jaxpr.eqns:
        parts = _module_path(str(e.source_info.name_stack))
        if parts:
            return parts[0]
    return None


def _iteration_stack(stack: str, i: int) -> str:
    """``blocks/attn`` in iteration 3 -> ``blocks_3/attn`` (wrappers such as ``jvp(`` kept)."""
    if not stack:
        return stack
    head, _, rest = stack.partition("/")
    m = re.match(r"^((?:[\w.]+\()*)([^()]*)(\)*)$", head)
    if m is None or not m.group(2):
        return stack
    head = f"{m.group(1)}{m.group(2)}_{i}{m.group(3)}"
    return f"{head}/{rest}" if rest else head


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
