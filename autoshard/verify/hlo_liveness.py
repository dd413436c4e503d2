"""The live peak of a compiled step from its scheduled HLO text alone (jax-free).

:func:`~autoshard.verify.memory.live_range_peak` reads XLA's own live ranges from an XLA
dump, which needs a second compile; a run that kept only ``compiled.as_text()`` (the GPU
runs' ``--hlo-tar``) can still be read here.  :func:`schedule_buffers` walks the entry
computation in its schedule (the printed order of a module with ``is_scheduled=true``) and
gives every buffer its bytes (from its shape) and its live range (from the instruction
that makes it to the last that reads it, both included); :func:`hlo_live_peak` is the most
bytes live at once, parameters included.  Buffer rules, as XLA's buffer assignment has them:

* ``bitcast``, ``get-tuple-element``, ``tuple`` and an async ``*-done`` make no buffer:
  they name their operand's (a ``*-done`` the ``*-start``'s result); an async start's
  operands stay live until its done;
* each element of a tuple-shaped result (a multi-output fusion, a combined all-reduce, a
  custom call's scratch) is its own buffer, live to the last instruction that names it or
  reads it: a ``get-tuple-element`` holds only the element it names (XLA's live range of a
  value ends at its last position or use, and the view is a position of that element
  only, a use of none), so a view printed late keeps no other element live; a ``tuple``
  holds each of its elements;
* a ``while`` keeps its state in its operand's buffers (XLA colocates them);
* ``output_to_operand_aliasing`` (an all-reduce-start, an in-place custom call) writes
  into the operand's buffer; an output the module aliases to a parameter
  (``input_output_alias``, a donated parameter) lives in the parameter's buffer;
* a fusion's output reuses an operand's buffer of the same bytes that dies there (XLA:GPU
  shares so within 1% on gpt-1.3b and 6.7b megatron, below), not a library call's
  (``kind=kCustom``: a GEMM or cuDNN call does not write over its input);
* a donated parameter's buffer holds temporaries between its last reader and the output
  written there (:func:`in_dead_donated_parameters`, as XLA's buffer assignment offers
  it before it heap-packs the rest): XLA:CPU puts 26, 241 and 562 values there on the
  gpt-tiny zero3 and wresnet-tiny zero3 and zero2 2x4 AdamW plans (its buffer-assignment
  dump, 2026-11-28); on XLA:GPU gpt-39b megatron 8x8 copies 103 weights (11.81 GiB)
  long before their updates (the old value is read after), and their buffers hold 1,218
  temporaries in between (18.60 -> 6.94 GiB of temporaries, XLA's 6.94);
* parameters live throughout; constants are not counted (XLA's ``memory_analysis`` does
  not count them as temporaries either).

Not modelled: buffers inside ``while`` bodies and called computations (the steps read so
far have none), heap gaps: the live peak is what XLA's heap must hold, XLA allocates it
plus the gaps it leaves (0.5% and 1.2% on gpt-tiny's captured auto and ZeRO-3 modules,
where a best-fit placement of this reader's buffers leaves 0.2% to 8.6%:
benchmarks/studies/gpu_tuple_reads.py --pack).  The reuse of donated buffers is XLA's
greedy order approximately (largest first), not its exact choice of tenants: on the
XLA:CPU plans above it places 21, 169 and 421 values there, 7, 134 and 354 of them
XLA's, and reads 2.0%, 9.6% and 4.0% under XLA's temporaries (+28% on wresnet-tiny zero2
without the rule); with XLA's own tenants (its dump) the same heap holds 2.0%, 7.2% and
0.7% under them, the gaps XLA's heap leaves, so the rest (0-3.2%) is the choice of
tenants.  Against XLA:GPU's ``temp_size_in_bytes`` (H100 compile-only topology,
jax 0.11.2; the 25 stored --hlo-tar modules read 2026-11-28): at or under it on all 25,
within 2% on 19 (gpt-1.3b's five, gpt-6.7b auto, megatron, zero2, zero3 and heuristic,
gpt-39b auto 8x8 and megatron 8x8, moe-1.3b auto, zero3, megatron and expert-zero2,
wresnet-1b zero3, gpt-tiny's two), 2.8% and 3.7% under on gpt-39b auto 64x8 and
wresnet-1b heuristic, 5.2-7.8% under on wresnet-1b auto, zero2 and dp and moe-1.3b zero2.
XLA:CPU: gpt-39b 4 layers on 64 fake devices (8x8) 3,746,058,260 vs 3,746,059,616 B
(2026-11-28, jax 0.11.2, ``python benchmarks/studies/gpu_held_updates.py --cpu 4 --out
FILE``).  Against XLA:CPU's own live-range dump, every tuple element's range is XLA's: a
max pool's gradient (``tests/test_hlo_gpu_liveness.py``), and 149, 290 and 473 elements
of the XLA:CPU plans above (``benchmarks/studies/live_peak_values.py ... --dump DIR``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}  # fmt: skip

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = ")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(r"%([^\s,()]+)")
_INDEX = re.compile(r"index=(\d+)")
_OUTPUT_ALIAS = re.compile(r"\{([\d,]*)\}: \((\d+), \{([\d,]*)\}")


class HloParseError(ValueError):
    """HLO text this reader cannot read (not a module, no scheduled entry computation)."""


def _shape(text: str, i: int):
    """Parse the shape at ``text[i:]``: (leaves [(index path, bytes, text)], end)."""
    while text[i] == " ":
        i += 1
    if text[i] == "(":
        i += 1
        leaves, k = [], 0
        while True:
            while text[i] in " ,":
                i += 1
            if text[i] == ")":
                return leaves, i + 1
            if text.startswith("/*", i):
                i = text.index("*/", i) + 2
                continue
            inner, i = _shape(text, i)
            leaves += [((k, *path), size, t) for path, size, t in inner]
            k += 1
    m = _ARRAY.match(text, i)
    if not m or m.group(1) not in DTYPE_BYTES:
        raise HloParseError(f"cannot read a shape at {text[i : i + 60]!r}")
    n = 1
    for d in m.group(2).split(","):
        if d:
            n *= int(d)
    return [((), n * DTYPE_BYTES[m.group(1)], m.group(0))], m.end()


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    leaves: tuple  # ((index path, bytes, shape text), ...)
    operands: tuple[str, ...]
    attributes: str  # the text after the operand list
    root: bool
    parameter_number: int | None = None


def entry_instructions(text: str) -> list[Instruction]:
    """The entry computation's instructions, in the printed (scheduled) order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise HloParseError("no ENTRY computation in this text (is it an HLO module?)")
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        leaves, j = _shape(line, m.end())
        op = _OPCODE.match(line, j)
        if not op:
            raise HloParseError(f"cannot read the opcode of {line[:120]!r}")
        k = q = op.end()
        depth = 1
        while depth:
            if line[q] == "(":
                depth += 1
            elif line[q] == ")":
                depth -= 1
            q += 1
        operands = tuple(_OPERAND.findall(line[k : q - 1]))
        number = int(line[k : q - 1]) if op.group(1) == "parameter" else None
        out.append(
            Instruction(
                m.group(2),
                op.group(1),
                tuple(leaves),
                operands,
                line[q:],
                bool(m.group(1)),
                number,
            )
        )
    if not out:
        raise HloParseError("the ENTRY computation has no instructions")
    return out


