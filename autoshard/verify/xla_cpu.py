"""XLA:CPU's habits, undone: compiled collectives normalised to what a plan predicts.

Normalisation (``normalize=True`` in :func:`~autoshard.verify.collectives.parse_collectives`)
undoes two XLA:CPU habits, each recorded in ``note``:

* GSPMD on CPU lowers partial -> sharded as an all-reduce whose every use is a
  dynamic-slice keeping 1/n of one dimension (n = group size).  That becomes a
  reduce-scatter with the all-reduce's input bytes, provided every use keeps the same
  block (an all-reduce read sliced one way by one use and another way by another is
  needed whole: it stays, with a note) and every device's slice starts at its rank's
  block: the start indices are evaluated for every partition/replica id by
  a small interpreter of integer index expressions (:mod:`autoshard.verify.index_eval`:
  partition-id, constants and constant tables, arithmetic, compare/select/clamp,
  dynamic-slice of a table, ...), followed across fusion parameters and loop-invariant
  while-loop tuple elements.  Where the interpreter meets an op it does not know, the
  note names it and the older check applies: offsets must come from the partition id and
  any per-device constant table must hold the group ranks (or rank * slice size).
  Otherwise the all-reduce stays, with a note; slices of 1/m (m > n) that only use a
  window of the reduced buffer also stay all-reduces (XLA really reduces the whole
  buffer), with a note giving the windows' bases.  (``psum_scatter`` under ``shard_map``
  does emit a real reduce-scatter on CPU.)
* CPU upcasts bf16/f16 dots and their all-reduces to f32.  An f32 all-reduce whose
  operand is a convert from the narrow type, or whose every use converts back to it and
  whose operand is made from narrow inputs (a bf16 dot computed in f32), is reported with
  the narrow type's bytes.  An f32 value the program makes itself from f32 inputs (an
  embedding gathered from an f32 table, then cast to bf16) keeps its f32 bytes.

What no plan can predict, left as XLA compiled it (never normalised away):

* sub-axis collectives: XLA (Shardy) may split a mesh axis and exchange over part of it,
  e.g. an all-to-all over pairs ``{0,1},{2,3},...`` of a 4-device ``model`` axis on a
  2x4 mesh (``{'axis_0':(2)2}`` in the mesh form).  Specs name whole mesh axes, so such a
  group is reported with axes ``("?",)`` and a note (gpt-tiny zero3 on 2x4);
* a reduction kept as an all-reduce whose users slice 1/m (m > group size) windows of it:
  XLA reduced the whole buffer where a reduce-scatter would do; the note gives the
  windows (gpt-tiny zero3 on 2x4: bias gradients of 192 kept 24 per device).

Jax-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autoshard.ir.spec import Collective
from autoshard.verify.hlo import (
    _HLO_DTYPES,
    CompiledCollective,
    _attr,
    _called,
    _Instr,
    _ints,
    _leaves,
    _Module,
)
from autoshard.verify.index_eval import _NotEvaluable, _slice_offsets
from autoshard.verify.replica_groups import UNKNOWN_AXES

_NARROW_FLOATS = ("bf16", "f16")
_PASS_THROUGH = {
    "bitcast",
    "copy",
    "reshape",
    "all-reduce-done",
    "all-gather-done",
    "all-to-all-done",
    "reduce-scatter-done",
    "async-done",
    "optimization-barrier",
}
_ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "tanh",
    "exponential", "log", "sqrt", "rsqrt", "logistic", "select", "clamp", "power", "convert",
}  # fmt: skip


@dataclass(frozen=True)
class _Path:
    slice_dims: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    slicer: str | None = None
    narrow: str | None = None


def _use_paths(
    mod: _Module, name: str, index: int | None, path: _Path, seen: set | None = None
) -> list[_Path]:
    """Follow the uses of value ``name`` (tuple element ``index``) to where they end."""
    seen = set() if seen is None else seen
    if (name, index, path) in seen:
        return []
    seen.add((name, index, path))
    ins = mod.instrs[name]
    users = mod.users.get(name, [])
    if not users:  # the root of a fused or called computation: continue at its caller
        callers = mod.callers(ins.computation) if mod.roots.get(ins.computation) == name else []
        if len(callers) == 1 and mod.instrs[callers[0]].opcode in ("fusion", "call"):
            return _use_paths(mod, callers[0], index, path, seen)
        return [path]
    out = []
    for uname, k in users:
        u = mod.instrs[uname]
        u_dtype, u_dims = _leaves(u.shape)[0] if _leaves(u.shape) else ("token", ())
        if u.opcode == "get-tuple-element":
            # index None: every element of a tuple-shaped value (an all-to-all's parts)
            if index is None or int(_attr(u.attrs, "index")) == index:
                out += _use_paths(mod, uname, None, path, seen)
        elif u.opcode in _PASS_THROUGH:
            out += _use_paths(mod, uname, index, path, seen)
        elif index is not None:
            out.append(path)
        elif u.opcode in ("fusion", "call"):
            called = _called(u.attrs, "calls|to_apply")
            param = mod.params(called[0]).get(k) if called else None
            out += [path] if param is None else _use_paths(mod, param, None, path, seen)
        elif u.opcode == "dynamic-slice" and k == 0 and path.slice_dims is None:
            dims = (_leaves(ins.shape)[0][1], u_dims)
            out += _use_paths(mod, uname, None, replace(path, slice_dims=dims, slicer=uname), seen)
        elif u.opcode == "convert" and u_dtype in _NARROW_FLOATS and path.narrow is None:
            out += _use_paths(mod, uname, None, replace(path, narrow=u_dtype), seen)
        elif u.opcode in _ELEMENTWISE and u_dims == _leaves(ins.shape)[0][1]:
            out += _use_paths(mod, uname, None, path, seen)
        else:
            out.append(path)
    return out


def _is_shard_slice(dims, n: int) -> bool:
    full, part = dims
    diff = [i for i, (a, b) in enumerate(zip(full, part, strict=True)) if a != b]
    return len(full) == len(part) and len(diff) == 1 and part[diff[0]] * n == full[diff[0]]


def _sources(mod: _Module, names: Sequence[str]) -> list[_Instr]:
    """The constants and partition/replica ids that values ``names`` are computed from.

    Walks operands backwards, out of fused and called computations through their
    parameters, and through while-loop tuples element by element.
    """
    todo, seen, out = list(names), set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        ins = mod.instrs[name]
        if ins.opcode in ("constant", "partition-id", "replica-id"):
            out.append(ins)
        elif ins.opcode == "parameter":
            for caller in map(mod.instrs.get, mod.callers(ins.computation)):
                if caller.opcode in ("fusion", "call"):
                    todo.append(caller.operands[int(ins.operand_text)])
        elif ins.opcode == "get-tuple-element":
            todo += _tuple_element(mod, ins.operands[0], int(_attr(ins.attrs, "index")))
        else:
            todo += ins.operands
    return out


def _tuple_element(mod: _Module, name: str, index: int) -> list[str]:
    """Where element ``index`` of tuple value ``name`` comes from (while loops included)."""
    ins = mod.instrs[name]
    if ins.opcode == "tuple":
        return [ins.operands[index]]
    if ins.opcode == "parameter":  # a loop-carried value: its initial value and its update
        out = []
        for loop in map(mod.instrs.get, mod.callers(ins.computation)):
            if loop.opcode == "while":
                out += _tuple_element(mod, loop.operands[0], index)
                body = _called(loop.attrs, "body")[0]
                out += _tuple_element(mod, mod.roots[body], index)
        return out
    return [name]


def _upcast_source(mod: _Module, name: str) -> str | None:
    """The narrow float type ``name`` was converted from, if it is such a convert."""
    ins = mod.instrs[name]
    while ins.opcode in ("fusion", "bitcast", "copy"):
        if ins.opcode == "fusion":
            called = _called(ins.attrs, "calls")
            ins = mod.instrs[mod.roots[called[0]]] if called and called[0] in mod.roots else None
        else:
            ins = mod.instrs[ins.operands[0]]
        if ins is None:
            return None
    if ins.opcode == "convert":
        src = _leaves(mod.instrs[ins.operands[0]].shape)[0][0]
        return src if src in _NARROW_FLOATS else None
    return None


def _narrow_inputs(mod: _Module, name: str) -> str | None:
    """The narrow float type that the op making ``name`` (past bitcasts and copies) reads,
    directly or through a convert up from it: XLA:CPU computes such an op (a bf16 dot) in
    f32 and all-reduces the f32 result. None where it reads no narrow float (a gather
    from an f32 table, an f32 dot): that f32 value is the program's own."""
    ins = mod.instrs[name]
    while ins.opcode in ("bitcast", "copy"):
        ins = mod.instrs[ins.operands[0]]
    found = set()
    for o in ins.operands:
        if o not in mod.instrs:
            continue
        dtype = (_leaves(mod.instrs[o].shape) or [("", ())])[0][0]
        low = dtype if dtype in _NARROW_FLOATS else _upcast_source(mod, o)
        if low:
            found.add(low)
    return found.pop() if len(found) == 1 else None


