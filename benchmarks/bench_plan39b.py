"""The issue-#32 search-time target: ``autoshard plan --model gpt-39b --batch 1024
--devices 64 --cluster alpa-v100 --pipeline auto --microbatches 64 --json``, cold, with
``--memory-budget 1024`` (GiB): the issue's search exactly. Since 2026-11-27 a pipeline plan
with ``--cluster`` takes the preset's HBM as its budget by default, and the plan this
command finds peaks at 126 GiB per device, so without the flag it ends after the same
search with exit status 2 (no plan of 64 micro-batches fits a 16 GB V100); the flag keeps
the search and the objective comparable with the runs before.

Each run is a fresh process with no ``AUTOSHARD_CACHE_DIR`` (no unit read from disk),
timed wall-clock and in CPU seconds (user + system of the child, which an idle machine's
wall time approaches when one core is busy), with the 1-minute load average before and
after.  ``--baseline DIR`` alternates each run with the same command run from another
checkout (``PYTHONPATH=DIR``), so that both are measured in the same minutes.  Prints each
run and the medians, and writes ``benchmarks/results/bench_plan39b.json``.

    python benchmarks/bench_plan39b.py [--repeats 3] [--baseline /work/main] [--jobs N]
        [--out FILE]

Each run prints its phases: imports and the JSON (the wall time outside the search), the
trace, the stage ILPs (their count and the wall seconds per ILP) and the stage DP (the
spans, the DP runs and the chosen stages' specs).  The child inherits the environment;
``--jobs N`` sets ``AUTOSHARD_JOBS=N`` for it (the stage ILPs' worker processes: unset,
one per CPU; ``1``, in the search's own process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGV = (
    "plan --model gpt-39b --batch 1024 --devices 64 --cluster alpa-v100 --pipeline auto "
    "--microbatches 64 --json --memory-budget 1024"
).split()


def run_once(tree: Path, jobs: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AUTOSHARD_CACHE_DIR"}
    env["PYTHONPATH"] = str(tree)
    if jobs is not None:
        env["AUTOSHARD_JOBS"] = jobs
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", *ARGV],
        capture_output=True, text=True, env=env, cwd=tree, timeout=3600,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {
        "tree": str(tree),
        "wall_s": wall,
        "cpu_s": cpu,
        "load_1min_before": load,
        "load_1min_after": os.getloadavg()[0],
        "autoshard_jobs": env.get("AUTOSHARD_JOBS"),
    }
    if proc.returncode != 0:
        row["error"] = proc.stderr[-2000:]
        return row
    plan = json.loads(proc.stdout)
    phases = dict(plan["phase_seconds"])
    phases["imports_and_json"] = max(wall - plan["search_seconds"], 0.0)
    row.update(
        objective_s=plan["objective_s"],
        phase_seconds=phases,
        num_ilps=plan["num_ilps"],
        seconds_per_ilp=phases.get("intra_op_ilps", 0.0) / max(plan["num_ilps"], 1),
        stages=[
            [s["start_layer"], s["end_layer"], s["submesh"], s["logical_mesh"], s["latency_s"]]
            for s in plan["stages"]
        ],
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="another checkout to alternate with")
    ap.add_argument("--jobs", default=None, help="AUTOSHARD_JOBS for the runs (default: inherit)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_plan39b.json"))
    args = ap.parse_args()
    trees = {"this": ROOT}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for k in range(args.repeats):
        for name, tree in trees.items():
            row = run_once(tree, args.jobs)
            runs[name].append(row)
            print(
                f"{name} run {k + 1}: wall {row['wall_s']:.1f} s, CPU {row['cpu_s']:.1f} s, "
                f"load {row['load_1min_before']:.1f}->{row['load_1min_after']:.1f}, "
                f"objective {row.get('objective_s', 'ERROR')} s, phases (wall s) "
                f"{ {p: round(v, 1) for p, v in row.get('phase_seconds', {}).items()} }, "
                f"{row.get('num_ilps')} ILPs at {row.get('seconds_per_ilp', 0.0):.2f} s each",
                flush=True,
            )
    summary = {}
    for name, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        summary[name] = {
            "median_wall_s": statistics.median(r["wall_s"] for r in ok) if ok else None,
            "median_cpu_s": statistics.median(r["cpu_s"] for r in ok) if ok else None,
            "objectives_s": sorted({r["objective_s"] for r in ok}),
            "load_1min": [r["load_1min_before"] for r in rows],
        }
        print(f"{name}: median wall {summary[name]['median_wall_s']} s, "
              f"median CPU {summary[name]['median_cpu_s']} s")  # fmt: skip
    doc = {
        "benchmark": "bench_plan39b",
        "command": "autoshard " + " ".join(ARGV),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
