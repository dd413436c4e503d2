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
  no ``S x S`` buffer at all, no workspace.  It takes 16-bit floats only: a float32
  attention runs XLA's body on XLA:GPU too (``MemoryLayout.wide_attention_held_blocks``),
  laid out otherwise than on XLA:CPU (below, "XLA's body on XLA:GPU").
* XLA's body (XLA:CPU, :func:`autoshard.models.attention._xla_fwd` / ``_xla_bwd``) writes
  the ``[B, H, Sq, Sk]`` float32 blocks as buffers of their own.  Both bodies are inlined
  into the step and scheduled with it, and XLA computes the backward's ``P = exp(s - lse)``
  once, in the forward (the same expression of the same ``q``, ``k``, ``lse``).  Counted,
  in ``unit`` = ``B H Sq Sk`` x 4 bytes of the shard the operator runs (measured on the
  compiled step's live ranges and buffer assignment, jax 0.10.2 and 0.12: gpt-tiny at
  seq 256 with one and two sequences a device, float32 and bfloat16; gpt-1.3b bfloat16
  ZeRO-3 on 8):

  - **held** from the forward operator to its backward (:func:`early_probabilities`,
    :func:`held_units`): ``P`` (1 unit), and where ``v`` is narrower than float32 the
    ``dV = P^T dO`` dot's copy of ``P`` rounded to ``v``'s dtype -- widened back to
    float32 where XLA:CPU runs narrow dots in float32 (``narrow_dots_in_f32``: 1 unit),
    else in ``v``'s dtype (2 bytes an element: 1/2 unit);
  - **forward**, at the operator: the scores and their masked copy (2 units), or ``P``,
    what is held and, with ``narrow_dots_in_f32``, the rounding of ``P`` and its float32
    copy that the ``PV`` dot reads (where a dot batch dim is one, as XLA runs 3-D dots;
    with 4-D dots the ``dV`` dot's copy serves both; bfloat16 3-D: 1 + 1 + 1/2 + 1 = 3.5
    units), whichever is more; the workspace is that less what is held from it on;
  - **backward**, at the operator: 2 units with what is held (``P`` and ``dP - delta``;
    then ``dS`` and, where a dot batch dim is one, its transposed copy for ``dQ``;
    bfloat16 under ``narrow_dots_in_f32``: ``P`` and its copy until the ``dV`` dot), so
    the workspace is 2 units less what is held (none in that bfloat16 case).

  (Compiled alone, the backward operator recomputes ``P`` and held up to 4 units; in the
  step that ``P`` is the forward's.)  The rest of the bodies' temporaries (transposed
  copies of ``q, k, v, d_out``, ``S x D`` each) are left out: ``D / S`` of a unit each,
  small at real sequence lengths.

One more buffer on XLA:CPU: one float32 ``[B, H, Sq, Sk]`` broadcast of a constant (the
forward's ``mul`` by the scale, shared by every layer's backward dot fusion) lives from the
first attention operator to the last: :func:`shared_broadcast`.

XLA's body on XLA:GPU (float32; the H100 scale runs' HLO, jax 0.11.2, docs/truth_gpu.md):
the forward writes the scores and ``scores - lse`` as buffers and fuses the ``exp`` into
each reader (the ``PV`` dot, and in the backward the ``dV`` dot and the ``dS`` fusion), so
both are **held** to the backward (``wide_attention_held_blocks`` units; XLA fuses the
subtraction into ``dS`` on some modules and holds 1); the forward needs nothing more, the
backward **1 unit** (``dP - delta``, ``dS`` written into its buffer:
:data:`GPU_BACKWARD_UNITS`).  No shared broadcast.

