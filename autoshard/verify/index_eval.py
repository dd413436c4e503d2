"""Integer index expressions of an HLO module, evaluated for every device at once.

:func:`_slice_offsets` gives the start offsets a dynamic-slice takes on every logical id
(``replica * num_partitions + partition``), by a small interpreter of integer index
expressions (:class:`_IndexEvaluator`): partition-id and replica-id, constants and
constant tables, iota, arithmetic, compare/select/clamp, slices and dynamic-slices of a
table, followed across fusion parameters and loop-invariant while-loop tuple elements.
Anything else raises :class:`_NotEvaluable` naming the instruction, so that the caller
(:mod:`autoshard.verify.xla_cpu`) can say where evaluation stopped.  Jax-free.
"""

from __future__ import annotations

import math
import re

import numpy as np

from autoshard.verify.hlo import _HLO_DTYPES, _attr, _called, _Instr, _ints, _leaves, _Module


class _NotEvaluable(Exception):
    """An index expression uses something the evaluator does not interpret."""


_INT_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "minimum": np.minimum,
    "maximum": np.maximum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "remainder": np.fmod,  # C's remainder: the sign of the dividend, as HLO's
}  # fmt: skip
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}  # fmt: skip
_MAX_INDEX_ELEMENTS = 1 << 22  # over all ids; index tables are small, tensors are not