def _table_check(mod: _Module, groups, paths: Sequence[_Path], stopped: str) -> str:
    """The fallback when offsets cannot be evaluated: look for a per-device table of group
    ranks (or of rank * slice size) among the constants the offsets are computed from."""
    rank = {i: r for g in groups for r, i in enumerate(g)}
    sizes = {1} | {p.slice_dims[1][_sliced_dim(p.slice_dims)] for p in paths}
    expected = [[rank[i] * s for i in range(len(rank))] for s in sizes]
    offsets = [o for p in paths for o in mod.instrs[p.slicer].operands[1:]]
    sources = _sources(mod, offsets)
    why = f" (offset evaluation stopped at {stopped})"
    if not any(src.opcode in ("partition-id", "replica-id") for src in sources):
        return "all-reduce + dynamic-slice kept: slice offsets do not depend on the device" + why
    tables = [
        _ints(src.operand_text)
        for src in sources
        if src.opcode == "constant" and re.fullmatch(rf"[su]\d+\[{len(rank)}\].*", src.shape)
    ]
    if tables and not any(e in tables for e in expected):
        return (
            "all-reduce + dynamic-slice kept: slice offsets are not the device's group rank" + why
        )
    checked = "offsets checked" if tables else "offsets depend on the device, not checked"
    return f"all-reduce + dynamic-slice normalised to reduce-scatter ({checked}){why}"


