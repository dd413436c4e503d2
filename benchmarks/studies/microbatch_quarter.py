"""What a quarter of the default micro-batch count adds to the search (docs/weak_scaling.md,
cause 5): the step time it finds and the search time it costs, on the weak-scaling figure's
GPT points.

For each GPT point of a weak-scaling chunk
(``benchmarks/results/weak_scaling_chunk_<cluster>_gpt_*.json``) it runs ``autoshard simulate --plan auto --microbatches search,<M...> --json`` in a fresh
process (``AUTOSHARD_CACHE_DIR`` unset: no plan read from disk), ``M`` the counts of the
chunk's Megatron-LM best points, as ``experiments/weak_scaling.py`` searches them. Every
candidate is a whole search of its own (nothing is shared between counts), so one run gives
both answers: the search without the quarter is the same run less that candidate. Per
candidate it records the step time, whether it fits, ``search_seconds`` and the wall time
(from the child's progress lines on stderr: tracing included). Prints a table; writes JSON::

    python benchmarks/studies/microbatch_quarter.py --cluster dgx-h100 [--max-gpus 64] [--out FILE]
    python benchmarks/studies/microbatch_quarter.py --cluster dgx-a100 --gpus 2 4 --grad-reduce auto
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_START = re.compile(r"micro-batch search (\d+)/(\d+): m=(\d+) \.\.\.")


def _chunk(cluster: str) -> dict:
    paths = sorted(glob.glob(f"benchmarks/results/weak_scaling_chunk_{cluster}_gpt_*.json"))
    if not paths:
        raise SystemExit(f"no weak-scaling GPT chunk for {cluster} under benchmarks/results")
    with open(paths[-1]) as f:
        return {"path": paths[-1], **json.load(f)}


def default_count(batch: int, model: str, cluster: str, gpus: int) -> int:
    """simulate's default count for ``plan="auto"`` at this point (the quarter is of it)."""
    from autoshard.hardware.clusters import load_cluster
    from autoshard.models.gpt import GPT_PRESETS
    from autoshard.sim.auto import _default_microbatches
    from autoshard.sim.simulate import shape_of

    c = load_cluster(cluster, gpus)
    dtype = "bf16" if "bf16" in c.device.peak_flops else c.device.default_dtype
    return _default_microbatches(batch, shape_of(GPT_PRESETS[model]), c, dtype)


def run_point(model: str, cluster: str, gpus: int, batch: int, extra, grad_reduce) -> dict:
    """One fresh ``simulate`` process; per candidate its wall seconds from stderr."""
    counts = ",".join(["search", *map(str, extra)])
    cmd = [
        sys.executable, "-m", "autoshard", "simulate", "--model", model, "--cluster", cluster,
        "--gpus", str(gpus), "--global-batch", str(batch), "--plan", "auto",
        "--microbatches", counts, "--grad-reduce", grad_reduce, "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "AUTOSHARD_CACHE_DIR"}
    starts = {}
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        for line in child.stderr:
            hit = _START.search(line)
            if hit:
                starts[int(hit.group(3))] = time.perf_counter()
        if child.wait():
            raise SystemExit(f"{' '.join(cmd)} failed ({child.returncode})")
        wall = time.perf_counter() - t0
        end = time.perf_counter()
        out.seek(0)
        report = json.load(out)
    order = sorted(starts, key=starts.get)
    ends = {m: starts[n] for m, n in zip(order, order[1:])} | {order[-1]: end}
    tried = report["plan"]["microbatch_search"]
    for c in tried:
        m = c["num_microbatches"]
        c["wall_s"] = ends[m] - starts[m]
    return {"command": " ".join(cmd[2:]), "wall_s": wall, "microbatch_search": tried}


def _best(tried):
    fits = [c for c in tried if c["fits"]]
    return min(
        fits or tried, key=lambda c: c["step_time_s"] if fits else c["peak_bytes_per_device"]
    )


def summarize(tried, quarter: int | None) -> dict:
    """The search with and without the ``quarter`` candidate."""
    without = [c for c in tried if c["num_microbatches"] != quarter]
    added = [c for c in tried if c["num_microbatches"] == quarter]
    old, new = _best(without), _best(tried)
    return {
        "quarter": quarter,
        "quarter_new": bool(added) and len(without) < len(tried),
        "without": {"m": old["num_microbatches"], "step_time_s": old["step_time_s"],
                    "search_seconds": sum(c["search_seconds"] for c in without),
                    "wall_s": sum(c["wall_s"] for c in without)},
        "with": {"m": new["num_microbatches"], "step_time_s": new["step_time_s"],
                 "search_seconds": sum(c["search_seconds"] for c in tried),
                 "wall_s": sum(c["wall_s"] for c in tried)},
        "quarter_step_s": added[0]["step_time_s"] if added else None,
        "quarter_fits": added[0]["fits"] if added else None,
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--max-gpus", type=int, default=64)
    ap.add_argument("--gpus", type=int, nargs="*", help="only these points")
    ap.add_argument("--grad-reduce", default="microbatch", choices=("microbatch", "auto"))
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    chunk = _chunk(args.cluster)
    batch = chunk["config"]["global_batch"]["gpt"]
    by_point: dict = {}
    for r in chunk["rows"]:
        by_point.setdefault((r["model"], r["gpus"]), {})[r["method"]] = r
    rows = []
    for (model, gpus), methods in sorted(by_point.items(), key=lambda kv: kv[0][1]):
        if gpus > args.max_gpus or "auto" not in methods or (args.gpus and gpus not in args.gpus):
            continue
        extra = sorted(
            {methods[m]["plan"]["num_microbatches"] for m in ("megatron", "megatron-flash")
             if m in methods and "plan" in methods[m]}
        )  # fmt: skip
        default = default_count(batch, model, args.cluster, gpus)
        quarter = default // 4 if default % 4 == 0 else None
        point = run_point(model, args.cluster, gpus, batch, extra, args.grad_reduce)
        # the quarter is new only where neither half, nor a Megatron-LM count, already had it
        s = summarize(point["microbatch_search"], quarter if quarter not in extra else None)
        row = {"model": model, "gpus": gpus, "default": default, "extra": extra, **point, **s}
        rows.append(row)
        w, n = row["without"], row["with"]
        print(
            f"{model:9s} {gpus:3d} GPUs  default {default:4d}  quarter {quarter}"
            f"{'' if row['quarter_new'] else ' (already searched)'}  "
            f"without: m={w['m']} {w['step_time_s']:.3f} s in {w['wall_s']:.0f} s  "
            f"with: m={n['m']} {n['step_time_s']:.3f} s in {n['wall_s']:.0f} s  "
            f"gain {(w['step_time_s'] / n['step_time_s'] - 1) * 100:+.1f}%  "
            f"time {(n['wall_s'] / w['wall_s'] - 1) * 100:+.0f}%",
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {"cluster": args.cluster, "chunk": chunk["path"], "batch": batch,
                     "grad_reduce": args.grad_reduce,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                    f, indent=1,
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
