"""Where layer sharing loses: the shared and the unshared plan compared layer by layer.

Solves the per-demand program (as ``bench_sharing.py`` does) tied ``--sharing`` and not
tied at all, the unshared solve started from the shared plan (so its plan is never
dearer), then prints, for every layer, how many of its nodes the two plans place
differently and which, which layers of the unshared plan are placed alike, and what the
unshared plan would cost once projected onto each tie structure (every tie root keeps
its unshared choice; a structure that holds the unshared plan projects to its objective).

    python benchmarks/studies/share_blocks.py --model gpt-tiny --layers 4 --mesh 2x4
        [--sharing "ends + period 2"] [--time-limit 300] [--out share_blocks.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

STRUCTURES = {
    "period 1": {"layer_period": 1},
    "period 2": {"layer_period": 2},
    "ends + period 1": {"layer_period": 1, "layer_ends": True},
    "ends + period 2": {"layer_period": 2, "layer_ends": True},
}


def _layer_nodes(graph) -> dict[str, list[int]]:
    by_layer: dict[str, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.index)
    return by_layer


def _projected(problem, plan) -> tuple[int, ...]:
    from autoshard.intra.ilp import resolve_ties

    roots, maps = resolve_ties(problem)
    return tuple(maps[v][plan[roots[v]]] for v in range(problem.num_nodes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--sharing", default="period 2", choices=sorted(STRUCTURES))
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from autoshard.api import trace_workload
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.ilp import objective_of, resolve_ties, solve
    from autoshard.intra.problem.build import build_problem
    from autoshard.intra.problem.options import IntraOptions

    traced = trace_workload(args.model, optimizer="sgd", num_layers=args.layers)
    graph = traced.graph
    mesh = alpa_test_mesh(tuple(int(s) for s in args.mesh.split("x")), ("data", "model"))
    base = IntraOptions(solver="highs")
    shared_ip = build_problem(graph, mesh, base.replace(**STRUCTURES[args.sharing]))
    unshared_ip = build_problem(graph, mesh, base.replace(share_layers=False))
    t0 = time.perf_counter()
    shared = solve(shared_ip.problem, solver="highs", time_limit_s=args.time_limit)
    t1 = time.perf_counter()
    unshared = solve(
        unshared_ip.problem, solver="highs", time_limit_s=args.time_limit, initial=shared.strategy
    )
    t2 = time.perf_counter()
    n_in = shared_ip.num_inputs
    strategies = unshared_ip.strategies
    doc: dict = {
        "command": shlex.join(["python", *sys.argv]),
        "time": time.strftime("%F %T"),
        "shared": {"sharing": args.sharing, "objective": shared.objective,
                   "status": shared.status, "solve_s": t1 - t0},
        "unshared": {"objective": unshared.objective, "status": unshared.status,
                     "gap": unshared.gap, "solve_s": t2 - t1},
    }  # fmt: skip
    print(json.dumps(doc), flush=True)

    def name(v: int, plan) -> str:
        return strategies[v][plan[v]].name

    layers = _layer_nodes(graph)
    diffs = {}
    for layer, idx in layers.items():
        differ = [i for i in idx if shared.strategy[n_in + i] != unshared.strategy[n_in + i]]
        diffs[layer] = {
            "nodes": len(idx),
            "differ": len(differ),
            "dots": [
                f"{graph.nodes[i].phase} {graph.nodes[i].module_path}: "
                f"{name(n_in + i, shared.strategy)} -> {name(n_in + i, unshared.strategy)}"
                for i in differ
                if graph.nodes[i].primitive == "dot_general"
            ],
        }
        print(layer, diffs[layer]["differ"], "of", len(idx), flush=True)
        for line in diffs[layer]["dots"]:
            print("   ", line)
    doc["differ_by_layer"] = diffs
    # which layers the unshared plan places alike (node by node, in order)
    alike = {}
    names = list(layers)
    for a in names:
        for b in names:
            if a < b and len(layers[a]) == len(layers[b]):
                same = sum(
                    unshared.strategy[n_in + i] == unshared.strategy[n_in + j]
                    for i, j in zip(layers[a], layers[b], strict=True)
                )
                alike[f"{a}={b}"] = f"{same}/{len(layers[a])}"
    doc["unshared_alike"] = alike
    print("unshared plan, layers alike:", alike)
    projections = {}
    for label, changes in STRUCTURES.items():
        ip = build_problem(graph, mesh, base.replace(**changes))
        plan = _projected(ip.problem, unshared.strategy)
        projections[label] = {
            "objective": objective_of(ip.problem, plan),
            "roots": len(set(resolve_ties(ip.problem)[0])),
        }
        print("projected onto", label, projections[label], flush=True)
    doc["projections"] = projections
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
