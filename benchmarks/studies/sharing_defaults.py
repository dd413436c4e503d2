"""Layer sharing under the planner's defaults: how far the tied plan is from the unshared one.

``bench_sharing.py`` solves the per-demand program alone on Alpa's test mesh; this study
plans as a user does (``auto_shard_graph`` with bench_truth's settings: the exact per-value
program on one-axis meshes, the per-demand plan priced per value on meshes of several
axes, the tie-break pass) three ways -- layers tied two at a time (``layer_period=2``, the
default), two at a time between the untied first and last layer of each run
(``layer_ends=True``) and not tied at all (``share_layers=False``) -- and records each
plan's objective, solver status and planning seconds (median of ``--repeat``); "proven" where every run's solve proved
its optimum (the exact program's time cap, ``--exact-min-seconds``, can stop it on a busy
machine, and the plan then depends on the load).  The
trace is made once per case and not timed.

    python benchmarks/studies/sharing_defaults.py [--cases gpt-tiny:6:8 moe-tiny:10:2x4 ...]
        [--repeat 3] [--time-limit 300] [--out FILE]

A case is ``model:layers:mesh`` (the mesh as bench_truth writes it: ``8`` is one axis of
8, ``2x4`` two).  Writes ``benchmarks/results/sharing_defaults.json`` by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_CASES = (
    "gpt-tiny:4:8",
    "gpt-tiny:6:8",
    "gpt-tiny:4:2x4",
    "gpt-tiny:6:2x4",
    "moe-tiny:6:8",
    "moe-tiny:10:8",
    "moe-tiny:6:2x4",
    "moe-tiny:10:2x4",
    "wresnet-tiny:50:8",
    "wresnet-tiny:50:2x4",
)
WAYS = {
    "period 2 (default)": {"layer_period": 2, "layer_ends": False},
    "ends, period 2": {"layer_period": 2, "layer_ends": True},
    "unshared": {"share_layers": False},
}


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "unknown"


def _per_demand_objectives() -> list[float]:
    """A list that receives the per-demand program's objective of every plan made after
    this call (the optimum the per-demand solve proved; on meshes of several axes the plan
    is then priced per value, and its objective is that price)."""
    from autoshard.intra.problem import exact_values

    seen: list[float] = []
    kept = exact_values.kept_per_demand

    def recording(first, *args, **kwargs):
        seen.append(first.objective)
        return kept(first, *args, **kwargs)

    # both the module and the planner's name for it (build imports it by name)
    from autoshard.intra.problem import build

    exact_values.kept_per_demand = recording
    build.kept_per_demand = recording
    return seen


def _case(text: str, repeat: int, time_limit: float, ways: list[str], seen: list) -> dict:
    from bench_truth import plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.problem.build import auto_shard_graph

    model, layers, mesh_text = text.split(":")
    optimizer = "sgd"
    traced = trace_workload(model, optimizer=optimizer, num_layers=int(layers))
    mesh = truth_mesh(mesh_text)
    base, _ = plan_settings(traced.graph, mesh, "auto", time_limit)
    row: dict = {"case": text, "optimizer": optimizer, "loadavg_start": _load()}
    for way in ways:
        options = base.replace(**WAYS[way])
        seconds, plans, per_demand = [], [], []
        for r in range(repeat):
            seen.clear()
            t0 = time.perf_counter()
            plans.append(auto_shard_graph(traced.graph, mesh, options))
            seconds.append(time.perf_counter() - t0)
            per_demand.append(seen[0] if seen else None)
            print(f"  {text} {way} run {r + 1}/{repeat}: {plans[-1].objective:,.1f} "
                  f"in {seconds[-1]:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
        plan = plans[0]
        row[way] = {
            "objective": plan.objective,
            "per_demand_objective": per_demand[0],
            "objectives_differ_between_runs": len({p.objective for p in plans}) > 1,
            "status": plan.solver.get("status"),
            "gap": plan.solver.get("gap"),
            "exact_stopped": plan.solver.get("exact_stopped"),
            "proven": all(
                p.solver.get("status") == "optimal" and not p.solver.get("exact_stopped")
                for p in plans
            ),
            "variables": plan.solver.get("num_variables"),
            "plan_s_median": statistics.median(seconds),
            "plan_s": seconds,
            "predicted_collectives": len(plan.predicted_collectives),
        }
    row["loadavg_end"] = _load()
    if "unshared" in row:
        for key in ("objective", "per_demand_objective"):
            best = row["unshared"][key]
            for way in ways:
                mine = row[way][key]
                row[way][f"{key}_over_unshared"] = (
                    None if best is None or mine is None else (mine / best - 1 if best else 0.0)
                )
    return row


def _cell(r: dict) -> str:
    over = r.get("objective_over_unshared")
    text = f"{r['objective']:,.1f}" + ("" if over is None else f" ({over:+.2%})")
    if r["per_demand_objective"] is not None and r["exact_stopped"]:
        over = r.get("per_demand_objective_over_unshared")
        text += f", per demand {r['per_demand_objective']:,.1f}"
        text += "" if over is None else f" ({over:+.2%})"
    return text + f", {r['plan_s_median']:.1f} s" + ("" if r["proven"] else ", not proven")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="model:layers:mesh")
    ap.add_argument("--repeat", type=int, default=3, help="plans per way (median time)")
    ap.add_argument(
        "--ways", nargs="+", default=list(WAYS), choices=list(WAYS), help="which tyings to plan"
    )
    ap.add_argument("--time-limit", type=float, default=300.0, help="ILP time limit (s)")
    ap.add_argument(
        "--exact-min-seconds",
        type=float,
        default=None,
        help="the exact program's time cap floor (exact_values.EXACT_MIN_SECONDS, 5 s by "
        "default): raise it so that its node budget, not the load, ends the exact solve",
    )
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results" / "sharing_defaults.json"),
    )
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    for text in args.cases:
        parts = text.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].replace("x", "").isdigit():
            ap.error(
                f"case {text!r}: write model:layers:mesh, e.g. gpt-tiny:6:8 or moe-tiny:10:2x4"
            )
    import jax

    from autoshard.intra.problem import exact_values

    if args.exact_min_seconds is not None:
        exact_values.EXACT_MIN_SECONDS = args.exact_min_seconds

    jax.config.update("jax_num_cpu_devices", 8)
    seen = _per_demand_objectives()
    rows = []
    for text in args.cases:
        print(f"{text} ...", file=sys.stderr, flush=True)
        rows.append(_case(text, args.repeat, args.time_limit, args.ways, seen))
        r = rows[-1]
        print(f"| {text} | " + " | ".join(_cell(r[w]) for w in args.ways) + " |", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            doc = {
                "command": " ".join(["python"] + sys.argv),
                "time": time.strftime("%F %T"),
                "exact_min_seconds": exact_values.EXACT_MIN_SECONDS,
            }
            json.dump({**doc, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