Before the held copy of ``P`` was counted (2026-11-27) gpt-1.3b bfloat16 ZeRO-3 on 8 with
the fused program was predicted 14.5% under XLA:CPU's peak: at that peak (the head's
backward) XLA holds ``P`` and its widened copy for both layers, 4 units of 128 MiB, where
the model counted 2.
"""

from __future__ import annotations

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.layout_copies import NARROW_FLOATS
from autoshard.intra.memory.reshard_copies import CopyGroup
from autoshard.ir.graph import Graph, Node
from autoshard.ir.primitives import ATTENTION, ATTENTION_FWD
from autoshard.ir.spec import ShardingSpec

# units live at once at either operator, what is held to the backward included: the
# scores and their masked copy (forward); P and dP - delta, or dS and its copy (backward)
SCORES_UNITS = 2.0
# XLA's body on XLA:GPU: units the backward operator holds beside what the forward keeps
# for it (dP - delta, and dS written into its buffer): 1 beside the held blocks in the
# backward of gpt-6.7b heuristic 2x8 and of moe-1.3b megatron 2x4 (whose 3 short-lived
# blocks live at once are the last layer's 2 held ones and it)
GPU_BACKWARD_UNITS = 1.0


def runs_gpu_xla_body(graph: Graph, node: Node, mesh: DeviceMesh) -> bool:
    """Whether fused attention ``node`` runs XLA's body where the backend's own kernel is
    cuDNN's (``mesh``'s layout counts ``wide_attention_held_blocks``): its ``q`` is wider
    than the 16-bit floats cuDNN's flash attention takes."""
    layout = mesh.memory_layout
    if layout.attention_scores_workspace or not layout.wide_attention_held_blocks:
        return False  # XLA:CPU's body everywhere, or a layout that does not count it
    return graph.tensors[node.inputs[0]].dtype not in NARROW_FLOATS


def attention_nodes(graph: Graph, mesh: DeviceMesh) -> list[int]:
    """Fused attention nodes that hold a workspace on ``mesh``'s backend: every one where
    its layout has ``attention_scores_workspace``, those in float32 where it counts
    ``wide_attention_held_blocks`` (:func:`runs_gpu_xla_body`), else none."""
    nodes = [n for n in graph.nodes if n.primitive in ATTENTION]
    if mesh.memory_layout.attention_scores_workspace:
        return [n.index for n in nodes]
    return [n.index for n in nodes if runs_gpu_xla_body(graph, n, mesh)]


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


def _narrow_copy_units(
    graph: Graph, node: Node, mesh: DeviceMesh, three_d: bool = False
) -> tuple[float, float]:
    """(units of the ``dV`` dot's copy of ``P``, units of the ``PV`` dot's own transient
    copies) for ``node``'s ``v`` dtype on ``mesh``'s backend: (0, 0) in float32.
    ``three_d``: a dot batch dim of the shard is one (XLA runs 3-D dots, and reads ``P``
    in another layout for ``PV`` than for ``dV``)."""
    v = graph.tensors[node.inputs[2]]
    if v.dtype not in NARROW_FLOATS:
        return 0.0, 0.0
    narrow = v.nbytes / max(1, v.size) / 4.0  # a narrow element in float32 units
    if not mesh.memory_layout.narrow_dots_in_f32:
        return narrow, 0.0
    # widened to float32; with 3-D dots the PV dot reads the rounding through a copy of
    # its own, with 4-D dots the dV dot's copy
    return 1.0, (narrow + 1.0) if three_d else 0.0


def held_units(graph: Graph, node: Node, mesh: DeviceMesh) -> float:
    """Units a forward operator makes and keeps to ``node``, its backward (or the forward
    itself: the same ``v``): ``P``, and in a narrow dtype the ``dV`` dot's copy of it;
    XLA's body on XLA:GPU: the layout's ``wide_attention_held_blocks``; cuDNN's: none."""
    if runs_gpu_xla_body(graph, node, mesh):
        return mesh.memory_layout.wide_attention_held_blocks
    if not mesh.memory_layout.attention_scores_workspace:
        return 0.0
    return 1.0 + _narrow_copy_units(graph, node, mesh)[0]


def workspace_units(
    graph: Graph, node: Node, mesh: DeviceMesh, held: bool = True, three_d: bool = False
) -> float:
    """Units ``node`` holds only while it runs, beyond what is held from the forward to the
    backward (``held``: whether this forward's ``P`` is kept for a backward; ``three_d``:
    a dot batch dim of the shard is one)."""
    keep = held_units(graph, node, mesh) if held else 0.0
    if runs_gpu_xla_body(graph, node, mesh):
        # the forward makes what it holds (scores, scores - lse); a backward with no
        # forward to keep them for it makes them again
        made = mesh.memory_layout.wide_attention_held_blocks
        extra = GPU_BACKWARD_UNITS if node.primitive not in ATTENTION_FWD else 0.0
        return made + extra - keep
    if not mesh.memory_layout.attention_scores_workspace:
        return 0.0  # cuDNN's flash attention: no S x S buffer
    if node.primitive in ATTENTION_FWD:
        copy, pv = _narrow_copy_units(graph, node, mesh, three_d)
        at_node = max(SCORES_UNITS, 1.0 + (copy if held else 0.0) + pv)
        return at_node - keep
    return max(0.0, SCORES_UNITS - keep)


