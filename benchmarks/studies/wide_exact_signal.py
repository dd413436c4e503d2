"""Which 2-D programs over the column rule does the exact search pay on? (issue #31)

On a mesh of several axes the default (``exact_search="lp"``) solves the exact per-value
program's LP only where the per-demand program has at most ``EXACT_MAX_COLUMNS``
columns.  bench_truth's wresnet-tiny (8 layers) on 2x4 is over that rule and its default
costs 9% more than a plan the exact program holds; bench_intra's GPT rows are over it too,
and there the planning time must stay below XLA's compile.  For each row (bench_truth's
rows as ``exact_truth_sample.py`` builds them, ``LABEL/MESH/PLAN``; bench_intra's as it
plans them, ``intra:MODEL/MESH``): the per-demand program's columns and solve seconds,
its plan's per-demand objective and per-value price (``price_per_value``), and the
signals a rule could read from that plan:

* ``overcharge``: 1 - price / per-demand objective (how much the per-demand program
  over-charges its own plan);
* ``shared_overcharge``: the part of that over-charge on values two or more of whose
  uses want one spec the producer does not make (reads XLA makes once), over the price;
* ``shared_values``: how many such values;
* ``hub_share``: the share of the values several demands read that the exact program
  prices by a hub (``exact_values.hub_share``, the rule the default reads since
  2026-11-28; ``--hub-share-only``: this alone, without a solve).

With ``--lp``, on a program over the rule: the default's own search with the column rule lifted and the LP capped at
``--lp-iterations`` (its LP's status, iterations and seconds, and the plan it returns:
objective and planning seconds, against the default's).  ``--time-limit`` caps each
solve (the user's limit, as bench_truth's ``--time-limit``).

With ``--shared-min-uses K`` (``K ...``): the per-demand program again with share nodes
(``value_edges.SHARED_READS``) on the values of at least K distinct uses
(``SHARED_READS_MIN_USES``; with ``--shared-no-partial`` only where the producer never
makes a partial sum), warm-started from the per-demand plan, under ``--time-limit``: its
columns, seconds, status and its plan's per-value price against the per-demand plan's.
With ``--per-value-min-uses K``: the same with those values priced per value (hubs or copy
nodes, as the exact program prices them) instead of share nodes.  One JSON line per row::

    python benchmarks/studies/wide_exact_signal.py --rows ROW ... [--lp] \\
        [--lp-iterations 60000] [--shared-min-uses 4 3] [--shared-no-partial] \\
        [--per-value-min-uses 4] [--time-limit 120] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def _row_problem(text: str, time_limit: float):
    """(graph, mesh, options, pinned) of a bench_truth row or a bench_intra one."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.problem.options import IntraOptions

    if text.startswith("intra:"):
        model, mesh_text = text[len("intra:") :].split("/")
        mesh = device_mesh_for(mesh_text)
        traced = trace_workload(model, batch_size=2 * mesh.num_devices)
        return traced.graph, mesh, IntraOptions(time_limit_s=time_limit), None
    from bench_truth import plan_settings, truth_mesh
    from exact_truth_sample import find_row

    _, model, overrides, optimizer, mesh_text, which = find_row(text)
    traced = trace_workload(model, optimizer=optimizer, **overrides)
    mesh = truth_mesh(mesh_text)
    options, pinned = plan_settings(traced.graph, mesh, which, time_limit)
    return traced.graph, mesh, options, pinned


def shared_overcharge(c, choice) -> tuple[float, int]:
    """(the per-demand over-charge of ``choice`` on values at least two of whose uses want
    one spec the producer does not make, how many such values)."""
    from per_demand_charge import value_charge_functions

    per_demand, per_value = value_charge_functions(c)
    total, count = 0.0, 0
    for i, v in enumerate(c.values):
        have = c.strategies[v.src][choice[v.src]].output_specs[v.k]
        wants = [c.strategies[u.dst][choice[u.dst]].input_specs[u.slot] for u in v.uses]
        moved = [w for w in wants if w is not None and w != have]
        if len(moved) > len(set(moved)):
            count += 1
            total += per_demand(i, choice) - per_value(i, choice)
    return total, count


@contextlib.contextmanager
def column_rule_lifted(lp_iterations: int):
    import autoshard.intra.problem.exact_values as exact_values

    saved = exact_values.EXACT_MAX_COLUMNS, exact_values.EXACT_LP_MAX_ITERATIONS
    exact_values.EXACT_MAX_COLUMNS = 10**12
    exact_values.EXACT_LP_MAX_ITERATIONS = lp_iterations
    try:
        yield
    finally:
        exact_values.EXACT_MAX_COLUMNS, exact_values.EXACT_LP_MAX_ITERATIONS = saved


@contextlib.contextmanager
def shared_reads(min_uses: int, no_partial: bool):
    import autoshard.intra.problem.value_edges as value_edges

    saved = (
        value_edges.SHARED_READS,
        value_edges.SHARED_READS_MIN_USES,
        value_edges.SHARED_READS_NO_PARTIAL,
    )
    value_edges.SHARED_READS, value_edges.SHARED_READS_MIN_USES = True, min_uses
    value_edges.SHARED_READS_NO_PARTIAL = no_partial
    try:
        yield
    finally:
        (
            value_edges.SHARED_READS,
            value_edges.SHARED_READS_MIN_USES,
            value_edges.SHARED_READS_NO_PARTIAL,
        ) = saved


