"""Kernels XLA:GPU copies into cuDNN's filter layout and what reads the copies again, from
the stored HLO of GPU runs (a diagnostic; jax-free, no compile).

For every Wide-ResNet module of the given ``--hlo-tar`` files this finds the filter
copies -- a fusion of one parameter alone (``wrapped_transpose``) that a forward cuDNN conv
reads as its filter -- and counts them by their other readers: a ``convBackwardInput``
(the conv's input gradient) and a fusion (the optimizer's update, which reads the copy
where it runs in the filter gradient's layout); with their bytes, how many are live at
the end of the forward pass (the first backward conv) and at the schedule's live peak
(:func:`autoshard.verify.hlo_liveness.hlo_live_peak`)::

    python benchmarks/studies/gpu_filter_copies.py \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27b.tar.gz \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27c.tar.gz

The memory model holds such copies on XLA:GPU (``cudnn_filter_copies``,
autoshard/intra/memory/filter_copies.py; docs/truth_gpu.md).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autoshard.verify.hlo_liveness import hlo_live_peak, schedule_buffers  # noqa: E402

_TARGET = re.compile(r'custom_call_target="__cudnn\$([^"]*)"')
_FORWARD = {"convForward", "convBiasActivationForward"}
_BACKWARD = {"convBackwardInput", "convBackwardFilter"}


def filter_copies(text: str) -> dict:
    """Per kind of copy (its readers besides the forward conv): how many, their bytes, and
    how many (bytes) are live at the forward's end and at the live peak, of one module."""
    instrs, bufs = schedule_buffers(text)
    by = {ins.name: ins for ins in instrs}
    pos = {ins.name: k for k, ins in enumerate(instrs)}
    kind = {}
    for ins in instrs:
        m = _TARGET.search(ins.attributes)
        kind[ins.name] = m.group(1) if m else ins.opcode
    readers = collections.defaultdict(list)
    for ins in instrs:
        for o in ins.operands:
            readers[o].append(ins.name)

    def source(name: str) -> str:
        while by[name].opcode in ("bitcast", "get-tuple-element"):
            name = by[name].operands[0]
        return name

    copies = set()
    for ins in instrs:
        if kind[ins.name] in _FORWARD:
            w = by[source(ins.operands[1])]
            if w.opcode == "fusion" and len(w.operands) == 1:
                if by[source(w.operands[0])].opcode == "parameter":
                    copies.add(w.name)
    backward = min(pos[n] for n, k in kind.items() if k in _BACKWARD)
    peak = hlo_live_peak(text)
    out: dict = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for b in bufs:
        name = b.made_by[0]
        if name not in copies or b.made_by[1] != ():
            continue
        others = {kind[r] for r in readers[name]} - _FORWARD
        key = " + ".join(sorted(others)) or "forward conv only"
        row = out[key]
        row[0], row[1] = row[0] + 1, row[1] + b.bytes
        if b.first <= backward <= b.last:
            row[2], row[3] = row[2] + 1, row[3] + b.bytes
        if b.first <= peak.position <= b.last:
            row[4], row[5] = row[4] + 1, row[5] + b.bytes
    out["(module)"] = [len(instrs), backward, peak.position, peak.temp_bytes, 0, 0]
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tars", nargs="+", type=Path, help="GPU runs' --hlo-tar files")
    args = ap.parse_args()
    gib = 2**30
    for path in args.tars:
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                name = Path(m.name).name.removesuffix(".hlo.txt")
                if not m.isfile() or not name.startswith("wresnet"):
                    continue
                rows = filter_copies(tar.extractfile(m).read().decode())
                n, backward, at, temp, _, _ = rows.pop("(module)")
                print(
                    f"{name}: {n} instructions, first backward conv at {backward}, "
                    f"schedule peak at {at} ({temp / gib:.2f} GiB temporaries)"
                )
                print(
                    f"  {'other readers':38s} {'copies':>6s} {'GiB':>6s} "
                    f"{'fwd end':>7s} {'GiB':>6s} {'at peak':>7s} {'GiB':>6s}"
                )
                for key, (c, cb, e, eb, p, pb) in sorted(rows.items()):
                    print(
                        f"  {key:38s} {c:6d} {cb / gib:6.2f} {e:7d} {eb / gib:6.2f} "
                        f"{p:7d} {pb / gib:6.2f}"
                    )


if __name__ == "__main__":
    main()
