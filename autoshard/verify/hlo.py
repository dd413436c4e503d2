"""What XLA actually compiled: collectives and memory of an executable (jax-free parsing).

Takes the text of ``jax.jit(f).lower(...).compile().as_text()`` plus the logical
:class:`~autoshard.ir.spec.Mesh` it was compiled for, and returns every collective as a
:class:`~autoshard.ir.spec.Collective` (kind, mesh axes, per-device bytes), so that a plan's
predicted collectives can be compared with the compiled ones (:func:`compare_collectives`).

How replica groups become mesh axes.  HLO replica groups hold *logical* ids
(``replica * num_partitions + partition``; "global device ids" in XLA's words), not
``Device.id``: the executable's device assignment maps logical id ``i`` to a device, and
for a jit over one JAX mesh that assignment is the mesh's devices in row-major order
(permuting the devices of a mesh leaves the HLO text unchanged).  A group's mesh axes are
the axes along which its members' mesh coordinates vary; the groups must partition the
devices into exactly the blocks spanned by those axes, otherwise the axes are reported as
``("?",)`` with a note, never guessed.  Forms understood: ``{{0,1},{2,3}}``, ``{}`` (all),
iota lists ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``, and the mesh form
``mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}`` (sub-axes ``'b':(1)2`` too).

Normalisation (``normalize=True``) undoes two XLA:CPU habits, each recorded in ``note``:

* GSPMD on CPU lowers partial -> sharded as an all-reduce whose every use is a
  dynamic-slice keeping 1/n of one dimension (n = group size).  That becomes a
  reduce-scatter with the all-reduce's input bytes, provided every device's slice starts
  at its rank's block: the start indices are evaluated for every partition/replica id by
  a small interpreter of integer index expressions (partition-id, constants and constant
  tables, arithmetic, compare/select/clamp, dynamic-slice of a table, ...), followed across
  fusion parameters and loop-invariant while-loop tuple elements.  Where the interpreter
  meets an op it does not know, the note names it and the older check applies: offsets
  must come from the partition id and any per-device constant table must hold the group
  ranks (or rank * slice size).  Otherwise the all-reduce stays, with a note; slices of
  1/m (m > n) that only use a window of the reduced buffer also stay all-reduces (XLA
  really reduces the whole buffer), with a note giving the windows' bases.
  (``psum_scatter`` under ``shard_map`` does emit a real reduce-scatter on CPU.)
* CPU upcasts bf16/f16 dots and their all-reduces to f32.  An f32 all-reduce whose
  operand is a convert from the narrow type, or whose every use converts back to it, is
  reported with the narrow type's bytes.

What no plan can predict, left as XLA compiled it (never normalised away):

* sub-axis collectives: XLA (Shardy) may split a mesh axis and exchange over part of it,
  e.g. an all-to-all over pairs ``{0,1},{2,3},...`` of a 4-device ``model`` axis on a
  2x4 mesh (``{'axis_0':(2)2}`` in the mesh form).  Specs name whole mesh axes, so such a
  group is reported with axes ``("?",)`` and a note (gpt-tiny zero3 on 2x4);
* a reduction kept as an all-reduce whose users slice 1/m (m > group size) windows of it:
  XLA reduced the whole buffer where a reduce-scatter would do; the note gives the
  windows (gpt-tiny zero3 on 2x4: bias gradients of 192 kept 24 per device).

Counting: each collective instruction is counted once where it is defined (fusions, async
wrappers and called computations included; ``*-done`` halves are skipped).  Tuple-shaped
(combined) all-reduces, all-gathers and reduce-scatters give one record per operand; a
tuple all-to-all is one exchange and gives one record.  Collectives inside while-loop
bodies are counted once and flagged ``in_loop`` (the note gives the known trip count).
``collective-permute`` is not an alpha-beta collective kind in :mod:`autoshard.ir.spec`;
it is reported separately as :class:`CompiledPermute`.

Only :func:`memory_stats` touches a jax object, duck-typed; this module does not import jax.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autoshard.ir.spec import Axes, Collective, Mesh

UNKNOWN_AXES: Axes = ("?",)

# HLO element type -> (numpy-style name, bits).
_HLO_DTYPES = {
    "pred": ("bool", 8), "s4": ("int4", 4), "u4": ("uint4", 4), "s8": ("int8", 8),
    "u8": ("uint8", 8), "s16": ("int16", 16), "u16": ("uint16", 16), "s32": ("int32", 32),
    "u32": ("uint32", 32), "s64": ("int64", 64), "u64": ("uint64", 64),
    "f16": ("float16", 16), "bf16": ("bfloat16", 16), "f32": ("float32", 32),
    "f64": ("float64", 64), "c64": ("complex64", 64), "c128": ("complex128", 128),
    "f8e4m3fn": ("float8_e4m3fn", 8), "f8e5m2": ("float8_e5m2", 8), "token": ("token", 0),
}  # fmt: skip
_NARROW_FLOATS = ("bf16", "f16")
_COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}  # fmt: skip
_PASS_THROUGH = {
    "bitcast",
    "copy",
    "reshape",
    "all-reduce-done",
    "async-done",
    "optimization-barrier",
}
_ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "tanh",
    "exponential", "log", "sqrt", "rsqrt", "logistic", "select", "clamp", "power", "convert",
}  # fmt: skip


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class CompiledCollective:
    """One collective found in compiled HLO, in the spec's :class:`Collective` terms."""

    collective: Collective
    dtype: str
    hlo_name: str
    note: str = ""
    in_loop: bool = False
    hlo_opcode: str = ""


