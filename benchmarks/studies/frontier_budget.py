"""The 1T search against SC21's layout under two memory budgets (one cost object).

Prices SC21's GPT-1T layout (TP 8 x PP 64 x DP 6, 512 micro-batches of one sequence per
replica, full recompute, Megatron's layer split) on the search's own stage costs, then runs
the stage search under the A100's HBM and under that layout's own peak memory, and writes
``benchmarks/results/frontier_budget.json``.

    python benchmarks/studies/frontier_budget.py
"""

from __future__ import annotations

import json
from pathlib import Path

from autoshard.hardware.clusters import load_cluster
from autoshard.inter.options import StageSearchOptions
from autoshard.inter.search import search_stages
from autoshard.inter.stages import microbatches_in_flight, pipeline_objective
from autoshard.sim.auto import search_stage_cost
from autoshard.sim.traced import megatron_stages


def main() -> None:
    cluster = load_cluster("dgx-a100", 3072)
    shape = {"num_layers": 128, "hidden": 25600, "num_heads": 160, "seq_len": 2048}
    m = 512
    cost = search_stage_cost("gpt-39b", cluster, 3072, m, "bf16", 20.0, shape)
    stages = [cost(a, b, (6, 8), (6, 8), "full") for a, b in megatron_stages(128, 64)]
    step = pipeline_objective([c.latency_s for c in stages], m)
    peak = max(
        c.memory_bytes(microbatches_in_flight(i, 64, m, "1f1b")) for i, c in enumerate(stages)
    )
    out = {"published_tp8_pp64_dp6": {"step_s": step, "peak_bytes": peak}, "search": []}
    print(f"SC21 layout: step {step:.1f} s, peak {peak / 1e9:.1f} GB")
    for budget in (cluster.device.hbm_bytes, peak):
        options = StageSearchOptions(
            m, recompute_modes=("none", "selective", "full"), memory_budget_bytes=budget
        )
        plan = search_stages(
            cost.graph, cluster.num_nodes, cluster.devices_per_node, options, cost=cost
        )
        st = plan.stage_plan.stages
        row = {
            "budget_bytes": budget,
            "step_s": plan.objective_s,
            "num_stages": len(st),
            "peak_bytes": max(s.peak_bytes for s in st),
            "submesh_logical": sorted({(s.submesh, s.logical_mesh) for s in st}),
            "recompute": sorted({s.recompute for s in st}),
            "layers_per_stage": sorted({s.end_layer - s.start_layer for s in st}),
        }
        out["search"].append(row)
        print(
            f"search under {budget / 1e9:.1f} GB: step {row['step_s']:.1f} s, "
            f"{row['num_stages']} stages on {row['submesh_logical']}, peak "
            f"{row['peak_bytes'] / 1e9:.1f} GB"
        )
    path = Path(__file__).parents[1] / "results" / "frontier_budget.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
