"""The default's integer program around the per-demand plan (exact_search="lp", a
fractional LP relaxation on an exact program over ``EXACT_MIP_MAX_COLUMNS``) where freeing
whole nodes would free more than ``NEIGHBOURHOOD_WHOLE_NODES_MAX`` columns: the rule
before 2026-11-28 (one round, the columns where the start and the LP differ) against the
rule now (:func:`autoshard.intra.ilp.solvers._neighbourhoods`: the first round also tries
the nodes where the LP puts under half its weight on the start's strategy and keeps the
cheaper plan, a second round searches around it).

``plans``: for each case (Alpa's n-layer conv net, bench_exact_search's ``conv_program``,
on Alpa's test mesh) both rules' plans in the same process, alternating (``--repeat``;
seconds: the median of ``auto_shard_graph``'s), with the objective, the free columns and
the rounds.  ``--variants``: on one case's exact program (captured from the default's
solve), each neighbourhood on its own, from the per-demand plan and then around the plan
the minority nodes found, with HiGHS's options as shipped and ``max_nodes`` 200: the
objective of the program (rescaled units), seconds and branch-and-bound nodes.
``--random N``: tests/test_ilp.py's random problems, N seeds per size, with whole nodes
forced off: the rule now against the columns alone.  One JSON document::

    python benchmarks/studies/neighbourhood_rounds.py [--cases conv4-4x2 conv3-2x4]
        [--repeat 2] [--variants conv4-4x2] [--random 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

CASES = {  # name: (layers, mesh); those whose default reaches the neighbourhood search
    "conv2-2x4": (2, (2, 4)),
    "conv2-4x2": (2, (4, 2)),
    "conv3-2x4": (3, (2, 4)),
    "conv4-4x2": (4, (4, 2)),
    "conv5-4x2": (5, (4, 2)),
}


def _before(model, incumbent, first):
    """The rule before 2026-11-28: whole nodes where at most the cap, else the columns."""
    import numpy as np

    from autoshard.intra.ilp import solvers

    differ = solvers._differing_columns(model, incumbent)
    whole = np.isin(model.node_of, model.node_of[differ])
    return [whole if whole.sum() <= solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX else differ]


def _plan(graph, mesh, rule: str) -> dict:
    from autoshard.intra.ilp import solvers
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    now = (solvers._neighbourhoods, solvers.NEIGHBOURHOOD_ROUNDS)
    if rule == "before":
        solvers._neighbourhoods, solvers.NEIGHBOURHOOD_ROUNDS = _before, 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            plan = auto_shard_graph(graph, mesh, IntraOptions(solver="highs", exact_search="lp"))
            seconds = time.perf_counter() - start
    finally:
        solvers._neighbourhoods, solvers.NEIGHBOURHOOD_ROUNDS = now
    return {
        "objective": round(plan.objective, 3),
        "plan_s": round(seconds, 2),
        "neighbourhood_free": plan.solver.get("neighbourhood_free"),
        "neighbourhood_rounds": plan.solver.get("neighbourhood_rounds"),
    }


def _graph_and_mesh(name):
    from bench_exact_search import conv_program

    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.ir.graph import build_graph

    layers, shape = CASES[name]
    return build_graph(conv_program(num_layers=layers).records), alpa_test_mesh(
        shape, ("data", "model")
    )


def plans(name: str, repeat: int) -> dict:
    graph, mesh = _graph_and_mesh(name)
    runs = {"before": [], "now": []}
    for _ in range(repeat):  # alternating, so load shifts hit both
        for rule in runs:
            runs[rule].append(_plan(graph, mesh, rule))
            print(name, rule, runs[rule][-1], file=sys.stderr, flush=True)
    row = {"case": name}
    for rule, got in runs.items():
        row[rule] = {**got[-1], "plan_s": statistics.median(r["plan_s"] for r in got)}
        row[rule]["plan_s_all"] = [r["plan_s"] for r in got]
    row["now_over_before"] = round(row["now"]["objective"] / row["before"]["objective"] - 1, 5)
    row["time_ratio"] = round(row["now"]["plan_s"] / row["before"]["plan_s"], 2)
    return row


def _captured(name):
    """The default's exact program at its neighbourhood search: (the HiGHS matrix as the
    search got it, the model)."""
    from autoshard.intra.ilp import solvers

    graph, mesh = _graph_and_mesh(name)
    got = {}
    real = solvers._neighbourhood

    def spy(highs, lp, model, relaxed):
        got["bounds"] = (list(lp.col_lower_), list(lp.col_upper_))
        got["model"], got["lp"], got["relaxed"] = model, lp, relaxed
        return real(highs, lp, model, relaxed)

    solvers._neighbourhood = spy
    try:
        _plan(graph, mesh, "now")
    finally:
        solvers._neighbourhood = real
    return got


def variants(name: str) -> dict:
    """Each neighbourhood on its own on ``name``'s exact program."""
    import highspy
    import numpy as np

    from autoshard.intra.ilp import solvers

    got = _captured(name)
    model, lp = got["model"], got["lp"]
    bounds = tuple(np.asarray(b, dtype=float) for b in got["bounds"])
    nb = model.num_binary
    start = np.full(nb, np.nan)
    cols, vals = model.start
    start[np.asarray(cols, dtype=np.int64)] = vals
    rows = []

    def run(label, incumbent, free):
        with solvers._banner_to_devnull():
            highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("mip_abs_gap", solvers._ABS_GAP)
        highs.setOptionValue("mip_rel_gap", 0.0)
        highs.setOptionValue("presolve", "on")
        highs.setOptionValue("mip_max_nodes", 200)
        kinds = highspy.HighsVarType
        lp.integrality_ = [kinds.kInteger] * nb + [kinds.kContinuous] * (model.num_cols - nb)
        objective, values, nodes, seconds = solvers._around(highs, lp, bounds, incumbent, free)
        rows.append({
            "neighbourhood": label, "free_columns": int(free.sum()),
            "objective": None if objective is None else round(objective, 3),
            "seconds": round(seconds, 2), "nodes": nodes,
        })  # fmt: skip
        print(name, rows[-1], file=sys.stderr, flush=True)
        return values

    lp_bin = model.lp_values[:nb]
    rounded = np.round(lp_bin)

    def columns(incumbent):
        return ~((np.abs(lp_bin - rounded) <= solvers._INTEGRAL_TOL) & (incumbent == rounded))

    def minority(incumbent, enclosed):
        return solvers._minority_nodes(model, incumbent, enclosed)

    before = run("start: columns where the start and the LP differ (the rule before)", start,
                 columns(start))  # fmt: skip
    found = run("start: minority nodes (round 1 now)", start, minority(start, False))
    whole_cap = solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX
    solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX = 10**9
    try:  # the enclosed nodes without the cap on columns
        run("start: minority nodes and those they enclose, uncapped", start, minority(start, True))
    finally:
        solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX = whole_cap
    run(
        "start: columns and minority nodes together", start, columns(start) | minority(start, False)
    )
    incumbent = np.round(found[:nb])
    run("round 2: minority nodes alone", incumbent, minority(incumbent, False))
    found = run("round 2: minority nodes and those they enclose (now)", incumbent,
                minority(incumbent, True))  # fmt: skip
    incumbent = np.round(found[:nb])
    run("round 3 (not run by default): minority nodes and those they enclose", incumbent,
        minority(incumbent, True))  # fmt: skip
    whole = np.isin(model.node_of, model.node_of[columns(start)])
    incumbent = np.round(before[:nb])
    for k in (20, 90):  # local branching around the rule before's plan
        rows.append(_local_branching(lp, bounds, model, incumbent, whole, k))
        print(name, rows[-1], file=sys.stderr, flush=True)
    return {"case": name, "lp_bound": round(got["relaxed"].bound, 3), "rows": rows}


