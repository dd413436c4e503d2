"""Simulator of clusters we do not have (jax-free).

* :mod:`~autoshard.hardware.clusters`: cluster presets as JSON data, and mesh axes -> links.
* :mod:`~autoshard.hardware.gemm`: achieved GEMM efficiency tables and memory-bound time.
* :mod:`~autoshard.sim.formulas`: model/hardware FLOPs, MFU/HFU, model-state and
  activation memory in closed form.
* :mod:`~autoshard.sim.megatron`: analytic step time of Megatron-LM TP x PP x DP training,
  validated against published A100 measurements (docs/validation.md).
* :mod:`~autoshard.sim.simulate`: ``simulate()``, the entry point; it checks the request and
  sends it to :mod:`~autoshard.sim.grid` (Megatron grids, DP, ZeRO on Megatron-LM's
  program), :mod:`~autoshard.sim.auto` (Alpa's search) or :mod:`~autoshard.sim.traced` (a
  grid on the traced step); each returns a :mod:`~autoshard.sim.report` ``SimulationReport``.
* :mod:`~autoshard.sim.exact`: compile a simulated plan and compare with XLA's numbers.
"""

from autoshard.hardware.clusters import (
    Cluster,
    DeviceSpec,
    LinkSpec,
    available_presets,
    cluster_mesh_costs,
    load_cluster,
)
from autoshard.hardware.gemm import GemmTable, memory_bound_time
from autoshard.hardware.mesh import to_device_mesh

__all__ = [
    "Cluster",
    "DeviceSpec",
    "GemmTable",
    "LinkSpec",
    "available_presets",
    "cluster_mesh_costs",
    "load_cluster",
    "memory_bound_time",
    "to_device_mesh",
]
