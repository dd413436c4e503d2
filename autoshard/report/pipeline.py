"""Pipeline plan files read for people and exported (jax-free).

Takes a :class:`~autoshard.ir.planfile.PipelinePlanFile` (``plan --pipeline ... --out``);
returns a :class:`PipelineDigest`: the stages (layers, sub-mesh, ``(dp, tp)`` view,
devices, recompute, latency, peak memory), the parallelism in words (``2 stages x (DP 1,
TP 4), no recompute``), and the report's sections, pictures and exports:

* Megatron-LM: ``--pipeline-model-parallel-size`` = stages, TP and DP from the stages'
  ``(dp, tp)`` views (the most common one when they differ: the stages that differ are
  listed), ``--micro-batch-size`` = global batch / (DP x microbatches),
  ``--recompute-granularity`` when the stages recompute (full: with ``--recompute-method
  uniform --recompute-num-layers 1``, every layer recomputed);
* DeepSpeed: micro batch and ``gradient_accumulation_steps`` = microbatches (the pipeline
  itself is set in code, ``PipelineModule(num_stages=...)``: said in a note), ZeRO 0;
* MaxText: ``ici_pipeline_parallelism``, ``ici_data_parallelism``,
  ``ici_tensor_parallelism``, ``num_pipeline_microbatches``, ``per_device_batch_size``.

Every configuration is checked against its target's start-up rules
(:mod:`autoshard.report.launchable`: layers divisible by stages, GPUs = TP x PP x DP,
companion flags); one the target cannot launch is refused (``ValueError``) with the
nearest grid it can, and that grid's settings.

The per-stage differences are :class:`~autoshard.report.export.TensorDifference` rows
whose ``path`` names the stage (a pipeline plan file keeps no per-tensor specs of its own).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from autoshard.inter.plan import InterPlan, Stage
from autoshard.inter.schedules import BACKWARD, gpipe, one_f_one_b
from autoshard.ir.planfile import PipelinePlanFile
from autoshard.report.export import (
    MAXTEXT_REMAT,
    Export,
    TensorDifference,
    megatron_args,
    megatron_recompute,
)
from autoshard.report.launchable import Grid, JobFacts, launch_problems, nearest_grid
from autoshard.report.text import Section, human_bytes


@dataclass(frozen=True)
class PipelineDigest:
    plan_file: PipelinePlanFile
    inter: InterPlan
    global_batch: int | None
    num_devices: int

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.inter.stages

    def common_view(self) -> tuple[int, int]:
        """The ``(dp, tp)`` view most stages use."""
        return Counter(tuple(s.logical_mesh) for s in self.stages).most_common(1)[0][0]

    def recompute(self) -> str:
        modes = {s.recompute for s in self.stages}
        return modes.pop() if len(modes) == 1 else "mixed"

    def summary(self) -> str:
        views = sorted({tuple(s.logical_mesh) for s in self.stages})
        roles = " / ".join(f"DP {dp}, TP {tp}" for dp, tp in views)
        rc = self.recompute()
        rc_text = "no recompute" if rc == "none" else f"{rc} recompute"
        return f"{len(self.stages)} stages x ({roles}), {rc_text}"


def pipeline_digest(pf: PipelinePlanFile) -> PipelineDigest:
    inter = InterPlan.from_json(dict(pf.inter_plan))
    devices = pf.fingerprint.get("devices") or {}
    n = int(devices.get("hosts", 1)) * int(devices.get("per_host", 0)) or sum(
        s.num_devices for s in inter.stages
    )
    return PipelineDigest(pf, inter, pf.extra.get("global_batch"), n)


def _cost(d: PipelineDigest, seconds: float) -> str:
    if d.plan_file.fingerprint.get("cluster"):
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds:.4g} (abstract units)"


def pipeline_sections(d: PipelineDigest) -> list[Section]:
    inter, pf = d.inter, d.plan_file
    head = (
        f"model {pf.model}, optimizer {pf.optimizer}, global batch {d.global_batch}, "
        f"{inter.num_microbatches} microbatches, schedule {inter.schedule} ({inter.method})",
        f"in words: {d.summary()}",
        f"pipeline latency {_cost(d, inter.objective_s)}"
        + ("" if pf.fingerprint.get("cluster") else " (no --cluster: Alpa's relative costs)"),
    )
    off = inter.offload
    if off:
        auto = " (chosen by auto)" if off.get("chosen_by") else ""
        usable = (
            f"{human_bytes(off['host_bytes_per_node'])} per node of "
            f"{human_bytes(off['host_memory_bytes'])} usable"
        )
        if len({s.offload for s in d.stages}) == 1:
            on_host = [c for c, w in off["where"].items() if w == "host" and c != "update"]
            head += (
                f"offload {off['offload']}{auto}: {', '.join(on_host)} in host memory on every "
                f"stage, update on {off['where']['update']}; {usable}",
            )
        else:
            by = " by auto" if off.get("chosen_by") else ""
            head += (f"offload chosen per stage{by} (the table's offload column); {usable}",)
        if off.get("why"):
            head += (f"auto offloads: {off['why']}",)
    rows = tuple(
        (
            str(i),
            f"{s.layers[0]}..{s.layers[-1]} ({len(s.layers)})" if s.layers else "?",
            f"{s.submesh[0]}x{s.submesh[1]}",
            f"DP {s.logical_mesh[0]}, TP {s.logical_mesh[1]}",
            ",".join(map(str, s.device_ids)),
            s.recompute,
            _cost(d, s.latency_s),
            human_bytes(s.peak_bytes),
        )
        + ((s.offload, *_host_cells(off, i)) if off else ())
        for i, s in enumerate(d.stages)
    )
    header = ("stage", "layers", "sub-mesh", "view", "devices", "recompute", "latency per "
              "microbatch", "peak bytes per device")  # fmt: skip
    if off:
        header += ("offload", "in host memory per device", "exposed offload per step")
    return [
        Section("Plan", head),
        Section("Stages, their layers and sub-meshes", header=header, rows=rows),
    ]


def _host_cells(off, i: int) -> tuple[str, str]:
    """A stage's host bytes per device and exposed offload seconds per step."""
    nbytes, exposed = off["host_bytes_per_stage"][i], off["exposed_s_per_stage"][i]
    return human_bytes(nbytes), f"{exposed * 1e3:.4g} ms"