def module_aliases(text: str) -> dict[tuple[int, ...], int]:
    """The module's ``input_output_alias``: output index -> parameter number."""
    head = text.split("\n", 1)[0]
    at = head.find("input_output_alias=")
    if at < 0:
        return {}
    out = {}
    for m in _OUTPUT_ALIAS.finditer(head, at):
        out[tuple(int(x) for x in m.group(1).split(",") if x)] = int(m.group(2))
    return out


@dataclass
class Buffer:
    """One buffer of the schedule: ``bytes``, live from ``first`` to ``last`` (positions
    in the entry's schedule, both included), made by ``made_by`` (instruction, index);
    ``values``: every (instruction, index) that lives in it, in order."""

    bytes: int
    first: int
    last: int
    made_by: tuple[str, tuple[int, ...]]
    opcode: str
    parameter: bool = False
    donated: bool = False  # an output written into a donated parameter's buffer
    values: list | None = None
    read_until: int = -1  # the last position an instruction reads it (-1: none)
    parameter_number: int | None = None  # a parameter's, or the donated one written


def schedule_buffers(text: str) -> tuple[list[Instruction], list[Buffer]]:
    """The entry computation's instructions and buffers (module docstring's rules)."""
    instrs = entry_instructions(text)
    ends = _plain_ends(instrs)
    return instrs, _buffers(instrs, module_aliases(text), ends)


def _plain_ends(instrs) -> dict:
    """(instruction, index) -> the last position its buffer is read, with no buffer
    shared between values (the sharing rule asks whether an operand dies at a fusion)."""
    bufs = _buffers(instrs, {}, None)
    return {v: b.last for b in bufs for v in b.values}