def _reduce_scatter_check(mod: _Module, groups, paths: Sequence[_Path]) -> str:
    """Note saying whether the dynamic-slices take each device's own 1/n shard.

    The slice offsets are evaluated for every logical id; device ``i`` must start at
    ``rank(i) * size`` along the sliced dimension (its rank's block of the reduced buffer)
    and at 0 along the others.  Offsets that cannot be evaluated fall back to
    :func:`_table_check`.
    """
    rank = {i: r for g in groups for r, i in enumerate(g)}
    for path in paths:
        full, part = path.slice_dims
        dim = next(d for d, (a, b) in enumerate(zip(full, part, strict=True)) if a != b)
        try:
            offsets = _slice_offsets(mod, path.slicer)
        except _NotEvaluable as err:
            return _table_check(mod, groups, paths, str(err))
        if len(set(offsets[:, dim].tolist())) == 1:
            return "all-reduce + dynamic-slice kept: slice offsets do not depend on the device"
        for i in range(len(offsets)):
            if offsets[i, dim] != rank[i] * part[dim]:
                return (
                    "all-reduce + dynamic-slice kept: slice offsets are not the device's group "
                    f"rank (id {i} starts at {int(offsets[i, dim])} along dim {dim}, its rank "
                    f"{rank[i]}'s block at {rank[i] * part[dim]})"
                )
    return (
        "all-reduce + dynamic-slice normalised to reduce-scatter "
        f"(offsets checked on all {len(rank)} devices)"
    )


def _shard_of(dims) -> tuple[int, int, int]:
    """The elements a 1/n slice keeps, shape-free: (elements before its dim, the dim's size,
    elements after it) of the row-major buffer; two uses through different bitcasts that
    keep the same block give the same triple."""
    full, _ = dims
    d = _sliced_dim(dims)
    return math.prod(full[:d]), full[d], math.prod(full[d + 1 :])


def _sliced_dim(dims) -> int | None:
    """The one dimension a dynamic-slice shortens (None if it shortens none or several)."""
    full, part = dims
    diff = [i for i, (a, b) in enumerate(zip(full, part, strict=True)) if a != b]
    return diff[0] if len(full) == len(part) and len(diff) == 1 else None