def _resolved(build, common, mesh, settings, first, price, **finish) -> dict:
    """The per-demand program built with ``finish`` (share nodes or values priced per
    value), warm-started from ``first``'s plan: its outcome, priced per value."""
    from autoshard.intra.ilp import solve
    from autoshard.intra.problem.exact_values import price_per_value

    t0 = time.perf_counter()
    ip = build._finish(common, False, **finish)
    start = ip.values.complete(ip.strategies, first.strategy, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        solution = solve(ip.problem, **settings, initial=start)
    seconds = time.perf_counter() - t0
    found = price_per_value(common, solution.strategy)
    return {
        "columns": solution.num_variables,
        "seconds": round(seconds, 2),
        "status": solution.status,
        "gap": solution.gap,
        "price": found,
        "change": found / price - 1,
    }


def run_row(
    text: str,
    time_limit: float,
    lp: bool,
    lp_iterations: int,
    shared: tuple[int, ...] = (),
    no_partial: bool = False,
    per_value: tuple[int, ...] = (),
    share_only: bool = False,
) -> dict:
    from exact_truth_sample import _LpRecorder

    import autoshard.intra.problem.exact_values as exact_values
    from autoshard.intra.baselines.tables import BaselineRefusedError
    from autoshard.intra.ilp import solve
    from autoshard.intra.problem import build
    from autoshard.intra.problem.exact_values import price_per_value, solve_exact

    try:
        graph, mesh, options, pinned = _row_problem(text, time_limit)
    except BaselineRefusedError as err:  # as bench_truth counts it: refused, not planned
        return {"row": text, "refused": str(err)[:300]}
    settings = dict(
        solver=options.solver, time_limit_s=time_limit, mip_gap=options.mip_gap, seed=options.seed
    )
    t0 = time.perf_counter()
    common = build._common(graph, mesh, options, pinned, True, None)
    demand = build._finish(common, False)
    build_s = time.perf_counter() - t0
    if share_only:  # the signal alone, no solve
        t0 = time.perf_counter()
        share = exact_values.hub_share(common)
        return {"row": text, "hub_share": share, "hub_share_s": round(time.perf_counter() - t0, 3)}
    first = solve(demand.problem, **settings)
    price = price_per_value(common, first.strategy)
    over, count = shared_overcharge(common, first.strategy)
    row = {
        "row": text,
        "columns": first.num_variables,
        "build_s": round(build_s, 2),
        "per_demand_s": round(first.seconds, 2),
        "per_demand_objective": first.objective,
        "price": price,
        "overcharge": 1 - price / first.objective,
        "shared_overcharge": over / price,
        "shared_values": count,
        "hub_share": exact_values.hub_share(common),
    }
    if lp and first.num_variables > exact_values.EXACT_MAX_COLUMNS:
        with column_rule_lifted(lp_iterations), warnings.catch_warnings(), _LpRecorder() as rec:
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            exact = build._finish(common, True)
            solution = solve_exact(exact, demand, mesh, settings, None, first, lp_only=True)
            searched_s = time.perf_counter() - t0
        row["lifted"] = {
            "objective": solution.objective,
            "change": solution.objective / price - 1,
            "lp": rec.lp,
            "seconds_past_per_demand": round(searched_s, 2),
            "exact_stopped": solution.exact_stopped,
        }
    distinct = common.memo["distinct"]
    uses = Counter(len(v.uses) for v in distinct.values())
    row["values_by_distinct_uses"] = {str(k): uses[k] for k in sorted(uses)}
    for k in shared:
        with shared_reads(k, no_partial):
            row[f"shared_reads_{k}"] = _resolved(build, common, mesh, settings, first, price)
    for k in per_value:
        chosen = frozenset(i for i, v in distinct.items() if len(v.uses) >= k)
        row[f"per_value_{k}"] = _resolved(
            build, common, mesh, settings, first, price, per_value=chosen
        )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", required=True)
    ap.add_argument("--lp", action="store_true")
    ap.add_argument("--lp-iterations", type=int, default=60_000)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--shared-min-uses", type=int, nargs="*", default=[])
    ap.add_argument("--shared-no-partial", action="store_true")
    ap.add_argument("--per-value-min-uses", type=int, nargs="*", default=[])
    ap.add_argument("--hub-share-only", action="store_true", help="the hub share alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, started = [], time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    loads = [os.getloadavg()[0]]
    for text in args.rows:
        row = run_row(
            text,
            args.time_limit,
            args.lp,
            args.lp_iterations,
            tuple(args.shared_min_uses),
            args.shared_no_partial,
            tuple(args.per_value_min_uses),
            args.hub_share_only,
        )
        row["load"] = round(os.getloadavg()[0], 1)
        loads.append(row["load"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(
                json.dumps(
                    {
                        "command": " ".join(["python", *sys.argv]),
                        "started_utc": started,
                        "load_1min": [min(loads), max(loads)],
                        "rows": rows,
                    },
                    indent=1,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