def _buffers(instrs, aliases, ends) -> list[Buffer]:
    by_name = {ins.name: ins for ins in instrs}
    donated = _donated_outputs(instrs, by_name, aliases)
    bufs: list[Buffer] = []
    value: dict[str, dict[tuple[int, ...], int]] = {}  # name -> index -> buffer

    def new(size, pos, made_by, opcode, **kw) -> int:
        bufs.append(Buffer(size, pos, pos, made_by, opcode, values=[made_by], **kw))
        return len(bufs) - 1

    def read(b: int, pos: int) -> None:
        bufs[b].last = max(bufs[b].last, pos)
        bufs[b].read_until = max(bufs[b].read_until, pos)

    n = len(instrs)
    for pos, ins in enumerate(instrs):
        op = ins.opcode
        if op != "get-tuple-element":  # it holds only the element it names: below
            for o in ins.operands:
                for b in value.get(o, {}).values():
                    read(b, pos)
        if op == "parameter":
            value[ins.name] = {}
            for path, size, _ in ins.leaves:
                number = ins.parameter_number
                b = new(size, 0, (ins.name, path), op, parameter=True, parameter_number=number)
                bufs[b].last = n
                value[ins.name][path] = b
        elif op == "while":  # XLA colocates a loop's state with its operand's buffers
            value[ins.name] = dict(value[ins.operands[0]])
        elif op == "bitcast":
            value[ins.name] = {(): value[ins.operands[0]][()]}
        elif op == "get-tuple-element":
            k = int(_INDEX.search(ins.attributes).group(1))
            src = value[ins.operands[0]]
            value[ins.name] = {p[1:]: b for p, b in src.items() if p and p[0] == k}
            for b in value[ins.name].values():
                read(b, pos)
        elif op == "tuple":
            value[ins.name] = {
                (k, *p): b for k, o in enumerate(ins.operands) for p, b in value[o].items()
            }
        elif op.endswith("-done"):
            src = value[ins.operands[0]]
            for b in src.values():  # an async start's operands are read until its done
                read(b, pos)
            value[ins.name] = {p[1:]: b for p, b in src.items() if p and p[0] == 1}
        elif op == "constant":
            value[ins.name] = {}
        else:
            value[ins.name] = _outputs(ins, pos, value, bufs, new, donated, ends)
    root = next((ins for ins in reversed(instrs) if ins.root), instrs[-1])
    for b in value[root.name].values():
        read(b, n)
    return bufs


def _outputs(ins, pos, value, bufs, new, donated, ends) -> dict:
    """The buffers of ``ins``'s outputs: an async start's operand echo ({0, ...}), an
    output aliased to an operand, a donated output, an output sharing a dying operand's
    buffer (fusions), else a new buffer."""
    aliased = {}
    if "output_to_operand_aliasing" in ins.attributes:
        for m in _OUTPUT_ALIAS.finditer(ins.attributes):
            out = tuple(int(x) for x in m.group(1).split(",") if x)
            aliased[out] = (int(m.group(2)), tuple(int(x) for x in m.group(3).split(",") if x))
    start = ins.opcode.endswith("-start")
    taken: set[int] = set()
    out = {}
    for path, size, _ in ins.leaves:
        if start and path and path[0] == 0:  # the operands, as the start holds them
            if len(path) == 1 and len(ins.operands) == 1:
                out[path] = value[ins.operands[0]][()]
            else:
                out[path] = value[ins.operands[path[1]]][path[2:]]
            continue
        if path in aliased:
            k, p = aliased[path]
            out[path] = value[ins.operands[k]][p]
            continue
        key = (ins.name, path)
        if key in donated:
            out[path] = new(size, pos, key, ins.opcode, donated=True, parameter_number=donated[key])
            continue
        shared = None
        if ends is not None and ins.opcode == "fusion" and "kind=kCustom" not in ins.attributes:
            for o in ins.operands:
                for b in value.get(o, {}).values():
                    buf = bufs[b]
                    if buf.parameter or buf.donated or b in taken or buf.bytes != size:
                        continue
                    if ends.get(buf.values[-1]) == pos:  # its value dies here
                        shared = b
                        break
                if shared is not None:
                    break
        if shared is not None:
            taken.add(shared)
            bufs[shared].values.append(key)
            out[path] = shared
        else:
            out[path] = new(size, pos, key, ins.opcode)
    return out


