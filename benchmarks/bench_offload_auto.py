"""What ``--offload auto`` costs the stage search: ILPs solved and wall time, before/after.

The cases of docs/offload.md that run the stage search under ``auto`` (``plan --pipeline``
and ``simulate --plan auto``), plus one where nothing needs offload (gpt-6.7b on eight
80 GB A100s). Each run is its own process (``AUTOSHARD_JOBS=1``: the ILPs solved in it, so
runs on a shared machine compare; no unit cache), timed from the call to its return (the
trace included, the imports not), with the ILPs counted where the stage search calls the
solver. With ``--old TREE`` every repetition runs the old tree's ``autoshard`` and then
this one's, alternating, so the machine's load falls on both; medians of ``--repeat``
runs, the load average (``/proc/loadavg``, 1 min) before each run recorded.

    python benchmarks/bench_offload_auto.py [--old /path/to/old/tree] [--repeat 3]
        [--cases plan-6.7b-v100x8 ...] [--out benchmarks/results/bench_offload_auto.json]

Writes the JSON (each run, the medians per case and tree, the commit) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABLATION = dict(
    num_layers=8, hidden=2048, vocab_size=25600, seq_len=1024, global_batch=8, attention="unfused"
)
# name -> (what it runs, docs/offload.md's command)
CASES = {
    "plan-6.7b-v100x8": (
        "plan",
        "plan --model gpt-6.7b --pipeline auto --devices 8 --stages 4 --microbatches 4 "
        "--dtype bfloat16 --cluster alpa-v100 --offload auto",
    ),
    "plan-6.7b-a100x8": (
        "plan",
        "the same on dgx-a100 (80 GB: nothing needs offload)",
    ),
    "sim-6.7b-h100x1": (
        "simulate",
        "simulate --model gpt-6.7b --cluster dgx-h100 --gpus 1 --plan auto --global-batch 8 "
        "--microbatches 1 --recompute none --dtype bf16 --offload auto",
    ),
    "sim-ablation-v100x1": (
        "simulate",
        "simulate --model gpt-1.3b --cluster alpa-v100 --gpus 1 --plan auto --layers 8 "
        "--hidden 2048 --vocab 25600 --seq 1024 --global-batch 8 --attention unfused "
        "--microbatches 1 --recompute none --offload auto",
    ),
    "sim-ablation-v100x1-recompute": (
        "simulate",
        "the same with --recompute auto (fits without offload: selective recompute)",
    ),
}


def run_case(name: str) -> dict:
    """One run of ``name`` in this process: seconds, ILPs, the plan chosen."""
    import autoshard.inter.stage_cost as stage_cost
    from autoshard.inter.progress import quiet

    counted = {"ilps": 0}
    solve = stage_cost.solve

    def counting(*args, **kwargs):
        counted["ilps"] += 1
        return solve(*args, **kwargs)

    stage_cost.solve = counting
    t0 = time.perf_counter()
    if name.startswith("plan-"):
        from autoshard.api_pipeline import auto_stage_plan
        from autoshard.inter.options import StageSearchOptions

        cluster = "alpa-v100" if "v100" in name else "dgx-a100"
        plan = auto_stage_plan(
            "gpt-6.7b", 1, 8, StageSearchOptions(4, num_stages=4), cluster=cluster,
            dtype="bfloat16", offload="auto", progress=quiet(),
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        objective = plan.objective_s
        placements = [s.offload for s in plan.stages]
        recompute = [s.recompute for s in plan.stages]
    else:
        from autoshard.sim.simulate import simulate

        if name == "sim-6.7b-h100x1":
            kw = dict(global_batch=8, dtype="bf16", recompute="none")
            report = simulate("gpt-6.7b", "dgx-h100", 1, plan="auto", num_microbatches=1,
                              offload="auto", **kw)  # fmt: skip
        else:
            recompute = "auto" if name.endswith("recompute") else "none"
            report = simulate("gpt-1.3b", "alpa-v100", 1, plan="auto", num_microbatches=1,
                              recompute=recompute, offload="auto", **ABLATION)  # fmt: skip
        seconds = time.perf_counter() - t0
        objective = report.step_time_s
        stages = report.plan["stages"]
        placements = [s["offload"] for s in stages]
        recompute = [s["recompute"] for s in stages]
    return {
        "case": name,
        "seconds": seconds,
        "ilps": counted["ilps"],
        "step_s": objective,
        "placements": placements,
        "recompute": recompute,
    }


def _one(tree: Path, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), AUTOSHARD_JOBS="1")
    env.pop("AUTOSHARD_CACHE_DIR", None)
    load = float(Path("/proc/loadavg").read_text().split()[0])
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", name],
        env=env, capture_output=True, text=True, check=False, timeout=1800,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{name} on {tree} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row | {"tree": str(tree), "load_1min": load}


def _commit(tree: Path) -> str:
    got = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return got.stdout.strip() or "not a git tree"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a worker: one run, JSON on stdout
    ap.add_argument("--old", type=Path, help="a tree with the autoshard to compare against")
    ap.add_argument(
        "--new", type=Path, default=ROOT, help="the tree measured as new (default: this one)"
    )
    ap.add_argument("--old-commit", help="the old tree's commit, where it is no git tree")
    ap.add_argument("--new-commit", help="the new tree's commit, where it is no git tree")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_offload_auto.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one)))
        return
    trees = ([("old", args.old)] if args.old else []) + [("new", args.new)]
    commits = {"old": args.old_commit, "new": args.new_commit}
    runs = []
    for case in args.cases:
        for rep in range(args.repeat):
            for label, tree in trees:
                print(f"[bench] {case} {label} run {rep + 1}/{args.repeat} ...", file=sys.stderr,
                      flush=True)  # fmt: skip
                runs.append(_one(tree, case) | {"which": label, "repeat": rep})
                _write(args, trees, commits, runs)  # what has run so far
    _write(args, trees, commits, runs, report=True)


def _write(args, trees, commits, runs, report: bool = False) -> None:
    """The JSON of ``runs`` (medians of the runs made so far); with ``report``, the table."""
    medians = []
    for case in args.cases:
        for label, tree in trees:
            mine = [r for r in runs if r["case"] == case and r["which"] == label]
            if not mine:
                continue
            medians.append(
                {
                    "case": case,
                    "which": label,
                    "commit": commits[label] or _commit(tree),
                    "median_seconds": statistics.median(r["seconds"] for r in mine),
                    "ilps": sorted({r["ilps"] for r in mine}),
                    "step_s": sorted({r["step_s"] for r in mine}),
                    "placements": mine[0]["placements"],
                    "recompute": mine[0]["recompute"],
                    "runs": len(mine),
                    "load_1min": [r["load_1min"] for r in mine],
                }
            )
    result = {
        "benchmark": "bench_offload_auto",
        "cases": {k: v[1] for k, v in CASES.items() if k in args.cases},
        "repeat": args.repeat,
        "env": "AUTOSHARD_JOBS=1, no unit cache, one process per run",
        "cpus": os.cpu_count(),
        "medians": medians,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not report:
        return
    print(f"{'case':32} {'tree':4} {'commit':8} {'median s':>9} {'ILPs':>6}  step s / placements")
    for m in medians:
        print(
            f"{m['case']:32} {m['which']:4} {m['commit']:8} {m['median_seconds']:9.1f} "
            f"{','.join(map(str, m['ilps'])):>6}  {','.join(f'{s:.4g}' for s in m['step_s'])} "
            f"{' | '.join(m['placements'])}  (load {', '.join(f'{x:.1f}' for x in m['load_1min'])})"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
