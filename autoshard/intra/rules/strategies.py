"""Sharding strategies per primitive (jax-free).

Takes a graph node (with its tensors) and a logical mesh; returns the node's candidate
:class:`Strategy` list: for every operand the spec it needs, for every output the spec it
produces, and what it costs to compute.

Every rule is written as a set of **slots**: groups of (operand, dim) / (output, dim)
positions that must be split over the same mesh axes.  A strategy assigns each mesh axis
to at most one slot; the enumeration does the rest.  Slot kinds:

* ``shard``   -- the positions are split together (a batch dim of a matmul on both
  operands and the output; a dim of an elementwise op on every operand and the output).
* ``reduce``  -- operand positions are split and the output becomes a partial sum over
  the axis (a contracting dim of a matmul; a summed dim of ``reduce_sum``; the
  vocabulary dim of an embedding lookup).
* ``through`` -- operands arrive as partial sums and the output stays one (linear ops:
  ``add``, ``neg``, ``mul`` by an unreduced factor, ``reduce_sum``, reshapes ...).

A slot is offered on an axis only when every position it names divides evenly, so a
strategy that does not divide a dimension evenly is never offered.  Rules go by kind as
well as by name: a primitive with no rule of its own that is elementwise
(``Node.elementwise``) gets the elementwise rule.  Other primitives without a rule get
one replicated strategy and a single warning naming them.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Collection

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.memory.layout_copies import folded_dot_transpose
from autoshard.intra.rules.attention import attention_seconds
from autoshard.intra.rules.registry import (  # noqa: F401 - Slot, RULES, register: exported
    OUT,
    RULES,
    NodeContext,
    Slot,
    Strategy,
    _out,
    register,
)
from autoshard.ir.graph import Graph, Node
from autoshard.ir.primitives import ATTENTION, ELEMENTWISE
from autoshard.ir.spec import ShardingSpec

# the fused attention operators run the attention's batched dots (rules/attention.py)
HEAVY = frozenset({"dot_general", "conv_general_dilated"}) | ATTENTION


# XLA's SPMD partitioner keeps a partial sum only inside the op that makes it (a dot with
# a split contracting dim, a reduction over a split dim, a vocabulary-parallel lookup) and
# resolves it into the sharding the consumer needs right there.  Linear ops that could in
# principle carry partial sums on ("through" slots) are therefore not offered by default:
# a plan XLA would not follow is a plan whose predictions cannot be checked.
ALLOW_THROUGH = False


# ----------------------------------------------------------------------------- rules


@register("dot_general")
def _dot(ctx: NodeContext) -> list[Slot]:
    (lc, rc), (lb, rb) = ctx.node.params["dimension_numbers"]
    lhs, rhs = ctx.in_shapes[0], ctx.in_shapes[1]
    slots = []
    out_dim = 0
    for a, b in zip(lb, rb):
        slots.append(Slot("shard", ((0, a), (1, b), (OUT, out_dim))))
        out_dim += 1
    for d in range(len(lhs)):
        if d not in lc and d not in lb:
            slots.append(Slot("shard", ((0, d), (OUT, out_dim))))
            out_dim += 1
    for d in range(len(rhs)):
        if d not in rc and d not in rb:
            slots.append(Slot("shard", ((1, d), (OUT, out_dim))))
            out_dim += 1
    for a, b in zip(lc, rc):
        slots.append(Slot("reduce", ((0, a), (1, b))))
    # a product is linear in each factor: an unreduced operand gives an unreduced product
    slots += [Slot("through", ((0, -1),)), Slot("through", ((1, -1),))]
    return slots


LINEAR_ALL = frozenset({"add", "sub", "add_any"})
LINEAR_FIRST = frozenset({"neg", "convert_element_type", "copy", "reduce_precision", "div"})
LINEAR_EITHER = frozenset({"mul"})
# its operand as it is (a partial sum passes through unreduced)
IDENTITIES = frozenset({"stop_gradient", "optimization_barrier"})


@register(
    *ELEMENTWISE,
    "select_n",
    "convert_element_type",
    "copy",
    "stop_gradient",
    "reduce_precision",
    "optimization_barrier",
)
def _elementwise(ctx: NodeContext) -> list[Slot] | None:
    shape = ctx.out_shapes[0]
    live = [i for i, s in enumerate(ctx.in_shapes) if s and not ctx.in_literal[i]]
    if any(len(ctx.in_shapes[i]) != len(shape) for i in live):
        return None  # only rank-0 operands broadcast implicitly
    full = [i for i in live if ctx.in_shapes[i] == shape]
    # size-1 dims broadcast implicitly: such an operand does not take part in that dim
    slots = [
        Slot("shard", tuple((i, d) for i in live if ctx.in_shapes[i][d] == shape[d]) + ((OUT, d),))
        for d in range(len(shape))
    ]
    prim = ctx.node.primitive
    if prim in LINEAR_ALL and len(full) == len(ctx.in_shapes):
        slots.append(Slot("through", tuple((i, -1) for i in full)))
    elif (prim in LINEAR_FIRST or prim in IDENTITIES) and 0 in full:
        slots.append(Slot("through", ((0, -1),)))
    elif prim in LINEAR_EITHER:
        slots += [Slot("through", ((i, -1),)) for i in live]
    return slots


@register("broadcast_in_dim")
def _broadcast(ctx: NodeContext) -> list[Slot]:
    src = ctx.in_shapes[0]
    dims = ctx.node.params["broadcast_dimensions"]
    out = ctx.out_shapes[0]
    slots = []
    for d in range(len(out)):
        pos = [(OUT, d)]
        if d in dims:
            j = dims.index(d)
            if src[j] == out[d] and not ctx.in_literal[0]:
                pos.insert(0, (0, j))
        slots.append(Slot("shard", tuple(pos)))
    if src and not ctx.in_literal[0]:
        slots.append(Slot("through", ((0, -1),)))
    return slots


@register("iota")
def _iota(ctx: NodeContext) -> list[Slot]:
    return [Slot("shard", ((OUT, d),)) for d in range(len(ctx.out_shapes[0]))]


@register("transpose")
def _transpose(ctx: NodeContext) -> list[Slot]:
    perm = ctx.node.params["permutation"]
    slots = [Slot("shard", ((0, perm[d]), (OUT, d))) for d in range(len(perm))]
    return slots + [Slot("through", ((0, -1),))]


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]]:
    """(src dim, dst dim) pairs that lead groups of equal products, e.g. [B,S,h]->[B,S,H,D]:
    (0,0), (1,1), (2,2)."""
    pairs = []
    i = j = 0
    while i < len(src) and j < len(dst):
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            break
        pairs.append((i, j))
        p, q = src[i], dst[j]
        i += 1
        j += 1
        while p != q:
            if p < q:
                p *= src[i]
                i += 1
            else:
                q *= dst[j]
                j += 1
    return pairs


@register("reshape", "squeeze", "expand_dims")
def _reshape(ctx: NodeContext) -> list[Slot]:
    src, dst = ctx.in_shapes[0], ctx.out_shapes[0]
    slots = [Slot("shard", ((0, i), (OUT, j))) for i, j in _reshape_groups(src, dst)]
    return slots + [Slot("through", ((0, -1),))]


@register("split")
def _split(ctx: NodeContext) -> list[Slot]:
    axis = ctx.node.params["axis"]
    n_out = len(ctx.out_shapes)
    return [
        Slot("shard", ((0, d),) + tuple((_out(k), d) for k in range(n_out)))
        for d in range(len(ctx.in_shapes[0]))
        if d != axis
    ] + [Slot("through", ((0, -1),))]


@register("concatenate")
def _concatenate(ctx: NodeContext) -> list[Slot]:
    axis = ctx.node.params["dimension"]
    n_in = len(ctx.in_shapes)
    return [
        Slot("shard", tuple((i, d) for i in range(n_in)) + ((OUT, d),))
        for d in range(len(ctx.out_shapes[0]))
        if d != axis
    ] + [Slot("through", tuple((i, -1) for i in range(n_in)))]


@register("gather")
def _gather(ctx: NodeContext) -> list[Slot] | None:
    dn = ctx.node.params["dimension_numbers"]
    operand = ctx.in_shapes[0]
    out = ctx.out_shapes[0]
    offset_dims = dn["offset_dims"]
    collapsed = dn["collapsed_slice_dims"]
    op_batch = dn["operand_batching_dims"]
    idx_batch = dn["start_indices_batching_dims"]
    slice_sizes = ctx.node.params["slice_sizes"]
    slots = []
    # output batch dims <-> indices dims (all but the trailing index vector dim)
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    for k, d in enumerate(batch_out):
        pos = [(1, k), (OUT, d)]
        if k in idx_batch:
            pos.insert(0, (0, op_batch[idx_batch.index(k)]))
        slots.append(Slot("shard", tuple(pos)))
    # offset dims <-> operand dims that are neither collapsed nor batching, if sliced whole
    window = [d for d in range(len(operand)) if d not in collapsed and d not in op_batch]
    for d_out, d_op in zip(offset_dims, window):
        if slice_sizes[d_op] == operand[d_op]:
            slots.append(Slot("shard", ((0, d_op), (OUT, d_out))))
    # a collapsed dim split over devices: each device looks up the rows it owns (masked),
    # so the output is a partial sum -- the vocabulary-parallel embedding, and (beside
    # batching dims: take_along_axis) the target logit of a vocabulary-parallel
    # cross-entropy
    for d in collapsed:
        if operand[d] > 1:
            slots.append(Slot("reduce", ((0, d),)))
    return slots


@register("scatter-add", "scatter_add")
def _scatter_add(ctx: NodeContext) -> list[Slot] | None:
    dn = ctx.node.params["dimension_numbers"]
    operand, indices, updates = ctx.in_shapes
    window_dims = dn["update_window_dims"]
    inserted = dn["inserted_window_dims"]
    op_batch = dn["operand_batching_dims"]
    idx_batch = dn["scatter_indices_batching_dims"]
    slots = []
    # update scatter dims <-> indices dims: split, each device scatters its share
    # (a partial sum), unless the dim is a batching dim, which stays split in the output
    scatter_upd = [d for d in range(len(updates)) if d not in window_dims]
    for k, d in enumerate(scatter_upd):
        if k in idx_batch:
            j = op_batch[idx_batch.index(k)]
            slots.append(Slot("shard", ((0, j), (1, k), (2, d), (OUT, j))))
        else:
            slots.append(Slot("reduce", ((1, k), (2, d))))
    window_op = [d for d in range(len(operand)) if d not in inserted and d not in op_batch]
    for d_upd, d_op in zip(window_dims, window_op):
        if updates[d_upd] == operand[d_op]:
            slots.append(Slot("shard", ((0, d_op), (2, d_upd), (OUT, d_op))))
    # operand split on an indexed dim: each device applies the updates to rows it owns
    if not op_batch:
        for d in inserted:
            slots.append(Slot("shard", ((0, d), (OUT, d))))
    return slots


# ----------------------------------------------------------------------------- enumeration


def _positions_ok(slot: Slot, axes_size: int, ctx: NodeContext) -> bool:
    if slot.groups > 1 and slot.groups % axes_size:
        return False
    for opnd, dim in slot.positions:
        if dim < 0:
            continue
        shape = ctx.out_shapes[OUT - opnd] if opnd < 0 else ctx.in_shapes[opnd]
        if shape[dim] % axes_size:
            return False
    return True


def enumerate_strategies(ctx: NodeContext, slots: list[Slot], mesh: DeviceMesh) -> list[Strategy]:
    """Every assignment of mesh axes to slots that divides evenly, as strategies."""
    names = mesh.axis_names
    options: list[list[int | None]] = []
    for a in names:
        size = mesh.mesh.size(a)
        opts: list[int | None] = [None]
        if size > 1:
            opts += [i for i, s in enumerate(slots)]
        options.append(opts)
    n_in, n_out = len(ctx.in_shapes), len(ctx.out_shapes)
    order = {a: i for i, a in enumerate(names)}

    def canon(axes):
        return tuple(sorted(axes, key=order.__getitem__))

    result = []
    seen = set()
    for choice in itertools.product(*options):
        # slots sharing axes must divide by the product of those axes
        by_slot: dict[int, list[str]] = {}
        for a, s in zip(names, choice):
            if s is not None:
                by_slot.setdefault(s, []).append(a)
        if any(
            not _positions_ok(slots[s], mesh.mesh.size(tuple(ax)), ctx) for s, ax in by_slot.items()
        ):
            continue
        in_dims = [[() for _ in s] for s in ctx.in_shapes]
        out_dims = [[() for _ in s] for s in ctx.out_shapes]
        in_partial: list[list[str]] = [[] for _ in range(n_in)]
        out_partial: list[str] = []
        factor = 1
        for s, axes in by_slot.items():
            slot = slots[s]
            if slot.kind == "through":
                out_partial += axes
                for opnd, _ in slot.positions:
                    in_partial[opnd] += axes
                continue
            factor *= mesh.mesh.size(tuple(axes))
            for opnd, dim in slot.positions:
                target = out_dims[OUT - opnd] if opnd < 0 else in_dims[opnd]
                target[dim] = target[dim] + tuple(axes)
            if slot.kind == "reduce":
                out_partial += axes
        ops = {slots[s].op for s in by_slot if slots[s].kind == "reduce"}
        if (out_partial and n_out > 1) or len(ops) > 1:
            continue
        input_specs = tuple(
            None
            if ctx.in_literal[i]
            else ShardingSpec(tuple(canon(d) for d in in_dims[i]), canon(in_partial[i]))
            for i in range(n_in)
        )
        op = next(iter(ops), "sum")
        output_specs = tuple(
            ShardingSpec(tuple(canon(d) for d in out_dims[k]), canon(out_partial), op)
            for k in range(n_out)
        )
        key = (input_specs, output_specs)
        if key in seen:
            continue
        seen.add(key)
        cost = strategy_seconds(ctx, input_specs, output_specs, factor, mesh)
        result.append(
            Strategy(_name(output_specs, input_specs), input_specs, output_specs, cost, factor)
        )
    return result


def _local(shape: tuple[int, ...], spec: ShardingSpec | None, mesh: DeviceMesh) -> list[int]:
    if spec is None:
        return list(shape)
    return [d // mesh.mesh.size(axes) for d, axes in zip(shape, spec.dims, strict=True)]


def _gemm_seconds(ctx: NodeContext, input_specs, mesh: DeviceMesh) -> float:
    """A dot_general's per-device time: its shard as ``batch x [M, K] @ [K, N]``."""
    (lc, rc), (lb, rb) = ctx.node.params["dimension_numbers"]
    lhs = _local(ctx.in_shapes[0], input_specs[0], mesh)
    rhs = _local(ctx.in_shapes[1], input_specs[1], mesh)
    batch = math.prod(lhs[d] for d in lb)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
    k = math.prod(lhs[d] for d in lc)
    return mesh.gemm.seconds(batch, max(m, 1), max(n, 1), max(k, 1), ctx.itemsize)


