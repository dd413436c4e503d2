"""A plan digest as sections of plain data, shared by the terminal and the HTML page
(jax-free).

Takes a :class:`~autoshard.report.digest.PlanDigest` (and, optionally, a simulated step
as a plain mapping: ``cluster``, ``gpus``, ``step_time_s``, ``mfu``, ``plan``); returns
:class:`Section` s: a title, a few lines of prose and at most one table, every number
with its unit. :func:`explain_json` is the same content for ``--json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.ir.planfile import describe_mesh
from autoshard.ir.units import format_bytes
from autoshard.report.digest import PlanDigest


def human_bytes(n: float) -> str:
    """``1.5 MiB``: binary units, as every memory figure autoshard prints
    (:func:`autoshard.ir.units.format_bytes`)."""
    return format_bytes(n)


@dataclass(frozen=True)
class Section:
    title: str
    lines: tuple[str, ...] = ()
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()


def _objective(d: PlanDigest) -> str:
    cluster = d.plan_file.fingerprint.get("cluster")
    unit = (
        f"s (costed on cluster {cluster})"
        if cluster
        else "(Alpa's relative cost units: no --cluster)"
    )
    return f"ILP objective {d.plan.objective:.6g} {unit}"


def sections(d: PlanDigest, simulated: Mapping | None = None) -> list[Section]:
    """The report, top to bottom (module docstring)."""
    pf, roles = d.plan_file, d.parallelism
    head = [
        f"model {pf.model or '(your own function)'}, optimizer {pf.optimizer or '(not recorded: your own step)'}, "
        f"global batch {d.global_batch if d.global_batch is not None else '?'}, "
        f"dtype {d.dtype or '?'}",
        f"plan {d.plan.name!r} on mesh {describe_mesh(d.mesh)}: {d.mesh.num_devices} devices",
        f"in words: {roles.summary()}",
        _objective(d),
    ]
    head += [f"note: {n}" for n in d.notes]
    out = [Section("Plan", tuple(head))]
    mesh_lines = [
        f"axis {a} ({d.mesh.size(a)} devices): "
        + (
            "data parallel (splits the batch)"
            if a in roles.dp_axes
            else "tensor parallel (splits weights)"
            if a in roles.tp_axes
            else "replicates everything"
            if d.mesh.size(a) > 1
            else "size 1"
        )
        for a in d.mesh.axis_names
    ]
    mesh_lines.append(f"stages: {roles.num_stages} (every layer on the whole mesh)")
    out.append(Section("Mesh and stages", tuple(mesh_lines)))
    rows = []
    for group in d.layers:
        for i, p in enumerate(group.params):
            rows.append(
                (group.label if i == 0 else "", p.name, p.spec, human_bytes(p.bytes_per_device))
            )
    out.append(
        Section(
            "Parameters (scaling-book notation: dim@mesh-axis; identical layers folded)",
            header=("layer", "parameter", "spec", "bytes per device"),
            rows=tuple(rows),
        )
    )
    coll = []
    for axes, kinds in d.collectives_by_axes.items():
        for kind, nbytes in kinds.items():
            coll.append(("+".join(axes), kind, f"{nbytes:,} B", human_bytes(nbytes)))
    out.append(
        Section(
            "Collectives per step by mesh axis (predicted, bytes per device)",
            () if coll else ("none: the plan communicates nothing",),
            ("mesh axes", "collective", "bytes", "readable"),
            tuple(coll),
        )
    )
    mem = tuple((k, human_bytes(v)) for k, v in d.memory_bytes.items())
    out.append(
        Section(
            "Memory per device by category",
            (
                f"predicted peak {human_bytes(d.plan.predicted_peak_bytes)}; gradients are an "
                "estimate (one per weight, laid out like the weight, or split like the "
                "optimizer state under ZeRO-2); activations and temporaries are the rest of "
                "the peak",
            ),
            ("category", "bytes per device"),
            mem,
        )
    )
    v = d.verification
    if v is None:
        out.append(
            Section(
                "Predicted vs compiled",
                ("not verified: save the plan with `plan --verify --out` to include it",),
            )
        )
    else:
        vrows = tuple(
            (
                "+".join(r["axes"]),
                r["kind"],
                f"{r['predicted_bytes']:,} B",
                f"{r['compiled_bytes']:,} B",
            )
            for r in v["rows"]
        )
        err = v.get("memory_error")
        out.append(
            Section(
                "Predicted vs compiled",
                (
                    f"peak memory per device: predicted {human_bytes(v['predicted_peak_bytes'])}, "
                    f"compiled {human_bytes(v['compiled_peak_bytes'] or 0)}"
                    + (f" (error {err:.1%})" if err is not None else ""),
                    f"collectives agree: {v['collectives_agree']}; overall agree: {v['agree']}",
                ),
                ("mesh axes", "collective", "predicted bytes", "compiled bytes"),
                vrows,
            )
        )
    if simulated is not None:
        out.append(
            Section(
                f"Simulated on {simulated['gpus']} GPUs of {simulated['cluster']}",
                (
                    f"step time {simulated['step_time_s'] * 1e3:.4g} ms, MFU "
                    f"{simulated['mfu'] * 100:.3g}% ({simulated['what']})",
                ),
            )
        )
    return out


def explain_json(d: PlanDigest, simulated: Mapping | None = None) -> dict:
    """The report as one JSON document (units in the key names)."""
    roles = d.parallelism
    return {
        "model": d.plan_file.model,
        "plan": d.plan.name,
        "mesh": {"axis_names": list(d.mesh.axis_names), "shape": list(d.mesh.shape)},
        "summary": roles.summary(),
        "roles": {
            "dp_axes": list(roles.dp_axes),
            "tp_axes": list(roles.tp_axes),
            "idle_axes": list(roles.idle_axes),
            "dp": roles.dp,
            "tp": roles.tp,
            "pp": roles.num_stages,
            "zero_stage": roles.zero_stage,
            "recompute": roles.recompute,
        },
        "global_batch": d.global_batch,
        "layers": [
            {
                "layers": list(g.layers),
                "params": [
                    {"name": p.name, "spec": p.spec, "bytes_per_device": p.bytes_per_device}
                    for p in g.params
                ],
            }
            for g in d.layers
        ],
        "collectives_bytes_per_device": {
            "+".join(axes): dict(kinds) for axes, kinds in d.collectives_by_axes.items()
        },
        "memory_bytes_per_device": dict(d.memory_bytes),
        "predicted_peak_bytes": d.plan.predicted_peak_bytes,
        "offload": dict(d.plan.offload) if d.plan.offload else None,
        "verification": dict(d.verification) if d.verification else None,
        "simulated": dict(simulated) if simulated else None,
    }
