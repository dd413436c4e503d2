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
    """``x`` as a host numpy array.

    A global array (a ``NamedSharding``, possibly on other processes' devices) is gathered
    to every process: with several processes every process must call this for it, in the
    same order.  An array on one device (``SingleDeviceSharding``: a process's own value)
    and a host value are read where they are.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    if not isinstance(x, jax.Array) or isinstance(x.sharding, SingleDeviceSharding):
        return np.asarray(x)
    if jax.process_count() == 1:
        return np.asarray(x)
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
    return np.asarray(transfer(x, everywhere).addressable_data(0))


def transfer(x, target):
    """``x`` laid out as ``target`` (a ``NamedSharding``), also when the two sit on
    different processes' devices, which ``jax.device_put`` refuses on CPU and GPU.

    In one process, or when both lie on one process's devices, it is ``jax.device_put``
    (other processes get the array's empty global handle).  Across processes: ``x`` is
    replicated over its own devices, written into rows of a ``[len(union), ...]`` array
    over the union of both device sets (zeros on the target's other devices), every row
    is set to the source's first row by one jitted broadcast (XLA's cross-process
    collectives move the bytes), and the target's rows become ``x`` on its devices.
    With several processes every process must call it, in the same order.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if jax.process_count() == 1:
        return jax.device_put(x, target)
    src = sorted(x.sharding.device_set, key=lambda d: d.id)
    dst = list(target.mesh.devices.flat)
    owners = {d.process_index for d in (*src, *dst)}
    if len(owners) == 1:  # one process holds both: the others keep an empty handle
        if owners == {jax.process_index()}:
            return jax.device_put(x, target)
        return jax.make_array_from_single_device_arrays(x.shape, target, [], dtype=x.dtype)
    full = jax.jit(
        lambda v: v, out_shardings=NamedSharding(Mesh(np.array(src), ("s",)), PartitionSpec())
    )(x)
    union = src + [d for d in dst if d not in set(src)]
    rows = NamedSharding(Mesh(np.array(union), ("u",)), PartitionSpec("u"))
    local = {s.device: s.data for s in full.addressable_shards}
    pieces = [
        local[d][None] if d in local else jax.device_put(np.zeros((1, *x.shape), x.dtype), d)
        for d in union
        if d.process_index == jax.process_index()
    ]
    stacked = jax.make_array_from_single_device_arrays(
        (len(union), *x.shape), rows, pieces, dtype=x.dtype
    )
    spread = jax.jit(lambda s: jnp.broadcast_to(s[0], s.shape), out_shardings=rows)(stacked)
    on_dst = set(dst)
    mine = [s.data[0] for s in spread.addressable_shards if s.device in on_dst]
    replicated = jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(Mesh(np.array(dst), ("d",)), PartitionSpec()), mine, dtype=x.dtype
    )
    # the same devices in the same order: a layout change within them
    return jax.jit(lambda v: v, out_shardings=target)(replicated)