def strategy_seconds(
    ctx: NodeContext,
    input_specs: tuple[ShardingSpec | None, ...],
    output_specs: tuple[ShardingSpec, ...],
    factor: int,
    mesh: DeviceMesh,
) -> float:
    """Per-device seconds of one node under one strategy (the ILP's node cost).

    * ``dot_general`` on a mesh with a GEMM timing (``mesh.gemm``): the GEMM table's time
      for the *per-device* shard shape (batch, M, N, K from the sharded operands).
    * a fused attention on such a mesh: :func:`~autoshard.intra.rules.attention.
      attention_seconds` (the attention table's, or the unfused attention's time).
    * otherwise the roofline of FLOPs / (``factor`` x peak) and, when ``mesh.hbm_bandwidth``
      is finite, the bytes the node reads and writes per device (``ctx.in_bytes`` /
      ``ctx.out_bytes`` times each spec's shard fraction) over HBM bandwidth.

    With an infinite peak and bandwidth (Alpa's test meshes) this is 0 for every node;
    with a finite peak only, it is FLOPs / (factor x peak), the classic Alpa compute cost.
    """
    if ctx.node.primitive == "dot_general" and mesh.gemm is not None and ctx.node.flops:
        return _gemm_seconds(ctx, input_specs, mesh)
    if ctx.node.primitive in ATTENTION and ctx.node.flops and mesh.gemm is not None:
        return attention_seconds(ctx, output_specs[0], factor, mesh)
    seconds = ctx.node.flops / factor / mesh.peak_flops if ctx.node.flops else 0.0
    if math.isfinite(mesh.hbm_bandwidth) and (ctx.in_bytes or ctx.out_bytes):
        nbytes = sum(
            b * spec.shard_fraction(mesh.mesh)
            for b, spec in zip(ctx.in_bytes, input_specs, strict=True)
            if b and spec is not None
        ) + sum(
            b * spec.shard_fraction(mesh.mesh)
            for b, spec in zip(ctx.out_bytes, output_specs, strict=True)
            if b
        )
        seconds = max(seconds, nbytes / mesh.hbm_bandwidth)
    return seconds


