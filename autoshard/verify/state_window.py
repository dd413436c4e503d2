"""How much offloaded state a step lowered for GPU may hold on the device at once (jax-free).

XLA:CPU ignores memory kinds, so an offloaded step's device working set cannot be measured
here; what can be read is the program XLA:GPU receives (``jit(...).trace(...).lower(
lowering_platforms=("cuda",))``, which needs no GPU): every ``jax.device_put`` to or from
``pinned_host`` is an ``annotate_device_placement`` custom call there. A **fetch** is one
to ``device`` of a value that comes from a ``pinned_host`` argument (through tuples,
``get-tuple-element``, ``opt-barrier``, sharding annotations); a **store** one to
``pinned_host`` of a value made on the device. The data dependences bound what any schedule
can do: fetch ``G`` may be on the device together with fetch ``F`` unless all of ``G``'s
stores (those its value feeds, not through a later fetch) are ancestors of ``F``, or all
of ``F``'s of ``G``.
:func:`state_window` gives the most bytes of fetches that may be on the device together.
Where each fetch depends on no store (the runtime's form before streaming), that is all of
the offloaded state: what XLA:GPU held on one H100 (docs/offload.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f64": 8}
_HOST_ARG = re.compile(r"%arg(\d+): tensor<[^>]*> \{[^}]*mhlo\.memory_kind = \"pinned_host\"")
_PLACEMENT = re.compile(r'_xla_buffer_placement="(\w+)"')
_MEMORY_ONLY = ("tuple", "get-tuple-element", "opt-barrier", "bitcast")


@dataclass(frozen=True)
class StateWindow:
    """``fetches`` / ``stores``: copies of offloaded state to / from the device;
    ``total_bytes``: the fetched bytes; ``window_bytes``: the most of them that may be on
    the device at once. Bytes of the unpartitioned (global) shapes."""

    fetches: int
    stores: int
    total_bytes: int
    window_bytes: int


def _nbytes(shape: str) -> int:
    m = _ARRAY.match(shape)
    if not m:
        return 0
    n = 1
    for d in m.group(2).split(","):
        n *= int(d) if d else 1
    return n * _BYTES.get(m.group(1), 4)


def _split(rest: str) -> tuple[str, str, list[str], str]:
    """``shape opcode(operands), attributes`` -> its four parts (operand names only)."""
    depth = i = 0
    while rest[i] != " " or depth:  # the shape ends at the first space outside brackets
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(rest[i], 0)
        i += 1
    shape, rest = rest[:i], rest[i + 1 :]
    k = rest.index("(")
    depth, q = 1, k + 1
    while depth:
        depth += {"(": 1, ")": -1}.get(rest[q], 0)
        q += 1
    operands = [o.split()[-1].lstrip("%") for o in rest[k + 1 : q - 1].split(",") if o.strip()]
    return shape, rest[:k], operands, rest[q:]


def entry(hlo: str) -> dict[str, tuple[str, str, list[str], str]]:
    """The ENTRY computation: name -> (shape, opcode, operands, attributes), in order."""
    lines = hlo.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("no ENTRY computation in this text (is it an HLO module?)")
    out = {}
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _LINE.match(line)
        if m:
            out[m.group(1)] = _split(m.group(2))
    return out


def state_window(lowered_text: str, lowered_hlo: str) -> StateWindow:
    """The :class:`StateWindow` of a step lowered for GPU: ``lowered_text`` its StableHLO
    (the arguments' memory kinds), ``lowered_hlo`` the same module as HLO text."""
    host_params = {int(n) for n in _HOST_ARG.findall(lowered_text)}
    ins = entry(lowered_hlo)
    order = {n: i for i, n in enumerate(ins)}

    def placement(name: str) -> str | None:
        _, opcode, _, attrs = ins[name]
        if opcode == "custom-call" and '"annotate_device_placement"' in attrs:
            m = _PLACEMENT.search(attrs)
            return m.group(1) if m else None
        return None

    on_host: dict[str, bool] = {}

    def in_host_memory(name: str) -> bool:
        """A host argument or a value put in ``pinned_host``, seen through instructions
        that only move or name it."""
        if name not in on_host:
            _, opcode, operands, attrs = ins[name]
            if opcode == "parameter":
                on_host[name] = int(operands[0]) in host_params
            elif placement(name) == "pinned_host":
                on_host[name] = True
            elif opcode in _MEMORY_ONLY or (opcode == "custom-call" and '"Sharding"' in attrs):
                on_host[name] = any(in_host_memory(o) for o in operands if o in ins)
            else:
                on_host[name] = False
        return on_host[name]

    def operand(name: str) -> str:
        return ins[name][2][0]

    fetches = [n for n in ins if placement(n) == "device" and in_host_memory(operand(n))]
    stores = [n for n in ins if placement(n) == "pinned_host" and not in_host_memory(operand(n))]
    ancestors = _ancestors(ins, order)
    feeds = {f: _feeds(f, fetches, stores, ancestors, order) for f in fetches}
    size = {f: _nbytes(ins[f][0]) for f in fetches}

    def done_before(a: str, b: str) -> bool:
        return bool(feeds[a]) and all(ancestors[b] >> order[s] & 1 for s in feeds[a])

    window = max(
        (
            sum(size[g] for g in fetches if not done_before(g, f) and not done_before(f, g))
            for f in fetches
        ),
        default=0,
    )
    return StateWindow(len(fetches), len(stores), sum(size.values()), window)


def _feeds(f: str, fetches: list, stores: list, ancestors: dict, order: dict) -> list[str]:
    """The stores fed by fetch ``f``'s value: those it is an ancestor of, less those it
    reaches only through a later fetch (a store of a later group waits on ``f``'s group
    through the barrier, but holds nothing of ``f``)."""
    bit = 1 << order[f]
    later = 0
    for h in fetches:
        if ancestors[h] & bit:
            later |= 1 << order[h]
    return [s for s in stores if ancestors[s] & bit and not ancestors[s] & later]


def _ancestors(ins: dict, order: dict) -> dict[str, int]:
    """Every instruction's transitive operands, a bit per position; the text lists
    operands before their users, so one pass in order."""
    out: dict[str, int] = {}
    for name, (_, _, operands, _) in ins.items():
        acc = 0
        for o in operands:
            if o in out:
                acc |= out[o] | (1 << order[o])
        out[name] = acc
    return out