def _window_note(mod: _Module, groups, paths: Sequence[_Path]) -> str:
    """Why an all-reduce whose slices are not 1/n of the buffer stays an all-reduce.

    A common GSPMD shape: each device keeps 1/m of the buffer (m > n), and a group's n
    slices are its ranks' blocks of a window at a group-dependent base, so only n/m of the
    reduced buffer is used.  That is said, with the bases, but not normalised: the
    compiled all-reduce really reduces the whole buffer.
    """
    n = len(groups[0])
    full, part = paths[0].slice_dims
    dim = _sliced_dim(paths[0].slice_dims)
    kept = (
        "all-reduce + dynamic-slice kept: each device keeps "
        f"{part[dim]} of {full[dim]} along dim {dim}, not 1/{n}"
    )
    try:
        offsets = [_slice_offsets(mod, p.slicer)[:, _sliced_dim(p.slice_dims)] for p in paths]
    except _NotEvaluable:
        return kept
    bases = set()
    for off, p in zip(offsets, paths, strict=True):
        size = p.slice_dims[1][_sliced_dim(p.slice_dims)]
        for g in groups:
            base = {int(off[i]) - r * size for r, i in enumerate(g)}
            if len(base) != 1:
                return kept
            bases |= base
    window = f"{n} * {part[dim]}" if len(paths) == 1 else f"{n} blocks"
    return kept + (
        f"; each group uses only its ranks' blocks of a window of {window} at bases "
        f"{sorted(bases)} (a reduce-scatter of that window would do)"
    )


def _normalise(
    mod: _Module, cc: CompiledCollective, ins: _Instr, index, groups
) -> CompiledCollective:
    c = cc.collective
    if c.axes == UNKNOWN_AXES:
        return cc
    if c.kind in ("all-gather", "all-to-all"):
        return _normalise_upcast(mod, cc, ins, index)
    if c.kind != "all-reduce":
        return cc
    notes = [cc.note] if cc.note else []
    piece = index if hasattr(index, "operand") else None  # a part of a concatenation
    if piece is not None:
        paths, index = _piece_paths(mod, ins.name, piece), None
    else:
        paths = _use_paths(mod, ins.name, index, _Path())
    kind, dtype, nbytes = c.kind, cc.dtype, c.bytes
    n = len(groups[0])
    shards = (
        n > 1 and paths and all(p.slice_dims and _is_shard_slice(p.slice_dims, n) for p in paths)
    )
    if shards and len({_shard_of(p.slice_dims) for p in paths}) > 1:
        # each use keeps 1/n, but not the same 1/n (the whole buffer is read): no reduce-scatter
        dims = sorted({_sliced_dim(p.slice_dims) for p in paths})
        notes.append(
            "all-reduce + dynamic-slice kept: its uses keep 1/n of different dims "
            f"({', '.join(str(d) for d in dims)})"
        )
    elif shards:
        notes.append(_reduce_scatter_check(mod, groups, paths))
        if "normalised" in notes[-1]:
            kind = "reduce-scatter"
    elif (
        n > 1
        and paths
        and all(p.slice_dims and _sliced_dim(p.slice_dims) is not None for p in paths)
    ):
        notes.append(_window_note(mod, groups, paths))
    operand = piece.operand if piece is not None else ins.operands[index or 0]
    source = _upcast_source(mod, operand)
    narrow = {p.narrow for p in paths}
    if len(narrow) != 1 or None in narrow or narrow != {_narrow_inputs(mod, operand)}:
        narrow = set()  # the program's own f32 value, cast down after: f32 bytes move
    if cc.dtype == "float32" and (source or narrow):
        low = source or narrow.pop()
        dtype = _HLO_DTYPES[low][0]
        nbytes = c.bytes * _HLO_DTYPES[low][1] // 32
        notes.append(f"{low} upcast to f32 normalised")
    return replace(
        cc, collective=Collective(kind, c.axes, nbytes), dtype=dtype, note="; ".join(notes)
    )