def pipeline_json(d: PipelineDigest) -> dict:
    extra = {"offload": dict(d.inter.offload)} if d.inter.offload else {}
    return extra | {
        "model": d.plan_file.model,
        "kind": "pipeline",
        "summary": d.summary(),
        "global_batch": d.global_batch,
        "num_microbatches": d.inter.num_microbatches,
        "schedule": d.inter.schedule,
        "objective_s": d.inter.objective_s,
        "stages": [s.to_json() for s in d.stages],
    }


def _stage_differences(d: PipelineDigest, view: tuple[int, int]) -> tuple[TensorDifference, ...]:
    return tuple(
        TensorDifference(
            f"stage {i} ({', '.join(s.layers)})",
            "stage",
            f"DP {s.logical_mesh[0]}, TP {s.logical_mesh[1]}",
            f"DP {view[0]}, TP {view[1]}",
        )
        for i, s in enumerate(d.stages)
        if tuple(s.logical_mesh) != view
    )


def _micro(d: PipelineDigest, dp: int) -> int:
    batch, m = d.global_batch, d.inter.num_microbatches
    if batch is None or batch % (dp * m):
        raise ValueError(f"global batch {batch} does not split into DP {dp} x {m} microbatches")
    return batch // (dp * m)


def transformer_layers(layer_names) -> int | None:
    """How many transformer blocks (``block_N``) the names hold; None where none is one
    (not a layered model: the targets' layer rules are not checked)."""
    blocks = {name for name in layer_names if re.fullmatch(r"block_\d+", name)}
    return len(blocks) or None


def job_facts(d: PipelineDigest) -> JobFacts:
    if d.global_batch is None:
        raise ValueError("the pipeline plan file records no global batch: nothing to export")
    layers = transformer_layers(name for s in d.stages for name in s.layers)
    return JobFacts(d.num_devices, layers, d.global_batch, d.inter.num_microbatches)


