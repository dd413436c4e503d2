"""A training step's state made where its plan keeps it, never gathered on one device first.

``Workload.init_train_args`` builds (params, opt_state, batch) on the default device and
the step then places them: fine for small models, an out-of-memory error for a model whose
state only fits because the plan shards it or keeps part of it in host memory (gpt-6.7b
with AdamW on one 80 GB GPU: 107 GB of f32 weights and optimizer state, 53 GB of it meant
for ``pinned_host``). :func:`init_placed` computes the same values (same keys, same
functions) under ``jax.jit`` with the step's input shardings as ``out_shardings``:

* leaves kept on the devices are made in one program per part (params, optimizer state,
  batch), each device holding only its shards;
* leaves kept in host memory are made in chunks of at most ``chunk_bytes`` per device, each
  chunk's program computing only its leaves (XLA drops the rest) and handing them to host
  memory, so the device never holds more than one chunk of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from autoshard.runtime.sharded import HOST_MEMORY

DEFAULT_CHUNK_BYTES = 4 << 30


def _leaf_bytes(leaf, sharding) -> int:
    shape = (
        sharding.shard_shape(tuple(leaf.shape)) if hasattr(sharding, "shard_shape") else leaf.shape
    )
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _groups(leaves, shardings, chunk_bytes: int) -> list[list[int]]:
    """Leaf indices in programs: all device leaves together, host leaves in chunks."""
    device = [i for i, s in enumerate(shardings) if s.memory_kind != HOST_MEMORY]
    groups = [device] if device else []
    chunk: list[int] = []
    size = 0
    for i, s in enumerate(shardings):
        if s.memory_kind != HOST_MEMORY:
            continue
        b = _leaf_bytes(leaves[i], s)
        if chunk and size + b > chunk_bytes:
            groups.append(chunk)
            chunk, size = [], 0
        chunk.append(i)
        size += b
    if chunk:
        groups.append(chunk)
    return groups


def _materialise(fn: Callable, arg, abstract, shardings: Sequence, chunk_bytes: int):
    """``fn(arg)``'s leaves, each made straight into its sharding (see module doc)."""
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    out: list = [None] * len(leaves)
    for group in _groups(leaves, shardings, chunk_bytes):

        def part(a, group=tuple(group)):
            flat = jax.tree_util.tree_leaves(fn(a))
            return [flat[i] for i in group]

        made = jax.jit(part, out_shardings=[shardings[i] for i in group])(arg)
        for i, value in zip(group, made, strict=True):
            out[i] = value
    return jax.tree_util.tree_unflatten(tree, out)


def init_placed(step, workload, optimizer, seed: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """(params, opt_state, batch) equal to ``workload.init_train_args(optimizer, seed)``,
    made directly in ``step``'s input shardings and memory kinds (a :class:`ShardedStep`
    of ``workload``'s train step).

    Raises ValueError when the step's arguments are not that workload's training state.
    """
    abstract = workload.abstract_train_args(optimizer)
    flat_abs, tree = jax.tree_util.tree_flatten(abstract)
    shardings = jax.tree_util.tree_leaves(step.in_shardings)
    if tree != step.program.in_tree or len(shardings) != len(flat_abs):
        raise ValueError(
            f"init_placed: the step takes {step.program.in_tree.num_leaves} arguments in "
            f"another structure than {workload.name}'s (params, opt_state, batch) with "
            f"{len(flat_abs)} leaves; trace the step from this workload and optimizer"
        )
    for i, a in enumerate(flat_abs):
        rec = step.program.records.tensors[step.program.records.inputs[i]]
        if tuple(rec.shape) != tuple(a.shape) or np.dtype(rec.dtype) != np.dtype(a.dtype):
            raise ValueError(
                f"init_placed: argument {i} is {rec.dtype}{list(rec.shape)} in the step but "
                f"{a.dtype}{list(a.shape)} in {workload.name}'s state"
            )
    n_params = len(jax.tree_util.tree_leaves(abstract[0]))
    n_opt = len(jax.tree_util.tree_leaves(abstract[1]))
    p_sh = shardings[:n_params]
    o_sh = shardings[n_params : n_params + n_opt]
    b_sh = shardings[n_params + n_opt :]
    k_params, k_batch = jax.random.split(jax.random.key(seed))
    params = _materialise(workload.init_fn, k_params, abstract[0], p_sh, chunk_bytes)
    if any(s.memory_kind == HOST_MEMORY for s in p_sh):
        # params rest in host memory: the optimizer's initial state is made from the key
        opt_state = _materialise(
            lambda k: optimizer.init(workload.init_fn(k)), k_params, abstract[1], o_sh, chunk_bytes
        )
    else:
        opt_state = _materialise(optimizer.init, params, abstract[1], o_sh, chunk_bytes)
    batch = _materialise(workload.random_batch, k_batch, abstract[2], b_sh, chunk_bytes)
    return params, opt_state, batch
