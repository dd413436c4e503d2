"""A closed jaxpr inlined into one flat list of equations (the tracer's inner loop).

Used by :func:`autoshard.trace.jaxpr.trace`: :class:`Flattener` walks a jaxpr, inlines the
bodies of call-like equations (``jit``, ``closed_call``, ``custom_jvp_call``, ``remat2``
...), keeps the fused attention's named jits whole, and unrolls every ``scan`` whose
unrolled body stays under :data:`MAX_UNROLLED_EQNS` equations (iteration ``i`` tagged
``<scanned module>_i``; stacked inputs sliced where each iteration reads them; stacked
outputs rebuilt only where read).  It records tensors as
:class:`~autoshard.ir.records.TensorRecord` and equations as plain tuples, which
:mod:`autoshard.trace.jaxpr` tags by layer and phase.
"""

from __future__ import annotations

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
from autoshard.ir.records import TensorRecord

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


def _recompute_behind_barrier(eqn) -> bool:
    """Whether ``eqn`` is a backward pass's recompute of a ``jax.checkpoint`` body
    (``differentiated``) that must not be merged with the forward values it recomputes
    (``prevent_cse``, the default): JAX lowers it with its operands behind an
    ``optimization_barrier``, so XLA's CSE cannot see that the recompute repeats the
    forward. Inlined without one, XLA merged the fused GELU's recomputed ``tanh`` into the
    forward's and kept it from the forward to the backward: 3.22 GB more temp than the
    plain step on gpt-1.3b (H100) and on gpt-350m (XLA:CPU), docs/fused.md."""
    return (
        eqn.primitive.name in ("remat2", "checkpoint")
        and bool(eqn.params.get("prevent_cse", False))
        and bool(eqn.params.get("differentiated", False))
    )


# A scan whose unrolled body would exceed this many equations is left as one equation.
MAX_UNROLLED_EQNS = 200_000


_WRAPPER = re.compile(r"^(?:[\w.]+\()+|\)+$")


def module_path(name_stack: str) -> tuple[str, ...]:
    """``transpose(jvp(GPT))/block_1/attn`` -> ``("GPT", "block_1", "attn")``."""
    parts = []
    for part in name_stack.split("/"):
        part = _WRAPPER.sub("", part)
        if part:
            parts.append(part)
    return tuple(parts)


@dataclass
class Flattener:
    """The flat program being built: its tensors, its equations (name, operand ids, result
    ids, primitive, bind params, name stack) and the constants it read; :meth:`flatten`
    inlines a jaxpr into it."""

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
                if _recompute_behind_barrier(eqn):
                    in_ids_e = self.behind_barriers(in_ids_e, full_stack)
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

    def behind_barriers(self, in_ids: Sequence[int], stack: str) -> list[int]:
        """``in_ids`` each through an ``optimization_barrier`` of its own (literals and
        constants as they are): what :func:`_recompute_behind_barrier`'s body reads."""
        return [
            tid
            if self.tensors[tid].kind in ("literal", "const")
            else self.emit(jax.lax.optimization_barrier, [tid], stack)[0]
            for tid in in_ids
        ]

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
        parts = module_path(str(e.source_info.name_stack))
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