class _IndexEvaluator:
    """Integer index expressions of an HLO module, evaluated for every logical id at once.

    A value is an int64 array of shape ``(num_ids, *dims)``: row ``i`` is what logical id
    ``i`` (``replica * num_partitions + partition``) computes.  ``ctx`` is the stack of
    fusion/call instructions entered from their outputs, so that a parameter reads the
    operand of the caller it was entered through; with an empty stack a parameter reads
    its computation's callers (which must agree).  Anything else raises
    :class:`_NotEvaluable` naming the instruction.
    """

    def __init__(self, mod: _Module):
        self.mod = mod
        self.num_ids = mod.replica_count * mod.num_partitions
        self.memo: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}

    def fail(self, ins: _Instr, why: str = "not interpreted") -> _NotEvaluable:
        return _NotEvaluable(f"%{ins.name} ({ins.opcode}): {why}")

    def value(self, name: str, ctx: tuple[str, ...] = ()) -> np.ndarray:
        key = (name, ctx)
        if key not in self.memo:
            self.memo[key] = self._value(self.mod.instrs[name], ctx)
        return self.memo[key]

    def _value(self, ins: _Instr, ctx: tuple[str, ...]) -> np.ndarray:
        leaves = _leaves(ins.shape)
        if ins.shape.startswith("(") or len(leaves) != 1:
            raise self.fail(ins, "tuple-shaped")
        dtype, dims = leaves[0]
        if not re.fullmatch(r"pred|[su]\d+", dtype):
            raise self.fail(ins, f"{dtype} is not an integer type")
        if self.num_ids * math.prod(dims) > _MAX_INDEX_ELEMENTS:
            raise self.fail(ins, f"{math.prod(dims)} elements per device is not an index table")
        out = self._compute(ins, ctx, dims)
        return _wrap(np.broadcast_to(out, (self.num_ids, *dims)).astype(np.int64), dtype)

    def _compute(self, ins: _Instr, ctx: tuple[str, ...], dims: tuple[int, ...]):
        op, mod = ins.opcode, self.mod
        args = lambda: [self.value(o, ctx) for o in ins.operands]  # noqa: E731
        ids = np.arange(self.num_ids)
        if op == "partition-id":
            return ids % mod.num_partitions
        if op == "replica-id":
            return ids // mod.num_partitions
        if op == "constant":
            text = ins.operand_text.replace("true", "1").replace("false", "0")
            flat = _ints(text)
            if len(flat) != math.prod(dims):
                raise self.fail(ins, "literal size does not match the shape")
            return np.array(flat, dtype=np.int64).reshape(dims)[None]
        if op == "iota":
            axis = int(_attr(ins.attrs, "iota_dimension"))
            shape = [1] * len(dims)
            shape[axis] = dims[axis]
            return np.arange(dims[axis]).reshape(shape)[None]
        if op == "parameter":
            return self._parameter(ins, ctx)
        if op in ("fusion", "call"):
            called = _called(ins.attrs, "calls|to_apply")
            if not called or called[0] not in mod.roots:
                raise self.fail(ins, "called computation not found")
            return self.value(mod.roots[called[0]], (*ctx, ins.name))
        if op == "get-tuple-element":
            name, ectx = self.element(ins.operands[0], int(_attr(ins.attrs, "index")), ctx)
            return self.value(name, ectx)
        if op in ("convert", "bitcast", "reshape", "copy", "bitcast-convert"):
            (x,) = args()
            if (
                op == "bitcast-convert"
                and _leaves(mod.instrs[ins.operands[0]].shape)[0][0][1:]
                != _leaves(ins.shape)[0][0][1:]
            ):
                raise self.fail(ins, "changes the bit width")
            return x.reshape(self.num_ids, *dims)
        if op == "broadcast":
            (x,) = args()
            where = _ints(_attr(ins.attrs, "dimensions") or "{}")
            if where != sorted(where):
                raise self.fail(ins, "transposing broadcast")
            shape = [1] * len(dims)
            for i, d in enumerate(where):
                shape[d] = x.shape[1 + i]
            return x.reshape(self.num_ids, *shape)
        if op in _INT_BINARY:
            a, b = args()
            if op == "remainder" and (b == 0).any():
                raise self.fail(ins, "remainder by zero")
            return _INT_BINARY[op](a, b)
        if op == "divide":
            a, b = args()
            if (b == 0).any():
                raise self.fail(ins, "division by zero")
            return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))  # truncates toward 0
        if op == "negate":
            return -args()[0]
        if op == "compare":
            a, b = args()
            return _COMPARE[_attr(ins.attrs, "direction")](a, b)
        if op in ("select", "clamp"):
            a, b, c = (_like(v, len(dims)) for v in args())
            return np.where(a != 0, b, c) if op == "select" else np.clip(b, a, c)
        if op == "slice":
            (x,) = args()
            spans = re.findall(r"\[(-?\d+):(-?\d+)(?::(\d+))?\]", _attr(ins.attrs, "slice"))
            return x[(slice(None), *(slice(int(a), int(b), int(s or 1)) for a, b, s in spans))]
        if op == "dynamic-slice":
            return self._dynamic_slice(ins, ctx, dims)
        raise self.fail(ins)

    def _parameter(self, ins: _Instr, ctx: tuple[str, ...]) -> np.ndarray:
        number = int(ins.operand_text)
        if ctx:
            return self.value(self.mod.instrs[ctx[-1]].operands[number], ctx[:-1])
        callers = [self.mod.instrs[c] for c in self.mod.callers(ins.computation)]
        values = []
        for caller in callers:
            if caller.opcode in ("fusion", "call"):
                values.append(self.value(caller.operands[number]))
            elif caller.opcode == "while" and self._invariant(caller, None):
                values.append(self.value(caller.operands[0]))
            else:
                raise self.fail(ins, f"parameter of %{caller.name} ({caller.opcode})")
        if not values:
            raise self.fail(ins, "entry parameter")
        if any(not np.array_equal(v, values[0]) for v in values[1:]):
            raise self.fail(ins, "callers pass different values")
        return values[0]

    def _dynamic_slice(self, ins: _Instr, ctx: tuple[str, ...], dims: tuple[int, ...]):
        table, *starts = (self.value(o, ctx) for o in ins.operands)
        starts = _start_indices(starts, table.ndim - 1)
        limit = np.array(table.shape[1:]) - np.array(dims)
        starts = np.clip(starts, 0, limit)  # HLO clamps starts to keep the slice in bounds
        return np.stack(
            [
                table[(i, *(slice(s, s + d) for s, d in zip(starts[i], dims, strict=True)))]
                for i in range(self.num_ids)
            ]
        )

    def element(self, name: str, index: int, ctx: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """Which instruction (and call stack) produces element ``index`` of tuple ``name``."""
        ins = self.mod.instrs[name]
        if ins.opcode == "tuple":
            return ins.operands[index], ctx
        if ins.opcode in ("fusion", "call"):
            called = _called(ins.attrs, "calls|to_apply")
            if called and called[0] in self.mod.roots:
                return self.element(self.mod.roots[called[0]], index, (*ctx, name))
        if ins.opcode == "get-tuple-element":
            inner, ictx = self.element(ins.operands[0], int(_attr(ins.attrs, "index")), ctx)
            return self.element(inner, index, ictx)
        if ins.opcode == "while" and self._invariant(ins, index):
            return self.element(ins.operands[0], index, ctx)
        if ins.opcode == "parameter":
            number = int(ins.operand_text)
            if ctx:
                return self.element(self.mod.instrs[ctx[-1]].operands[number], index, ctx[:-1])
            callers = [self.mod.instrs[c] for c in self.mod.callers(ins.computation)]
            if len(callers) == 1 and callers[0].opcode in ("fusion", "call"):
                return self.element(callers[0].operands[number], index, ())
            if len(callers) == 1 and callers[0].opcode == "while":
                if self._invariant(callers[0], index):
                    return self.element(callers[0].operands[0], index, ())
                raise self.fail(ins, f"element {index} changes in loop %{callers[0].name}")
        raise self.fail(ins, f"cannot follow tuple element {index}")

    def _invariant(self, loop: _Instr, index: int | None) -> bool:
        """Whether the loop body passes tuple element ``index`` (None: the whole state) on."""
        body = _called(loop.attrs, "body")[0]
        name = self.mod.roots[body]
        if index is not None:
            root = self.mod.instrs[name]
            if root.opcode != "tuple":
                return False
            name = root.operands[index]
        ins = self.mod.instrs[name]
        while ins.opcode in ("copy", "bitcast"):
            ins = self.mod.instrs[ins.operands[0]]
        if index is None:
            return ins.opcode == "parameter" and ins.computation == body
        source = self.mod.instrs[ins.operands[0]] if ins.operands else ins
        return (
            ins.opcode == "get-tuple-element"
            and int(_attr(ins.attrs, "index")) == index
            and source.opcode == "parameter"
            and source.computation == body
        )


def _wrap(values: np.ndarray, dtype: str) -> np.ndarray:
    """Integers wrapped into the range of HLO type ``dtype`` (pred: 0 or 1)."""
    if dtype == "pred":
        return (values != 0).astype(np.int64)
    bits = _HLO_DTYPES[dtype][1]
    if bits >= 64:
        return values
    values = np.mod(values, 1 << bits)
    return values - (1 << bits) * (values >= 1 << (bits - 1)) if dtype[0] == "s" else values


def _like(value: np.ndarray, rank: int) -> np.ndarray:
    """A per-id scalar shaped to broadcast against per-id arrays of ``rank`` dims."""
    return value.reshape(value.shape + (1,) * (rank + 1 - value.ndim))


def _start_indices(starts: list[np.ndarray], rank: int) -> np.ndarray:
    """(num ids, rank) start indices from scalar operands or one old-style index vector."""
    if len(starts) == 1 and starts[0].ndim == 2:
        return starts[0]
    if len(starts) != rank or any(s.ndim != 1 for s in starts):
        raise _NotEvaluable(f"dynamic-slice with {len(starts)} start indices for rank {rank}")
    return np.stack(starts, axis=1)


def _slice_offsets(mod: _Module, slicer: str) -> np.ndarray:
    """Clamped start offsets of dynamic-slice ``slicer`` for every logical id."""
    if mod._evaluator is None:
        mod._evaluator = _IndexEvaluator(mod)
    evaluator, ins = mod._evaluator, mod.instrs[slicer]
    full = _leaves(mod.instrs[ins.operands[0]].shape)[0][1]
    part = _leaves(ins.shape)[0][1]
    try:
        starts = _start_indices([evaluator.value(o) for o in ins.operands[1:]], len(full))
    except (KeyError, TypeError, ValueError, IndexError) as err:  # HLO this reader misreads
        raise _NotEvaluable(f"%{slicer}'s offsets: {type(err).__name__}: {err}") from err
    return np.clip(starts, 0, np.array(full) - np.array(part))
