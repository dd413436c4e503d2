"""The fused attention operators' own temporaries, as the memory model counts them (jax-free).

Takes a graph and a priced mesh; returns, for each fused attention node
(``attention_fwd[_causal]``, ``attention_bwd[_causal]``), the bytes of the buffers it
holds only while it runs: a workspace made at the node and freed after it.  Used by
:mod:`autoshard.intra.memory.model` for the predicted peak and the ILP's memory rows.

What the node saves for later (forward: ``out`` and the log-sum-exp; it keeps ``q, k, v``
alive for the backward) are ordinary values of the graph, counted as such.  The
workspace depends on the backend's body for the operator
(:class:`~autoshard.hardware.mesh.MemoryLayout`'s ``attention_scores_workspace``):

* cuDNN's flash attention (XLA:GPU) streams the scores through on-chip memory in tiles:
  no ``S x S`` buffer at all, no workspace.
* XLA's body (XLA:CPU, :func:`autoshard.models.attention._xla_fwd` / ``_xla_bwd``) writes
  the ``[B, H, Sq, Sk]`` float32 blocks as buffers of their own.  Measured with
  jax 0.10.2 from the compiled operator's live ranges and buffer assignment, per device
  (``unit`` = ``B H Sq Sk`` x 4 bytes of the shard it runs):

  - forward: 2 units at its peak -- the masked scores and ``exp(s - lse)``, the ``PV``
    dot's operand -- whatever the shapes and dtype (2.00-2.07 on 10 shapes, f32 and bf16);
  - backward: the recomputed probabilities ``P``, ``dP`` and ``dS`` in turn.  Where the
    dots' batch ``B x H`` has a dim of size one (one sequence or one head per device),
    XLA runs them as 3-D dots and writes ``dS`` twice (as is, for ``dK = dS^T Q``, and
    transposed, for ``dQ = dS K``): 4 units live at once (3.0-4.0 on 5 shapes); with
    both above one it keeps the 4-D layout and reuses dying buffers: 2 units
    (2.25-2.5 on 2 shapes).

  The rest of the body's temporaries (transposed copies of ``q, k, v, d_out``, ``S x D``
  each) are left out: ``D / S`` of a unit each, small at real sequence lengths.

Two more buffers on XLA:CPU, where both bodies are inlined into the step and scheduled
with it (seen in the compiled gpt-tiny 2x4 and gpt-350m 8-device steps, at XLA's peak in
the head's backward, before any attention backward has run):

* each backward's ``P = exp(s - lse)`` (1 unit) is computed as soon as ``q``, ``k`` and
  ``lse`` exist, in the forward pass, and kept to the backward (an optimization barrier
  tying it to ``d_out`` does not stop it): :func:`early_probabilities`, a buffer from
  the forward operator that made ``lse`` to the backward -- so the backward's own
  workspace is the rest of its peak (3 or 1 units);
* one float32 ``[B, H, Sq, Sk]`` broadcast of a constant (the forward's ``mul`` by the
  scale, shared by every layer's backward dot fusion) lives from the first attention
  operator to the last: :func:`shared_broadcast`.
"""

from __future__ import annotations

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph, Node
from autoshard.ir.primitives import ATTENTION, ATTENTION_FWD
from autoshard.ir.spec import ShardingSpec

FORWARD_UNITS = 2.0
# the backward's peak less its early P (counted from the forward on: early_probabilities)
BACKWARD_UNITS_3D = 3.0  # a dot batch dim of size one: dS written twice
BACKWARD_UNITS_4D = 1.0


def attention_nodes(graph: Graph, mesh: DeviceMesh) -> list[int]:
    """Fused attention nodes that hold a workspace on ``mesh``'s backend (none where its
    layout has no ``attention_scores_workspace``)."""
    if not mesh.memory_layout.attention_scores_workspace:
        return []
    return [n.index for n in graph.nodes if n.primitive in ATTENTION]


def _local_dims(graph: Graph, node: Node, spec: ShardingSpec | None, mesh: DeviceMesh):
    """(B, H, Sq, Sk) of ``node``'s shard when its ``[B, S, H, D]`` result (``out``
    forward, ``dq`` backward) is in layout ``spec`` (None: whole)."""
    b, sq, h, _ = graph.tensors[node.outputs[0]].shape
    keys = node.inputs[1] if node.primitive in ATTENTION_FWD else node.outputs[1]  # k or dk
    sk = graph.tensors[keys].shape[1]
    if spec is not None:
        b //= mesh.mesh.size(spec.dims[0])
        h //= mesh.mesh.size(spec.dims[2])
    return b, h, sq, sk


