"""Hand-written parallel plans as rule tables (jax-free).

Each baseline fixes the specs of the program inputs (parameters, optimizer state, data)
by rules on their pytree paths, MaxText-style; the intra-operator ILP then places every
other tensor, so baselines go through the same plan object, runtime, verifier and
simulator as automatic plans.

* ``dp``    -- parameters and optimizer state replicated; batch split over every axis.
* ``zero2`` -- as dp, but optimizer state split over every axis (first divisible dim):
  gradients are reduce-scattered, updated parameters all-gathered.
* ``zero3`` -- parameters and optimizer state split (FSDP): weights are all-gathered
  before use.
* ``megatron`` -- tensor parallel over the last mesh axis ("model"): attention qkv and
  MLP fc kernels column-split, attention and MLP output projections row-split, the token
  embedding (tied LM head) vocabulary-parallel; batch split over the other axes (TP x DP
  on a 2-D mesh).  On a 1-D mesh the one axis is the tensor-parallel axis.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from autoshard.ir.graph import Graph
from autoshard.ir.spec import Mesh, ShardingSpec

BASELINES = ("dp", "zero2", "zero3", "megatron")

# (path regex, dim to split over the tensor-parallel axis); first match wins
MEGATRON_RULES: tuple[tuple[str, int | None], ...] = (
    (r"\['attn'\]\['qkv'\]\['kernel'\]", 1),
    (r"\['attn'\]\['qkv'\]\['bias'\]", 0),
    (r"\['attn'\]\['proj'\]\['kernel'\]", 0),
    (r"\['mlp'\]\['fc'\]\['kernel'\]", 1),
    (r"\['mlp'\]\['fc'\]\['bias'\]", 0),
    (r"\['mlp'\]\['proj'\]\['kernel'\]", 0),
    (r"\['embedding'\]\['wte'\]", 0),
    (r"\['dense_\d+'\]\['kernel'\]", None),  # MLP model: handled by alternation below
)


def _split_first_divisible(shape: Sequence[int], axes: tuple[str, ...], mesh: Mesh) -> ShardingSpec:
    n = mesh.size(axes)
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return ShardingSpec.replicated(len(shape)).with_dim(d, axes)
    return ShardingSpec.replicated(len(shape))


def _split_dim(shape: Sequence[int], dim: int, axes: tuple[str, ...], mesh: Mesh) -> ShardingSpec:
    spec = ShardingSpec.replicated(len(shape))
    if axes and dim < len(shape) and shape[dim] % mesh.size(axes) == 0:
        return spec.with_dim(dim, axes)
    return spec


def baseline_inputs(graph: Graph, mesh: Mesh, name: str) -> dict[int, ShardingSpec]:
    """Pinned specs for every program input under baseline ``name``."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    all_axes = tuple(a for a in mesh.axis_names if mesh.size(a) > 1)
    if name == "megatron":
        tp = (mesh.axis_names[-1],) if mesh.size(mesh.axis_names[-1]) > 1 else ()
        dp = tuple(a for a in mesh.axis_names[:-1] if mesh.size(a) > 1)
    else:
        tp, dp = (), all_axes
    dense_layer = re.compile(r"\['dense_(\d+)'\]\['(kernel|bias)'\]")
    pinned: dict[int, ShardingSpec] = {}
    for pos, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        if t.kind == "data":
            pinned[pos] = _split_dim(t.shape, 0, dp, mesh) if t.shape else ShardingSpec(())
            continue
        if not t.shape:
            pinned[pos] = ShardingSpec(())
            continue
        state = t.kind == "opt_state"
        if name == "dp":
            pinned[pos] = ShardingSpec.replicated(len(t.shape))
        elif name == "zero2":
            pinned[pos] = (
                _split_first_divisible(t.shape, dp, mesh)
                if state
                else ShardingSpec.replicated(len(t.shape))
            )
        elif name == "zero3":
            pinned[pos] = _split_first_divisible(t.shape, dp, mesh)
        else:
            spec = ShardingSpec.replicated(len(t.shape))
            for pattern, dim in MEGATRON_RULES:
                if dim is not None and re.search(pattern, t.path):
                    spec = _split_dim(t.shape, dim, tp, mesh)
                    break
            m = dense_layer.search(t.path)
            if m is not None:  # Alpa's MLP: alternate column / row splits
                column = int(m.group(1)) % 2 == 0
                if m.group(2) == "kernel":
                    spec = _split_dim(t.shape, 1 if column else 0, tp, mesh)
                elif column:
                    spec = _split_dim(t.shape, 0, tp, mesh)
            pinned[pos] = spec
    return pinned
