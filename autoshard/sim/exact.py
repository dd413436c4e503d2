"""Exact mode of the simulator: compile a simulated single-mesh plan and read XLA's numbers.

For a :class:`~autoshard.sim.report.SimulationReport` whose plan the intra-op runtime can
build -- ``dp``, ``zero2``, ``zero3``, ``megatron:TPx1xDP`` and an ``auto`` plan with one
stage -- :func:`exact_check` builds the intra-op plan for the same model on a
``(data, model) = (dp, tp)`` mesh of the simulated GPU count (the baseline's pinned input
specs, :mod:`autoshard.intra.baselines.tables`, or for ``auto`` the ILP's own choice; the rest placed by
the ILP with the cluster preset's costs), traces one micro-batch's training step at the
simulated micro-batch size and dtype, compiles it with abstract shapes on that many fake
CPU devices (:func:`autoshard.verify.check.verify_plan`) and returns an :class:`ExactReport`:
compiled vs simulated peak bytes per device, compiled vs predicted collective bytes per
(kind, mesh axes), whether the compiled peak fits the device's HBM, and notes that say
what the two sides do not share. Pipelines (more than one stage) are reported as not
available, with the reason. At most ``MAX_EXACT_DEVICES`` devices.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

MAX_EXACT_DEVICES = 512


@dataclass(frozen=True)
class ExactReport:
    """Compiled vs predicted numbers of one simulated plan (all bytes per device).

    ``available`` is False (with ``why``) for plans the single-mesh runtime cannot build;
    then every number is zero. Otherwise ``compiled_*`` come from the executable XLA
    compiled (peak = arguments + outputs - donated + temp, as ``VerificationReport``),
    ``predicted_peak_bytes`` is the simulator's, ``intra_predicted_peak_bytes`` the intra-op
    plan's memory model with XLA:CPU's memory layout (``xla_cpu_memory_layout()``: the
    executable compared is XLA:CPU's), and ``predicted_collective_bytes`` the intra-op plan's collectives
    (the grid simulator prices its collectives in seconds, not per collective).
    Collective keys are ``"kind@axes"`` (e.g. ``"all-reduce@data"``), bytes summed.
    """

    available: bool
    why: str = ""
    devices: int = 0
    mesh_dp_tp: tuple[int, int] = (0, 0)
    intra_plan: str = ""  # the baseline pinned, or "auto"
    compiled_batch: int = 0  # sequences in the compiled step: one micro-batch over all DP
    compiled_peak_bytes: float = 0.0
    predicted_peak_bytes: float = 0.0
    intra_predicted_peak_bytes: float = 0.0
    hbm_bytes: float = 0.0
    compiled_collective_bytes: Mapping[str, int] = field(default_factory=dict)
    predicted_collective_bytes: Mapping[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0
    plan_seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def memory_error(self) -> float:
        """|simulated - compiled| / compiled peak bytes."""
        c = self.compiled_peak_bytes
        return abs(self.predicted_peak_bytes - c) / max(c, 1.0)

    @property
    def fits_hbm(self) -> bool:
        return self.compiled_peak_bytes <= self.hbm_bytes

    def to_json(self) -> dict:
        if not self.available:
            return {"available": False, "why": self.why}
        return {
            "available": True,
            "devices": self.devices,
            "mesh_dp_tp": list(self.mesh_dp_tp),
            "intra_plan": self.intra_plan,
            "compiled_batch": self.compiled_batch,
            "compiled_peak_bytes": self.compiled_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "intra_predicted_peak_bytes": self.intra_predicted_peak_bytes,
            "memory_error": self.memory_error,
            "hbm_bytes": self.hbm_bytes,
            "fits_hbm": self.fits_hbm,
            "compiled_collective_bytes": dict(self.compiled_collective_bytes),
            "predicted_collective_bytes": dict(self.predicted_collective_bytes),
            "compile_seconds": self.compile_seconds,
            "plan_seconds": self.plan_seconds,
            "notes": list(self.notes),
        }


def check_exact_devices(gpus: int) -> None:
    """Raise ``ValueError`` if exact mode would compile on more than ``MAX_EXACT_DEVICES``."""
    if gpus > MAX_EXACT_DEVICES:
        raise ValueError(
            f"exact mode compiles on at most {MAX_EXACT_DEVICES} fake CPU devices (compile time "
            f"grows with the device count); {gpus} GPUs asked: drop --exact or simulate fewer"
        )


def unavailable_reason(plan: Mapping) -> str | None:
    """Why the single-mesh runtime cannot build a simulated plan (None if it can)."""
    if plan["pp"] > 1:
        what = "auto plan has" if plan["kind"] == "auto" else "grid has"
        return (
            f"the {what} {plan['pp']} pipeline stages; exact mode compiles single-mesh plans "
            "(pp = 1) only. Use `autoshard pipeline` for pipelines."
        )
    return None


def _bytes_by_key(rows, side: str) -> dict[str, int]:
    out = {}
    for r in rows:
        if getattr(r, f"{side}_count"):
            out[f"{r.kind}@{','.join(r.axes) or '-'}"] = getattr(r, f"{side}_bytes")
    return out


def _notes(plan: Mapping, recompute: str, dp: int, tp: int) -> tuple[str, ...]:
    m = plan["num_microbatches"]
    notes = [
        f"compiled on XLA:CPU: one micro-batch's forward, backward and AdamW update of "
        f"autoshard's JAX GPT ({'float32' if plan['dtype'] == 'fp32' else 'bfloat16'} "
        f"compute, fp32 parameters and Adam moments) on a (dp, tp) = ({dp}, {tp}) mesh",
    ]
    if plan["kind"] == "auto":
        notes.append(
            "simulated memory: the stage DP's model of its intra-op plans; the compiled plan is "
            "the ILP re-solved for the whole step on the same logical mesh"
        )
    else:
        notes.append(
            "simulated memory: Megatron-LM's (16 B/param model state with 16-bit weight and "
            "gradient copies, activations of its fused kernels, Korthikanti et al.); the "
            "compiled step holds fp32 parameters, gradients and Adam moments and XLA's buffers"
        )
    if recompute != "none":
        notes.append(
            f"the simulated plan recomputes activations ({recompute}); the intra-op runtime "
            "does not, so the compiled step keeps every activation"
        )
    if m > 1:
        notes.append(
            f"the simulated step runs {m} micro-batches with gradient accumulation; the "
            "compiled step is one: its per-micro-batch collectives repeat "
            f"{m} times per step, and the accumulation buffer is not in its peak"
        )
    if plan["dtype"] == "fp16":
        notes.append("fp16 is compiled as bfloat16 (the same bytes)")
    if plan["dtype"] != "fp32":
        notes.append(
            "XLA:CPU computes bf16 dots in f32 and moves some of their operands and results "
            "as f32; the verifier counts those collectives at 16-bit bytes (autoshard.verify.xla_cpu)"
        )
    notes.append(
        "predicted collective bytes are the intra-op plan's (same alpha-beta cost model as "
        "the simulator); the grid simulator itself prices collectives in seconds"
    )
    return tuple(notes)


def exact_check(
    report,
    cluster: str,
    *,
    solver: str = "highs",
    time_limit_s: float = 20.0,
    **overrides,
) -> ExactReport:
    """Compile ``report``'s plan (a ``SimulationReport``) and compare (see module docstring).

    ``cluster`` is the preset name or file the report was simulated on, ``overrides`` the
    simulation's ``MODEL_OVERRIDES``. Needs ``report.gpus`` JAX CPU devices (set
    ``jax_num_cpu_devices`` before JAX starts; ``autoshard simulate --exact`` does);
    raises ``ValueError`` if it has fewer, or if ``report.gpus > MAX_EXACT_DEVICES``.
    """
    plan = report.plan
    why = unavailable_reason(plan)
    if why is not None:
        return ExactReport(available=False, why=why)
    gpus = report.gpus
    check_exact_devices(gpus)
    import jax

    from autoshard.api import plan_workload, xla_cpu_memory_layout
    from autoshard.hardware.clusters import load_cluster
    from autoshard.hardware.mesh import preset_mesh
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.intra.problem.options import IntraOptions

    devices = jax.devices("cpu")
    if len(devices) < gpus:
        raise ValueError(
            f"exact mode needs {gpus} CPU devices but JAX has {len(devices)}: call "
            f"jax.config.update('jax_num_cpu_devices', {gpus}) before JAX starts (the CLI's "
            "`simulate --exact` does this)"
        )
    if plan["kind"] == "auto":
        (stage,) = plan["stages"]
        dp, tp = stage["logical_mesh_dp_tp"]
        recompute, baseline = stage["recompute"], None
        batch = plan["microbatch_size"]  # auto's micro-batch spans all devices
    else:
        dp, tp = plan["dp"], plan["tp"]
        recompute, baseline = plan["recompute"], plan["kind"]
        batch = plan["microbatch_size"] * dp  # Megatron's micro-batch is per replica
    the_cluster = load_cluster(cluster, gpus)
    mesh = preset_mesh(the_cluster, (dp, tp), ("data", "model"), plan["dtype"])
    t0 = time.perf_counter()
    bound = plan_workload(
        report.model,
        mesh,
        baseline=baseline,
        options=IntraOptions(solver=solver, time_limit_s=time_limit_s),
        batch_size=batch,
        dtype="float32" if plan["dtype"] == "fp32" else "bfloat16",
        **overrides,
    )
    plan_seconds = time.perf_counter() - t0
    verification = bound.verify(devices[:gpus])
    rows = verification.comparison.rows
    # the plan is made for the cluster's GPUs; what it is compared with here is XLA:CPU's
    # executable, so its memory is predicted the way XLA:CPU lays it out
    intra_cpu = predicted_peak_bytes(
        bound.graph,
        bound.plan.specs_by_tensor(bound.graph.inputs),
        dataclasses.replace(mesh, memory_layout=xla_cpu_memory_layout()),
        bound.plan.operand_specs,
    )
    return ExactReport(
        available=True,
        devices=gpus,
        mesh_dp_tp=(dp, tp),
        intra_plan=baseline or "auto",
        compiled_batch=batch,
        compiled_peak_bytes=verification.compiled_peak_bytes,
        predicted_peak_bytes=report.peak_bytes_per_device,
        intra_predicted_peak_bytes=intra_cpu,
        hbm_bytes=the_cluster.device.hbm_bytes,
        compiled_collective_bytes=MappingProxyType(_bytes_by_key(rows, "compiled")),
        predicted_collective_bytes=MappingProxyType(_bytes_by_key(rows, "predicted")),
        compile_seconds=verification.compile_seconds,
        plan_seconds=plan_seconds,
        notes=_notes(plan, recompute, dp, tp),
    )


__all__ = ["MAX_EXACT_DEVICES", "ExactReport", "check_exact_devices", "exact_check"]