def _local_branching(lp, bounds, model, incumbent, free, k: int) -> dict:
    """The integer program with ``free`` free (the rest fixed at ``incumbent``) and one
    more row: at most ``k`` nodes leave ``incumbent``'s strategy; 50 nodes."""
    import highspy
    import numpy as np

    from autoshard.intra.ilp import solvers

    nb = model.num_binary
    with solvers._banner_to_devnull():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("mip_abs_gap", solvers._ABS_GAP)
    highs.setOptionValue("mip_rel_gap", 0.0)
    highs.setOptionValue("mip_max_nodes", 50)
    lower, upper = bounds[0].copy(), bounds[1].copy()
    lower[:nb][~free] = incumbent[~free]
    upper[:nb][~free] = incumbent[~free]
    lp.col_lower_, lp.col_upper_ = lower, upper
    highs.passModel(lp)
    chosen = np.flatnonzero(incumbent == 1).astype(np.int32)
    highs.addRow(float(chosen.size - k), highspy.kHighsInf, chosen.size, chosen,
                 np.ones(chosen.size))  # fmt: skip
    highs.setSolution(nb, np.arange(nb, dtype=np.int32), incumbent)
    started = time.perf_counter()
    highs.run()
    seconds = time.perf_counter() - started
    info = highs.getInfo()
    feasible = info.primal_solution_status == 2
    return {
        "neighbourhood": f"local branching: at most {k} nodes change from the rule before's "
        "plan, every node where the start and the LP differ free",
        "free_columns": int(free.sum()),
        "objective": round(info.objective_function_value, 3) if feasible else None,
        "seconds": round(seconds, 2), "nodes": int(info.mip_node_count),
    }  # fmt: skip


