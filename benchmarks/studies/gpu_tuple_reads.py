"""The schedule reader's reading of tuples, checked: each module of the given ``--hlo-tar``
files (or ``.hlo.txt[.gz]`` files) read as stored and with every ``get-tuple-element``
moved next to the tuple it names, beside XLA:GPU's own temporaries (a diagnostic;
jax-free, no compile).

XLA prints a ``get-tuple-element`` anywhere after its tuple (it runs nothing).  Until
2026-11-28 :func:`autoshard.verify.hlo_liveness.hlo_live_peak` counted it as reading every
element of the tuple, so a view printed late kept every element of a multi-output fusion
live to it (wresnet-1b zero2 read +10.9% over XLA as stored, -3.6% with the views moved);
it now reads only the element it names, as XLA's dataflow does, and both columns agree.
``--pack`` adds where a best-fit heap puts the reader's own buffers (128-byte aligned,
largest first, or longest-lived first; XLA:GPU keeps the better of such orders), the
gaps any placement leaves above the live peak (slow on the large modules)::

    python benchmarks/studies/gpu_tuple_reads.py \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27b.tar.gz \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27c.tar.gz \\
        --runs benchmarks/results/gpu_truth_scale_h100_2026-11-27b.json \\
        benchmarks/results/gpu_truth_scale_h100_2026-11-27c.json
    python benchmarks/studies/gpu_tuple_reads.py --pack \\
        tests/fixtures/xla_gpu/h100_2026-11-27/gpt-tiny-L2-*-2x4.hlo.txt.gz \\
        --runs benchmarks/results/gpu_truth_h100_2026-11-27.json

prints the temporaries (GiB, or KiB below 1 GiB) beside XLA:GPU's own (``temp_bytes`` of
the runs' JSON).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autoshard.verify.hlo_liveness import (  # noqa: E402
    _union,
    _value_pieces,
    hlo_live_peak,
    in_dead_donated_parameters,
    schedule_buffers,
)

_DEFINES = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_GTE = re.compile(r"get-tuple-element\(%([^\s,()]+)\)")


def views_next_to_tuples(text: str) -> str:
    """``text`` with each ``get-tuple-element`` of the entry computation moved to just
    after the instruction that defines its operand (views of one operand in their order)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    groups: list[list[str]] = []  # a line that stays, then the views moved after it
    group_of: dict[str, int] = {}  # name -> its group
    for line in lines[start + 1 : end]:
        m, g = _DEFINES.match(line), _GTE.search(line)
        root = line.lstrip().startswith("ROOT ")
        if m and g and not root and g.group(1) in group_of:
            k = group_of[g.group(1)]
            groups[k].append(line)
            group_of[m.group(1)] = k
            continue
        if m:
            group_of[m.group(1)] = len(groups)
        groups.append([line])
    body = [line for group in groups for line in group]
    return "\n".join(lines[: start + 1] + body + lines[end:])


def best_fit_heap(text: str, largest_first: bool, align: int = 128) -> int:
    """The bytes a best-fit heap needs for the temporaries of ``text`` (the reader's
    buffers and live ranges, each rounded up to ``align``, less what it puts in donated
    parameters' buffers): buffers taken largest first
    (or longest-lived first), each put in the smallest gap that is free for its whole
    live range, else on top."""
    instrs, bufs = schedule_buffers(text)
    pieces = _value_pieces(instrs, bufs)
    inside = in_dead_donated_parameters(instrs, bufs, pieces)
    items = [
        (first, last, -(-b.bytes // align) * align)
        for k, b in enumerate(bufs)
        if b.bytes and not b.parameter and not b.donated
        for first, last in _union([p for i, p in enumerate(pieces[k]) if (k, i) not in inside])
    ]
    if largest_first:
        items.sort(key=lambda t: (-t[2], t[0]))
    else:
        items.sort(key=lambda t: (t[0] - t[1], -t[2]))
    placed: list[tuple[int, int, int, int]] = []  # first, last, offset, bytes
    top = 0
    for first, last, size in items:
        taken = sorted((o, o + s) for a, z, o, s in placed if a <= last and first <= z)
        best = at = None
        end = 0
        for lo, hi in taken:
            if lo - end >= size and (best is None or lo - end < best):
                best, at = lo - end, end
            end = max(end, hi)
        at = end if at is None else at
        placed.append((first, last, at, size))
        top = max(top, at + size)
    return top


def modules(paths: list[Path]):
    """(name, text) of each module in the tars and text files."""
    for path in paths:
        if path.name.endswith((".hlo.txt", ".hlo.txt.gz")):
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as f:
                yield path.name.split(".hlo.txt")[0], f.read()
            continue
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.isfile():
                    name = Path(m.name).name.removesuffix(".hlo.txt")
                    yield name, tar.extractfile(m).read().decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tars", nargs="+", type=Path, help="--hlo-tar files or .hlo.txt[.gz]")
    ap.add_argument("--runs", nargs="*", type=Path, default=[], help="the runs' JSON")
    ap.add_argument("--pack", action="store_true", help="add the best-fit heaps")
    args = ap.parse_args()
    temp = {}
    for run in args.runs:
        for row in json.loads(run.read_text())["rows"]:
            memory = (row.get("verification") or {}).get("compiled_memory")
            if not memory:
                continue
            if temp.setdefault(row["name"], memory["temp_bytes"]) != memory["temp_bytes"]:
                raise SystemExit(f"{row['name']}: two runs compiled it differently; give one")
    heads = ["stored", "views moved"] + (["best fit, largest", "best fit, longest"] * args.pack)
    print(f"{'module':36s} {'XLA':>9s} " + " ".join(f"{h:>19s}" for h in heads))
    for name, text in modules(args.tars):
        xla = temp.get(name)
        unit = 2**30 if (xla or hlo_live_peak(text).temp_bytes) >= 2**30 else 2**10
        figures = [hlo_live_peak(t).temp_bytes for t in (text, views_next_to_tuples(text))]
        if args.pack:
            figures += [best_fit_heap(text, True), best_fit_heap(text, False)]
        cells = []
        for b in figures:
            rel = f" ({b / xla - 1:+.1%})" if xla else ""
            cells.append(f"{b / unit:9.2f}{rel}")
        shown = f"{xla / unit:9.2f}" if xla else "        -"
        print(f"{name:36s} {shown} " + " ".join(f"{c:>19s}" for c in cells))


if __name__ == "__main__":
    main()
