"""Multi-controller JAX: join a ``jax.distributed`` run, and move arrays to and from hosts.

autoshard runs across processes on the engine JAX already has: every process runs the
same program (the same plan, the same steps) on one global device list, and XLA's
collectives cross processes (gloo on CPU, NCCL on GPUs).

* :func:`initialize` joins the run.  With a :class:`ProcessGroup` (coordinator address,
  process count, this process's id, its local devices) it is a local run on fake CPU
  devices: each process makes ``local_devices`` CPU devices and uses gloo for
  cross-process CPU collectives.  Without one it calls ``jax.distributed.initialize()``
  with no arguments, which reads its settings from the cluster (SLURM, Open MPI, ...).
* :func:`process_group_from_env` reads the group the local launcher
  (:mod:`autoshard.cli.launch`) puts in each child's environment.
* :func:`to_host` gathers any array, including one spread over other processes' devices,
  to a host numpy array (every process must call it: it is a collective).

Guarantees: :func:`initialize` runs before any JAX backend starts (it raises otherwise,
naming the setting that came too late).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ENV_COORDINATOR = "AUTOSHARD_COORDINATOR"
ENV_NUM_PROCESSES = "AUTOSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOSHARD_PROCESS_ID"
ENV_LOCAL_DEVICES = "AUTOSHARD_LOCAL_DEVICES"


@dataclass(frozen=True)
class ProcessGroup:
    """One process's view of a local multi-process run."""

    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_devices: int  # fake CPU devices this process makes

    def to_env(self) -> dict[str, str]:
        """The environment variables :func:`process_group_from_env` reads back."""
        return {
            ENV_COORDINATOR: self.coordinator,
            ENV_NUM_PROCESSES: str(self.num_processes),
            ENV_PROCESS_ID: str(self.process_id),
            ENV_LOCAL_DEVICES: str(self.local_devices),
        }


def process_group_from_env(env=None) -> ProcessGroup | None:
    """The group set by the launcher, or None when this is not a launched child."""
    env = os.environ if env is None else env
    if ENV_PROCESS_ID not in env:
        return None
    return ProcessGroup(
        env[ENV_COORDINATOR],
        int(env[ENV_NUM_PROCESSES]),
        int(env[ENV_PROCESS_ID]),
        int(env[ENV_LOCAL_DEVICES]),
    )


def initialize(group: ProcessGroup | None = None) -> None:
    """Join the multi-controller run (see the module docstring)."""
    import jax

    if group is None:  # a real cluster: JAX reads SLURM / MPI / cloud settings itself
        jax.distributed.initialize()
        return
    try:
        jax.config.update("jax_num_cpu_devices", group.local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as err:
        raise RuntimeError(
            f"cannot join a {group.num_processes}-process run: a JAX backend already "
            f"started in this process ({err}); initialize before using JAX"
        ) from None
    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
    )


def is_multi_process() -> bool:
    import jax

    return jax.process_count() > 1


def to_host(x) -> np.ndarray:
    """``x`` as a host numpy array on every process (gathered across processes if it is
    spread over devices this process cannot address)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
