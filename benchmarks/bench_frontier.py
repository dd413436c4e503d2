"""Search time at frontier scale: GPT-175B / 530B / 1T on 512-4,096 simulated A100s and H100s.

Each row runs ``autoshard simulate --plan auto`` in a fresh process (no ILP cache carried
over: a cold search), timed wall-clock, ``--repeats`` times (the median is the row's
time), and records the search's phases (trace, intra-op ILPs, stage DP), the plan it chose
(TP x PP x DP, micro-batches, stages, recompute) and the predicted step time and MFU.
Rows with a published Megatron-LM layout (SC21, Narayanan et al. Table 1) also price that
layout the same way: ``--plan megatron:TPxPPxDP --program traced`` (the search's own stage
costs on the traced step, same micro-batches), so the two step times compare like for like.
Prints a table and writes ``benchmarks/results/bench_frontier.json`` (with the load
average before and after).

    python benchmarks/bench_frontier.py [--rows 1t-a100-3072 ...] [--repeats 3]
        [--microbatches search|N] [--out FILE]
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
# GPT shapes (Narayanan et al., SC21, Table 1): layers, hidden, heads; seq 2048
MODELS = {
    "175b": (96, 12288, 96),
    "530b": (105, 20480, 128),
    "1t": (128, 25600, 160),
}
# row -> (model, cluster, gpus, global batch, published (tp, pp, dp) or None)
ROWS = {
    "175b-a100-512": ("175b", "dgx-a100", 512, 1536, None),
    "175b-a100-1536": ("175b", "dgx-a100", 1536, 1536, (8, 12, 16)),
    "530b-a100-2240": ("530b", "dgx-a100", 2240, 2240, (8, 35, 8)),
    "1t-a100-3072": ("1t", "dgx-a100", 3072, 3072, (8, 64, 6)),
    "175b-h100-1024": ("175b", "dgx-h100", 1024, 1536, None),
    "1t-h100-4096": ("1t", "dgx-h100", 4096, 4096, None),
}
DEFAULT_ROWS = ("1t-a100-3072", "175b-a100-1536", "530b-a100-2240", "175b-h100-1024")


def _simulate(model: str, cluster: str, gpus: int, batch: int, plan: str, extra: list[str]):
    layers, hidden, heads = MODELS[model]
    argv = [
        sys.executable, "-m", "autoshard", "simulate", "--model", "gpt-39b",
        "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
        "--seq", "2048", "--cluster", cluster, "--gpus", str(gpus),
        "--global-batch", str(batch), "--plan", plan, "--json", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    # from the repository root: `-m autoshard` is this clone's package
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    wall = time.perf_counter() - t0
    # exit 1 with a report on stdout: the plan does not fit (`simulate` exits 1 on OOM)
    report = None
    if proc.returncode in (0, 1) and proc.stdout.strip():
        try:
            report = json.loads(proc.stdout)
        except json.JSONDecodeError:
            report = None
    if report is None or (proc.returncode != 0 and not report.get("oom")):
        return {"argv": argv[2:], "wall_seconds": wall, "error": proc.stderr[-2000:]}
    return {"argv": argv[2:], "wall_seconds": wall, "report": report}


def _summary(report: dict) -> dict:
    plan = report["plan"]
    out = {
        "step_time_s": report["step_time_s"],
        "mfu": report["mfu"],
        "tflops_per_device": report["tflops_per_device"],
        "peak_gib_per_device": report["peak_bytes_per_device"] / 2**30,
        "oom": report["oom"],
        "tp_pp_dp": [plan.get("tp"), plan.get("pp"), plan.get("dp")],
        "num_microbatches": plan.get("num_microbatches"),
        "search_seconds": report.get("search_seconds"),
    }
    if plan.get("kind") == "auto":
        stages = plan["stages"]
        out["phase_seconds"] = plan.get("phase_seconds")
        out["num_ilps"] = plan.get("num_ilps")
        out["stages"] = sorted(
            {
                (tuple(s["submesh"]), tuple(s["logical_mesh_dp_tp"]), s["recompute"]): 0
                for s in stages
            }
        )
        out["layers_per_stage"] = sorted({s["num_layers"] for s in stages})
        if "microbatch_search" in plan:
            out["microbatch_search"] = plan["microbatch_search"]
    return out


def measure_row(
    name: str,
    repeats: int = 3,
    microbatches: str | None = None,
    published: bool = True,
    on_run=lambda label: None,
) -> dict:
    """One row of ``ROWS``: ``repeats`` cold searches in fresh processes (the median wall is
    the row's time; phases and plan from the last run that succeeded), then, where the row
    has a published layout and ``published``, that layout priced the same way.
    ``on_run(label)`` is called before each process starts (progress)."""
    model, cluster, gpus, batch, layout = ROWS[name]
    extra = [] if microbatches is None else ["--microbatches", microbatches]
    if microbatches is None and layout is not None:
        # the published run's count: one sequence per data-parallel replica
        extra = ["--microbatches", str(batch // layout[2])]
    runs = []
    for i in range(repeats):
        on_run(f"{name}: search {i + 1}/{repeats}")
        runs.append(_simulate(model, cluster, gpus, batch, "auto", extra))
    ok = [r for r in runs if "report" in r]
    row = {
        "row": name,
        "model": f"gpt-{model}",
        "cluster": cluster,
        "gpus": gpus,
        "global_batch": batch,
        "wall_seconds": [r["wall_seconds"] for r in runs],
        "median_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "argv": runs[0]["argv"],
    }
    if ok:
        row["auto"] = _summary(ok[-1]["report"])
        # the run the phases and plan are from
        row["summary_run"] = max(i for i, r in enumerate(runs) if "report" in r)
    else:
        row["error"] = runs[-1]["error"]
    if layout is not None and published and ok:
        tp, pp, dp = layout
        # SC21's micro-batch: one sequence per replica (the search's count by default)
        on_run(f"{name}: the published layout {tp}x{pp}x{dp}")
        priced = {}
        for label, flags in (("microbatch_1", ["--microbatch-size", "1"]),):
            r = _simulate(
                model, cluster, gpus, batch, f"megatron:{tp}x{pp}x{dp}",
                ["--program", "traced", "--recompute", "full", *flags],
            )  # fmt: skip
            priced[label] = _summary(r["report"]) if "report" in r else {"error": r["error"]}
        row["published"] = {"tp_pp_dp": [tp, pp, dp], "priced": priced}
    return row


def print_row(row: dict) -> None:
    auto = row.get("auto", {})
    print(
        f"{row['row']}: search {row['median_wall_seconds']:.1f} s wall (median of "
        f"{len(row['wall_seconds'])}: {', '.join(f'{w:.1f}' for w in row['wall_seconds'])}); "
        f"plan TPxPPxDP {auto.get('tp_pp_dp')} m={auto.get('num_microbatches')}, "
        f"step {auto.get('step_time_s', float('nan')):.3g} s, MFU {auto.get('mfu', 0):.3f}, "
        f"oom {auto.get('oom')}; phases {auto.get('phase_seconds')}",
        flush=True,
    )
    for label, p in row.get("published", {}).get("priced", {}).items():
        print(
            f"  published {row['published']['tp_pp_dp']} ({label}): step "
            f"{p.get('step_time_s', float('nan')):.3g} s, MFU {p.get('mfu', 0):.3f}, "
            f"oom {p.get('oom')}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=sorted(ROWS))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    ap.add_argument(
        "--microbatches",
        default=None,
        help="--microbatches for the search (default: the published run's count where the "
        "row has one, else simulate's; 'search' tries several)",
    )
    ap.add_argument("--no-published", action="store_true", help="skip pricing SC21's layouts")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_frontier.json"))
    args = ap.parse_args()

    load_before = os.getloadavg()
    rows = []
    for name in args.rows:
        row = measure_row(name, args.repeats, args.microbatches, not args.no_published)
        rows.append(row)
        print_row(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "bench_frontier",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