def _donated_outputs(instrs, by_name, aliases) -> dict:
    """(instruction, index) of each value the module returns in a donated parameter ->
    that parameter's number."""
    root = next((ins for ins in reversed(instrs) if ins.root), instrs[-1])

    def resolve(name, path):
        ins = by_name[name]
        if ins.opcode == "bitcast":
            return resolve(ins.operands[0], path)
        if ins.opcode == "get-tuple-element":
            k = int(_INDEX.search(ins.attributes).group(1))
            return resolve(ins.operands[0], (k, *path))
        return (name, path)

    if root.opcode != "tuple":
        return {resolve(root.name, ()): aliases[()]} if () in aliases else {}
    return {resolve(o, ()): aliases[(k,)] for k, o in enumerate(root.operands) if (k,) in aliases}


@dataclass(frozen=True)
class HloLivePeak:
    """The most bytes live at once in a schedule (:func:`hlo_live_peak`): ``bytes``
    (parameters included; ``parameter_bytes`` of them), at ``position`` of the entry's
    schedule (``instruction``), and the buffers live there (largest first)."""

    bytes: int
    parameter_bytes: int
    position: int
    instruction: str
    live: tuple[Buffer, ...]

    @property
    def temp_bytes(self) -> int:
        """The peak less the parameters: what XLA's ``temp_size_in_bytes`` allocates
        (for a module whose outputs are donated)."""
        return self.bytes - self.parameter_bytes


def hlo_live_peak(text: str) -> HloLivePeak:
    """The live peak of a scheduled module's entry computation (module docstring)."""
    instrs, bufs = schedule_buffers(text)
    n = len(instrs)
    pieces = _value_pieces(instrs, bufs)
    inside = in_dead_donated_parameters(instrs, bufs, pieces)
    spans: dict[int, list[tuple[int, int]]] = {}  # buffer -> where the heap holds it
    for k, b in enumerate(bufs):
        if b.bytes and not b.donated:
            kept = [piece for i, piece in enumerate(pieces[k]) if (k, i) not in inside]
            spans[k] = _union(kept)
    delta = [0] * (n + 2)
    for k, intervals in spans.items():
        for first, last in intervals:
            delta[first] += bufs[k].bytes
            delta[last + 1] -= bufs[k].bytes
    best, at, running = -1, 0, 0
    for i in range(n + 1):
        running += delta[i]
        if running > best:
            best, at = running, i
    params = sum(b.bytes for b in bufs if b.parameter)
    live = sorted(
        (bufs[k] for k, intervals in spans.items() if any(f <= at <= z for f, z in intervals)),
        key=lambda b: -b.bytes,
    )
    where = instrs[min(at, n - 1)].name
    return HloLivePeak(best, params, at, where, tuple(live))


def _value_pieces(instrs, bufs) -> list[list[tuple[int, int]]]:
    """Each buffer's values as live ranges: a value from where it is made to where the
    next value sharing the buffer is made (it dies there), the last to the buffer's end.
    XLA assigns each such value apart; the sharing is its heap's choice."""
    position = {ins.name: k for k, ins in enumerate(instrs)}
    out = []
    for b in bufs:
        starts = [b.first] + [position[name] for name, _ in (b.values or [])[1:]]
        out.append([(f, z) for f, z in zip(starts, starts[1:] + [b.last])])
    return out


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for first, last in sorted(intervals):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def in_dead_donated_parameters(instrs, bufs: list[Buffer], pieces) -> set[tuple[int, int]]:
    """The temporaries ((buffer, value) of :func:`_value_pieces`) XLA's buffer assignment
    puts into a donated parameter's buffer while it holds nothing: after the parameter's
    last reader, before the output written there is made.  XLA offers such a buffer to
    every temporary that fits before it heap-packs the rest (``MaybeAssignBuffer`` through
    ``TryAssignToExistingAllocation``): largest first, earliest first among equals, each
    into the smallest fitting parameter whose other tenants it does not meet (a reused
    allocation is not packed); a value may start where the parameter's last reader is,
    or end where the output is made, when that instruction writes it in place (a fusion
    that reads it, not a library call).  A step that copies a weight before its update
    (the old value read after it) frees the weight's buffer between the copy and the
    update."""

    def in_place(user: int, name: str) -> bool:
        ins = instrs[user]
        return (
            ins.opcode == "fusion"
            and "kind=kCustom" not in ins.attributes
            and (name in ins.operands)
        )

    outputs: dict[int, int] = {}  # parameter number -> first position of its output
    for b in bufs:
        if b.donated and b.parameter_number is not None:
            at = outputs.get(b.parameter_number, b.first)
            outputs[b.parameter_number] = min(at, b.first)
    windows = []  # (bytes, -number, dead after, dead before, parameter, tenants)
    for b in bufs:
        if b.parameter and b.parameter_number in outputs:
            start, end = b.read_until, outputs[b.parameter_number]
            if end - start > 0:
                windows.append((b.bytes, -b.parameter_number, start, end, b.made_by[0], []))
    if not windows:
        return set()
    windows.sort()  # smallest first
    largest = windows[-1][0]
    candidates = sorted(
        (
            (-b.bytes, first, last, k, i)
            for k, b in enumerate(bufs)
            if 0 < b.bytes <= largest and not b.parameter and not b.donated
            for i, (first, last) in enumerate(pieces[k])
        )
    )
    inside = set()
    for minus_bytes, first, last, k, i in candidates:
        name = bufs[k].values[i][0]
        for size, _, start, end, parameter, tenants in windows:
            if size < -minus_bytes or not start <= first or not last <= end:
                continue
            if first == start and not (instrs[first].name == name and in_place(first, parameter)):
                continue
            if last == end and not in_place(end, name):
                continue
            if any(not (last < lo or hi < first) for lo, hi in tenants):
                continue
            tenants.append((first, last))
            inside.add((k, i))
            break
    return inside


