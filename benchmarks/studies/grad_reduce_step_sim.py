"""What reducing data-parallel gradients once per step buys the search on the weak-scaling
figure's GPT points (docs/weak_scaling.md, cause 1).

For each GPT point of a weak-scaling chunk (``benchmarks/results/weak_scaling_chunk_<cluster>_gpt_*.json``)
it re-prices ``simulate(plan="auto")`` at the micro-batch counts of the figure's auto point
and of Megatron-LM's best flash point, twice in the same process: with every stage reducing
its gradients each micro-batch (``grad_reduce="microbatch"``, the runtime's default) and
with each stage choosing (``"auto"``: once a step where that is faster,
:meth:`autoshard.inter.stage_cost.IntraStageCost.replica_range_cost`), the faster count
winning in each. Prints a table against the chunk's Megatron-LM points; writes JSON::

    python benchmarks/studies/grad_reduce_step_sim.py --cluster dgx-h100 [--max-gpus 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time


def _chunk(cluster: str) -> dict:
    paths = sorted(glob.glob(f"benchmarks/results/weak_scaling_chunk_{cluster}_gpt_*.json"))
    if not paths:
        raise SystemExit(f"no weak-scaling GPT chunk for {cluster} under benchmarks/results")
    with open(paths[-1]) as f:
        return {"path": paths[-1], **json.load(f)}


def _best(model, cluster, gpus, batch, counts, grad_reduce, dtype):
    from autoshard.sim.simulate import simulate

    best = None
    for m in counts:
        t0 = time.perf_counter()
        report = simulate(
            model, cluster, gpus, plan="auto", global_batch=batch, num_microbatches=m,
            grad_reduce=grad_reduce, dtype=dtype, ilp_time_limit_s=20.0,
        )  # fmt: skip
        row = {
            "num_microbatches": m,
            "step_time_s": report.step_time_s,
            "peak_bytes_per_device": report.peak_bytes_per_device,
            "oom": report.oom,
            "comm_data_s": report.step_breakdown.get("comm_data", 0.0),
            "compute_s": report.step_breakdown["compute"],
            "stages": [
                [s["num_layers"], s["logical_mesh_dp_tp"], s["recompute"], s["grad_reduce"]]
                for s in report.plan["stages"]
            ],
            "wall_s": time.perf_counter() - t0,
        }
        print(f"  {model} {gpus} {grad_reduce} m={m}: {row['step_time_s']:.4f} s", file=sys.stderr)
        if best is None or (row["oom"], row["step_time_s"]) < (best["oom"], best["step_time_s"]):
            best = row
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--max-gpus", type=int, default=64)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    chunk = _chunk(args.cluster)
    batch = chunk["config"]["global_batch"]["gpt"]
    by_point: dict = {}
    for r in chunk["rows"]:
        by_point.setdefault((r["model"], r["gpus"]), {})[r["method"]] = r
    rows = []
    for (model, gpus), methods in sorted(by_point.items(), key=lambda kv: kv[0][1]):
        if gpus > args.max_gpus or "auto" not in methods:
            continue
        auto = methods["auto"]
        counts = [auto["plan"]["num_microbatches"]]
        flash = methods.get("megatron-flash")
        if flash is not None and "plan" in flash:
            counts.append(flash["plan"]["num_microbatches"])
        counts = sorted(set(counts))
        dtype = auto["plan"]["dtype"]
        row = {"model": model, "gpus": gpus, "counts": counts}
        for g in ("microbatch", "auto"):
            row[g] = _best(model, args.cluster, gpus, batch, counts, g, dtype)
        for method in ("megatron", "megatron-flash"):
            if method in methods:
                row[method + "_s"] = methods[method]["step_time_s"]
        row["figure_auto_s"] = auto["step_time_s"]
        rows.append(row)
        every, once = row["microbatch"]["step_time_s"], row["auto"]["step_time_s"]
        flash_s = row.get("megatron-flash_s")
        print(
            f"{model:9s} {gpus:3d} GPUs  every micro-batch {every:7.3f} s  auto {once:7.3f} s "
            f"({(every / once - 1) * 100:+.1f}%)  stages {row['auto']['stages']}"
            + (f"  vs flash {(flash_s / once - 1) * 100:+.1f}%" if flash_s else ""),
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {"cluster": args.cluster, "chunk": chunk["path"], "rows": rows}, f, indent=1
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