def workspace_bytes(
    graph: Graph, node: Node, spec: ShardingSpec | None, mesh: DeviceMesh, held: bool = True
) -> float:
    """Per-device bytes of ``node``'s workspace when it runs with its ``[B, S, H, D]``
    result (``out`` forward, ``dq`` backward) in layout ``spec`` (None: whole)."""
    b, h, _, _ = _local_dims(graph, node, spec, mesh)
    units = workspace_units(graph, node, mesh, held, min(b, h) == 1)
    return units * unit_bytes(graph, node, spec, mesh)


def early_probabilities(graph: Graph, mesh: DeviceMesh) -> list[tuple[int, int]]:
    """(forward node, backward node) of each backward whose ``P`` (and, narrow, the ``dV``
    dot's copy of it: :func:`held_units`) XLA makes in the forward pass: the forward that
    made one of the backward's operands (its ``lse``) and the backward, on a backend with
    ``attention_scores_workspace``."""
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
    constant broadcast lives, or None (no attention, or another backend than XLA:CPU)."""
    if not mesh.memory_layout.attention_scores_workspace:
        return None
    nodes = attention_nodes(graph, mesh)
    fwd = [i for i in nodes if graph.nodes[i].primitive in ATTENTION_FWD]
    return (fwd[0], nodes[-1]) if fwd else None


def workspace_groups(graph: Graph, strategies, n_in: int, mesh: DeviceMesh, pos) -> list[CopyGroup]:
    """:func:`attention_nodes`' workspaces as :class:`CopyGroup` entries (for the ILP's
    memory rows): per node and size, the node's strategies that need that size; live at
    the node only (``pos``: program positions)."""
    out = []
    pairs = early_probabilities(graph, mesh)
    kept = {f for f, _ in pairs} | {b for _, b in pairs}
    for index in attention_nodes(graph, mesh):
        node, ilp = graph.nodes[index], n_in + index
        by_size: dict[float, list[int]] = {}
        for q, s in enumerate(strategies[ilp]):
            size = workspace_bytes(graph, node, s.output_specs[0], mesh, index in kept)
            by_size.setdefault(size, []).append(q)
        reader = ((pos[index], ilp, tuple(range(len(strategies[ilp])))),)
        out += [
            CopyGroup(ilp, tuple(qs), size, pos[index], pos[index], reader)
            for size, qs in by_size.items()
            if size
        ]
    # (sized by, from, to, units)
    held = [(b, f, b, held_units(graph, graph.nodes[b], mesh)) for f, b in pairs]
    shared = shared_broadcast(graph, mesh)
    if shared is not None:
        held.append((shared[0], *shared, 1.0))
    for sized_by, first, last, units in held:
        node, ilp = graph.nodes[sized_by], n_in + sized_by
        by_size = {}
        for q, s in enumerate(strategies[ilp]):
            size = units * unit_bytes(graph, node, s.output_specs[0], mesh)
            by_size.setdefault(size, []).append(q)
        reader = ((pos[last], n_in + last, tuple(range(len(strategies[n_in + last])))),)
        out += [
            CopyGroup(ilp, tuple(qs), size, pos[first], pos[last], reader)
            for size, qs in by_size.items()
            if size
        ]
    return out


def held_buffers(graph: Graph, spec_of, mesh: DeviceMesh, pos) -> list[tuple[int, int, float]]:
    """(first, last program position, per-device bytes) of every buffer of this module
    under the plan's tensor layouts ``spec_of``: the workspaces, the early ``P``s (with
    their narrow copies) and the shared broadcast (for :func:`autoshard.intra.memory.model.predicted_live_bytes`)."""

    def unit(i: int) -> float:
        node = graph.nodes[i]
        return unit_bytes(graph, node, spec_of.get(node.outputs[0]), mesh)

    pairs = early_probabilities(graph, mesh)
    kept = {f for f, _ in pairs} | {b for _, b in pairs}
    out = [
        (
            pos[i],
            pos[i],
            workspace_bytes(
                graph, graph.nodes[i], spec_of.get(graph.nodes[i].outputs[0]), mesh, i in kept
            ),
        )
        for i in attention_nodes(graph, mesh)
    ]
    out += [(pos[f], pos[b], held_units(graph, graph.nodes[b], mesh) * unit(b)) for f, b in pairs]
    shared = shared_broadcast(graph, mesh)
    if shared is not None:
        out.append((pos[shared[0]], pos[shared[1]], unit(shared[0])))
    return out
