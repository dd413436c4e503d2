"""Max pooling's backward as XLA:CPU expands it: the temporaries it holds (jax-free).

Part of the memory model (:mod:`autoshard.intra.memory.model`), on a backend whose
:class:`~autoshard.hardware.mesh.MemoryLayout` has ``expanded_select_and_scatter``.

The gradient of ``reduce_window_max`` is one jaxpr primitive, ``select_and_scatter_add``
(the transpose of the JVP's ``select_and_gather_add``); it lowers to an HLO
``select-and-scatter``, which XLA:CPU has no kernel for: its ``SelectAndScatterExpander``
pass rewrites it into

* one ``s32`` iota per dimension of the (padded) forward operand, each of that operand's
  shape (an iota along a dimension of size 1 is folded into a broadcast of 0, of the same
  size);
* a variadic ``reduce-window`` over the padded operand and the iotas: per window, the
  selected value and its index along every dimension -- ``1 + rank`` results of the pooled
  (source) shape, the indices ``s32``;
* the indices concatenated into a ``[pooled elements, rank]`` ``s32`` array, and a
  ``scatter`` of the incoming gradient at them into a broadcast of zeros of the padded
  operand's shape (updated in place: the zeros become the result).

How XLA:CPU schedules these (jax 0.10.2, ``benchmarks/studies/bench_exact_search.py``'s
two-layer conv net, batch 8 of 32 x 32 x 8, on 8 devices; ``docs/truth_memory.md``): the
iotas and the zeros depend on nothing, so they are made at the start of the step; the
reduce-window depends on the forward operand only, so it runs in the forward pass, right
after the pooling, reading the padded copy (a ``pad`` fusion) of the operand; the
indices are then held to the scatter in the backward pass.  What the model counts per
pooling backward (:func:`pool_buffers`), sized from the operator's per-device shapes:

* ``iotas``: ``rank`` x 4 bytes x padded operand elements, from the step's start to the
  forward pooling;
* ``zeros``: the padded operand in the operand's dtype, from the step's start to just
  before the backward operator (whose result then takes the buffer over);
* ``window``: the padded copy of the operand (where the window pads) and the selected
  values, at the forward pooling only;
* ``indices``: ``rank`` x 4 bytes x pooled elements, from the forward pooling to the
  backward operator.

XLA:GPU (jax 0.11.2) expands it too, but fuses the iotas and the pad into the
reduce-window, which its scheduler runs in the backward pass (the committed wresnet-1b
HLO, ``benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27b.tar.gz``): not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph, Node
from autoshard.ir.spec import ShardingSpec

POOL_BACKWARD = "select_and_scatter_add"
POOL_FORWARD = "reduce_window_max"
INDEX_BYTES = 4  # the expander's iotas and indices are s32


@dataclass(frozen=True)
class PoolBuffers:
    """Per-device bytes of one pooling backward's temporaries (see the module's doc)."""

    iotas: float
    zeros: float
    window: float
    indices: float


@dataclass(frozen=True)
class PoolBackward:
    """A ``select_and_scatter_add`` node and the ``reduce_window_max`` node of its forward
    (where XLA runs the index reduce-window), or None where there is none (then the
    whole expansion runs at the backward operator)."""

    node: int
    forward: int | None


def _window(node: Node) -> tuple:
    p = node.params
    return (
        tuple(p["window_dimensions"]),
        tuple(p["window_strides"]),
        tuple(map(tuple, p["padding"])),
    )


def pool_backwards(graph: Graph, mesh: DeviceMesh) -> list[PoolBackward]:
    """Every max-pooling backward whose expansion ``mesh``'s backend holds buffers for
    (none unless its layout has ``expanded_select_and_scatter``), each with the forward
    pooling of the same operand and window."""
    if not mesh.memory_layout.expanded_select_and_scatter:
        return []
    out = []
    for node in graph.nodes:
        if node.primitive != POOL_BACKWARD:
            continue
        operand = node.inputs[1]  # (source, operand): jax's select_and_scatter_add
        forwards = [
            c
            for c in graph.tensors[operand].consumers
            if graph.nodes[c].primitive == POOL_FORWARD
            and c < node.index
            and _window(graph.nodes[c]) == _window(node)
        ]
        out.append(PoolBackward(node.index, min(forwards) if forwards else None))
    return out


def _local(shape, spec: ShardingSpec | None, mesh: DeviceMesh) -> list[int]:
    """``shape``'s per-device shard under ``spec`` (None: whole)."""
    if spec is None:
        return [int(s) for s in shape]
    return [-(-int(s) // mesh.mesh.size(axes)) for s, axes in zip(shape, spec.dims)]


def pool_buffers(
    graph: Graph, node: Node, spec: ShardingSpec | None, mesh: DeviceMesh
) -> PoolBuffers:
    """The temporaries of pooling backward ``node`` whose result (the operand's gradient)
    is in layout ``spec`` (None: whole); the source is split alike (the pooled dims stay
    whole: :func:`autoshard.intra.rules.conv.select_window_slots`)."""
    if node.primitive != POOL_BACKWARD:
        raise ValueError(f"node {node.index} is {node.primitive!r}, not {POOL_BACKWARD!r}")
    source, operand = (graph.tensors[t] for t in node.inputs[:2])
    itemsize = operand.nbytes / max(1, operand.size)
    padding = node.params["padding"]
    local = _local(operand.shape, spec, mesh)
    padded = math.prod(n + lo + hi for n, (lo, hi) in zip(local, padding))
    pooled = math.prod(_local(source.shape, spec, mesh))
    rank = len(local)
    pads = any(lo or hi for lo, hi in padding)
    return PoolBuffers(
        iotas=float(rank * INDEX_BYTES * padded),
        zeros=float(itemsize * padded),
        window=float(itemsize * (padded * pads + pooled)),
        indices=float(rank * INDEX_BYTES * pooled),
    )


def _intervals(pool: PoolBackward, pos) -> dict[str, tuple[int, int]]:
    """Field of :class:`PoolBuffers` -> (first, last program position) of that buffer."""
    back = pos[pool.node]
    fwd = back if pool.forward is None else pos[pool.forward]
    return {
        "iotas": (0, fwd),
        "zeros": (0, max(0, back - 1)),
        "window": (fwd, fwd),
        "indices": (fwd, back),
    }


def pool_buffer_intervals(graph: Graph, spec_of, mesh: DeviceMesh, pos) -> list[tuple]:
    """(first, last program position, per-device bytes) of every pooling backward's
    temporaries under the plan's tensor layouts ``spec_of`` (for
    :func:`autoshard.intra.memory.model.predicted_live_bytes`)."""
    out = []
    for pool in pool_backwards(graph, mesh):
        node = graph.nodes[pool.node]
        sizes = pool_buffers(graph, node, spec_of.get(node.outputs[0]), mesh)
        for name, (first, last) in _intervals(pool, pos).items():
            out.append((first, last, getattr(sizes, name)))
    return out


def pool_groups(graph: Graph, strategies, n_in: int, mesh: DeviceMesh, pos) -> list[CopyGroup]:
    """The same buffers as :class:`CopyGroup` entries for the ILP's memory rows: per
    pooling backward, buffer and size, the backward node's strategies that give that size
    (``pos``: program positions)."""
    out = []
    for pool in pool_backwards(graph, mesh):
        node, ilp = graph.nodes[pool.node], n_in + pool.node
        sizes = [pool_buffers(graph, node, s.output_specs[0], mesh) for s in strategies[ilp]]
        reader = ((pos[pool.node], ilp, tuple(range(len(strategies[ilp])))),)
        for name, (first, last) in _intervals(pool, pos).items():
            by_size: dict[float, list[int]] = {}
            for q, s in enumerate(sizes):
                by_size.setdefault(getattr(s, name), []).append(q)
            out += [
                CopyGroup(ilp, tuple(qs), size, first, last, reader)
                for size, qs in by_size.items()
                if size
            ]
    return out