def _piece_paths(mod: _Module, name: str, piece, seen: set | None = None) -> list[_Path]:
    """Where piece ``piece`` (elements ``[start, stop)``) of the concatenated all-reduce
    ``name`` is used: the uses of each static slice that takes exactly that range (a
    ``slice`` or a loop fusion whose root slices its parameter), past the ``-done`` half
    and bitcasts. Slices of other pieces are not its uses; any other use of the whole
    buffer ends a path unsliced (the piece then stays an all-reduce)."""
    seen = set() if seen is None else seen
    out = []
    for uname, _ in mod.users.get(name, []):
        if uname in seen:
            continue
        seen.add(uname)
        u = mod.instrs[uname]
        if u.opcode in _PASS_THROUGH:
            out += _piece_paths(mod, uname, piece, seen)
            continue
        taken = _static_slice(mod, u)
        if taken is None:
            out.append(_Path())
        elif taken == (piece.start, piece.stop):
            out += _use_paths(mod, uname, None, _Path())
    return out


def _static_slice(mod: _Module, ins: _Instr) -> tuple[int, int] | None:
    """``(start, stop)`` of a 1-D ``slice`` with stride 1, or of a fusion whose root is one
    taken of its only parameter; None for anything else."""
    if ins.opcode == "fusion" and len(ins.operands) == 1:
        called = _called(ins.attrs, "calls")
        root = mod.instrs.get(mod.roots.get(called[0], "")) if called else None
        if root is None or root.operands != tuple(mod.params(called[0]).values()):
            return None
        ins = root
    if ins.opcode != "slice":
        return None
    m = re.fullmatch(r"\{\[(\d+):(\d+)(?::1)?\]\}", _attr(ins.attrs, "slice") or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _normalise_upcast(
    mod: _Module, cc: CompiledCollective, ins: _Instr, index
) -> CompiledCollective:
    """XLA:CPU moves some bf16/f16 values through all-gathers and all-to-alls as f32: the
    operand is converted up from the narrow type, and either every use converts the result
    back down, or every use is a dot (XLA:CPU computes narrow dots in f32 and hoists the
    operand's convert above the data movement). Count the bytes of the narrow type then.
    An operand the program itself converts up is used as f32 elsewhere: it keeps its bytes."""
    operands = ins.operands if index is None else [ins.operands[index]]
    sources = {_upcast_source(mod, o) for o in operands}
    source = sources.pop() if len(sources) == 1 else None
    if cc.dtype != "float32" or source is None:
        return cc
    narrow = {p.narrow for p in _use_paths(mod, ins.name, index, _Path())}
    if narrow != {source} and not _feeds_only_dots(mod, ins.name, index):
        return cc
    c = cc.collective
    note = "; ".join(n for n in (cc.note, f"{source} upcast to f32 normalised") if n)
    nbytes = c.bytes * _HLO_DTYPES[source][1] // 32
    return replace(
        cc,
        collective=Collective(c.kind, c.axes, nbytes),
        dtype=_HLO_DTYPES[source][0],
        note=note,
    )


_LAYOUT_ONLY = frozenset(
    {"parameter", "bitcast", "copy", "transpose", "reshape", "concatenate", "convert"}
)


def _feeds_only_dots(mod: _Module, name: str, index: int | None, depth: int = 0) -> bool:
    """Does every use of ``name`` (tuple element ``index``) reach a dot through layout
    changes only (tuple elements, bitcasts, copies, transposes, layout-only loop fusions)?"""
    users = mod.users.get(name, [])
    if not users or depth > 8:
        return False
    for uname, _ in users:
        u = mod.instrs[uname]
        if u.opcode == "get-tuple-element":
            if index is not None and int(_attr(u.attrs, "index")) != index:
                continue
            ok = _feeds_only_dots(mod, uname, None, depth + 1)
        elif u.opcode in _PASS_THROUGH:
            ok = _feeds_only_dots(mod, uname, index, depth + 1)
        elif u.opcode == "dot" or (u.opcode == "fusion" and "kind=kCustom" in u.attrs):
            ok = True
        elif u.opcode == "fusion" and "kind=kLoop" in u.attrs:
            called = _called(u.attrs, "calls")
            body = mod.computations.get(called[0], []) if called else []
            ok = bool(body) and all(mod.instrs[i].opcode in _LAYOUT_ONLY for i in body)
            ok = ok and _feeds_only_dots(mod, uname, None, depth + 1)
        else:
            ok = False
        if not ok:
            return False
    return True
