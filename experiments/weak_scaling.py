"""End-to-end weak scaling (Alpa's main figure), simulated on cluster presets.

For each model family of Alpa's (GPT, GPT-MoE, Wide-ResNet), each cluster preset and
each point (model, GPUs): autoshard's full search (``simulate(plan="auto")``: intra-op
ILPs + stage DP), intra-op only (the same ILP costs, one stage on the whole mesh),
inter-op only (the same stage DP, stages restricted to data-parallel logical meshes), and
the family's hand-written baseline: for GPT Megatron-LM (the best point of its TP x PP x
DP x micro-batch x recompute grid; and, on clusters whose device has an attention table,
the same search on Megatron-LM's flash-attention program, ``megatron-flash``: today's
Megatron-LM, the fair baseline for autoshard's own fused-attention step); for GPT-MoE DeepSpeed-style expert parallelism
with ZeRO-2 data parallelism (the ``expert-zero2`` intra-op baseline: experts split over
the data-parallel devices, or, where the GPUs do not divide the experts, over
DeepSpeed-MoE's expert-parallel group on a (n / g) x g view, :func:`expert_views`); for Wide-ResNet data parallelism with ZeRO (the faster of the
``zero2`` and ``zero3`` baselines that fits). Each baseline is a restricted search priced
by the same simulator: one stage on the whole mesh, the purely data-parallel logical mesh,
every stage ILP's inputs pinned as the baseline pins them, recompute chosen as for the
others, as many micro-batches (at most 64) as keep each micro-batch divisible by the GPUs.
Every method of a family prices the step with the optimizer Alpa's benchmark trains that
family with (``OPTIMIZER``): AdamW for GPT (Megatron-LM's grid models mixed-precision
Adam), Adafactor for GPT-MoE, SGD with Nesterov momentum 0.9 for Wide-ResNet; the traced
step's optimizer state is what each search's memory and update time count.
For GPT the full search also chooses its micro-batch count (``SEARCH_MICROBATCHES``;
``simulate(num_microbatches=("search", m))``): the whole search at the default count, a
quarter and half of it, twice and four times it, and at the count ``m`` of each
Megatron-LM method's best grid point (``megatron``, and ``megatron-flash`` where it runs),
the fastest that fits winning (each row's ``plan.microbatch_search`` lists them), as
Megatron's grid searches its own; intra-op only and inter-op only take the count it chose.
GPT-MoE and Wide-ResNet keep the one default count (their chunks take 12-20 min each at one
count), and so does ``--quick`` (the search would take it past 5 minutes);
``config.auto_microbatches`` says which.
Where a GPT stage with data-parallel replicas reduces its gradients is ``--grad-reduce``
(``simulate``'s ``grad_reduce``: every micro-batch, the default; ``step``; or ``auto``, each
stage choosing, docs/weak_scaling.md): the full search and the restricted searches priced
from its stage costs take it; ``config.grad_reduce`` records it per family (GPT-MoE and
Wide-ResNet keep ``microbatch``).
Throughput is model FLOPs per second (PFLOPS, recompute not counted), so methods that
recompute more are not credited for it; out of memory (the memory model against the
device's HBM) is a cross; a baseline that finds no plan at all (no micro-batch count or
stage plan fits its rule) is a ``no_plan`` row, drawn as an open circle.

    python experiments/weak_scaling.py [--quick] [--grad-reduce auto] [--out docs/figures]
"""

from __future__ import annotations

import itertools
import math
import sys

import figure

NAME = "weak-scaling"
TITLE = "End-to-end weak scaling"
SOURCE = "simulated"
FIGURE = 1