def random_scan(seeds: int) -> dict:
    """tests/test_ilp.py's dense random problems (6-8 nodes, 3-4 strategies, the start
    ``(seed + i) % k``) with whole nodes forced off (``NEIGHBOURHOOD_WHOLE_NODES_MAX`` 0):
    the rule now against the columns alone (no minority nodes); where they differ, brute
    force's optimum."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from test_ilp import brute_force, dense_random

    from autoshard.intra.ilp import solve, solvers

    def no_minority(model, incumbent, enclosed):
        return np.zeros(model.num_binary, dtype=bool)

    real, cap = solvers._minority_nodes, solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX
    solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX = 0
    problems, dearer, cheaper = 0, [], []
    try:
        for n, k in ((6, 3), (7, 3), (6, 4), (8, 3)):
            for seed in range(seeds):
                dense = dense_random(n, k, seed)
                start = tuple((seed + i) % k for i in range(n))
                got = {}
                for rule, minority in (("columns", no_minority), ("now", real)):
                    solvers._minority_nodes = minority
                    got[rule] = solve(dense, solver="highs", merge=False, lp_first=True,
                                      initial=start, mip_max_columns=0, max_nodes=50)  # fmt: skip
                problems += 1
                a, b = got["columns"].objective, got["now"].objective
                case = {"n": n, "k": k, "seed": seed, "columns": round(a, 4), "now": round(b, 4)}
                if b > a + 1e-9:
                    dearer.append(case)
                elif b < a - 1e-6:
                    case["optimum"] = round(brute_force(dense)[0], 4)
                    case["rounds"] = got["now"].neighbourhood_rounds
                    cheaper.append(case)
    finally:
        solvers._minority_nodes, solvers.NEIGHBOURHOOD_WHOLE_NODES_MAX = real, cap
    return {"problems": problems, "dearer": dearer, "cheaper": cheaper}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=[], choices=list(CASES))
    ap.add_argument("--random", type=int, default=0, help="seeds per size of the scan")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).parent))
    started = time.time()
    out = {
        "command": "python benchmarks/studies/neighbourhood_rounds.py " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "load_1min_start": os.getloadavg()[0],
        "plans": [plans(name, args.repeat) for name in args.cases],
        "variants": [variants(name) for name in args.variants],
        "random": random_scan(args.random) if args.random else None,
    }
    out["wall_s"] = round(time.time() - started, 1)
    out["load_1min_end"] = os.getloadavg()[0]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
