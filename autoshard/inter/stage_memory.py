"""A stage unit's per-micro-batch terms (jax-free): what it keeps between its forward and
backward passes, what recompute adds and saves, and the optimizer update's share of each
micro-batch -- the parts of :class:`~autoshard.inter.stage_cost.IntraStageCost`'s units
that are not the ILP itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.intervals import mesh_intervals
from autoshard.ir.graph import Graph
from autoshard.ir.spec import ShardingSpec


def is_attention_sized(shape: tuple[int, ...]) -> bool:
    """A ``[batch, heads, s, s]`` tensor: attention scores, probabilities, their masks."""
    return len(shape) == 4 and shape[-1] == shape[-2] > 1


def zero_dim(shape: tuple[int, ...], split: tuple[int, ...], dp: int) -> int | None:
    """The dim a data-parallel replica stage shards an optimizer-state leaf of ``shape``
    on over ``data`` (ZeRO-1: each of the ``dp`` replicas updates ``1/dp`` of it): the
    first dim whose size divides by ``dp`` times ``split[d]``, the product of the mesh
    axis sizes the replica's spec already puts on ``d``.  None where no dim does (a
    scalar such as a step count, a dim too small): the leaf stays replicated over
    ``data``.  The runtime (:class:`~autoshard.runtime.stage.StageExecutable`) and the
    stage pricing share this rule."""
    if len(split) != len(shape):
        raise ValueError(f"split {split} has not one entry per dim of shape {shape}")
    if dp < 1 or any(s < 1 for s in split):
        raise ValueError(f"dp ({dp}) and split {split} must be positive")
    for d, (size, held) in enumerate(zip(shape, split, strict=True)):
        if size % (dp * held) == 0:
            return d
    return None


def spec_fraction(spec: ShardingSpec, mesh: DeviceMesh) -> float:
    """The share of ``spec``'s whole tensor one device of ``mesh`` holds."""
    return spec.shard_fraction(mesh.mesh)


def activation_bytes_of(graph: Graph, spec_of: Mapping[int, ShardingSpec], mesh) -> float:
    """Per-device bytes of buffers live across the forward -> backward boundary: made (or
    received) before the last forward equation and still read after it."""
    return sum(kept_activations(graph, spec_of, mesh).values())


def kept_activations(
    graph: Graph, spec_of: Mapping[int, ShardingSpec], mesh, copies=frozenset()
) -> dict[int, float]:
    """Tensor id -> per-device bytes of each buffer :func:`activation_bytes_of` counts.
    ``copies``: the 16-bit copies of weights cast once a step (:func:`cast_copies`), state
    held all step, not kept per microbatch."""
    forward = [n.index for n in graph.nodes if n.phase == "forward"]
    if not forward:
        return {}
    boundary = max(forward)
    kept: dict[int, float] = {}
    for tid, (first, last) in mesh_intervals(graph, mesh).items():
        t = graph.tensors[tid]
        if t.kind in ("param", "opt_state") or tid not in spec_of or tid in copies:
            continue
        if t.producer is None:  # an input: kept when the forward reads it and a later op too
            reads = list(t.consumers)
            keep = (
                any(graph.nodes[c].phase == "forward" for c in reads)
                and max(reads, default=-1) > boundary
            )
        else:
            keep = first <= boundary < last and graph.nodes[t.producer].phase == "forward"
        if keep:
            kept[tid] = t.nbytes * spec_fraction(spec_of[tid], mesh)
    return kept


def cast_copies(graph: Graph, plan, once: Mapping[int, int]) -> frozenset[int]:
    """The convert outputs that are the 16-bit copies of weights cast once a step
    (``once``: parameter id -> its convert node): those whose plan reads the weight and
    makes the copy in the weight's own spec. The pipeline runtime passes such a copy
    through (``StageExecutable._passthrough``), so the backward reads it as state; another
    (a reshard into or out of the convert) is a new value per microbatch."""
    spec_of = plan.specs_by_tensor(graph.inputs)
    out = set()
    for tid, node in once.items():
        made = graph.nodes[node].outputs[0]
        read = plan.operand_specs.get(node, {}).get(0, spec_of[tid])
        if spec_of.get(made) == spec_of[tid] == read:
            out.add(made)
    return frozenset(out)