# family -> [(model preset, GPUs)] (Alpa's suites, REFERENCE.md)
SUITES = {
    "gpt": [
        ("gpt-350m", 1), ("gpt-760m", 2), ("gpt-1.3b", 4), ("gpt-2.6b", 8),
        ("gpt-6.7b", 16), ("gpt-15b", 32), ("gpt-39b", 64),
    ],
    "moe": [
        ("moe-380m", 1), ("moe-690m", 2), ("moe-1.3b", 4), ("moe-2.4b", 8),
        ("moe-10b", 16), ("moe-27b", 32), ("moe-70b", 64),
    ],
    "wresnet": [
        ("wresnet-250m", 1), ("wresnet-500m", 2), ("wresnet-1b", 4), ("wresnet-2b", 8),
        ("wresnet-4b", 16), ("wresnet-6.8b", 32), ("wresnet-13b", 64),
    ],
}  # fmt: skip
CLUSTERS = ("alpa-v100", "dgx-a100", "dgx-h100")
METHODS = (
    "auto", "megatron", "megatron-flash", "expert-zero2", "zero-dp", "intra-only", "inter-only",
)  # fmt: skip
LABELS = {
    "auto": "autoshard (full search)",
    "megatron": "Megatron-LM (best grid)",
    "megatron-flash": "Megatron-LM + flash attention (best grid)",
    "expert-zero2": "DeepSpeed-style expert parallel + ZeRO-2",
    "zero-dp": "Data parallel + ZeRO (best of 2, 3)",
    "intra-only": "Intra-op only",
    "inter-only": "Inter-op only (PP + DP)",
}
GLOBAL_BATCH = {"gpt": 1024, "moe": 1024, "wresnet": 1536}  # Alpa's (REFERENCE.md)
# the optimizer each family trains with in Alpa's benchmark (benchmark/alpa/
# benchmark_one_case_{gpt_bert,moe,wresnet}.py): every method of a family traces its step
OPTIMIZER = {"gpt": "adamw", "moe": "adafactor", "wresnet": "sgd-momentum"}
OPTIMIZER_LABELS = {
    "adamw": "AdamW",
    "adafactor": "Adafactor",
    "sgd-momentum": "SGD + Nesterov 0.9",
}
# the family's hand-written baseline: a Megatron grid, or intra-op baselines to search with
FAMILY_BASELINES = {"gpt": (), "moe": ("expert-zero2",), "wresnet": ("zero2", "zero3")}
QUICK_MAX_GPUS = {"gpt": 16, "moe": 8, "wresnet": 4}  # --only weak-scaling --quick < 5 min
ILP_TIME_LIMIT_S = 20.0
# families whose full search also searches its micro-batch count (not under --quick); the
# MoE and Wide-ResNet chunks take 12-20 min each at one count, so they keep the default
SEARCH_MICROBATCHES = ("gpt",)
# families whose searches take --grad-reduce (the others reduce every micro-batch)
GRAD_REDUCE_FAMILIES = ("gpt",)
GRAD_REDUCE_CHOICES = ("microbatch", "step", "auto")  # inter.stages.GRAD_REDUCE_CHOICES
MEGATRON_RECOMPUTE = ("none", "selective", "full")  # the Megatron grid's recompute axis
# the Megatron grid's methods -> the simulator's program (sim.simulate.PROGRAMS)
MEGATRON_PROGRAMS = {"megatron": "megatron-lm", "megatron-flash": "megatron-lm-flash"}


def simulated_presets() -> set[str]:
    """The presets :func:`autoshard.sim.simulate.simulate` prices (GPT with every plan,
    GPT-MoE and Wide-ResNet with ``plan="auto"``)."""
    from autoshard.models.gpt import GPT_PRESETS
    from autoshard.models.moe import MOE_PRESETS
    from autoshard.models.wresnet import WRESNET_PRESETS

    return set(GPT_PRESETS) | set(MOE_PRESETS) | set(WRESNET_PRESETS)


def _data_parallel_only(cost, views=()):
    """``cost`` on the purely data-parallel logical meshes only (n x 1), and the logical
    ``views`` (dp, tp) a baseline reads as data-parallel too (expert-zero2's expert groups)."""
    from autoshard.inter.stages import StageCost

    def stage_cost(start, end, submesh, logical, *mode, **how):  # how: grad_reduce=
        if logical[1] > 1 and tuple(logical) not in views:  # a tensor-parallel view
            return StageCost(math.inf, 0.0, 0.0)
        return cost(start, end, submesh, logical, *mode, **how)

    stage_cost.refusals = getattr(cost, "refusals", [])  # the same list: the DP quotes it
    return stage_cost


