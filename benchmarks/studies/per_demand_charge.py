"""Where the per-demand program's charge parts from the per-value price: two plans of one
bench_truth row, value by value (issue #31: wresnet-tiny(num_layers=8) 2x4 auto, whose
default plan costs 9% more per value than a plan the exact program holds).

The row's problem is built as ``exact_truth_sample.py`` builds it.  Plan A is the
default plan; plan B is read from ``--plans`` (a JSON of ILP strategy indices, keys
``default`` and ``exact``) or, where that file does not exist, found by solving the exact
per-value program warm-started from plan A for ``--time-limit`` seconds (the study's
``solve_exact_long``) and written there, so the long solve runs once.

For each plan: its per-value price (``price_per_value``) and what the per-demand program
charges it (``objective_of`` on that program, its discount nodes completed; and with
its share nodes, ``value_edges.SHARED_READS``), the first two split
into node costs and, per value, that value's charge: per demand (its edges in the
per-demand program) and per value (its edges in the per-value program priced at the
chosen strategies, as ``price_per_value`` does).  The two splits are checked against the
totals.  Then the values whose charges differ between the plans, or where a plan's
per-demand charge is over its per-value price, ranked, with their producer and readers.
``--shared-reads``: the row planned by default once more with the share nodes on (its
objective, seconds, status and columns).  One JSON on ``--out``, a summary on stdout::

    python benchmarks/studies/per_demand_charge.py [--row LABEL/MESH/PLAN] \\
        [--plans FILE] [--time-limit 300] [--shared-reads] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

ROW = "wresnet-tiny(num_layers=8)/2x4/auto"


def value_charge_functions(c):
    """(per_demand(i, choice), per_value(i, choice)): value ``i``'s charge in the
    per-demand program and its per-value price, at the assignment ``choice``."""
    from autoshard.intra.problem.value_edges import hub_max_sets, hubbed_values, value_edges

    cap = hub_max_sets(c.mesh)
    forbidden = c.options.forbidden_collectives()
    hubbed = hubbed_values(c.values, c.strategies, c.ties, cap, {})
    chains_of = defaultdict(list)
    for ch in c.chains:
        chains_of[ch.src, ch.k].append(ch)
    n = len(c.strategies)

    def evaluate(ve, strategies, choice):
        full = ve.complete(strategies, choice, c.mesh)
        return math.fsum(e.costs[full[e.src]][full[e.dst]] for e in ve.edges)

    def per_demand(i, choice):
        v = c.values[i]
        ve = value_edges(
            [v], c.strategies, c.ties, c.mesh, c.cost_options, False, {}, forbidden, cap,
            chains=tuple(chains_of[v.src, v.k]),
        )  # fmt: skip
        return evaluate(ve, c.strategies, choice)

    def per_value(i, choice):
        v = c.values[i]
        chosen = [(c.strategies[j][choice[j]],) for j in range(n)]
        have = chosen[v.src][0].output_specs[v.k]
        uses = tuple(
            u
            for u in v.uses
            if (want := chosen[u.dst][0].input_specs[u.slot]) is not None and want != have
        )
        if not uses:
            return 0.0
        one = dataclasses.replace(v, uses=uses, steps=(v.steps[choice[v.src]],))
        ve = value_edges(
            [one], chosen, (None,) * n, c.mesh, c.cost_options, True, {}, forbidden, cap,
            frozenset({0}) if i in hubbed else frozenset(), tuple(chains_of[v.src, v.k]),
        )  # fmt: skip
        return evaluate(ve, chosen, (0,) * n)

    return per_demand, per_value


def describe_node(c, j, choice) -> dict:
    s = c.strategies[j][choice[j]]
    if j < c.n_in:
        t = c.graph.tensors[c.graph.inputs[j]]
        return {"node": j, "op": "input", "what": t.path, "kind": t.kind, "strategy": s.name}
    node = c.graph.nodes[j - c.n_in]
    return {
        "node": j,
        "op": node.primitive,
        "layer": node.layer,
        "phase": node.phase,
        "what": node.module_path,
        "strategy": s.name,
        "in": [str(x) for x in s.input_specs],
        "out": [str(x) for x in s.output_specs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default=ROW)
    ap.add_argument("--plans", default="per_demand_charge_plans.json")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--shared-reads",
        action="store_true",
        help="also plan the row by default with the per-demand program's share nodes on",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    here = Path(__file__).parent
    sys.path[:0] = [str(here), str(here.parent)]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from bench_truth import plan_settings, truth_mesh
    from exact_truth_sample import PLAN_TIME_LIMIT, find_row, solve_exact_long

    from autoshard.api import trace_workload
    from autoshard.intra.ilp import objective_of
    from autoshard.intra.problem.build import _common, _finish, auto_shard_graph
    from autoshard.intra.problem.exact_values import price_per_value

    suite, model, overrides, optimizer, mesh_text, which = find_row(args.row)
    traced = trace_workload(model, optimizer=optimizer, **overrides)
    graph, mesh = traced.graph, truth_mesh(mesh_text)
    options, pinned = plan_settings(graph, mesh, which, PLAN_TIME_LIMIT)
    t0 = time.perf_counter()
    plan = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
    default_s = time.perf_counter() - t0
    c = _common(graph, mesh, options, pinned, True, None)
    n = len(c.strategies)
    demand = _finish(c, False)
    a = tuple(plan.solver["strategy"])[:n]
    plans_path = Path(args.plans)
    if plans_path.exists():
        saved = json.loads(plans_path.read_text())
        if tuple(saved["default"][:n]) != a:
            print("note: the default plan differs from the saved one", file=sys.stderr)
        b = tuple(saved["exact"])
        found = saved.get("found")
    else:
        exact = _finish(c, True)
        sol, choice, obj, _, _ = solve_exact_long(exact, mesh, a, args.time_limit)
        b = tuple(choice[:n])
        found = {"objective": obj, "status": sol.status, "seconds": round(sol.seconds, 1),
                 "gap": sol.gap, "time_limit": args.time_limit}  # fmt: skip
        plans_path.write_text(json.dumps({"default": list(a), "exact": list(b), "found": found}))

    import autoshard.intra.problem.value_edges as value_edges_module

    value_edges_module.SHARED_READS = True  # the per-demand program with share nodes
    shared = _finish(_common(graph, mesh, options, pinned, True, None), False)
    value_edges_module.SHARED_READS = False
    per_demand, per_value = value_charge_functions(c)
    plans = {"default": a, "cheaper": b}
    totals, charges = {}, {}
    for name, ch in plans.items():
        full = demand.values.complete(c.strategies, ch, mesh)
        nodes = math.fsum(c.node_costs[j][ch[j]] for j in range(n))
        fixed = math.fsum(e.costs[ch[e.src]][ch[e.dst]] for e in c.edges)
        pd = [per_demand(i, ch) for i in range(len(c.values))]
        pv = [per_value(i, ch) for i in range(len(c.values))]
        totals[name] = {
            "per_value": price_per_value(c, ch),
            "per_demand": objective_of(demand.problem, full),
            "per_demand_shared_reads": objective_of(
                shared.problem, shared.values.complete(c.strategies, ch, mesh)
            ),
            "node_costs": nodes,
            "fixed_edges": fixed,
            "values_per_demand": math.fsum(pd),
            "values_per_value": math.fsum(pv),
        }
        t = totals[name]
        for whole, part in (("per_value", pv), ("per_demand", pd)):  # the splits add up
            assert math.isclose(t[whole], nodes + fixed + math.fsum(part), rel_tol=1e-9), (
                name, whole, t[whole], nodes + fixed + math.fsum(part))  # fmt: skip
        charges[name] = (pd, pv)

    rows = []
    for i, v in enumerate(c.values):
        r = {
            "value": i,
            "shape": list(v.shape),
            "producer": describe_node(c, v.src, a)["op"],
            "uses": len(v.uses),
        }
        for name in plans:
            pd, pv = charges[name]
            r[name] = {"per_demand": pd[i], "per_value": pv[i]}
        if any(r[k]["per_demand"] != r[k]["per_value"] for k in plans) or (
            r["default"]["per_value"] != r["cheaper"]["per_value"]
        ):
            rows.append(r)
    changed_nodes = [j for j in range(n) if a[j] != b[j]]
    node_delta = defaultdict(float)
    for j in changed_nodes:
        op = describe_node(c, j, a)["op"]
        node_delta[op] += c.node_costs[j][b[j]] - c.node_costs[j][a[j]]

    def by_producer(key):
        out = defaultdict(float)
        for r in rows:
            out[r["producer"]] += key(r)
        return dict(sorted(out.items(), key=lambda kv: kv[1]))

    result = {
        "row": args.row,
        "default_plan_seconds": round(default_s, 2),
        "cheaper_found": found,
        "totals": totals,
        "nodes_changed": len(changed_nodes),
        "node_cost_change_by_op": dict(node_delta),
        "value_change_per_value_by_producer": by_producer(
            lambda r: r["cheaper"]["per_value"] - r["default"]["per_value"]
        ),
        "value_change_per_demand_by_producer": by_producer(
            lambda r: r["cheaper"]["per_demand"] - r["default"]["per_demand"]
        ),
        "overcharge_by_producer": {
            name: by_producer(lambda r, k=name: r[k]["per_demand"] - r[k]["per_value"])
            for name in plans
        },
        "values": rows,
        "changed_nodes": [
            {"default": describe_node(c, j, a), "cheaper": describe_node(c, j, b)}
            for j in changed_nodes
        ],
    }
    if args.shared_reads:  # the default path, its per-demand program with share nodes
        value_edges_module.SHARED_READS = True
        t0 = time.perf_counter()
        try:
            wide = auto_shard_graph(graph, mesh, options, pinned_inputs=pinned, name=which)
        finally:
            value_edges_module.SHARED_READS = False
        result["default_shared_reads"] = {
            "objective": wide.objective,
            "seconds": round(time.perf_counter() - t0, 2),
            "status": wide.solver.get("status"),
            "gap": wide.solver.get("gap"),
            "columns": wide.solver.get("num_variables"),
            "exact_stopped": wide.solver.get("exact_stopped"),
        }
        result["default_columns"] = plan.solver.get("num_variables")
    print(json.dumps({k: v for k, v in result.items() if k not in ("values", "changed_nodes")},
                     indent=1))  # fmt: skip
    top = sorted(rows, key=lambda r: -abs(r["cheaper"]["per_demand"] - r["cheaper"]["per_value"]))
    for r in top[: args.top]:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
