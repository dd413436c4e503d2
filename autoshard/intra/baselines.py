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

A baseline means its name or is refused: a batch the data-parallel axes do not divide,
or a Megatron-split dim the tensor-parallel axis does not divide, raises ValueError naming
the tensor and what would divide (never a silently replicated tensor under the label).
:func:`baseline_options` adds what pins alone cannot say: ``dp`` and ``megatron`` keep
every activation split over their data-parallel axes (``IntraOptions.data_parallel_axes``),
so the ILP cannot leave data parallelism where the pins stop.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from autoshard.intra.options import IntraOptions
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


def _split_dim(
    shape: Sequence[int], dim: int, axes: tuple[str, ...], mesh: Mesh, what: str
) -> ShardingSpec:
    """``dim`` of ``shape`` split over ``axes``; ValueError (naming ``what`` and the sizes
    that would divide) where the axes do not divide it."""
    spec = ShardingSpec.replicated(len(shape))
    if not axes or dim >= len(shape):
        return spec
    n = mesh.size(axes)
    if shape[dim] % n:
        raise ValueError(
            f"{what} (shape {tuple(shape)}): dim {dim} of size {shape[dim]} is not divisible "
            f"by the {n} devices of mesh axes {axes}; use a size that is a multiple of {n}, "
            "or a mesh whose axes divide it"
        )
    return spec.with_dim(dim, axes)


def _dp_tp_axes(mesh: Mesh, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(data-parallel axes, tensor-parallel axes) of baseline ``name`` on ``mesh``."""
    if name == "megatron":
        last = mesh.axis_names[-1]
        tp = (last,) if mesh.size(last) > 1 else ()
        return tuple(a for a in mesh.axis_names[:-1] if mesh.size(a) > 1), tp
    return tuple(a for a in mesh.axis_names if mesh.size(a) > 1), ()


def baseline_options(options: IntraOptions, mesh: Mesh, name: str) -> IntraOptions:
    """``options`` for baseline ``name``: ``dp`` and ``megatron`` keep data split over
    their data-parallel axes in every op (``data_parallel_axes``); ZeRO gathers its
    parameters over those axes by design, so it keeps ``options`` as they are."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    if name in ("dp", "megatron"):
        return options.replace(data_parallel_axes=_dp_tp_axes(mesh, name)[0])
    return options


def baseline_inputs(graph: Graph, mesh: Mesh, name: str) -> dict[int, ShardingSpec]:
    """Pinned specs for every program input under baseline ``name``."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    dp, tp = _dp_tp_axes(mesh, name)
    dense_layer = re.compile(r"\['dense_(\d+)'\]\['(kernel|bias)'\]")
    pinned: dict[int, ShardingSpec] = {}
    for pos, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        if t.kind == "data":
            what = f"baseline {name!r}: the batch of data input {t.path or pos}"
            pinned[pos] = _split_dim(t.shape, 0, dp, mesh, what) if t.shape else ShardingSpec(())
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
            what = f"baseline 'megatron': {t.kind} {t.path}"
            for pattern, dim in MEGATRON_RULES:
                if dim is not None and re.search(pattern, t.path):
                    spec = _split_dim(t.shape, dim, tp, mesh, what)
                    break
            m = dense_layer.search(t.path)
            if m is not None:  # Alpa's MLP: alternate column / row splits
                column = int(m.group(1)) % 2 == 0
                if m.group(2) == "kernel":
                    spec = _split_dim(t.shape, 1 if column else 0, tp, mesh, what)
                elif column:
                    spec = _split_dim(t.shape, 0, tp, mesh, what)
            pinned[pos] = spec
    return pinned