def export_pipeline(d: PipelineDigest, target: str) -> Export:
    """``target``'s configuration of the plan's grid (TP and DP from the stages' common
    view, PP = stages), checked against the target's start-up rules
    (:mod:`autoshard.report.launchable`); ``ValueError`` naming the rules it breaks and
    the nearest grid the target can launch, with its settings, otherwise."""
    if target not in ("megatron", "deepspeed", "maxtext"):
        raise ValueError(f"unknown export target {target!r}")
    dp, tp = d.common_view()
    pp = len(d.stages)
    want = Grid(1, pp, dp * tp) if target == "deepspeed" else Grid(tp, pp, dp)
    facts = job_facts(d)
    if d.global_batch % (want.dp * d.inter.num_microbatches) == 0:
        out = _export_on(d, target, want)
        problems = launch_problems(target, out.config, facts, pipeline_stages=pp)
        if not problems:
            return out
    else:
        problems = [
            f"global batch {d.global_batch} does not split into DP {want.dp} x "
            f"{d.inter.num_microbatches} microbatches"
        ]
    stated = f"{want}" if want.gpus == facts.gpus else f"{want}, of {facts.gpus}"
    text = f"{target} cannot launch this plan as it is ({stated}): {'; '.join(problems)}"
    m = d.inter.num_microbatches
    if target == "maxtext" and want.gpus == facts.gpus and m % pp:
        keep = [k for k in range(pp, 4 * m + 1, pp) if k >= m and d.global_batch % k == 0]
        if keep:
            text += f" (re-planning with --microbatches {keep[0]} keeps the {pp} stages)"
    near = nearest_grid(target, want, facts)
    if near is None:
        raise ValueError(
            f"{text}; no TP x PP x DP grid of {facts.gpus} GPUs keeps {target}'s rules for "
            f"{facts.layers or 'these'} layers, global batch {facts.global_batch} and "
            f"{facts.microbatches} microbatches: "
            "re-plan with --stages dividing the layers and the devices"
        )
    nearest = _export_on(d, target, near)
    assert not launch_problems(target, nearest.config, facts, pipeline_stages=near.pp)
    one_line = {
        "megatron": nearest.text,
        "deepspeed": json.dumps(dict(nearest.config)),
        "maxtext": nearest.text.replace("\n", " "),
    }[target]
    if target == "deepspeed":
        one_line += f" with PipelineModule(num_stages={near.pp})"
    raise ValueError(
        f"{text}; the nearest launchable configuration is {near}: {one_line} "
        f"(or re-plan with --stages {near.pp})"
    )


def _export_on(d: PipelineDigest, target: str, grid: Grid) -> Export:
    """``target``'s settings for the plan laid on ``grid``; stages on another view are
    listed as differences."""
    tp, pp, dp, m = grid.tp, grid.pp, grid.dp, d.inter.num_microbatches
    diffs = _stage_differences(d, (dp, tp)) if pp == len(d.stages) else ()
    if pp != len(d.stages):
        diffs = (
            TensorDifference(
                "stages", "stage", f"{len(d.stages)} stages", f"{pp} stages of equal layers"
            ),
        )
    rc = d.recompute()
    notes = []
    if rc == "mixed":
        notes.append("the stages recompute differently; the frameworks take one setting: none")
    if target == "megatron":
        config: dict[str, object] = {
            "tensor-model-parallel-size": tp,
            "pipeline-model-parallel-size": pp,
            "micro-batch-size": _micro(d, dp),
            "global-batch-size": d.global_batch,
            "sequence-parallel": False,
            "use-distributed-optimizer": False,
        }
        config.update(megatron_recompute(rc))
        if d.inter.schedule == "gpipe":
            notes.append("Megatron-LM runs 1F1B; the plan was costed for GPipe")
        return Export("megatron", config, megatron_args(config), diffs, tuple(notes))
    if target == "deepspeed":  # no tensor parallelism: every TP group becomes DP
        view_tp = d.common_view()[1]
        if view_tp > 1 and pp == len(d.stages):
            diffs = tuple(
                TensorDifference(
                    f"stage {i} ({', '.join(s.layers)})",
                    "stage",
                    f"DP {s.logical_mesh[0]}, TP {s.logical_mesh[1]}",
                    f"DP {dp}, TP 1",
                )
                for i, s in enumerate(d.stages)
            )
        config = {
            "train_batch_size": d.global_batch,
            "train_micro_batch_size_per_gpu": _micro(d, dp),
            "gradient_accumulation_steps": m,
            "zero_optimization": {"stage": 0},
        }
        notes.append(
            f"DeepSpeed sets the pipeline in code: PipelineModule(num_stages={pp})"
            + (
                f"; its config has no tensor parallelism ({view_tp}): nearest is DP"
                if view_tp > 1
                else ""
            )
        )
        return Export("deepspeed", config, json.dumps(config, indent=2), diffs, tuple(notes))
    batch = d.global_batch or 0
    if batch % d.num_devices:
        raise ValueError(f"maxtext: global batch {batch} is not a multiple of "
                         f"{d.num_devices} devices")  # fmt: skip
    config = {
        "ici_pipeline_parallelism": pp,
        "ici_data_parallelism": dp,
        "ici_fsdp_parallelism": 1,
        "ici_tensor_parallelism": tp,
        "dcn_pipeline_parallelism": 1,
        "dcn_data_parallelism": 1,
        "num_pipeline_microbatches": m,
        "per_device_batch_size": batch // d.num_devices,
        "remat_policy": MAXTEXT_REMAT[rc if rc in MAXTEXT_REMAT else "none"],
    }
    text = "\n".join(f"{k}={v}" for k, v in config.items())
    return Export("maxtext", config, text, diffs, tuple(notes))


