"""What ``grad_reduce="auto"`` adds to the stage search's time, against the default
``"microbatch"`` (docs/weak_scaling.md, cause 1): an A/B for the default.

Every run is a fresh process with ``AUTOSHARD_CACHE_DIR`` unset (the on-disk unit cache is
opt-in: no plan is read from disk, none from an earlier run in memory), and the two
arms alternate A B B A per round (A: ``microbatch``, B: ``auto``) so that a machine whose
load drifts charges both alike; the table gives medians. Two kinds of run:

* ``simulate``: ``autoshard simulate --model M --cluster C --gpus N --global-batch 1024
  --plan auto --microbatches K --grad-reduce G --json`` at weak-scaling figure points, ``K``
  the count the figure's auto point chose (one count: the micro-batch search would repeat
  the same per count). Recorded: the report's ``search_seconds`` (the ILPs and the stage
  DP), the process's wall seconds (tracing and imports too) and the step time.
* ``plan``: ``autoshard plan --model gpt-tiny ... --pipeline auto --devices 8 --grad-reduce
  G`` on fake CPU devices (what a user of the CLI waits for): the process's wall seconds.

::

    python benchmarks/studies/grad_reduce_default_ab.py [--rounds 2] [--out FILE]
    python benchmarks/studies/grad_reduce_default_ab.py --only simulate --rounds 1 \
        --point dgx-a100:gpt-6.7b:16:16 --point dgx-h100:gpt-39b:64:64 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ARMS = ("microbatch", "auto")
# (cluster, model, GPUs, micro-batches: the figure's auto point's count,
# benchmarks/results/weak_scaling_chunk_<cluster>_gpt_2026-11-27.json)
SIM_POINTS = (
    ("dgx-h100", "gpt-1.3b", 4, 16),
    ("dgx-h100", "gpt-6.7b", 16, 32),
    ("dgx-h100", "gpt-15b", 32, 32),
)
# plan --pipeline auto --devices 8 on small GPTs (fake CPU devices)
PLAN_CASES = (
    ("gpt-tiny", ["--layers", "4", "--microbatches", "4"]),
    ("gpt-tiny", ["--layers", "8", "--microbatches", "8"]),
)


def _fresh_env() -> dict:
    """The environment less ``AUTOSHARD_CACHE_DIR``: no unit plan read from disk."""
    env = {k: v for k, v in os.environ.items() if k != "AUTOSHARD_CACHE_DIR"}
    env.setdefault("PYTHONPATH", os.getcwd())
    return env


def _run(cmd: list[str]) -> tuple[float, str]:
    """``cmd`` in a fresh process without the on-disk unit cache: (wall seconds, stdout)."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_fresh_env())
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return wall, done.stdout


def simulate_cmd(cluster, model, gpus, m, arm) -> list[str]:
    return [
        sys.executable, "-m", "autoshard", "simulate", "--model", model, "--cluster", cluster,
        "--gpus", str(gpus), "--global-batch", "1024", "--plan", "auto", "--microbatches",
        str(m), "--grad-reduce", arm, "--json",
    ]  # fmt: skip


def plan_cmd(model, extra, arm) -> list[str]:
    return [
        sys.executable, "-m", "autoshard", "--quiet", "plan", "--model", model, *extra,
        "--devices", "8", "--pipeline", "auto", "--grad-reduce", arm,
    ]  # fmt: skip


def run_simulate(point, arm) -> dict:
    cluster, model, gpus, m = point
    wall, out = _run(simulate_cmd(cluster, model, gpus, m, arm))
    report = json.loads(out)
    return {
        "wall_s": wall,
        "search_seconds": report["search_seconds"],
        "step_time_s": report["step_time_s"],
        "stages": [
            [s["num_layers"], s["logical_mesh_dp_tp"], s.get("grad_reduce")]
            for s in report["plan"]["stages"]
        ],
    }


def run_plan(case, arm) -> dict:
    model, extra = case
    wall, out = _run(plan_cmd(model, extra, arm))
    # "pipeline latency ...; search 5.46 s (trace 1.13 s, intra_op_ilps 4.32 s, ...); 18 ILPs"
    found = re.search(r"; search ([0-9.]+) s \(", out)
    if found is None:
        raise SystemExit(f"no search time in plan's output:\n{out[-2000:]}")
    return {"wall_s": wall, "search_seconds": float(found.group(1)),
            "stdout_tail": out.strip().splitlines()[-1]}  # fmt: skip


