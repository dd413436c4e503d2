"""Merge the per-part JSON files a GPU check left under $OUT into one file per kind.

``gpu_fused_check.sh`` measures in several processes (each with its own timeout), each
writing ``measured_<i>.json`` or ``peer_<i>.json``; a lent machine returns at most 8
files, so the parts are merged into ``measured.json`` and ``peer.json`` (runs appended,
commands joined by " ; ") and the parts removed.  Safe to run twice, and after a check
that was cut short (whatever parts exist are merged)::

    python benchmarks/gpu_merge_out.py $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PARTS = {
    "measured": ["measured_0", "measured_1", "measured_u"],
    "peer": ["peer_0", "peer_1"],
}


def merge(out: Path) -> list[Path]:
    written = []
    for kind, parts in PARTS.items():
        target = out / f"{kind}.json"
        merged = json.loads(target.read_text()) if target.exists() else None
        found = [out / f"{p}.json" for p in parts if (out / f"{p}.json").exists()]
        for f in found:
            d = json.loads(f.read_text())
            if merged is None:
                merged = d
            else:
                merged["runs"] += d["runs"]
                merged["command"] += " ; " + d["command"]
        if found and merged is not None:
            target.write_text(json.dumps(merged, indent=1) + "\n")
            for f in found:
                f.unlink()
            written.append(target)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out_folder", type=Path, help="the folder a GPU check left its parts in ($OUT)"
    )
    args = parser.parse_args()
    if not args.out_folder.is_dir():
        parser.error(f"{args.out_folder} is not a folder: give the $OUT folder of a GPU check")
    for path in merge(args.out_folder):
        print(f"merged into {path}")