def pipeline_pictures(d: PipelineDigest) -> dict[str, bytes]:
    """``mesh`` (devices coloured by stage) and ``timeline`` (the schedule, each task as
    long as its stage's share of the latency: forward 1/3, backward 2/3)."""
    from autoshard.report.pictures import PHASE_COLOURS, STAGE_COLOURS, _figure, _png

    n = d.num_devices
    cols = min(n, 8)
    rows = -(-n // cols)
    plt, fig, ax = _figure(1.2 + 1.1 * cols, 1.4 + 0.9 * rows)
    stage_of = {dev: i for i, s in enumerate(d.stages) for dev in s.device_ids}
    for dev in range(n):
        r, c = divmod(dev, cols)
        st = stage_of.get(dev)
        colour = "#bbbbbb" if st is None else STAGE_COLOURS[st % len(STAGE_COLOURS)]
        ax.add_patch(plt.Rectangle((c, rows - 1 - r), 0.92, 0.88, color=colour))
        label = f"dev {dev}\nstage {st}" if st is not None else f"dev {dev}\nunused"
        ax.text(c + 0.46, rows - 1 - r + 0.44, label, ha="center", va="center", color="white",
                fontsize=9)  # fmt: skip
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(-0.1, rows + 0.1)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"{n} devices coloured by pipeline stage ({d.summary()})", fontsize=9)
    mesh_png = _png(plt, fig)

    pp, m = len(d.stages), d.inter.num_microbatches
    schedule = (gpipe if d.inter.schedule == "gpipe" else one_f_one_b)(pp, m)
    plt, fig, ax = _figure(8.0, 1.4 + 0.6 * pp)
    # in ms on a cluster; else relative to the slowest stage (abstract units are ~1e-7:
    # matplotlib's offset label "1e-6" then sat on the axis label)
    on_cluster = bool(d.plan_file.fingerprint.get("cluster"))
    raw = np.array([s.latency_s for s in d.stages])
    length = raw * 1e3 if on_cluster else raw / max(raw.max(), 1e-300)
    # a stage far quicker than the others (an embedding alone) still shows its bars
    visible = 0.004 * float(length.max()) * (3 * m)
    clock = 0.0
    for tick in schedule:
        width = 0.0
        for t in tick:
            w = length[t.stage] * (2 / 3 if t.kind == BACKWARD else 1 / 3)
            ax.barh(t.stage, max(w, visible), left=clock, color=PHASE_COLOURS[t.kind],
                    edgecolor="white")  # fmt: skip
            if w >= 0.15 * float(length.max()):  # a label that fits its bar
                ax.text(clock + w / 2, t.stage, f"{t.kind[0].upper()}{t.microbatch}",
                        ha="center", va="center", color="white", fontsize=7)  # fmt: skip
            width = max(width, w)
        clock += width
    for s in range(pp):
        ax.barh(s, length.max() / 6, left=clock, color=PHASE_COLOURS["update"], edgecolor="white")
    ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
    ax.invert_yaxis()
    unit = "ms" if on_cluster else "the slowest stage's latency = 1"
    ax.set_xlabel(f"time ({unit}; forward 1/3, backward 2/3 of a stage's latency; idle = bubble)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    ax.legend(handles, list(PHASE_COLOURS), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8)  # fmt: skip
    ax.set_title(f"pipeline timeline: {pp} stages, {m} microbatches, {d.inter.schedule}")
    return {"mesh": mesh_png, "timeline": _png(plt, fig)}