def _name(outs: tuple[ShardingSpec, ...], ins: tuple[ShardingSpec | None, ...]) -> str:
    return f"{outs[0]} <- " + " x ".join("_" if s is None else str(s) for s in ins)


def replicated_strategy(ctx: NodeContext, mesh: DeviceMesh) -> Strategy:
    ins = tuple(
        None if lit or not s else ShardingSpec.replicated(len(s))
        for s, lit in zip(ctx.in_shapes, ctx.in_literal)
    )
    outs = tuple(ShardingSpec.replicated(len(s)) for s in ctx.out_shapes)
    cost = strategy_seconds(ctx, ins, outs, 1, mesh)
    return Strategy(_name(outs, ins), ins, outs, cost, 1)


def node_context(
    graph: Graph, node: Node, materialized: Collection[int] | None = None
) -> NodeContext:
    """``materialized``: tensor ids held in memory (None: memory traffic not modelled).

    A transpose that XLA folds into the dot whose result it reads (the dot writes its
    result transposed: :func:`~autoshard.intra.memory.layout_copies.folded_dot_transpose`,
    every weight gradient) streams nothing: its bytes are 0, so it costs no time."""
    tensors = graph.tensors
    in_bytes = out_bytes = ()
    if materialized is not None and folded_dot_transpose(graph, node) is not None:
        in_bytes = (0.0,) * len(node.inputs)
        out_bytes = (0.0,) * len(node.outputs)
    elif materialized is not None:
        in_bytes = tuple(
            float(tensors[t].nbytes) if t in materialized else 0.0 for t in node.inputs
        )
        out_bytes = tuple(
            float(tensors[t].nbytes) if t in materialized else 0.0 for t in node.outputs
        )
    first = tensors[node.inputs[0]] if node.inputs else None
    itemsize = max(first.nbytes // max(first.size, 1), 1) if first is not None else 4
    return NodeContext(
        node,
        tuple(tensors[t].shape for t in node.inputs),
        tuple(tensors[t].shape for t in node.outputs),
        tuple(
            tensors[t].kind in ("literal", "const") and not tensors[t].shape for t in node.inputs
        ),
        in_bytes,
        out_bytes,
        itemsize,
    )


def node_strategies(
    graph: Graph,
    node: Node,
    mesh: DeviceMesh,
    warn: set[str] | None = None,
    materialized: Collection[int] | None = None,
    cache: dict | None = None,
    heavy_use_all_devices: bool = True,
) -> list[Strategy]:
    """Candidate strategies of one node; a replicated fallback for unknown primitives.

    ``materialized`` (tensor ids in memory) lets the node costs charge memory traffic.
    ``cache`` (a dict kept by the caller for one mesh and these settings): nodes with the
    same primitive, parameters, FLOPs, operand and result shapes and bytes get the same
    list object. ``heavy_use_all_devices``: a dot or convolution keeps only the
    strategies that split its work over the most devices (Alpa's rule); False keeps
    every strategy, replicated work included (a Megatron-LM router, a replicated
    weight's dot, where nothing may be gathered afterwards).
    """
    ctx = node_context(graph, node, materialized)
    if cache is None:
        return _node_strategies(ctx, mesh, warn, heavy_use_all_devices)
    key = (
        node.primitive,
        repr(sorted(node.params.items())),
        node.flops,
        ctx.in_shapes,
        ctx.out_shapes,
        ctx.in_literal,
        ctx.in_bytes,
        ctx.out_bytes,
        ctx.itemsize,
    )
    if key not in cache:
        cache[key] = _node_strategies(ctx, mesh, warn, heavy_use_all_devices)
    return cache[key]


def _node_strategies(
    ctx: NodeContext, mesh: DeviceMesh, warn: set[str] | None, heavy_use_all_devices: bool = True
) -> list[Strategy]:
    node = ctx.node
    rule = RULES.get(node.primitive) or (_elementwise if node.elementwise else None)
    slots = rule(ctx) if rule is not None else None
    if slots is None:
        if warn is not None and node.primitive not in warn:
            warn.add(node.primitive)
            warnings.warn(
                f"autoshard has no sharding rule for primitive {node.primitive!r}: it is "
                "planned replicated (correct, maybe slow)",
                stacklevel=2,
            )
        return [replicated_strategy(ctx, mesh)]
    if not ALLOW_THROUGH:
        slots = [s for s in slots if s.kind != "through"]
    strategies = enumerate_strategies(ctx, slots, mesh)
    if node.primitive in HEAVY and strategies and heavy_use_all_devices:
        # Alpa: heavy operators never replicate computation -- keep the strategies that
        # split the work over the most devices (all of them whenever shapes divide)
        most = max(s.parallel_factor for s in strategies)
        strategies = [s for s in strategies if s.parallel_factor == most]
    return strategies or [replicated_strategy(ctx, mesh)]


def input_strategies(shape: tuple[int, ...], mesh: DeviceMesh) -> list[ShardingSpec]:
    """Specs a program input may take: each mesh axis on one dim (evenly) or unused."""
    ctx = NodeContext(Node(-1, "input", (), (), {}, 0.0, None, "forward", ""), (), (shape,), ())
    slots = [Slot("shard", ((OUT, d),)) for d in range(len(shape))]
    return [s.output_specs[0] for s in enumerate_strategies(ctx, slots, mesh)]


__all__ = [
    "Slot",
    "Strategy",
    "RULES",
    "register",
    "node_strategies",
    "input_strategies",
    "enumerate_strategies",
    "strategy_seconds",
]
