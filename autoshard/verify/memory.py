"""The memory of a compiled executable: XLA's allocation and its live peak.

:func:`memory_stats` reads ``compiled.memory_analysis()`` (XLA's allocation per device).
:func:`live_range_peak` reads the live-range and buffer-assignment dumps XLA writes with
:data:`LIVE_RANGE_DUMP_OPTIONS` and returns the most bytes its schedule holds live at
once (:class:`LivePeak`); :func:`dump_live_peak` does so for a dump folder, and
:func:`stated_live_peak_bytes` reads the (different) peak the dump itself prints.

Only :func:`memory_stats` touches a jax object, duck-typed; this module does not import jax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
