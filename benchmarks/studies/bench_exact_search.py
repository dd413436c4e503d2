"""The exact per-value program on meshes of several axes: the default before
(``exact_search="one-axis"``: the per-demand plan priced per value) against the default
now (``"auto"``: the exact program, with hubs, solved from that plan where the
per-demand program has at most ``EXACT_MAX_COLUMNS`` columns), and the proven optimum.

For each case: both settings' objective, status, why the exact program was not solved
(``exact_stopped``) and ``auto_shard_graph``'s seconds (median of ``--repeat`` runs);
then the exact program solved on its own as a MIP (no start, no node budget, ``--time-limit``),
which proves the optimum.  Cases: Alpa's n-layer conv net (its test_conv.py: 3x3/2
conv, batch norm, relu, 2x2/1 max pool; SGD with momentum) on 2x2, and the verifier's
small suites (gpt-tiny, moe-tiny, wresnet-tiny, mlp) on 2x2, 2x4 and 4x2, with Alpa's
test mesh costs.  One JSON line per case on stdout, progress on stderr; ``--out`` writes
every row as one JSON document with the command, the load and the time.

    python benchmarks/studies/bench_exact_search.py [--repeat 3] [--cases conv2 gpt-tiny-2x4]
        [--out benchmarks/results/bench_exact_search.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

CASES = {
    "conv2-2x2": ("conv", {"num_layers": 2}, (2, 2)),
    "conv4-2x2": ("conv", {"num_layers": 4}, (2, 2)),
    "mlp-2x2": ("mlp", {"batch_size": 16, "hidden": 256, "num_layers": 2}, (2, 2)),
    "gpt-tiny-2x4": ("gpt-tiny", {}, (2, 4)),
    "gpt-tiny-4x2": ("gpt-tiny", {}, (4, 2)),
    "moe-tiny-2x4": ("moe-tiny", {}, (2, 4)),
    "wresnet-tiny-2x4": ("wresnet-tiny", {"num_layers": 8}, (2, 4)),
}


def conv_net(num_layers=2, batch=8, image=32, channel=8):
    """Alpa's test_n_layer_conv model and step, traced (tests/test_exact_2d.py plans it too)."""
    from autoshard.ir.graph import build_graph

    return build_graph(conv_program(num_layers, batch, image, channel).records)


def conv_program(num_layers=2, batch=8, image=32, channel=8):
    """:func:`conv_net`'s traced program (what the verifier compiles)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from autoshard.models import make_train_step
    from autoshard.trace.jaxpr import trace_train_step

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(num_layers):
                x = nn.Conv(channel, (3, 3), strides=(2, 2), use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=False)(x)
                x = nn.relu(x)
                x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
            return x

    model = Model()
    x = jnp.ones((batch, image, image, channel))
    side = image // 2**num_layers
    y = jnp.ones((batch, side, side, channel))
    variables = model.init(jax.random.key(0), x)
    stats = variables["batch_stats"]

    def loss(params, b):
        out, _ = model.apply(
            {"params": params, "batch_stats": stats}, b["x"], mutable=["batch_stats"]
        )
        return jnp.mean((out - b["y"]) ** 2)

    opt = optax.sgd(0.1, momentum=0.9)
    step = make_train_step(loss, opt)
    return trace_train_step(step, variables["params"], opt.init(variables["params"]),
                            {"x": x, "y": y})  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeat", type=int, default=3, help="plans per setting (median time)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="the optimum's solve, s")
    ap.add_argument("--out", default=None, help="also write every row here (JSON)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    from autoshard.api import trace_workload
    from autoshard.hardware.mesh import alpa_test_mesh
    from autoshard.intra.ilp import solve
    from autoshard.intra.problem.build import _common, _finish, auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    rows = []
    for name in args.cases:
        model, kw, shape = CASES[name]
        print(f"{name} ...", file=sys.stderr, flush=True)
        if model == "conv":
            graph = conv_net(**kw)
        else:
            graph = trace_workload(model, optimizer="sgd", **kw).graph
        mesh = alpa_test_mesh(shape, ("data", "model"))
        options = IntraOptions(solver="highs", time_limit_s=60)
        row = {"case": name, "model": model, "overrides": kw, "mesh": "x".join(map(str, shape))}
        for search in ("one-axis", "auto"):
            times, plan = [], None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                plan = auto_shard_graph(graph, mesh, options.replace(exact_search=search))
                times.append(time.perf_counter() - t0)
            key = "before" if search == "one-axis" else "after"
            row[key] = {
                "exact_search": search,
                "objective": plan.objective,
                "status": plan.solver["status"],
                "exact_stopped": plan.solver.get("exact_stopped"),
                "plan_s_median": round(statistics.median(times), 3),
                "plan_s_runs": [round(t, 3) for t in times],
            }
            print(f"  {search}: {plan.objective:.6g} in {statistics.median(times):.2f} s "
                  f"({plan.solver.get('exact_stopped')})", file=sys.stderr, flush=True)  # fmt: skip
        common = _common(graph, mesh, options, None, True, None)
        exact = _finish(common, True)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimum = solve(exact.problem, solver="highs", time_limit_s=args.time_limit)
        row["optimum"] = {
            "objective": optimum.objective,
            "status": optimum.status,
            "gap": optimum.gap,
            "solve_s": round(time.perf_counter() - t0, 3),
            "columns": optimum.num_variables,
            "hubs": sum(g.hub >= 0 for g in exact.values.groups),
            "copy_groups": sum(g.hub < 0 for g in exact.values.groups),
        }
        for key in ("before", "after"):
            row[key]["over_optimum_pct"] = round(
                100 * (row[key]["objective"] / optimum.objective - 1), 3
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "command": "python " + " ".join(sys.argv),
                    "loadavg": open("/proc/loadavg").read().split()[:3],
                    "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