@dataclass(frozen=True)
class HeldUpdate:
    """An optimizer update XLA:GPU gathers early and adds into its parameter late: the
    ``all-gather-done`` ``gathered`` (at ``gathered_at``) read only by ``add`` (at
    ``added_at``), a fusion of an entry parameter and the gathered update that writes a
    donated output; ``bytes`` of gathered update held in between."""

    gathered: str
    add: str
    gathered_at: int
    added_at: int
    bytes: int


def held_updates(text: str) -> list[HeldUpdate]:
    """Each gathered update of the schedule (:class:`HeldUpdate`): the pattern
    ``held_update_gathers`` models (autoshard/intra/memory/reshard_copies.py)."""
    instrs = entry_instructions(text)
    by_name = {ins.name: ins for ins in instrs}
    donated = _donated_outputs(instrs, by_name, module_aliases(text))
    position = {ins.name: k for k, ins in enumerate(instrs)}
    readers: dict[str, list[int]] = {}
    for k, ins in enumerate(instrs):
        for o in ins.operands:
            readers.setdefault(o, []).append(k)
    out = []
    for k, ins in enumerate(instrs):
        if ins.opcode not in ("all-gather-done", "all-gather"):
            continue
        users = readers.get(ins.name, [])
        if len(users) != 1:
            continue
        add = instrs[users[0]]
        reads_parameter = any(by_name[o].opcode == "parameter" for o in add.operands)
        if add.opcode != "fusion" or not reads_parameter or (add.name, ()) not in donated:
            continue
        first = k
        if ins.opcode == "all-gather-done":
            first = position.get(ins.operands[0], k)
        size = sum(s for _, s, _ in ins.leaves)
        out.append(HeldUpdate(ins.name, add.name, first, users[0], size))
    return out


__all__ = [
    "HeldUpdate",
    "HloLivePeak",
    "HloParseError",
    "entry_instructions",
    "held_updates",
    "hlo_live_peak",
    "module_aliases",
    "schedule_buffers",
]


def most_live_square_blocks(text: str, side: int, dtype: str = "f32") -> tuple[int, int]:
    """(the most buffers whose shape ends ``[side, side]`` in ``dtype`` live at once in the
    schedule, the first position where that many are): with ``side`` the sequence length
    and three or more dims, the attention's ``S x S`` blocks an XLA body keeps
    (``wide_attention_held_blocks`` in the memory model)."""
    instrs, bufs = schedule_buffers(text)
    shape = {(ins.name, path): t for ins in instrs for path, _, t in ins.leaves}
    delta = [0] * (len(instrs) + 2)
    for b in bufs:
        m = _ARRAY.match(shape.get(b.made_by, ""))
        dims = m.group(2).split(",") if m and m.group(1) == dtype else []
        if len(dims) >= 3 and dims[-2:] == [str(side)] * 2:
            delta[b.first] += 1
            delta[b.last + 1] -= 1
    best, at, running = 0, 0, 0
    for i, d in enumerate(delta):
        running += d
        if running > best:
            best, at = running, i
    return best, at
