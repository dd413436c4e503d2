"""A sweep of memory budgets: what the ILP gives up for memory, checked against XLA.

gpt-350m shapes (2 blocks, batch 8, AdamW, f32) on 8 fake CPU devices. For the data-parallel
baseline, the unconstrained ILP plan and every budget, plan with ``plan_workload`` (the
compile loop on: the compiled peak must fit) and report the predicted and compiled peak
per device, how much of the training state (parameters, optimizer state) each device
holds, the plan's cost (the ILP objective), how many times it was compiled (the loop compiles
again after each re-plan) and the time; a budget that nothing fits reports the error's
figure. Writes ``benchmarks/results/bench_budget.json``::

    python benchmarks/bench_budget.py [--budgets 2.0 1.6 1.2 1.0] [--solver highs]
        [--out FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_BUDGETS_GB = (3.0, 2.0, 1.6, 1.4, 1.3, 1.2, 1.1, 1.0)
SETTING = dict(optimizer="adamw", batch_size=8, num_layers=2)


def _state_fractions(bound) -> dict[str, float]:
    """Per kind of program input: bytes per device over bytes of the whole value."""
    graph, plan = bound.graph, bound.plan
    held: dict[str, list[float]] = {}
    for tid, spec in zip(graph.inputs, plan.input_specs, strict=True):
        t = graph.tensors[tid]
        part = held.setdefault(t.kind, [0.0, 0.0])
        part[0] += t.nbytes * spec.shard_fraction(plan.mesh)
        part[1] += t.nbytes
    return {kind: a / b for kind, (a, b) in held.items() if kind != "data" and b}


def run(budgets, solver: str) -> list[dict]:
    from autoshard.api import plan_workload
    from autoshard.intra.ilp import InfeasibleBudgetError
    from autoshard.intra.problem.options import IntraOptions

    rows = []
    cases = [("dp", None), ("auto", None)] + [("auto", b * 1e9) for b in budgets]
    for which, budget in cases:
        start = time.perf_counter()
        row = {"plan": which, "budget_bytes": budget}
        try:
            bound = plan_workload(
                "gpt-350m",
                "8",
                baseline=None if which == "auto" else which,
                options=IntraOptions(solver=solver, memory_budget_bytes=budget),
                **SETTING,
            )
            report = bound.verify()
        except InfeasibleBudgetError as err:
            row.update(
                status="refused",
                smallest_peak_bytes=err.min_feasible_bytes,
                proven=err.proven,
                message=str(err),
            )
        else:
            row.update(
                status="planned",
                predicted_peak_bytes=bound.plan.predicted_peak_bytes,
                compiled_peak_bytes=report.compiled_peak_bytes,
                state_fraction=_state_fractions(bound),
                objective=bound.plan.objective,
                # compiles of the budget loop (none without a budget)
                compiles=sum("memory round" in n for n in bound.plan.notes) if budget else None,
            )
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _line(row: dict) -> str:
    head = f"{row['plan']:5s} budget {_gb(row['budget_bytes']):>5s} GB: "
    if row["status"] == "refused":
        return head + (
            f"refused, smallest peak {_gb(row['smallest_peak_bytes'])} GB "
            f"({'proven' if row['proven'] else 'estimate'}), {row['seconds']:.1f} s"
        )
    frac = row["state_fraction"]
    return head + (
        f"predicted {_gb(row['predicted_peak_bytes'])} GB, compiled "
        f"{_gb(row['compiled_peak_bytes'])} GB, params/device {frac.get('param', 0):.0%}, "
        f"optimizer state/device {frac.get('opt_state', 0):.0%}, cost {row['objective']:.4g}, "
        f"compiles {row['compiles'] or '-'}, {row['seconds']:.1f} s"
    )


def markdown(rows: list[dict]) -> str:
    out = [
        "| plan | budget GB | predicted GB | compiled GB | params per device | "
        "optimizer state per device | cost (ILP objective) | compiles |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "refused":
            kind = "proven" if r["proven"] else "estimated"
            out.append(
                f"| {r['plan']} | {_gb(r['budget_bytes'])} | refused: smallest peak "
                f"{_gb(r['smallest_peak_bytes'])} ({kind}) | | | | | |"
            )
            continue
        f = r["state_fraction"]
        out.append(
            f"| {r['plan']} | {_gb(r['budget_bytes'])} | {_gb(r['predicted_peak_bytes'])} | "
            f"{_gb(r['compiled_peak_bytes'])} | {f.get('param', 0):.0%} | "
            f"{f.get('opt_state', 0):.0%} | {r['objective']:.4g} | {r['compiles'] or '-'} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS_GB))
    ap.add_argument("--solver", default="highs", choices=("cbc", "highs"))
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results" / "bench_budget.json"),
    )
    ap.add_argument("--markdown", default=None, help="also write the table as markdown")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    start = time.perf_counter()
    rows = run(args.budgets, args.solver)
    result = {
        "command": "python " + " ".join(sys.argv),
        "setting": {"model": "gpt-350m", "mesh": "8", **SETTING, "dtype": "float32"},
        "solver": args.solver,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
