"""Cost of the full inter-operator search: trace, per-layer intra-op ILPs, stage DP.

Alpa reports about 2,400 s to search GPT-39B on 64 GPUs (mostly compiling and profiling
stage candidates).  Here every stage candidate is costed from intra-op ILP plans of its
layers (abstract shapes, nothing compiled or run) on Alpa's cluster preset ``alpa-v100``
(NVLink inside a node, 25 Gbps between nodes).  For each (model, cluster size) this
records wall time by phase, the number of ILPs solved and of cache hits, and the chosen
stages.  Writes ``benchmarks/results/bench_inter.json``.

    python benchmarks/bench_inter.py [--models gpt-2.6b gpt-39b] [--time-limit 60]
        [--microbatches 64] [--batch 1024] [--granularity layer] [--solver highs]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# model -> (hosts, devices per host): Alpa's weak-scaling sizes
SETTINGS = {"gpt-2.6b": (1, 8), "gpt-39b": (8, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SETTINGS), choices=sorted(SETTINGS))
    ap.add_argument("--cluster", default="alpa-v100")
    ap.add_argument("--batch", type=int, default=1024, help="global batch (Alpa: 1024)")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--time-limit", type=float, default=60.0, help="per-ILP limit (s)")
    ap.add_argument("--granularity", choices=("layer", "range"), default="layer")
    ap.add_argument("--memory-budget-gib", type=float, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_inter.json"))
    args = ap.parse_args()

    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    rows = []
    for model in args.models:
        hosts, per_host = SETTINGS[model]
        t0 = time.perf_counter()
        plan = auto_stage_plan(
            model,
            hosts,
            per_host,
            StageSearchOptions(
                args.microbatches,
                memory_budget_bytes=(
                    None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30
                ),
                solver=args.solver,
                time_limit_s=args.time_limit,
                granularity=args.granularity,
            ),
            cluster=args.cluster,
            batch_size=args.batch,
        )
        wall = time.perf_counter() - t0
        row = {
            "model": model,
            "hosts": hosts,
            "devices_per_host": per_host,
            "cluster": args.cluster,
            "global_batch": args.batch,
            "solver": args.solver,
            "ilp_time_limit_s": args.time_limit,
            "wall_seconds": wall,
            "plan": plan.to_json(),
        }
        rows.append(row)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in plan.phase_seconds.items())
        print(
            f"{model} on {hosts}x{per_host}: {wall:.1f} s ({phases}); {plan.num_ilps} ILPs, "
            f"{plan.num_cache_hits} cache hits; {len(plan.stages)} stages, "
            f"objective {plan.objective_s:.4g} s",
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