def _stage_search(
    cost, stage_cost, cluster, m: int, stages: int | None, grad_reduce: str = "microbatch"
) -> dict:
    """The stage DP over ``stage_cost`` (``stages``: a fixed count, None: searched), under
    the device's HBM, each stage reducing its gradients as ``grad_reduce`` says; the fastest
    plan flagged out of memory where none fits."""
    from autoshard.inter.stages import RECOMPUTE_MODES, grad_reduces_for, optimal_stage_plan

    hbm = cluster.device.hbm_bytes
    kw = dict(
        num_stages=stages, recompute_modes=RECOMPUTE_MODES,
        grad_reduces=grad_reduces_for(grad_reduce),
    )  # fmt: skip
    # the chain the cost stands for (a folded cost traces a few blocks for many: num_layers)
    args = (cost.num_layers, cluster.num_nodes, cluster.devices_per_node, stage_cost, m)
    try:
        sp = optimal_stage_plan(*args, memory_budget_bytes=hbm, **kw)
        oom = False
    except ValueError as err:
        if "budget" not in str(err):
            raise
        sp = optimal_stage_plan(*args, **kw)  # the fastest, flagged out of memory
        oom = True
    peak = max(s.peak_bytes for s in sp.stages)
    return {
        "step_time_s": sp.objective_s,
        "oom": oom or peak > hbm,
        "peak_bytes_per_device": peak,
        "plan": {
            "stages": [
                {
                    "layers": [s.start_layer, s.end_layer],
                    "submesh": list(s.submesh),
                    "logical_mesh_dp_tp": list(s.logical_mesh),
                    "recompute": s.recompute,
                    "grad_reduce": s.grad_reduce,
                }
                for s in sp.stages
            ],
            "num_microbatches": m,
        },
    }


def _restricted_searches(
    report, cluster_name: str, gpus: int, batch: int, grad_reduce: str = "microbatch"
) -> dict:
    """Intra-op only and inter-op only, priced with the stage costs ``auto`` used (its
    micro-batches, dtype, optimizer and ``grad_reduce``)."""
    from autoshard.hardware.clusters import load_cluster
    from autoshard.sim.auto import shared_stage_cost

    plan = report.plan
    cluster = load_cluster(cluster_name, gpus)
    m = plan["num_microbatches"]
    cost = shared_stage_cost(
        report.model, cluster, batch, m, plan["dtype"], ILP_TIME_LIMIT_S, {},
        optimizer=plan["optimizer"],
    )  # fmt: skip
    return {
        "intra-only": _stage_search(cost, cost, cluster, m, 1, grad_reduce),
        "inter-only": _stage_search(cost, _data_parallel_only(cost), cluster, m, None, grad_reduce),
    }


