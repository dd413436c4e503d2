"""Offload on 16 GB V100s (issue #34): do the out-of-memory points of the intra-op ablation
and of the weak-scaling figure fit with state in host memory, and at what step time?

Points (``alpa-v100``):

* ``ablation``: the intra-op ablation's 1-GPU point (GPT, hidden 2048, 8 layers, vocab
  25600, batch 8, seq 1024, bf16 with f32 master weights and AdamW: no plan fits, least
  peak 20.0 GiB): ``plan_workload(..., offload=...)`` as ``experiments/intra_ablation.py``
  plans it, under each placement and ``auto``; ``ablation:zero2:<gpus>`` and
  ``ablation:zero3:<gpus>``: that figure's ZeRO-2 / ZeRO-3 points drawn as crosses (hidden
  2048 / 3072 / 4096 / 5760 on 1 / 2 / 4 / 8 GPUs), the baseline's rule table under each
  placement;
* ``weak:<model>:<method>``: the V100 weak-scaling rows marked out of memory in
  ``docs/figures/weak-scaling.json`` (gpt-39b intra-only on 64 GPUs, moe-27b / moe-70b
  expert-zero2 on 32 / 64): the same restricted stage search (``experiments/
  weak_scaling.py``: one stage on the whole mesh, the row's micro-batches, dtype and
  optimizer, recompute chosen) with every stage under each placement.

Writes ``benchmarks/results/offload_v100.json`` and prints a table::

    python benchmarks/offload_v100.py [--placements P1;P2] [POINT ...]    # default: all

(``--placements``: the placements to run, separated by ``;``; rows of other placements of a
point already in the JSON are kept; ``OFFLOAD_V100_OUT``: another JSON to write.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = ("none", "optimizer", "optimizer,master", "optimizer,master,gradients")
# the points' program as the figures drew them and these rows were first made: attention
# unfused (S x S scores), not the fused default of GPT and GPT-MoE since 263a841 (with it the
# ablation point fits 16 GiB without offload: 11.23 GiB)
ATTENTION = "unfused"
ABLATION = dict(
    num_layers=8, vocab_size=25600, batch_size=8, seq_len=1024, dtype="bfloat16",
    attention=ATTENTION,
)  # fmt: skip
# (baseline, GPUs, hidden): the intra-op ablation's out-of-memory points
# (docs/figures/intra-ablation.json) whose method takes offload: the ILP's (it finds no plan)
# and ZeRO-2's / ZeRO-3's (data parallel and the heuristic model systems without offload)
ABLATION_POINTS = {
    "ablation": (None, 1, 2048),
    **{f"ablation:zero2:{g}": ("zero2", g, h) for h, g in ((2048, 1), (3072, 2), (4096, 4), (5760, 8))},
    **{f"ablation:zero3:{g}": ("zero3", g, h) for h, g in ((2048, 1), (3072, 2))},
}  # fmt: skip
# (model, method, GPUs, micro-batches, optimizer): the rows of docs/figures/weak-scaling.json
WEAK = {
    "weak:gpt-39b:intra-only": ("gpt-39b", "intra-only", 64, 256, "adamw"),
    "weak:moe-27b:expert-zero2": ("moe-27b", "expert-zero2", 32, 32, "adafactor"),
    "weak:moe-70b:expert-zero2": ("moe-70b", "expert-zero2", 64, 16, "adafactor"),
}


def ablation_point(name: str = "ablation", placements=None) -> list[dict]:
    """``ablation``: the ILP's 1-GPU point; ``ablation:<baseline>:<gpus>``: a ZeRO
    baseline's out-of-memory point of the intra-op ablation (its rule table, its size)."""
    import autoshard
    from autoshard.intra.ilp import InfeasibleBudgetError, SolverTimeLimitError
    from autoshard.sim import formulas

    baseline, gpus, hidden = ABLATION_POINTS[name]
    if placements is None:  # auto: the ILP's point (a baseline's is the fastest that fits)
        placements = (*PLACEMENTS, "auto") if baseline is None else PLACEMENTS
    opts = autoshard.IntraOptions(solver="highs", time_limit_s=120.0, merge_elementwise=True)
    flops = formulas.model_flops_per_step(8, 1024, 8, hidden, 25600)
    hbm = 16 * GIB  # alpa-v100
    rows = []
    for placement in placements:
        t0 = time.perf_counter()
        print(f"{name}: offload {placement} ...", file=sys.stderr, flush=True)
        try:
            bound = autoshard.plan_workload(
                "gpt-1.3b", str(gpus), options=opts, cluster="alpa-v100", hidden=hidden,
                baseline=baseline, offload=placement, **ABLATION,
            )  # fmt: skip
        except InfeasibleBudgetError as err:
            rows.append(
                {"point": name, "offload": placement, "fits": False,
                 "least_peak_bytes": err.min_feasible_bytes, "why": str(err).split(" -- ")[-1]}
            )  # fmt: skip
            continue
        except SolverTimeLimitError:  # no plan under the HBM in time: the peak without it
            free = autoshard.plan_workload(
                "gpt-1.3b", str(gpus), options=opts.replace(memory_budget_bytes=1e15),
                cluster="alpa-v100", hidden=hidden, baseline=baseline, offload=placement,
                **ABLATION,
            ).plan  # fmt: skip
            rows.append(
                {"point": name, "offload": placement, "fits": False,
                 "least_peak_bytes": free.predicted_peak_bytes,
                 "why": "no plan under the HBM within the ILP's 120 s; the least peak is the "
                 "plan's without a budget"}
            )  # fmt: skip
            continue
        plan, rec = bound.plan, bound.plan.offload
        step = rec.get("step_time_s", plan.objective)
        if plan.predicted_peak_bytes > hbm:  # a pinned baseline is priced, not refused
            rows.append(
                {"point": name, "offload": placement, "fits": False,
                 "least_peak_bytes": plan.predicted_peak_bytes, "step_time_s": step,
                 "why": "predicted peak over the HBM"}
            )  # fmt: skip
            continue
        rows.append(
            {
                "point": name,
                "offload": placement,
                "chosen": rec.get("offload", "none"),
                "fits": True,
                "peak_bytes": plan.predicted_peak_bytes,
                "step_time_s": step,
                "device_step_s": plan.objective,
                "pflops": flops / step / 1e15,
                "host_bytes_per_node": rec.get("host_bytes_per_node", 0.0),
                "exposed_s": rec.get("exposed_s", 0.0),
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows


def _host_bytes(cost, result) -> float:
    """Host bytes per device of the stage plan ``result`` (the stage holding most)."""
    most = 0.0
    for st in result["plan"]["stages"]:
        start, end = st["layers"]
        logical = tuple(st["logical_mesh_dp_tp"])
        most = max(most, sum(cost.unit(i, i + 1, logical).host_bytes for i in range(start, end)))
    return most


def _leanest(cost, stage_cost, cluster) -> float:
    """The least per-device memory of one stage on the whole cluster over its logical
    meshes and recompute modes (one micro-batch in flight: a single stage)."""
    from autoshard.inter.stages import RECOMPUTE_MODES, logical_mesh_shapes

    submesh = (cluster.num_nodes, cluster.devices_per_node)
    layers = len(cost.graph.layers)
    return min(
        stage_cost(0, layers, submesh, logical, mode).memory_bytes(1)
        for logical in logical_mesh_shapes(submesh)
        for mode in RECOMPUTE_MODES
        if stage_cost(0, layers, submesh, logical, mode).latency_s < float("inf")
    )


def weak_point(name: str, placements=PLACEMENTS) -> list[dict]:
    sys.path.insert(0, str(ROOT / "experiments"))
    import weak_scaling as ws

    from autoshard.hardware.clusters import load_cluster
    from autoshard.intra.offload.placement import HOST_USABLE_FRACTION, parse_offload
    from autoshard.models import get_workload
    from autoshard.sim import formulas
    from autoshard.sim.auto import search_stage_cost

    model, method, gpus, m, optimizer = WEAK[name]
    cluster = load_cluster("alpa-v100", gpus)
    cfg = get_workload(model).config
    baseline = "expert-zero2" if method == "expert-zero2" else None
    views = ws.expert_views(getattr(cfg, "num_experts", 0), gpus) if baseline else ()
    rows, graph, solutions = [], None, None
    for placement in placements:
        t0 = time.perf_counter()
        print(f"{name}: offload {placement} ...", file=sys.stderr, flush=True)
        offload = parse_offload(placement) or None
        cost = search_stage_cost(
            model, cluster, ws.GLOBAL_BATCH["gpt" if model.startswith("gpt") else "moe"], m,
            "fp16", ws.ILP_TIME_LIMIT_S, {"attention": ATTENTION}, baseline, optimizer=optimizer,
            graph=graph,
            offload=offload,
        )  # fmt: skip
        graph = cost.graph
        if solutions is None:
            solutions = cost._solutions
        else:  # equal ILPs (a device update changes none) are solved once across placements
            cost._solutions = solutions
        stage_cost = ws._data_parallel_only(cost, views) if baseline else cost
        r = ws._stage_search(cost, stage_cost, cluster, m, 1)
        leanest = _leanest(cost, stage_cost, cluster) if r["oom"] else r["peak_bytes_per_device"]
        host = _host_bytes(cost, r) if offload else 0.0
        per_node = host * cluster.devices_per_node
        fits_host = per_node <= cluster.host.memory_bytes * HOST_USABLE_FRACTION
        batch = ws.GLOBAL_BATCH["gpt" if model.startswith("gpt") else "moe"]
        if model.startswith("gpt"):
            from autoshard.sim.simulate import gpt_shape

            shape, _ = gpt_shape(model)
            flops = formulas.model_flops_per_step(
                batch, shape.seq_len, shape.layers, shape.hidden, shape.vocab
            )
        else:
            flops = graph.model_flops_where() * m  # the traced micro-batch step, m times
        rows.append(
            {
                "point": name,
                "offload": placement,
                "fits": (not r["oom"]) and fits_host,
                "oom_hbm": r["oom"],
                "fits_host": fits_host,
                "peak_bytes": r["peak_bytes_per_device"],
                "leanest_bytes": leanest,  # the least any (logical mesh, recompute) needs
                "step_time_s": r["step_time_s"],
                "pflops": flops / r["step_time_s"] / 1e15,
                "host_bytes_per_node": per_node,
                "plan": r["plan"],
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="writes benchmarks/results/offload_v100.json (OFFLOAD_V100_OUT: another JSON)",
    )
    parser.add_argument(
        "points",
        nargs="*",
        metavar="POINT",
        help="ablation, ablation:zero2:<1|2|4|8>, ablation:zero3:<1|2> or one of "
        f"{', '.join(WEAK)} (default: all)",
    )
    parser.add_argument(
        "--placements",
        help=f"the placements to run, separated by ';' (default: {';'.join(PLACEMENTS)})",
    )
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # the ablation's meshes (before any use)
    placements = tuple(args.placements.split(";")) if args.placements else PLACEMENTS
    points = args.points or [*ABLATION_POINTS, *WEAK]
    unknown = [p for p in points if p not in ABLATION_POINTS and p not in WEAK]
    if unknown:
        print(f"unknown point(s) {unknown}; choose from {', '.join([*ABLATION_POINTS, *WEAK])}")
        return 2
    out = Path(os.environ.get("OFFLOAD_V100_OUT", ROOT / "benchmarks/results/offload_v100.json"))
    for point in points:
        if point in ABLATION_POINTS:
            rows = ablation_point(point, *(() if args.placements is None else (placements,)))
        else:
            rows = weak_point(point, placements)
        # read just before writing: another run may have added rows meanwhile
        doc = json.loads(out.read_text()) if out.exists() else {"rows": []}
        redone = {(r["point"], r["offload"]) for r in rows}
        doc["rows"] = [r for r in doc["rows"] if (r["point"], r["offload"]) not in redone]
        doc["rows"] += rows
        commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
        load = Path("/proc/loadavg").read_text().split()[:3]
        for r in rows:
            r |= {"commit": commit, "load": load}
        out.write_text(json.dumps(doc, indent=1))
        for r in rows:
            peak = r.get("peak_bytes", r.get("least_peak_bytes", 0.0)) / GIB
            step = f"{r['step_time_s']:.4g} s" if "step_time_s" in r else "-"
            print(
                f"{r['point']:28s} {r['offload']:28s} fits {str(r['fits']):5s} peak "
                f"{peak:7.2f} GiB  step {step:>10s}  host/node "
                f"{r.get('host_bytes_per_node', 0.0) / GIB:8.1f} GiB"
            )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
