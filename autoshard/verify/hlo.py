"""HLO text, read: the module's computations and instructions, shapes and attributes.

Takes the text of ``jax.jit(f).lower(...).compile().as_text()`` and returns a
:class:`_Module`: every instruction (name, computation, shape, opcode, operands, the text
of its attributes), each computation's parameters and root, each value's users, and the
module's ``replica_count`` and ``num_partitions``.  Helpers read one attribute
(:func:`_attr`), the computations an instruction calls (:func:`_called`) and a shape's
array leaves and bytes (:func:`_leaves`, :func:`_nbytes`); :class:`CompiledCollective` is
the record a collective read from it becomes.  The readers built on it --
replica groups, collectives, the XLA:CPU normalisation -- live beside it in
:mod:`autoshard.verify`.  Jax-free.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from autoshard.ir.spec import Collective

# HLO element type -> (numpy-style name, bits).
_HLO_DTYPES = {
    "pred": ("bool", 8), "s4": ("int4", 4), "u4": ("uint4", 4), "s8": ("int8", 8),
    "u8": ("uint8", 8), "s16": ("int16", 16), "u16": ("uint16", 16), "s32": ("int32", 32),
    "u32": ("uint32", 32), "s64": ("int64", 64), "u64": ("uint64", 64),
    "f16": ("float16", 16), "bf16": ("bfloat16", 16), "f32": ("float32", 32),
    "f64": ("float64", 64), "c64": ("complex64", 64), "c128": ("complex128", 128),
    "f8e4m3fn": ("float8_e4m3fn", 8), "f8e5m2": ("float8_e5m2", 8), "token": ("token", 0),
}  # fmt: skip


@dataclass(frozen=True)
class _Instr:
    name: str
    computation: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attrs: str


@dataclass(frozen=True)
class CompiledCollective:
    """One collective found in compiled HLO, in the spec's :class:`Collective` terms."""

    collective: Collective
    dtype: str
    hlo_name: str
    note: str = ""
    in_loop: bool = False
    hlo_opcode: str = ""


@dataclass
class _Module:
    instrs: dict[str, _Instr] = field(default_factory=dict)
    computations: dict[str, list[str]] = field(default_factory=dict)
    roots: dict[str, str] = field(default_factory=dict)
    users: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    num_partitions: int = 1
    replica_count: int = 1
    _callers: dict[str, list[str]] | None = None
    # index_eval's _IndexEvaluator for this module, made on first use (index_eval.py reads
    # this module, so the slot is not typed with its class)
    _evaluator: object | None = None

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
_COMP_END_RE = re.compile(r"^\s*\}\s*(?:,\s*\w+=.*)?$")
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
        if _COMP_END_RE.match(line):  # "}", or "}, execution_thread=..." (async threads)
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


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]