def recompute_costs(
    graph: Graph,
    ip,
    solution,
    kept: Mapping[int, float],
    layer_inputs: Mapping[int, float] | None = None,
    once: frozenset[int] = frozenset(),
):
    """Per recompute mode, (seconds added per microbatch, activation bytes kept).

    * ``none``: nothing added; every kept buffer.
    * ``selective`` (Korthikanti et al.): the attention core is recomputed -- the forward
      equations that make or read attention-sized tensors (:func:`is_attention_sized`:
      Q K^T, softmax, dropout, P V) -- and its buffers are not kept.  A fused attention
      operator (``attention_fwd``) has no attention-sized tensor: it keeps only ``q, k, v``,
      its output and the log-sum-exp, which the layer keeps anyway, and its backward
      recomputes the scores itself (counted in its FLOPs), so selective recompute adds
      nothing and drops nothing there: it costs what ``none`` costs.
    * ``full``: the whole forward (equations at their chosen strategies, plus the
      resharding into them) runs again; only the unit's inputs (the layer input) are kept:
      ``layer_inputs`` (tensor id -> per-device bytes of the activations entering the unit
      that its forward reads), which the forward needs to run again even where the
      backward never reads them (so ``kept`` may lack them); without it, the inputs in
      ``kept``.  ``once``: the nodes that cast a weight once a step (:func:`amortise_update`),
      which the recomputed forward does not repeat (it reads their 16-bit copies).
    """
    forward = {n.index for n in graph.nodes if n.phase == "forward"}
    chosen = [
        ip.strategies[ip.node_of(n.index)][solution.strategy[ip.node_of(n.index)]]
        for n in graph.nodes
    ]
    forward_s = sum(chosen[i].compute_cost for i in forward if i not in once)
    forward_nodes = {ip.node_of(i) for i in forward}
    for edge, readers in zip(ip.problem.edges, ip.edge_consumers, strict=True):
        if any(r in forward_nodes for r in readers):  # a value resharded for the forward
            forward_s += edge.costs[solution.strategy[edge.src]][solution.strategy[edge.dst]]
    attention = [
        n.index
        for n in graph.nodes
        if n.index in forward
        and any(is_attention_sized(graph.tensors[t].shape) for t in (*n.inputs, *n.outputs))
    ]
    selective_s = sum(chosen[i].compute_cost for i in attention)
    total = sum(kept.values())
    attention_bytes = sum(b for t, b in kept.items() if is_attention_sized(graph.tensors[t].shape))
    inputs_bytes = sum(b for t, b in kept.items() if graph.tensors[t].producer is None)
    seconds = {"none": 0.0, "selective": selective_s, "full": forward_s}
    full = sum(layer_inputs.values()) if layer_inputs else inputs_bytes
    kept_bytes = {"none": total, "selective": total - attention_bytes, "full": full}
    return seconds, kept_bytes


def amortise_update(ip, factor: float, once: frozenset[int] = frozenset()):
    """The ILP with the optimizer update's costs scaled by ``factor`` (= 1 / microbatches).

    Gradients are accumulated over microbatches; the reduction (the resharding into the
    update equations) and the update itself run once per step.  Scaling their compute
    costs and the costs of resharding the values only they read makes the objective
    seconds per microbatch.  ``once``: graph nodes that also run once a step (the converts
    of weights cast once, :func:`autoshard.intra.offload.placement.cast_once_params`):
    their compute costs are scaled too (a reshard into one stays per microbatch: the
    runtime reshards the 16-bit copy as each microbatch reads it).
    """
    if factor == 1.0:
        return ip.problem
    update = {ip.node_of(n.index) for n in ip.graph.nodes if n.phase == "update"}
    edges = tuple(
        dataclasses.replace(e, costs=tuple(tuple(c * factor for c in row) for row in e.costs))
        if readers and all(r in update for r in readers)
        else e
        for e, readers in zip(ip.problem.edges, ip.edge_consumers, strict=True)
    )
    update |= {ip.node_of(i) for i in once}
    node_costs = tuple(
        tuple(c * factor for c in row) if i in update else row
        for i, row in enumerate(ip.problem.node_costs)
    )
    return dataclasses.replace(ip.problem, edges=edges, node_costs=node_costs)