def abba(run, case, rounds: int) -> dict:
    """``run(case, arm)`` A B B A per round; the samples per arm, in run order."""
    samples = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in (ARMS[0], ARMS[1], ARMS[1], ARMS[0]):
            r = run(case, arm) | {"at": time.strftime("%H:%M:%S", time.gmtime())}
            samples[arm].append(r)
            print(f"  {case[:4] if len(case) == 4 else case[0]} {arm}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float)),
                  file=sys.stderr, flush=True)  # fmt: skip
    return samples


def _point(text: str) -> tuple[str, str, int, int]:
    parts = text.split(":")
    if len(parts) != 4 or not (parts[2].isdigit() and parts[3].isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: give CLUSTER:MODEL:GPUS:MICROBATCHES")
    return parts[0], parts[1], int(parts[2]), int(parts[3])


def median(samples, key):
    return statistics.median(s[key] for s in samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds per case (2)")
    ap.add_argument("--only", choices=("simulate", "plan"), help="one kind of run")
    ap.add_argument(
        "--point",
        action="append",
        type=_point,
        help="CLUSTER:MODEL:GPUS:MICROBATCHES, a simulate point instead of SIM_POINTS (repeatable)",
    )
    ap.add_argument(
        "--out",
        default="benchmarks/results/grad_reduce_default_ab_"
        + time.strftime("%Y-%m-%d", time.gmtime())
        + ".json",
        help="write the samples and medians as JSON here (default: benchmarks/results/"
        "grad_reduce_default_ab_<date>.json)",
    )
    args = ap.parse_args(argv)
    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "rounds": args.rounds,
           "load_at_start": os.getloadavg(), "simulate": [], "plan": []}  # fmt: skip

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)

    if args.only != "plan":
        print("| cluster | GPUs | model | m | search s: microbatch | auto | +% | wall s: "
              "microbatch | auto | step s: microbatch | auto | auto's stages |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for point in args.point or SIM_POINTS:
            samples = abba(run_simulate, point, args.rounds)
            b = samples[ARMS[1]]
            row = {
                "point": dict(zip(("cluster", "model", "gpus", "num_microbatches"), point)),
                "command": " ".join(simulate_cmd(*point, "G")[2:]),
                "samples": samples,
                "median": {arm: {k: median(samples[arm], k) for k in
                                 ("search_seconds", "wall_s", "step_time_s")} for arm in ARMS},
            }  # fmt: skip
            doc["simulate"].append(row)
            ma, mb = row["median"][ARMS[0]], row["median"][ARMS[1]]
            cluster, model, gpus, m = point
            print(
                f"| {cluster} | {gpus} | {model} | {m} | {ma['search_seconds']:.1f} | "
                f"{mb['search_seconds']:.1f} | "
                f"{(mb['search_seconds'] / ma['search_seconds'] - 1) * 100:+.0f}% | "
                f"{ma['wall_s']:.1f} | {mb['wall_s']:.1f} | {ma['step_time_s']:.3f} | "
                f"{mb['step_time_s']:.3f} | {b[0]['stages']} |",
                flush=True,
            )
            save()
    if args.only != "simulate":
        print("| plan command | search s: microbatch | auto | +% | wall s: microbatch | auto |")
        print("|---|---|---|---|---|---|")
        for case in PLAN_CASES:
            samples = abba(run_plan, case, args.rounds)
            med = {arm: {k: median(samples[arm], k) for k in ("search_seconds", "wall_s")}
                   for arm in ARMS}  # fmt: skip
            cmd = " ".join(plan_cmd(*case, "G")[2:])
            doc["plan"].append({"command": cmd, "samples": samples, "median": med})
            ma, mb = med[ARMS[0]], med[ARMS[1]]
            print(
                f"| `{cmd}` | {ma['search_seconds']:.2f} | {mb['search_seconds']:.2f} | "
                f"{(mb['search_seconds'] / ma['search_seconds'] - 1) * 100:+.0f}% | "
                f"{ma['wall_s']:.1f} | {mb['wall_s']:.1f} |",
                flush=True,
            )
            save()
    doc["load_at_end"] = os.getloadavg()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
