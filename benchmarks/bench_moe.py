"""Alpa's MoE layer under three all-to-all pricings: what the plan is and what it costs.

Plans the layer of Alpa's ``test_moe_layer`` (batch 64, sequence 16, hidden 64, 16 heads,
16 experts, groups of 32 tokens; MSE loss, Adam) on Alpa's 4x1 and 1x4 test meshes
(alpha 1, beta 1) with

* ``alpa``: ``CostOptions(all_to_all_penalty_scales_with_n=True)``, Alpa's pricing,
* ``alpa-before-fix``: what the Alpa option charged before all-to-alls were priced on
  the per-device buffer with (n-1)/n (``(n-1)/n^2`` of it times n/2), and
* ``default``: autoshard's own (per-device buffer, (n-1)/n, no penalty),

and prints, per mesh and pricing, the objective, Alpa's expected objective for its
expert-parallel plan (its test's formula), how the expert weights are split and the
predicted collectives; ``--verify`` also compiles each plan on 4 fake CPU devices and
compares. Writes JSON::

    python benchmarks/bench_moe.py [--verify] [--out benchmarks/results/bench_moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path


def alpa_expected_objective(n: int, b=64, s=16, h=64, e=16) -> float:
    """Alpa's test expectation: 4 all-to-alls of the dispatched tokens (the whole tensor,
    b s h x 2 x 4 bytes, priced (n-1)/n^2 x n/2) and the all-reduces of the replicated
    weights' gradients, each with Alpa's tie-breakers."""

    def a2a(nbytes):
        return 1 + (n - 1) / n / n * nbytes * n / 2 + 0.001

    def ar(nbytes):
        return 1 + 2 * (n - 1) / n * nbytes + 0.01

    return (
        a2a(b * s * h * 2 * 4) * 4
        + ar(h * h * 3 * 4)
        + ar(h * 3 * 4)
        + ar(h * h * 4)
        + ar(h * 4) * 5
        + ar(h * e * 4)
    )


def run(verify: bool) -> list[dict]:
    import jax

    from autoshard.api import auto_shard
    from autoshard.hardware.mesh import uniform_mesh
    from autoshard.intra.cost.resharding import CostOptions
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.models.moe import alpa_moe_layer_step

    step, args = alpa_moe_layer_step()
    pricings = {
        "alpa": CostOptions(all_to_all_penalty_scales_with_n=True),
        # what autoshard charged with Alpa's option before pricing the per-device buffer
        # with (n-1)/n: (n-1)/n^2 x n/2 of it, i.e. a penalty of 1/2 on one axis of any n
        "alpa-before-fix": CostOptions(all_to_all_penalty=0.5),
        "default": None,
    }
    rows = []
    for shape in ((4, 1), (1, 4)):
        mesh = uniform_mesh(shape, ("x", "y"), 1.0, 1.0)
        for name, cost in pricings.items():
            t0 = time.perf_counter()
            bound = auto_shard(
                step, *args, mesh=mesh, options=IntraOptions(solver="highs", cost=cost)
            )
            plan = bound.plan
            specs = dict(zip(plan.input_paths, plan.input_specs))
            row = {
                "mesh": "x".join(map(str, shape)),
                "pricing": name,
                "objective": plan.objective,
                "alpa_expected_objective": alpa_expected_objective(4),
                "wi": str(specs["[0]['moe']['wi']"]),
                "wo": str(specs["[0]['moe']['wo']"]),
                "qkv_kernel": str(specs["[0]['attn']['qkv']['kernel']"]),
                "predicted": {
                    f"{k}@{','.join(a)}": c
                    for (k, a), c in sorted(
                        Counter((c.kind, c.axes) for c in plan.predicted_collectives).items()
                    )
                },
                "plan_seconds": time.perf_counter() - t0,
            }
            if verify:
                report = bound.verify(jax.devices()[:4])
                row["collectives_agree"] = report.collectives_agree
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--verify", action="store_true", help="compile each plan and compare")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_moe.json"))
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    rows = run(args.verify)
    command = "python benchmarks/bench_moe.py" + (" --verify" if args.verify else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
