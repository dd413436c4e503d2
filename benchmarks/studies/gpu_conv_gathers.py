"""Gathered activations XLA:GPU reads in both a forward conv and a filter-gradient conv,
from the stored HLO of GPU runs (a diagnostic; jax-free, no compile).

For every Wide-ResNet module of the given ``--hlo-tar`` files this counts the all-gathers
whose result (directly or through up to two fusions: XLA's layout transposes) is read by
a forward cuDNN conv and by a ``convBackwardFilter``, their bytes, and how many of them
are live at the schedule's live peak
(:func:`autoshard.verify.hlo_liveness.hlo_live_peak`)::

    python benchmarks/studies/gpu_conv_gathers.py \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27b.tar.gz \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27c.tar.gz

The memory model holds such copies to the backward conv on XLA:GPU
(``reused_conv_gathers``, autoshard/intra/memory/reshard_copies.py; docs/truth_gpu.md).
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

_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FORWARD = {"convForward", "convBiasActivationForward"}


def conv_gathers(text: str) -> tuple[int, int, int, int, int]:
    """(gathers read by a forward conv and a filter-gradient conv, their bytes, how many
    are live at the live peak, their bytes, the live peak's bytes) of one module."""
    instrs, bufs = schedule_buffers(text)
    target = {}
    for ins in instrs:
        m = _TARGET.search(ins.attributes)
        target[ins.name] = m.group(1).split("$")[-1] if m else ""
    readers = collections.defaultdict(list)
    for ins in instrs:
        for o in ins.operands:
            readers[o].append(ins.name)

    def convs(name: str, depth: int = 0) -> set[str]:
        out: set[str] = set()
        for r in readers[name]:
            if target[r].startswith("conv"):
                out.add(target[r])
            elif depth < 2 and not target[r]:
                out |= convs(r, depth + 1)
        return out

    peak = hlo_live_peak(text)
    n = nbytes = live = live_bytes = 0
    for b in bufs:
        name = b.made_by[0]
        if not name.startswith("all-gather"):
            continue
        kinds = convs(name.replace("-start", "-done"))
        if kinds & _FORWARD and "convBackwardFilter" in kinds:
            n, nbytes = n + 1, nbytes + b.bytes
            if b.first <= peak.position <= b.last:
                live, live_bytes = live + 1, live_bytes + b.bytes
    return n, nbytes, live, live_bytes, peak.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tars", nargs="+", type=Path, help="GPU runs' --hlo-tar files")
    args = ap.parse_args()
    gib = 2**30
    print(
        f"{'module':36s} {'gathers':>7s} {'GiB':>6s} {'at peak':>7s} {'GiB':>6s} {'peak GiB':>8s}"
    )
    for path in args.tars:
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                name = Path(m.name).name.removesuffix(".hlo.txt")
                if not m.isfile() or not name.startswith("wresnet"):
                    continue
                n, nb, live, lb, peak = conv_gathers(tar.extractfile(m).read().decode())
                print(
                    f"{name:36s} {n:7d} {nb / gib:6.2f} {live:7d} {lb / gib:6.2f} {peak / gib:8.2f}"
                )


if __name__ == "__main__":
    main()