def unit_state(graph, plan, mesh, offload, cluster, num_microbatches, owner_of, cast_once=None):
    """A stage unit's training state per device and what offloading it costs:
    ``(owned, borrowed, offload_s, staging_bytes, host_bytes)``. ``owned``: the unit's own
    parameters and optimizer state resident in HBM, and its parameters' gradients where the
    device updates; ``borrowed``: bytes of parameters read from a layer outside the unit,
    by owner layer (``owner_of(tid)``, e.g. a tied embedding); the rest from
    :func:`autoshard.intra.offload.placement.offload_cost` where ``offload`` moves state to the host
    (its transfers partly hidden behind the backward of every one of ``num_microbatches``:
    the preset's ``copy_overlap`` share of them, at most that backward).

    The gradients: accumulated over ``num_microbatches > 1`` into a buffer held all step
    (Megatron-LM's and the pipeline runtime's), owned bytes; with one microbatch a step the
    pipeline runtime runs a stage's backward and update as one program
    (:meth:`autoshard.runtime.stage.StageExecutable.backward_update`) and the device
    updates each weight as soon as its gradient is made (as the one-mesh memory model has
    it, :func:`autoshard.intra.memory.intervals.program_positions`), so a unit holds its own
    gradients only while they are made: staging (working) bytes, held once. On a backend
    that updates late (XLA:CPU, ``late_updates``) they are owned bytes either way.

    ``cast_once`` (parameter ids): the f32 weights cast to 16 bits once a step, whose
    16-bit copies the device holds all step beside them (owned bytes)."""
    from autoshard.intra.offload.placement import narrow_copy_bytes, offload_cost, offload_tensors

    aliased = {src for src, _ in graph.aliases}
    owned = 0.0
    borrowed: dict[int, float] = {}
    moved = offload_tensors(graph, offload, strict=False) if offload else None
    host = moved.host if moved is not None else frozenset()
    grads_here = not offload.host_update
    streamed = num_microbatches == 1 and not mesh.memory_layout.late_updates
    made = 0.0  # gradients streamed into the update as they are made (one microbatch)
    for tid, spec in zip(graph.inputs, plan.input_specs):
        t = graph.tensors[tid]
        if t.kind not in ("param", "opt_state"):
            continue
        size = t.nbytes * spec_fraction(spec, mesh)
        if tid in aliased:
            # the state in HBM (a master weight offloaded: its 16-bit copy, which the
            # device holds all step), and a param's gradient (streamed out as it is
            # made when the host updates)
            resident = size
            if tid in host:
                resident = (
                    size * narrow_copy_bytes(graph, tid) / t.nbytes if t.kind == "param" else 0.0
                )
            elif cast_once and tid in cast_once:  # its 16-bit copy, held all step
                resident += size * narrow_copy_bytes(graph, tid) / t.nbytes
            grad = size if t.kind == "param" and grads_here else 0.0
            owned += resident + (0.0 if streamed else grad)
            made += grad if streamed else 0.0
        else:
            owner = owner_of(tid)
            borrowed[owner] = borrowed.get(owner, 0.0) + size
    offload_s = staging = host_bytes = 0.0
    if moved is not None and moved.state_in:
        # transfers partly hide behind the backward of every microbatch of the step
        backward = plan.solver.get("compute_s_by_phase", {}).get("backward", 0.0)
        paid = offload_cost(
            graph, moved, plan.specs_by_tensor(graph.inputs), mesh.mesh, cluster,
            backward * num_microbatches, cluster.devices_per_node,
        )  # fmt: skip
        offload_s, staging, host_bytes = (
            paid.exposed_s, paid.staging_bytes, paid.host_bytes_per_device,
        )  # fmt: skip
    return owned, borrowed, offload_s, staging + made, host_bytes
