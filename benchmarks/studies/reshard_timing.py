"""How long the planner's resharding function takes on a real planning's calls (issue 31).

``capture`` plans gpt-1.3b on 2x4 (batch 16, the planner's defaults, Alpa's test-mesh
costs) and pickles the arguments of every :func:`autoshard.intra.cost.resharding.reshard` call;
``time`` replays them with cold caches, ``--repeat`` times, and prints the median CPU
seconds (``time.process_time``: steadier than wall time on a shared machine).  Replay the
same file under two trees to compare them::

    python benchmarks/studies/reshard_timing.py capture /tmp/reshard_args.pkl
    PYTHONPATH=OTHER_TREE python benchmarks/studies/reshard_timing.py time /tmp/reshard_args.pkl
    python benchmarks/studies/reshard_timing.py time /tmp/reshard_args.pkl --out FILE
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time


def capture(path: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import autoshard.intra.cost.resharding as cost
    import autoshard.intra.problem.value_edges as value_edges
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    calls, original = [], cost.reshard

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    cost.reshard = value_edges.reshard = recorded  # the two modules that call it by name
    traced = trace_workload("gpt-1.3b", batch_size=16)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    print("planning gpt-1.3b on 2x4 ...", file=sys.stderr)
    auto_shard_graph(traced.graph, mesh, IntraOptions())
    with open(path, "wb") as f:
        pickle.dump(calls, f)
    print(f"{len(calls)} reshard calls -> {path}", file=sys.stderr)


def replay(path: str, repeat: int) -> dict:
    import autoshard.intra.cost.resharding as cost

    try:
        from autoshard.intra import reshard_tiles
    except ImportError:  # a tree from before issue 31
        reshard_tiles = None
    with open(path, "rb") as f:
        calls = pickle.load(f)
    runs = []
    for _ in range(repeat):
        cost._valid_spec.cache_clear()
        if reshard_tiles is not None:
            reshard_tiles._route.cache_clear()
        start = time.process_time()
        for args, kwargs in calls:
            cost.reshard(*args, **kwargs)
        runs.append(time.process_time() - start)
    return {"calls": len(calls), "median_cpu_s": statistics.median(runs), "runs_cpu_s": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("capture", "time"))
    p.add_argument("path")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.what == "capture":
        capture(args.path)
        return 0
    row = replay(args.path, args.repeat)
    print(f"{row['calls']} calls: median {row['median_cpu_s']:.3f} s CPU over {args.repeat} runs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
