"""What XLA actually compiled: the collectives of an executable (jax-free parsing).

Takes the text of ``jax.jit(f).lower(...).compile().as_text()`` plus the logical
:class:`~autoshard.ir.spec.Mesh` it was compiled for, and returns every collective as a
:class:`~autoshard.ir.spec.Collective` (kind, mesh axes, per-device bytes), so that a plan's
predicted collectives can be compared with the compiled ones
(:func:`~autoshard.verify.compare.compare_collectives`).  Replica groups become mesh axes as
:mod:`autoshard.verify.replica_groups` says; ``normalize=True`` undoes XLA:CPU's habits as
:mod:`autoshard.verify.xla_cpu` says.

Counting: each collective instruction is counted once where it is defined (fusions, async
wrappers and called computations included; ``*-update`` and ``*-done`` halves are skipped).
XLA:GPU's spellings read as XLA:CPU's sync ones: ``all-reduce-start``, ``all-gather-start``
and ``collective-permute-start``; reduce-scatter and all-to-all inside a generic
``async-start`` (counted in the computation it calls) or, printed with XLA's async syntax
sugar, as ``reduce-scatter-start`` / ``all-to-all-start`` (tests/test_hlo_gpu.py).  Tuple-shaped
(combined) all-reduces, all-gathers and reduce-scatters give one record per operand; a
tuple all-to-all is one exchange and gives one record.  XLA:GPU also combines all-reduces
by concatenation (one flat buffer of the operands, sliced back after): such an all-reduce
gives one record per concatenated operand too, normalised through its slice
(:func:`_concatenated_pieces`), so a record is one reduced value on both backends.  Collectives inside while-loop
bodies are counted once and flagged ``in_loop`` (the note gives the known trip count).
A ``collective-permute`` is reported separately as :class:`CompiledPermute` (its
source-target pairs too) and compared as a ``collective-permute``
:class:`~autoshard.ir.spec.Collective` (:meth:`HloCollectives.compared`): the mesh axes
along which its pairs differ, the bytes each device sends.  Replica groups over part of a
mesh axis (XLA's all-gathers over pairs of a 4-device axis) read as sub-axes, ``data:(1)2``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.spec import Axes, Collective, Mesh
from autoshard.verify.hlo import (
    _HLO_DTYPES,
    CompiledCollective,
    _attr,
    _called,
    _Instr,
    _leaves,
    _Module,
    _nbytes,
    _parse_module,
)
from autoshard.verify.replica_groups import (
    UNKNOWN_AXES,
    _coords,
    _global_groups,
    _group_axes,
    _group_order_note,
    parse_replica_groups,
)
from autoshard.verify.xla_cpu import _PASS_THROUGH, _normalise, _static_slice

# Synchronous opcodes (XLA:CPU) and XLA:GPU's asynchronous starts: all-reduce-start,
# all-gather-start and collective-permute-start are opcodes of their own; reduce-scatter and
# all-to-all run inside a generic async-start whose called computation holds the plain op
# (counted there), or, printed with XLA's async syntax sugar, as reduce-scatter-start /
# all-to-all-start.  The -update and -done halves are never counted.
_COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter", "reduce-scatter-start": "reduce-scatter",
    "all-to-all": "all-to-all", "all-to-all-start": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}  # fmt: skip


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

    def compared(self) -> tuple[Collective, ...]:
        """What a plan's predictions are compared with: the normalised collectives, and
        every collective-permute as a ``collective-permute`` :class:`Collective` (the
        axes its pairs move along, the bytes each device sends)."""
        permutes = (
            Collective("collective-permute", p.axes, p.bytes) for p in self.permutes if p.axes
        )
        return tuple(c.collective for c in self.collectives) + tuple(permutes)


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
        pieces = _concatenated_pieces(mod, ins) if kind == "all-reduce" else None
        if pieces:  # XLA:GPU's combiner: one all-reduce of the operands concatenated
            combined = "part {} of {} of an all-reduce combined by concatenation"
            for k, piece in enumerate(pieces):
                record = CompiledCollective(
                    Collective(kind, axes, piece.bytes),
                    _HLO_DTYPES[piece.dtype][0],
                    ins.name,
                    "; ".join(notes + [combined.format(k, len(pieces))]),
                    bool(loop_note),
                    ins.opcode,
                )
                found.append((record, ins, piece, groups))
            continue
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


@dataclass(frozen=True)
class _Piece:
    """One operand of an all-reduce combined by concatenation: ``operand`` (the value
    concatenated, in the calling computation), elements ``[start, stop)`` of the
    concatenated buffer."""

    operand: str
    start: int
    stop: int
    dtype: str

    @property
    def bytes(self) -> int:
        return _nbytes(self.dtype, (self.stop - self.start,))


def _concatenated_pieces(mod: _Module, ins: _Instr) -> list[_Piece] | None:
    """The pieces of an all-reduce whose one operand is a concatenation of flat values.

    XLA:GPU writes several all-reduces (same replica groups) as one: the operands, bitcast
    flat, are concatenated by a loop fusion (``wrapped_concatenate``) and each use of the
    result takes its piece back with a static slice (``wrapped_slice``; the captured
    gpt-1.3b and gpt-tiny modules of 2026-11-27).  None when the operand is not such a concatenation
    (an ordinary all-reduce)."""
    if len(ins.operands) != 1:
        return None
    fusion = mod.instrs[ins.operands[0]]
    if fusion.opcode != "fusion":
        return None
    called = _called(fusion.attrs, "calls")
    root = mod.instrs.get(mod.roots.get(called[0], "")) if called else None
    if root is None or root.opcode != "concatenate" or len(root.operands) < 2:
        return None
    params = {name: k for k, name in mod.params(called[0]).items()}
    pieces, start = [], 0
    for o in root.operands:
        leaves = _leaves(mod.instrs[o].shape)
        if o not in params or len(leaves) != 1 or len(leaves[0][1]) != 1:
            return None  # not a flat parameter of the fusion: some other concatenation
        dtype, (size,) = leaves[0]
        pieces.append(_Piece(fusion.operands[params[o]], start, start + size, dtype))
        start += size
    # the combiner's signature: every use takes one piece back whole. A concatenation the
    # program makes itself (read whole, or sliced otherwise) is one value: left as it is
    ranges = {(piece.start, piece.stop) for piece in pieces}
    if not all(taken in ranges for taken in _slices_taken(mod, ins.name)):
        return None
    return pieces


def _slices_taken(mod: _Module, name: str) -> list:
    """The static slice taken by each use of ``name`` past its ``-done`` and bitcasts
    (None for a use that is no static slice)."""
    out = []
    for uname, _ in mod.users.get(name, []):
        u = mod.instrs[uname]
        out += _slices_taken(mod, uname) if u.opcode in _PASS_THROUGH else [_static_slice(mod, u)]
    return out


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