def unit_bytes(graph: Graph, node: Node, spec: ShardingSpec | None, mesh: DeviceMesh) -> float:
    """Per-device bytes of one float32 ``[B, H, Sq, Sk]`` block of ``node``'s shard."""
    b, h, sq, sk = _local_dims(graph, node, spec, mesh)
    return 4.0 * b * h * sq * sk


def workspace_bytes(graph: Graph, node: Node, spec: ShardingSpec | None, mesh: DeviceMesh) -> float:
    """Per-device bytes of ``node``'s workspace when it runs with its ``[B, S, H, D]``
    result (``out`` forward, ``dq`` backward) in layout ``spec`` (None: whole)."""
    b, h, _, _ = _local_dims(graph, node, spec, mesh)
    unit = unit_bytes(graph, node, spec, mesh)
    if node.primitive in ATTENTION_FWD:
        return FORWARD_UNITS * unit
    return (BACKWARD_UNITS_3D if min(b, h) == 1 else BACKWARD_UNITS_4D) * unit


def early_probabilities(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int]]:
    """(forward node, backward node) of each backward whose ``P`` XLA makes in the forward
    pass: the forward that made one of the backward's operands (its ``lse``) and the
    backward, on a backend with ``attention_scores_workspace``."""
    out = []
    for index in attention_nodes(graph, mesh):
        node = graph.nodes[index]
        if node.primitive in ATTENTION_FWD:
            continue
        made = [graph.tensors[t].producer for t in node.inputs]
        fwd = [p for p in made if p is not None and graph.nodes[p].primitive in ATTENTION_FWD]
        if fwd:
            out.append((max(fwd), index))
    return out


def shared_broadcast(graph: Graph, mesh: DeviceMesh) -> tuple[int, int] | None:
    """(first forward, last attention node) between which the shared ``[B, H, Sq, Sk]``
    constant broadcast lives, or None (no attention, or another backend)."""
    nodes = attention_nodes(graph, mesh)
    fwd = [i for i in nodes if graph.nodes[i].primitive in ATTENTION_FWD]
    return (fwd[0], nodes[-1]) if fwd else None


def workspace_groups(graph: Graph, strategies, n_in: int, mesh: DeviceMesh, pos) -> list[CopyGroup]:
    """:func:`attention_nodes`' workspaces as :class:`CopyGroup` entries (for the ILP's
    memory rows): per node and size, the node's strategies that need that size; live at
    the node only (``pos``: program positions)."""
    out = []
    for index in attention_nodes(graph, mesh):
        node, ilp = graph.nodes[index], n_in + index
        by_size: dict[float, list[int]] = {}
        for q, s in enumerate(strategies[ilp]):
            size = workspace_bytes(graph, node, s.output_specs[0], mesh)
            by_size.setdefault(size, []).append(q)
        reader = ((pos[index], ilp, tuple(range(len(strategies[ilp])))),)
        out += [
            CopyGroup(ilp, tuple(qs), size, pos[index], pos[index], reader)
            for size, qs in by_size.items()
            if size
        ]
    held = [(b, f, b) for f, b in early_probabilities(graph, mesh)]  # (sized by, from, to)
    shared = shared_broadcast(graph, mesh)
    if shared is not None:
        held.append((shared[0], *shared))
    for sized_by, first, last in held:
        node, ilp = graph.nodes[sized_by], n_in + sized_by
        by_size = {}
        for q, s in enumerate(strategies[ilp]):
            by_size.setdefault(unit_bytes(graph, node, s.output_specs[0], mesh), []).append(q)
        reader = ((pos[last], n_in + last, tuple(range(len(strategies[n_in + last])))),)
        out += [
            CopyGroup(ilp, tuple(qs), size, pos[first], pos[last], reader)
            for size, qs in by_size.items()
            if size
        ]
    return out


def held_buffers(graph: Graph, spec_of, mesh: DeviceMesh, pos) -> list[tuple[int, int, float]]:
    """(first, last program position, per-device bytes) of every buffer of this module
    under the plan's tensor layouts ``spec_of``: the workspaces, the early ``P``s and the
    shared broadcast (for :func:`autoshard.intra.memory.model.predicted_live_bytes`)."""

    def unit(i: int) -> float:
        node = graph.nodes[i]
        return unit_bytes(graph, node, spec_of.get(node.outputs[0]), mesh)

    out = [
        (
            pos[i],
            pos[i],
            workspace_bytes(graph, graph.nodes[i], spec_of.get(graph.nodes[i].outputs[0]), mesh),
        )
        for i in attention_nodes(graph, mesh)
    ]
    out += [(pos[f], pos[b], unit(b)) for f, b in early_probabilities(graph, mesh)]
    shared = shared_broadcast(graph, mesh)
    if shared is not None:
        out.append((pos[shared[0]], pos[shared[1]], unit(shared[0])))
    return out
