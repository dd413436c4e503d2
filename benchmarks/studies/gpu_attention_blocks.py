"""How many float32 ``S x S`` attention blocks XLA:GPU keeps a layer, from the stored HLO of
GPU runs (a diagnostic; jax-free, no compile).

cuDNN's flash attention takes no float32, so a float32 GPT or MoE step runs the fused
attention operator's XLA body on XLA:GPU, whose ``[..., S, S]`` float32 blocks XLA keeps
from the forward to the backward.  For every GPT / MoE module of the given ``--hlo-tar``
files (names ``MODEL-L<layers>-PLAN-MESH``) this prints the most such blocks live at once
in XLA's schedule (:func:`autoshard.verify.hlo_liveness.most_live_square_blocks`), per
layer, and how many are live at the schedule's live peak::

    python benchmarks/studies/gpu_attention_blocks.py \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27*.tar.gz [--seq 1024]

The memory model's ``wide_attention_held_blocks`` (autoshard/hardware/mesh.py) is the
per-layer count this measured (docs/truth_gpu.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autoshard.verify.hlo_liveness import hlo_live_peak, most_live_square_blocks  # noqa: E402

_ROW = re.compile(r"^(gpt|moe)-[\w.]+-L(\d+)-")


def _blocks_at(text: str, side: int, position: int) -> int:
    """The ``[..., side, side]`` float32 buffers live at ``position`` of the schedule."""
    from autoshard.verify.hlo_liveness import schedule_buffers

    instrs, bufs = schedule_buffers(text)
    shape = {(ins.name, path): t for ins in instrs for path, _, t in ins.leaves}
    tail = f"{side},{side}]"
    return sum(
        1
        for b in bufs
        if b.first <= position <= b.last
        and shape.get(b.made_by, "").startswith("f32[")
        and shape[b.made_by].split("{")[0].endswith(tail)
        and shape[b.made_by].count(",") >= 2
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tars", nargs="+", type=Path, help="GPU runs' --hlo-tar files")
    ap.add_argument("--seq", type=int, default=1024, help="the sequence length S")
    args = ap.parse_args()
    print(f"{'module':36s} {'layers':>6s} {'most live':>9s} {'a layer':>7s} {'at peak':>7s}")
    for path in args.tars:
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                name = Path(m.name).name.removesuffix(".hlo.txt")
                row = _ROW.match(name)
                if not m.isfile() or not row:
                    continue
                text = tar.extractfile(m).read().decode()
                most, _ = most_live_square_blocks(text, args.seq)
                layers = int(row.group(2))
                at_peak = _blocks_at(text, args.seq, hlo_live_peak(text).position)
                print(f"{name:36s} {layers:6d} {most:9d} {most / layers:7.2f} {at_peak:7d}")


if __name__ == "__main__":
    main()