@dataclass(frozen=True)
class CompiledPermute:
    """A collective-permute: point-to-point sends along ``axes`` (not a spec Collective)."""

    hlo_name: str
    axes: Axes
    bytes: int
    dtype: str
    pairs: tuple[tuple[int, int], ...]
    note: str = ""
    in_loop: bool = False


@dataclass(frozen=True)
class HloCollectives:
    """Everything :func:`analyze_collectives` found: normalised, raw and permutes."""

    collectives: tuple[CompiledCollective, ...]
    raw: tuple[CompiledCollective, ...]
    permutes: tuple[CompiledPermute, ...]


# --------------------------------------------------------------------------- HLO text


@dataclass(frozen=True)
class _Instr:
    name: str
    computation: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attrs: str


@dataclass
class _Module:
    instrs: dict[str, _Instr] = field(default_factory=dict)
    computations: dict[str, list[str]] = field(default_factory=dict)
    roots: dict[str, str] = field(default_factory=dict)
    users: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    num_partitions: int = 1
    replica_count: int = 1
    _callers: dict[str, list[str]] | None = None
    _evaluator: _IndexEvaluator | None = None

    def params(self, computation: str) -> dict[int, str]:
        out = {}
        for n in self.computations.get(computation, ()):
            ins = self.instrs[n]
            if ins.opcode == "parameter":
                out[int(ins.operand_text)] = n
        return out

    def callers(self, computation: str) -> list[str]:
        """Instructions that call ``computation`` (fusion, call, while body or condition)."""
        if self._callers is None:
            self._callers = {}
            for i in self.instrs.values():
                for c in _called(i.attrs, "calls|to_apply|body|condition"):
                    self._callers.setdefault(c, []).append(i.name)
        return self._callers.get(computation, [])


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_ARRAY_RE = re.compile(r"([a-z]\w*)\[([^\]]*)\]")


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 80]!r}")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _parse_module(hlo_text: str) -> _Module:
    mod = _Module()
    if m := re.search(r"num_partitions=(\d+)", hlo_text):
        mod.num_partitions = int(m.group(1))
    if m := re.search(r"replica_count=(\d+)", hlo_text):
        mod.replica_count = int(m.group(1))
    comp = None
    for line in hlo_text.splitlines():
        if comp is None:
            if m := _COMP_RE.match(line):
                comp = m.group(2)
                mod.computations[comp] = []
            continue
        if line.strip() == "}":
            comp = None
            continue
        m = _INSTR_RE.match(_COMMENT_RE.sub("", line))  # long lists carry /*index=5*/
        if not m:
            continue
        root, name, rest = m.groups()
        end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        close = _balanced(rest, op.end() - 1)
        operand_text = rest[op.end() : close - 1]
        operands = tuple(t.split()[-1].lstrip("%") for t in _split_top(operand_text) if "%" in t)
        mod.instrs[name] = _Instr(
            name, comp, shape, op.group(1), operands, operand_text, rest[close:]
        )
        mod.computations[comp].append(name)
        if root:
            mod.roots[comp] = name
    for ins in mod.instrs.values():
        for k, o in enumerate(ins.operands):
            mod.users.setdefault(o, []).append((ins.name, k))
    return mod


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(r"(?:^|,\s*)" + re.escape(key) + r"=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs[i] in "{([":
        return attrs[i : _balanced(attrs, i)]
    return re.match(r"[^,\s]*", attrs[i:]).group(0)


def _called(attrs: str, keys: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"(?:^|,\s*)(" + keys + r")=%?([\w.\-]+)", attrs)]


def _leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype not in _HLO_DTYPES:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        out.append((dtype, tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())))
    return out


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    return math.ceil(math.prod(dims) * _HLO_DTYPES[dtype][1] / 8)


# --------------------------------------------------------------------------- replica groups


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm is not None else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _mesh_form_groups(text: str) -> list[list[int]]:
    m = re.match(r"mesh\[(.*?)\](?:,\s*device_ids=\((.*)\))?\s*\{(.*)\}\s*$", text)
    if not m:
        raise ValueError(f"cannot read mesh-form replica groups {text!r}")
    names, sizes = [], []
    for part in _split_top(m.group(1)):
        name, size = part.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    if m.group(2) is None:
        ids = np.arange(n)
    elif it := re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", m.group(2)):
        ids = _iota(_ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None).reshape(-1)
    else:
        flat = _ints(m.group(2))
        ids = np.array(flat[-n:] if len(flat) >= n else flat)
    if ids.size != n:
        raise ValueError(f"mesh-form device_ids in {text!r} hold {ids.size} ids, mesh has {n}")
    # Split every mesh axis into factors at the sub-axis boundaries ('b':(pre)size).
    refs = []
    for part in _split_top(m.group(3)):
        r = re.fullmatch(r"\s*['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?\s*", part)
        if not r or r.group(1) not in names:
            raise ValueError(f"replica-group axis {part!r} is not one of mesh axes {names}")
        axis = names.index(r.group(1))
        pre, size = (int(r.group(2)), int(r.group(3))) if r.group(2) else (1, sizes[axis])
        refs.append((axis, pre, size))
    # Shardy reshapes an axis of size n into [pre, size, n / (pre * size)] for 'b':(pre)size,
    # so cutting every axis at its sub-axis boundaries gives factors, major first.
    cuts = [{1, s} for s in sizes]
    for axis, pre, size in refs:
        cuts[axis] |= {pre, pre * size}
    factors = [
        (axis, lo, hi)
        for axis in range(len(sizes))
        for lo, hi in itertools.pairwise(sorted(cuts[axis]))
    ]
    arr = ids.reshape([hi // lo for _, lo, hi in factors])
    grouped = [
        f
        for axis, pre, size in refs
        for f, (a, lo, _) in enumerate(factors)
        if a == axis and pre <= lo < pre * size
    ]
    rest = [i for i in range(arr.ndim) if i not in grouped]
    size = math.prod(arr.shape[i] for i in grouped)
    return arr.transpose(rest + grouped).reshape(-1, size).tolist()


def parse_replica_groups(text: str, num_ids: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups written in any HLO form -> tuple of ordered id groups.

    ``num_ids`` is the size of the id space, used for ``{}`` (one group of everyone).
    """
    text = text.strip()
    if text.startswith("mesh["):
        groups = _mesh_form_groups(text)
    elif m := re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        shape = _ints(m.group(1))
        arr = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        groups = arr.reshape(shape).tolist()
    elif text.startswith("{"):
        inner = text[1:-1].strip()
        groups = [_ints(g) for g in _split_top(inner)] if inner else [list(range(num_ids))]
    else:
        raise ValueError(
            f"unrecognised replica_groups {text!r}; expected {{{{0,1}},{{2,3}}}}, "
            "[2,4]<=[8], [4,2]<=[2,4]T(1,0) or mesh[...] {...}"
        )
    return tuple(tuple(int(i) for i in g) for g in groups)


def _coords(mesh: Mesh, device_ids: Sequence[int], assignment: Sequence[int]) -> np.ndarray:
    """Mesh coordinates of each logical id, shape (num logical ids, mesh rank)."""
    if len(device_ids) != mesh.num_devices or len(set(device_ids)) != len(device_ids):
        raise ValueError(
            f"device_ids must list the {mesh.num_devices} distinct device ids of mesh {mesh} "
            f"in row-major order, got {list(device_ids)}"
        )
    position = {d: i for i, d in enumerate(device_ids)}
    missing = [d for d in assignment if d not in position]
    if missing:
        raise ValueError(f"device assignment uses devices {missing} that are not on the mesh")
    return np.array([np.unravel_index(position[d], mesh.shape) for d in assignment]).reshape(
        len(assignment), len(mesh.shape)
    )


def replica_group_axes(
    groups: Sequence[Sequence[int]],
    mesh: Mesh,
    device_ids: Sequence[int],
    device_assignment: Sequence[int] | None = None,
) -> Axes | None:
    """The mesh axes (in mesh order) whose blocks of devices are exactly ``groups``, or None.

    ``groups`` hold logical ids; ``device_assignment[i]`` is the device id running logical id
    ``i`` (default: ``device_ids``, the mesh's devices in row-major order, as JAX assigns).
    """
    assignment = device_ids if device_assignment is None else device_assignment
    return _group_axes(groups, mesh, _coords(mesh, device_ids, assignment))


def _group_axes(groups: Sequence[Sequence[int]], mesh: Mesh, coords: np.ndarray) -> Axes | None:
    flat = [i for g in groups for i in g]
    if sorted(flat) != list(range(len(coords))):
        return None
    varying = [
        a for a in range(len(mesh.shape)) if any(len({coords[i][a] for i in g}) > 1 for g in groups)
    ]
    size = math.prod(mesh.shape[a] for a in varying)
    if any(len(g) != size for g in groups):
        return None
    return tuple(mesh.axis_names[a] for a in varying)


def _group_order_note(groups, mesh: Mesh, coords: np.ndarray, axes: Axes) -> str:
    if len(axes) < 2:
        return ""
    idx = [mesh.index(a) for a in axes]
    for perm in itertools.permutations(idx):
        if all(
            list(g) == sorted(g, key=lambda i: tuple(coords[i][a] for a in perm)) for g in groups
        ):
            if list(perm) == idx:
                return ""
            return "group order is " + "-major, ".join(mesh.axis_names[a] for a in perm) + "-minor"
    return "group order matches no axis order"


# --------------------------------------------------------------------------- collectives


def _replica_groups_text(attrs: str) -> str | None:
    """The ``replica_groups=`` value, whose mesh and iota forms run past commas."""
    m = re.search(r"(?:^|,\s*)replica_groups=", attrs)
    if not m:
        return None
    rest = attrs[m.end() :]
    if rest.startswith("{"):
        return rest[: _balanced(rest, 0)]
    if iota := re.match(r"\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?", rest):
        return iota.group(0)
    if rest.startswith("mesh["):
        end = _balanced(rest, 4)
        if d := re.match(r",\s*device_ids=", rest[end:]):
            end = _balanced(rest, end + d.end())
        return rest[: _balanced(rest, rest.index("{", end))]
    raise ValueError(f"unrecognised replica_groups in {attrs[:120]!r}")


def _global_groups(mod: _Module, ins: _Instr, kind: str) -> list[list[int]]:
    """Replica groups of ``ins`` as groups of flattened logical ids (XLA's group modes)."""
    r, p = mod.replica_count, mod.num_partitions
    has_channel = _attr(ins.attrs, "channel_id") is not None
    flattened = _attr(ins.attrs, "use_global_device_ids") == "true"
    text = _replica_groups_text(ins.attrs)
    if flattened:
        return [list(g) for g in parse_replica_groups(text or "{}", r * p)]
    if kind in ("all-to-all", "collective-permute") and has_channel:  # cross-partition
        groups = parse_replica_groups(text or "{}", p)
        return [[rep * p + i for i in g] for rep in range(r) for g in groups]
    groups = parse_replica_groups(text or "{}", r)
    if has_channel:  # cross-replica-and-partition
        return [[rep * p + i for rep in g for i in range(p)] for g in groups]
    return [[rep * p + part for rep in g] for part in range(p) for g in groups]  # cross-replica


def _loop_notes(mod: _Module) -> dict[str, str]:
    """computation -> note, for every computation reachable from a while-loop body."""
    notes: dict[str, str] = {}
    for ins in mod.instrs.values():
        if ins.opcode != "while":
            continue
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        note = f"inside while loop %{ins.name}" + (
            f": counted once, runs {trip.group(1)} times"
            if trip
            else ": counted once, trip count unknown"
        )
        todo = _called(ins.attrs, "body|condition")
        while todo:
            c = todo.pop()
            if c in notes or c not in mod.computations:
                continue
            notes[c] = note
            for n in mod.computations[c]:
                todo += _called(mod.instrs[n].attrs, "calls|to_apply|body|condition")
    return notes


def _permute(ins: _Instr, mod: _Module, mesh: Mesh, coords: np.ndarray, note: str):
    text = _attr(ins.attrs, "source_target_pairs") or "{}"
    pairs = tuple((g[0], g[1]) for g in parse_replica_groups(text, 0) if g)
    rank = range(len(mesh.shape))
    moved = sorted({a for s, t in pairs for a in rank if coords[s][a] != coords[t][a]})
    dtype, dims = _leaves(mod.instrs[ins.operands[0]].shape)[0]
    axes = tuple(mesh.axis_names[a] for a in moved)
    return CompiledPermute(
        ins.name, axes, _nbytes(dtype, dims), _HLO_DTYPES[dtype][0], pairs, note, bool(note)
    )


def _raw_collectives(mod: _Module, mesh: Mesh, coords: np.ndarray):
    """[(record, instruction, tuple index or None, groups)] and the collective-permutes."""
    loops = _loop_notes(mod)
    found, permutes = [], []
    for ins in mod.instrs.values():
        kind = _COLLECTIVE_OPCODES.get(ins.opcode)
        if kind is None:
            continue
        loop_note = loops.get(ins.computation, "")
        if kind == "collective-permute":
            permutes.append(_permute(ins, mod, mesh, coords, loop_note))
            continue
        leaves = [leaf for o in ins.operands for leaf in _leaves(mod.instrs[o].shape)]
        groups = _global_groups(mod, ins, kind)
        axes = _group_axes(groups, mesh, coords)
        notes = [loop_note] if loop_note else []
        if axes is None:
            axes = UNKNOWN_AXES
            notes.append(f"replica groups {groups} match no set of mesh axes of {mesh}")
        elif order := _group_order_note(groups, mesh, coords, axes):
            notes.append(order)
        factor = len(groups[0]) if kind == "all-gather" else 1  # all-gather: gathered output
        if kind == "all-to-all" or len(leaves) == 1:  # a tuple all-to-all is one exchange
            parts = [(None, leaves, notes)]
        else:
            combined = "operand {} of {} of a combined " + kind
            parts = [
                (k, [lf], notes + [combined.format(k, len(leaves))]) for k, lf in enumerate(leaves)
            ]
        for index, part, note in parts:
            nbytes = factor * sum(_nbytes(*lf) for lf in part)
            dtype = _HLO_DTYPES[part[0][0]][0]
            record = CompiledCollective(
                Collective(kind, axes, nbytes),
                dtype,
                ins.name,
                "; ".join(note),
                bool(loop_note),
                ins.opcode,
            )
            found.append((record, ins, index, groups))
    return found, permutes


# --------------------------------------------------------------------------- normalisation


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
    paths = _use_paths(mod, ins.name, index, _Path())
    kind, dtype, nbytes = c.kind, cc.dtype, c.bytes
    n = len(groups[0])
    if n > 1 and paths and all(p.slice_dims and _is_shard_slice(p.slice_dims, n) for p in paths):
        notes.append(_reduce_scatter_check(mod, groups, paths))
        if "normalised" in notes[-1]:
            kind = "reduce-scatter"
    elif (
        n > 1
        and paths
        and all(p.slice_dims and _sliced_dim(p.slice_dims) is not None for p in paths)
    ):
        notes.append(_window_note(mod, groups, paths))
    source = _upcast_source(mod, ins.operands[index or 0])
    narrow = {p.narrow for p in paths}
    if cc.dtype == "float32" and (source or (len(narrow) == 1 and None not in narrow)):
        low = source or narrow.pop()
        dtype = _HLO_DTYPES[low][0]
        nbytes = c.bytes * _HLO_DTYPES[low][1] // 32
        notes.append(f"{low} upcast to f32 normalised")
    return replace(
        cc, collective=Collective(kind, c.axes, nbytes), dtype=dtype, note="; ".join(notes)
    )


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


def analyze_collectives(
    hlo_text: str,
    mesh: Mesh,
    device_ids: Sequence[int],
    device_assignment: Sequence[int] | None = None,
) -> HloCollectives:
    """Every collective in compiled HLO text, raw and normalised, plus collective-permutes.

    ``device_ids``: the mesh's device ids in row-major mesh order.  ``device_assignment``:
    the device id of each logical id (replica-major); JAX's default, the mesh order, is
    used when None.
    """
    mod = _parse_module(hlo_text)
    num_ids = mod.replica_count * mod.num_partitions
    if num_ids != mesh.num_devices:
        raise ValueError(
            f"HLO module runs on {num_ids} devices (replica_count={mod.replica_count}, "
            f"num_partitions={mod.num_partitions}) but mesh {mesh} has {mesh.num_devices}; "
            "pass the mesh the function was compiled for"
        )
    assignment = list(device_ids if device_assignment is None else device_assignment)
    if len(assignment) != num_ids:
        raise ValueError(f"device_assignment has {len(assignment)} entries, expected {num_ids}")
    coords = _coords(mesh, device_ids, assignment)
    found, permutes = _raw_collectives(mod, mesh, coords)
    raw = tuple(cc for cc, *_ in found)
    normalised = tuple(_normalise(mod, cc, ins, index, groups) for cc, ins, index, groups in found)
    return HloCollectives(normalised, raw, tuple(permutes))


def parse_collectives(
    hlo_text: str,
    mesh: Mesh,
    device_ids: Sequence[int],
    normalize: bool = True,
    device_assignment: Sequence[int] | None = None,
) -> tuple[CompiledCollective, ...]:
    """The collectives (not permutes) in compiled HLO text; see :func:`analyze_collectives`."""
    found = analyze_collectives(hlo_text, mesh, device_ids, device_assignment)
    return found.collectives if normalize else found.raw


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryStats:
    """Per-device memory of a compiled executable, in bytes.

    ``peak_bytes`` is XLA's own ``peak_memory_in_bytes`` (from its buffer-assignment heap
    simulation) when the executable reports it; otherwise the upper bound
    ``argument + output + temp - alias`` (``peak_from_xla`` says which).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    peak_from_xla: bool


def memory_stats(compiled) -> MemoryStats:
    """Read ``compiled.memory_analysis()`` (a jax ``Compiled``; duck-typed)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError("this executable reports no memory analysis (memory_analysis() is None)")

    def get(attr: str) -> int:
        return int(getattr(analysis, attr, 0) or 0)

    args, out = get("argument_size_in_bytes"), get("output_size_in_bytes")
    temp, alias = get("temp_size_in_bytes"), get("alias_size_in_bytes")
    peak = get("peak_memory_in_bytes")
    return MemoryStats(
        args, out, temp, alias, get("generated_code_size_in_bytes"),
        peak if peak > 0 else args + out + temp - alias, peak > 0,
    )  # fmt: skip


# The options that make XLA write its buffer live ranges (``*-live-range.txt``) and buffer
# assignment (``*-buffer-assignment.txt``) into a folder: text dumps of the optimized
# module only (no per-pass dumps).
LIVE_RANGE_DUMP_OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "NONE"}

_PEAK_BLOCK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$", re.M)
_PEAK_VALUE = re.compile(r"^\s+\S.*: (\d+) bytes \(cumulative: (\d+) bytes\)\s*$")
_PEAK_TOTAL = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+?) bytes")
_LIVE_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)\s*$", re.M)
_ALLOCATION = re.compile(r"^allocation (\d+): ")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: @\d+)?> \(size=(\d+),offset=(\d+)\)")


def stated_live_peak_bytes(live_range: str) -> int | None:
    """The peak XLA states in an ``HloLiveRange`` dump (``*-live-range.txt``): the sum of
    its ``Live ranges at N (peak):`` block, or the line ``Stack trace breakdown for peak
    usage: 1 781 008 bytes`` where there is no block; ``None`` where neither is found or
    the two disagree (a format this parser does not know).  Not the live peak: XLA sums
    *values*, so two values that share one buffer (an in-place scatter and the buffer it
    updates, live together at the scatter) count twice, and the moment it prints is not
    the peak (:func:`live_range_peak`).
    """
    block = None
    match = _PEAK_BLOCK.search(live_range)
    if match:
        total, running = 0, None
        for line in live_range[match.end() :].lstrip("\n").splitlines():
            value = _PEAK_VALUE.match(line)
            if not value:
                break
            total += int(value.group(1))
            running = int(value.group(2))
        if running is not None and running == total:
            block = total
    breakdown = None
    match = _PEAK_TOTAL.search(live_range)
    if match:
        breakdown = int(match.group(1).replace(" ", ""))
    if block is not None and breakdown is not None and block != breakdown:
        return None
    return block if block is not None else breakdown


def buffer_slices(buffer_assignment: str) -> dict[str, list[tuple[int, int, int]]]:
    """Value (``name{index}``, as live-range dumps name them) -> its (allocation, offset,
    size) slices, from XLA's ``*-buffer-assignment.txt``.  Values in constant and
    thread-local allocations map to no slice: ``memory_analysis`` counts neither (nor
    does the model)."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    allocation, counted = None, True
    for line in buffer_assignment.splitlines():
        match = _ALLOCATION.match(line)
        if match:
            allocation = int(match.group(1))
            header = line[match.end() :]
            counted = "constant" not in header and "thread-local" not in header
            continue
        match = _VALUE.match(line)
        if match and allocation is not None:
            pieces = out.setdefault(match.group(1) + (match.group(2) or "{}"), [])
            if counted:
                pieces.append((allocation, int(match.group(4)), int(match.group(3))))
    return out


@dataclass(frozen=True)
class LivePeak:
    """XLA's peak of bytes live at once (:func:`live_range_peak`): ``bytes``, at
    ``position`` in XLA's schedule (``instruction``), and the values live there with the
    bytes each holds (largest first; a slice shared with an earlier-listed value is 0)."""

    bytes: int
    position: int
    instruction: str
    values: tuple[tuple[str, int], ...]


def live_range_peak(
    live_range: str, buffer_assignment: str, shared_once: bool = True
) -> LivePeak | None:
    """The most bytes live at once in XLA's schedule of one module, from its dumps: the
    live range of every value (``*-live-range.txt``: positions in the schedule, both ends
    included -- an instruction's operands and its result are live together) over the
    buffer slice it occupies (``*-buffer-assignment.txt``).  A slice that several live
    values share -- an in-place update and the buffer it writes into, a donated parameter
    and the output that reuses it -- counts once (``shared_once=False`` counts each value).
    Parameters and outputs are included.  This is what a liveness model predicts; XLA's
    allocation (``memory_analysis``) is this plus any gaps its heap leaves between
    buffers.

    Not the figure the live-range dump prints as its peak (:func:`stated_live_peak_bytes`):
    XLA picks that moment with a running sum that adds a moment's new values before it
    frees the previous moment's dead ones, and prints the values live at the moment after
    the true peak (on gpt-tiny's 4-block data-parallel step: 1,739 KiB printed, 2,579 KiB
    at the true peak, which is XLA's allocation).

    Returns ``None`` where the dumps do not parse or a live value has no buffer slice
    (then the figure would be short of what is live).
    """
    ranges = [
        (m.group(1), int(m.group(2)), int(m.group(3))) for m in _LIVE_RANGE.finditer(live_range)
    ]
    slices = buffer_slices(buffer_assignment)
    if not ranges or not slices or any(name not in slices for name, _, _ in ranges):
        return None
    events: dict[int, list[tuple[int, str]]] = {}
    for name, first, last in ranges:
        events.setdefault(first, []).append((1, name))
        events.setdefault(last + 1, []).append((-1, name))
    live: dict[str, int] = {}
    best, best_at = -1, 0
    for position in sorted(events):
        for step, name in events[position]:
            live[name] = live.get(name, 0) + step
            if not live[name]:
                del live[name]
        total = _live_bytes(live, slices, shared_once)
        if total > best:
            best, best_at = total, position
    at = {name for name, first, last in ranges if first <= best_at <= last}
    values, seen = [], set()
    for name in sorted(at, key=lambda n: (-sum(p[2] for p in slices[n]), n)):
        pieces = set(slices[name])
        held = sum(p[2] for p in pieces - seen) if shared_once else sum(p[2] for p in pieces)
        seen |= pieces
        values.append((name, held))
    sequence = re.findall(r"^\s+(\d+):(\S+)\s*$", live_range, re.M)
    instruction = dict((int(i), n) for i, n in sequence).get(best_at, "")
    return LivePeak(best, best_at, instruction, tuple(values))


def _live_bytes(live, slices, shared_once: bool) -> int:
    if shared_once:
        return _union_bytes(p for name in live for p in slices[name])
    return sum(p[2] * count for name, count in live.items() for p in slices[name])


def _union_bytes(pieces) -> int:
    """Bytes covered by (allocation, offset, size) slices, overlaps counted once."""
    total, end_of = 0, {}
    for allocation, offset, size in sorted(set(pieces)):
        end = end_of.get(allocation, 0)
        if offset + size > end:
            total += offset + size - max(offset, end)
            end_of[allocation] = offset + size
    return total


def dump_live_peak(dump_dir: str) -> LivePeak | None:
    """:func:`live_range_peak` of the largest optimized module XLA dumped into
    ``dump_dir`` (the step's; small helper modules may sit beside it); ``None`` where the
    live-range or buffer-assignment file is missing or does not parse."""
    import glob
    import os

    files = glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt"))
    if not files:
        return None
    live_range_file = max(files, key=os.path.getsize)
    assignment_file = live_range_file.replace("-live-range.txt", "-buffer-assignment.txt")
    if not os.path.exists(assignment_file):
        return None
    with open(live_range_file, encoding="utf-8", errors="replace") as f:
        live_range = f.read()
    with open(assignment_file, encoding="utf-8", errors="replace") as f:
        assignment = f.read()
    return live_range_peak(live_range, assignment)


# --------------------------------------------------------------------------- comparison


def _as_collective(c: Collective | CompiledCollective) -> Collective:
    return c.collective if isinstance(c, CompiledCollective) else c


def _key(c: Collective) -> tuple[str, Axes]:
    return c.kind, tuple(sorted(set(c.axes)))


def summarize(
    collectives: Sequence[Collective | CompiledCollective],
) -> dict[tuple[str, Axes], int]:
    """Total bytes per (kind, axes); axes as a sorted tuple, so order does not matter."""
    out: dict[tuple[str, Axes], int] = {}
    for c in map(_as_collective, collectives):
        out[_key(c)] = out.get(_key(c), 0) + c.bytes
    return out


@dataclass(frozen=True)
class ComparisonRow:
    kind: str
    axes: Axes
    predicted_count: int
    predicted_bytes: int
    compiled_count: int
    compiled_bytes: int
    agree: bool


@dataclass(frozen=True)
class CollectiveComparison:
    """Predicted vs compiled collectives per (kind, axes)."""

    rows: tuple[ComparisonRow, ...]
    rel_tol: float

    @property
    def agree(self) -> bool:
        return all(r.agree for r in self.rows)

    def format(self) -> str:
        head = ("kind", "axes", "pred #", "pred bytes", "compiled #", "compiled bytes", "agree")
        body = [
            (r.kind, ",".join(r.axes) or "-", str(r.predicted_count), f"{r.predicted_bytes:,}",
             str(r.compiled_count), f"{r.compiled_bytes:,}", "yes" if r.agree else "NO")
            for r in self.rows
        ]  # fmt: skip
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [head, *body]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        verdict = "agree" if self.agree else "DISAGREE"
        lines.append(f"{verdict} (bytes within {self.rel_tol:.0%} per kind and axes)")
        return "\n".join(lines)


def compare_collectives(
    predicted: Sequence[Collective | CompiledCollective],
    compiled: Sequence[Collective | CompiledCollective],
    rel_tol: float = 0.02,
) -> CollectiveComparison:
    """Row per (kind, axes) present on either side; a row agrees when both sides have it
    and their total bytes differ by at most ``rel_tol`` of the larger."""
    if rel_tol < 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")
    pred, comp = list(map(_as_collective, predicted)), list(map(_as_collective, compiled))
    pred_bytes, comp_bytes = summarize(pred), summarize(comp)
    rows = []
    for key in sorted(set(pred_bytes) | set(comp_bytes)):
        p, c = pred_bytes.get(key, 0), comp_bytes.get(key, 0)
        pn, cn = sum(_key(x) == key for x in pred), sum(_key(x) == key for x in comp)
        agree = pn > 0 and cn > 0 and abs(p - c) <= rel_tol * max(p, c)
        rows.append(ComparisonRow(key[0], key[1], pn, p, cn, c, agree))
    return CollectiveComparison(tuple(rows), rel_tol)