def baseline_microbatches(batch: int, gpus: int, tokens_per_sample: int = 1, group: int = 1):
    """Micro-batches for a data-parallel baseline: the most (up to 64) whose micro-batch
    the GPUs divide (and, for a GPT-MoE, holds whole expert groups of ``group`` tokens);
    None where none does."""
    fits = [
        d
        for d in range(1, min(batch, 64) + 1)
        if batch % d == 0
        and (batch // d) % gpus == 0
        and (batch // d * tokens_per_sample) % group == 0
    ]
    return max(fits) if fits else None


def expert_views(experts: int, gpus: int) -> tuple[tuple[int, int], ...]:
    """The logical view expert-zero2 also takes where the ``gpus`` do not divide the
    ``experts``: (gpus / g, g) with g the largest count dividing both, DeepSpeed-MoE's
    expert-parallel group (moe-27b's 48 experts on 32 GPUs: 2 x 16), both axes
    data-parallel and the experts split over the second; () where the gpus divide them."""
    if experts < 1 or experts % gpus == 0:
        return ()
    g = math.gcd(experts, gpus)
    return ((gpus // g, g),) if g > 1 else ()


def baseline_search(model: str, cluster_name: str, gpus: int, batch: int, dtype: str,
                    baselines: tuple[str, ...], optimizer: str = "adamw") -> dict | None:  # fmt: skip
    """The family's hand-written baseline as a restricted search: one stage on the whole
    mesh, its data-parallel logical mesh, each stage ILP pinned as ``baselines`` pin it
    (the fastest that fits of several; else the fastest, flagged out of memory), on the
    step traced with ``optimizer``; None where no micro-batch count keeps the batch
    divisible."""
    from autoshard.hardware.clusters import load_cluster
    from autoshard.models import get_workload
    from autoshard.sim.auto import search_stage_cost

    cfg = get_workload(model).config
    seq, group = getattr(cfg, "seq_len", 1), getattr(cfg, "expert_group_size", 1)
    m = baseline_microbatches(batch, gpus, seq, group)
    if m is None:
        return None
    cluster = load_cluster(cluster_name, gpus)
    found, graph = [], None
    for name in baselines:
        cost = search_stage_cost(
            model, cluster, batch, m, dtype, ILP_TIME_LIMIT_S, {}, name, optimizer=optimizer,
            graph=graph,
        )  # fmt: skip
        graph = cost.graph  # the same step for every baseline: traced once
        views = expert_views(getattr(cfg, "num_experts", 0), gpus) if name == "expert-zero2" else ()
        try:
            r = _stage_search(cost, _data_parallel_only(cost, views), cluster, m, 1)
        except ValueError:  # no finite plan: the baseline cannot plan some layer here
            continue
        found.append(r | {"baseline": name})
    if not found:
        return None
    fits = [r for r in found if not r["oom"]] or found
    return min(fits, key=lambda r: r["step_time_s"])


def megatron_best(model: str, cluster: str, gpus: int, batch: int, method: str = "megatron"):
    """Megatron-LM's best grid point with recompute in the grid: the TP x PP x DP x
    micro-batch grid searched at each of none, selective and full recompute, the fastest
    in model FLOPs/s that fits (the fastest of all, out of memory, if none fits), on the
    ``method``'s program (``MEGATRON_PROGRAMS``: the 2021 kernels, or flash attention)."""
    from autoshard.sim.simulate import simulate

    program = MEGATRON_PROGRAMS[method]
    found = [
        simulate(
            model, cluster, gpus, "megatron", recompute=mode, global_batch=batch, program=program
        )
        for mode in MEGATRON_RECOMPUTE
    ]
    fits = [r for r in found if not r.oom] or found
    return max(fits, key=_model_pflops)


def has_attention_table(cluster: str) -> bool:
    """Whether ``cluster``'s device names an attention table: where Megatron-LM's
    flash-attention program (``megatron-flash``) can be priced."""
    from autoshard.hardware.clusters import load_cluster

    return load_cluster(cluster).device.attention_table is not None


def megatron_methods(cluster: str) -> tuple[str, ...]:
    """The Megatron grid methods of a GPT panel on ``cluster``: ``megatron``, and
    ``megatron-flash`` where the device has an attention table."""
    return ("megatron", "megatron-flash") if has_attention_table(cluster) else ("megatron",)


def megatron_row(cluster: str, family: str, model: str, gpus: int, batch: int, method: str):
    """One Megatron grid method's row (and its report): :func:`megatron_best` on the
    method's program (closed form: seconds, not a search)."""
    report = megatron_best(model, cluster, gpus, batch, method)
    return _row(cluster, family, model, gpus, method, report, _model_pflops(report)), report


def _model_pflops(report) -> float:
    """Model FLOP/s of a report, in PFLOPS (MFU x peak x GPUs)."""
    from autoshard.hardware.clusters import load_cluster

    cluster = load_cluster(report.cluster, report.gpus)
    peak = cluster.device.peak_flops_for(report.plan["dtype"])
    return report.mfu * peak * report.gpus / 1e15


def auto_microbatches(*megas) -> tuple:
    """The micro-batch counts the full search tries (``simulate``'s ``num_microbatches``):
    its default candidates and, for GPT, the count of each Megatron-LM method's best grid
    point in ``megas`` (micro-batches per step, as ``auto`` counts them; the flash
    program's best often takes fewer, larger micro-batches than the 2021 program's)."""
    return ("search", *sorted({m.plan["num_microbatches"] for m in megas if m is not None}))


def family_grad_reduce(family: str, grad_reduce: str) -> str:
    """Where ``family``'s searches reduce data-parallel gradients under ``--grad-reduce``:
    as asked for a family of ``GRAD_REDUCE_FAMILIES``, every micro-batch for the others."""
    if grad_reduce not in GRAD_REDUCE_CHOICES:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_CHOICES}, got {grad_reduce!r}")
    return grad_reduce if family in GRAD_REDUCE_FAMILIES else "microbatch"


def add_arguments(ap) -> tuple[str, ...]:
    """This experiment's own flags (figure.main): the names ``run`` takes them by."""
    ap.add_argument(
        "--grad-reduce",
        choices=GRAD_REDUCE_CHOICES,
        default="microbatch",
        help="where the GPT searches' stages reduce data-parallel gradients: every "
        "micro-batch (default), once a step, or auto (each stage chooses)",
    )
    return ("grad_reduce",)


def run(quick: bool, progress, grad_reduce: str = "microbatch") -> dict:
    from autoshard.sim.simulate import simulate

    reduce_by = {f: family_grad_reduce(f, grad_reduce) for f in SUITES}

    clusters = CLUSTERS[:1] if quick else CLUSTERS
    max_gpus = dict(QUICK_MAX_GPUS) if quick else {f: 64 for f in SUITES}
    known = simulated_presets()
    points = [
        (family, model, gpus)
        for family, suite in SUITES.items()
        for model, gpus in suite
        if gpus <= max_gpus[family]
    ]
    todo = [(c, f, m, g) for c in clusters for f, m, g in points if m in known]
    skipped = sorted({f for f, m, _ in points if m not in known})
    rows = []
    for i, (cluster, family, model, gpus) in enumerate(todo):
        progress(i, len(todo), f"{cluster} {model} on {gpus}")
        batch, optimizer = GLOBAL_BATCH[family], OPTIMIZER[family]
        megas, counts = [], None
        if family == "gpt":  # the grid's memory and update model Adam (formulas.py)
            assert optimizer == "adamw", "Megatron-LM's grid models mixed-precision Adam"
            for method in megatron_methods(cluster):
                row, report = megatron_row(cluster, family, model, gpus, batch, method)
                rows.append(row)
                megas.append(report)
        if family in SEARCH_MICROBATCHES and not quick:
            counts = auto_microbatches(*megas)
        auto = simulate(
            model, cluster, gpus, "auto", ilp_time_limit_s=ILP_TIME_LIMIT_S, global_batch=batch,
            optimizer=optimizer, num_microbatches=counts, grad_reduce=reduce_by[family],
        )  # fmt: skip
        flops_per_step = _model_pflops(auto) * auto.step_time_s  # model PFLOP per step
        rows.append(_row(cluster, family, model, gpus, "auto", auto, _model_pflops(auto)))
        searched = _restricted_searches(auto, cluster, gpus, batch, reduce_by[family])
        if FAMILY_BASELINES[family]:
            method = "expert-zero2" if family == "moe" else "zero-dp"
            dtype = auto.plan["dtype"]
            found = baseline_search(
                model, cluster, gpus, batch, dtype, FAMILY_BASELINES[family], optimizer
            )
            if found is None:  # said in the JSON, drawn as an open circle
                rows.append(
                    {"cluster": cluster, "family": family, "model": model, "gpus": gpus,
                     "method": method, "pflops": None, "step_time_s": None, "oom": False,
                     "no_plan": True, "optimizer": optimizer}
                )  # fmt: skip
            else:
                searched = {method: found, **searched}
        for method, r in searched.items():
            rows.append(
                {"cluster": cluster, "family": family, "model": model, "gpus": gpus,
                 "method": method, "pflops": flops_per_step / r["step_time_s"],
                 "optimizer": optimizer, **r}
            )  # fmt: skip
    progress(len(todo), len(todo), "done")
    return {
        "config": {
            "global_batch": GLOBAL_BATCH,
            "optimizer": {f: OPTIMIZER[f] for f in SUITES},
            "family_baselines": {f: list(b) for f, b in FAMILY_BASELINES.items()},
            "seq_len": "1024 (GPT, GPT-MoE)",
            "recompute": "megatron: the grid's best of none/selective/full; searches: chosen per "
            "stage (none/selective/full)",
            "megatron_flash": MEGATRON_FLASH_NOTE,
            "dtype": "the device's 16-bit type (fp16 on V100, bf16 on A100/H100)",
            "ilp_time_limit_s": ILP_TIME_LIMIT_S,
            "grad_reduce": reduce_by,
            "auto_microbatches": {
                f: "searched: the default count, a quarter, half, 2x and 4x it and each "
                "Megatron-LM method's best point's (the fastest that fits wins; plan.microbatch_search "
                "lists them)"
                if f in SEARCH_MICROBATCHES and not quick
                else "one count: simulate's default for plan='auto'"
                + (
                    " (--quick: the search would take it past 5 minutes)"
                    if f in SEARCH_MICROBATCHES
                    else ""
                )
                for f in SUITES
            },
            "clusters": list(clusters),
            "max_gpus": max_gpus,
            "batch_unit": "sequences (GPT, GPT-MoE), images (Wide-ResNet)",
            "throughput": "model FLOPs per second (PFLOPS), recompute excluded",
        },
        "families_skipped": {
            f: "no presets the simulator prices yet (simulate() takes GPT presets)" for f in skipped
        },
        "rows": rows,
    }


MEGATRON_FLASH_NOTE = (
    "GPT, on clusters whose device has an attention table (dgx-a100, dgx-h100): Megatron-LM's "
    "best grid point on its flash-attention program (simulate program='megatron-lm-flash'), "
    "searched as megatron is; auto's micro-batch candidates take both methods' counts"
)


def _row(cluster, family, model, gpus, method, report, pflops) -> dict:
    return {
        "cluster": cluster,
        "family": family,
        "model": model,
        "gpus": gpus,
        "method": method,
        "pflops": pflops,
        "step_time_s": report.step_time_s,
        "oom": bool(report.oom),
        "peak_bytes_per_device": report.peak_bytes_per_device,
        "plan": report.to_json()["plan"],
        "search_seconds": report.search_seconds,
        "optimizer": report.plan.get("optimizer", "adamw"),  # grids: mixed-precision Adam
    }


def panels(doc: dict) -> list[tuple[str, str]]:
    """(cluster, family) of each panel, in order."""
    seen = []
    for r in doc["data"]["rows"]:
        key = (r["cluster"], r["family"])
        if key not in seen:
            seen.append(key)
    return seen


def no_plan(doc: dict, cluster: str, family: str) -> set[tuple[str, str]]:
    """(method, GPUs as text) of a panel where the method found no plan: a ``no_plan`` row,
    or no row at all for a method the panel has at other GPU counts (chunks run before
    no-plan rows were written leave the row out; ``run`` leaves one out only then)."""
    rows = [r for r in doc["data"]["rows"] if r["cluster"] == cluster and r["family"] == family]
    have = {(r["method"], str(r["gpus"])) for r in rows if not r.get("no_plan")}
    methods = {r["method"] for r in rows}
    return {(m, str(r["gpus"])) for m in methods for r in rows} - have


def panel_data(doc: dict, cluster: str, family: str):
    """Groups (GPU counts as text), methods, {(method, gpus): row} (rows with a plan), and
    the linear outline."""
    rows = [r for r in doc["data"]["rows"] if r["cluster"] == cluster and r["family"] == family]
    gpus = sorted({r["gpus"] for r in rows})
    by = {(r["method"], str(r["gpus"])): r for r in rows if not r.get("no_plan")}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    base = [by.get((m, str(gpus[0]))) for m in methods]
    base_pflops = max((r["pflops"] for r in base if r and not r["oom"]), default=None)
    linear = [None if base_pflops is None else base_pflops * g / gpus[0] for g in gpus]
    return [str(g) for g in gpus], methods, by, linear


def panel_title(doc: dict, cluster: str, family: str) -> str:
    """E.g. "MOE on alpa-v100, Adafactor": the optimizer the panel's rows were traced with
    (rows from before it was recorded traced AdamW, as the Megatron-LM grid models)."""
    rows = [r for r in doc["data"]["rows"] if r["cluster"] == cluster and r["family"] == family]
    names = sorted({r.get("optimizer", "adamw") for r in rows})
    return f"{family.upper()} on {cluster}, " + " / ".join(
        OPTIMIZER_LABELS.get(n, n) for n in names
    )


def plot(doc: dict):
    """One panel per (cluster, family): families down, clusters across."""
    keys = panels(doc)
    clusters = list(dict.fromkeys(c for c, _ in keys))
    families = list(dict.fromkeys(f for _, f in keys))
    fig, axes = figure.plt.subplots(
        len(families), len(clusters), figsize=(6.4 * len(clusters), 3.9 * len(families)),
        squeeze=False, layout="constrained",
    )  # fmt: skip
    for (row, family), (col, cluster) in itertools.product(
        enumerate(families), enumerate(clusters)
    ):
        ax = axes[row, col]
        if (cluster, family) not in keys:
            ax.set_axis_off()
            continue
        groups, methods, by, linear = panel_data(doc, cluster, family)
        models = {r["gpus"]: r["model"] for r in doc["data"]["rows"] if r["family"] == family}
        figure.grouped_bars(
            ax, groups, methods,
            cells={k: (r["pflops"], r["oom"]) for k, r in by.items()},
            linear=linear, labels=LABELS, no_plan=no_plan(doc, cluster, family),
            xlabel="The number of GPUs (model: " + ", ".join(
                models[int(g)].split("-", 1)[1] for g in groups) + ")",
        )  # fmt: skip
        ax.set_title(panel_title(doc, cluster, family), fontsize=10)
    fig.suptitle(figure.title(doc, "End-to-end weak scaling, throughput in model PFLOPS"))
    return fig


if __name__ == "__main__":
    figure.main(sys.modules[__name__])
