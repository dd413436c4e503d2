"""Where a plan is compiled to be checked: this process's devices, or GPUs described ahead of time.

Takes a target's text (``"cpu"``, ``"gpu-aot"`` or ``"gpu-aot:1x1x8"``) and returns a
:class:`CompileTarget`; :func:`target_devices` turns a target and a device count into the
devices to mesh.  ``cpu`` is this process's JAX devices (fake CPU devices on a laptop), as
before.  ``gpu-aot:SxHxD`` is XLA:GPU ahead of time: ``S`` slices of ``H`` hosts of ``D``
GPUs each, described by ``jax.experimental.topologies.get_topology_desc(topology_name="gpu",
platform="cuda", topology="SxHxD")`` as compile-only devices -- 64 H100s ("1x8x8") from one
lent H100, compiled with abstract shapes, never run.  Plain ``gpu-aot`` sizes the topology
to the plan: ``1x1xN`` up to 8 GPUs, ``1x(N/8)x8`` beyond.  Needs a CUDA jaxlib and one
visible GPU (XLA:GPU compiles for the GPU it sees); without them
:class:`TargetUnavailableError` (a ValueError) says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("cpu", "gpu-aot")
GPUS_PER_HOST = 8


class TargetUnavailableError(ValueError):
    """The compile target cannot be used in this process (no CUDA backend, ...)."""


@dataclass(frozen=True)
class CompileTarget:
    """``kind`` "cpu" (this process's devices) or "gpu-aot" (XLA:GPU ahead of time);
    ``topology`` "SxHxD" for gpu-aot (None: sized to the plan)."""

    kind: str = "cpu"
    topology: str | None = None

    def __str__(self) -> str:
        return self.kind + (f":{self.topology}" if self.topology else "")

    def topology_for(self, num_devices: int) -> str:
        """The gpu-aot topology that describes ``num_devices`` GPUs (ValueError: none)."""
        if self.topology is not None:
            have = math.prod(int(x) for x in self.topology.split("x"))
            if have != num_devices:
                raise ValueError(
                    f"target {self} describes {have} GPUs but the plan's mesh has "
                    f"{num_devices}; use --target gpu-aot:{default_topology(num_devices)} "
                    "(or plain gpu-aot, sized to the plan)"
                )
            return self.topology
        return default_topology(num_devices)


def default_topology(num_devices: int) -> str:
    """``1x1xN`` up to 8 GPUs (one host), ``1x(N/8)x8`` beyond (hosts of 8)."""
    if num_devices <= GPUS_PER_HOST:
        return f"1x1x{num_devices}"
    if num_devices % GPUS_PER_HOST:
        raise ValueError(
            f"{num_devices} GPUs do not fill hosts of {GPUS_PER_HOST}; give the topology "
            "(--target gpu-aot:SxHxD, slices x hosts x GPUs per host)"
        )
    return f"1x{num_devices // GPUS_PER_HOST}x{GPUS_PER_HOST}"


def parse_target(text: str | CompileTarget | None) -> CompileTarget:
    """``"cpu"``, ``"gpu-aot"`` or ``"gpu-aot:SxHxD"`` (None: cpu) -> CompileTarget."""
    if isinstance(text, CompileTarget):
        return text
    if text is None or text.strip() == "cpu":
        return CompileTarget()
    m = re.fullmatch(r"\s*gpu-aot(?::(\d+x\d+x\d+))?\s*", text)
    if not m:
        raise ValueError(
            f"unknown compile target {text!r}; expected cpu (this process's devices), gpu-aot "
            "(XLA:GPU ahead of time, sized to the plan) or gpu-aot:SxHxD (slices x hosts x "
            "GPUs per host, e.g. gpu-aot:1x1x8 for 8 GPUs, gpu-aot:1x8x8 for 64)"
        )
    topology = m.group(1)
    if topology is not None and any(int(x) < 1 for x in topology.split("x")):
        raise ValueError(f"topology {topology!r} has an empty dimension; each of S, H, D >= 1")
    return CompileTarget("gpu-aot", topology)


def target_devices(target: str | CompileTarget | None, num_devices: int) -> list:
    """The ``num_devices`` devices to mesh for ``target``.

    cpu: this process's first ``num_devices`` JAX devices (fewer: ValueError saying how to
    get more).  gpu-aot: the topology's compile-only GPUs, in the topology's order.
    """
    import jax

    target = parse_target(target)
    if target.kind == "cpu":
        devices = jax.devices()
        if len(devices) < num_devices:
            raise ValueError(
                f"the plan's mesh needs {num_devices} devices but this process has "
                f"{len(devices)} ({jax.default_backend()}); for fake CPU devices run the CLI "
                f"with --devices {num_devices} (or jax.config.update('jax_num_cpu_devices', "
                f"{num_devices}) before JAX starts), or compile for GPUs ahead of time with "
                "--target gpu-aot on a machine with a CUDA jaxlib and one GPU"
            )
        return list(devices[:num_devices])
    topology = target.topology_for(num_devices)
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(topology_name="gpu", platform="cuda", topology=topology)
    except Exception as err:  # no CUDA plugin, no GPU, or a jaxlib without GPU topologies
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise TargetUnavailableError(
            f"--target {target} compiles for XLA:GPU ahead of time and needs a CUDA jaxlib "
            "(pip install 'jax[cuda12]' or 'jax[cuda13]') and one visible NVIDIA GPU; this "
            f"JAX {jax.__version__} cannot describe CUDA GPUs ({type(err).__name__}: {first}). "
            "Without a GPU, verify on fake CPU devices: drop --target (or --target cpu)"
        ) from err
    devices = list(desc.devices)
    if len(devices) != num_devices:  # the plugin read the topology differently
        raise TargetUnavailableError(
            f"topology {topology} gave {len(devices)} GPUs, not the {num_devices} the plan needs"
        )
    return devices


def describe_devices(devices) -> str:
    """``"8 x NVIDIA H100 80GB HBM3 (gpu)"``: what a mesh was compiled for."""
    first = devices[0]
    return (
        f"{len(devices)} x {getattr(first, 'device_kind', '?')} ({getattr(first, 'platform', '?')})"
    )
