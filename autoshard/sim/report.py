"""What the simulator returns: :class:`SimulationReport` and the utilisation of a step.

A report holds one plan's predicted training step (step time, tokens/s, TFLOP/s per
device, MFU, HFU, peak bytes per device, an out-of-memory flag, the plan as a dict and a
breakdown that adds up to ``step_time_s``, and ``step_breakdown``: the same step as
compute, recompute, exposed communication per mesh axis, pipeline bubble and optimizer,
:mod:`autoshard.sim.breakdown`); :func:`utilisation` derives tokens/s,
TFLOP/s, MFU and HFU from a step time with :mod:`autoshard.sim.formulas`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.sim import formulas
from autoshard.sim.exact import ExactReport
from autoshard.sim.megatron import GPTShape


@dataclass(frozen=True)
class SimulationReport:
    """The predicted training step of one plan (see the module docstring)."""

    model: str
    cluster: str
    gpus: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (recompute included), as Megatron reports
    mfu: float
    hfu: float
    peak_bytes_per_device: float
    oom: bool
    plan: Mapping
    breakdown: Mapping[str, float]  # seconds per step; sums to step_time_s
    search_seconds: float = 0.0
    exact: ExactReport | None = None  # with simulate(..., exact=True)
    # compute, recompute, exposed comm per mesh axis, bubble, optimizer; sums to step_time_s
    # (autoshard.sim.breakdown)
    step_breakdown: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "cluster": self.cluster,
            "gpus": self.gpus,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "oom": self.oom,
            "plan": _plain(self.plan),
            "breakdown": dict(self.breakdown),
            "step_breakdown": dict(self.step_breakdown),
            "search_seconds": self.search_seconds,
        }
        if self.exact is not None:
            out["exact"] = self.exact.to_json()
        return out


def _plain(value):
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def utilisation(
    shape: GPTShape, global_batch: int, recompute: str, step_s: float, gpus: int, peak: float
) -> dict:
    """tokens/s, hardware TFLOP/s per device, MFU and HFU of a step (formulas module)."""
    s, n_layers, h, v = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    model_flops = formulas.model_flops_per_step(global_batch, s, n_layers, h, v)
    hw_flops = formulas.hardware_flops_per_step(global_batch, s, n_layers, h, v, recompute)
    return {
        "tokens_per_s": global_batch * s / step_s,
        "tflops_per_device": hw_flops / step_s / gpus / 1e12,
        "mfu": formulas.flops_utilization(model_flops, step_s, gpus, peak),
        "hfu": formulas.flops_utilization(hw_flops, step_s, gpus, peak),
    }
