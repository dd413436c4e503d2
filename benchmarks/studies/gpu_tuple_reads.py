"""How much of the schedule reader's live peak is its reading of tuples: each module of
the given ``--hlo-tar`` files read as stored and with every ``get-tuple-element`` moved
next to the tuple it names (a diagnostic; jax-free, no compile).

:func:`autoshard.verify.hlo_liveness.hlo_live_peak` counts an instruction as reading every
buffer of its operands, so a ``get-tuple-element`` printed late in the schedule (XLA puts
these views anywhere: they run nothing) keeps every element of a multi-output fusion live
to it, where XLA's liveness ends each element at the readers of its own view. Moving each
``get-tuple-element`` right after its operand changes nothing XLA runs and leaves each
element live to its own readers::

    python benchmarks/studies/gpu_tuple_reads.py \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27b.tar.gz \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27c.tar.gz \\
        --runs benchmarks/results/gpu_truth_scale_h100_2026-11-27b.json \\
        benchmarks/results/gpu_truth_scale_h100_2026-11-27c.json

prints both temporaries (GiB) beside XLA:GPU's own (``temp_bytes`` of the runs' JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autoshard.verify.hlo_liveness import hlo_live_peak  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tars", nargs="+", type=Path, help="GPU runs' --hlo-tar files")
    ap.add_argument("--runs", nargs="*", type=Path, default=[], help="the runs' JSON")
    args = ap.parse_args()
    temp = {}
    for run in args.runs:
        for row in json.loads(run.read_text())["rows"]:
            memory = (row.get("verification") or {}).get("compiled_memory")
            if memory:
                temp[row["name"]] = memory["temp_bytes"]
    gib = 2**30
    print(f"{'module':36s} {'XLA':>6s} {'stored':>15s} {'views moved':>15s}")
    for path in args.tars:
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if not m.isfile():
                    continue
                name = Path(m.name).name.removesuffix(".hlo.txt")
                text = tar.extractfile(m).read().decode()
                xla = temp.get(name)
                cells = []
                for t in (text, views_next_to_tuples(text)):
                    peak = hlo_live_peak(t).temp_bytes
                    rel = f" ({peak / xla - 1:+.1%})" if xla else ""
                    cells.append(f"{peak / gib:6.2f}{rel}")
                shown = f"{xla / gib:6.2f}" if xla else "     -"
                print(f"{name:36s} {shown} {cells[0]:>15s} {cells[1]:>15s}")


if __name__ == "__main__":
    main()
