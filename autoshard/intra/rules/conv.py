"""Sharding rules for convolutions, pooling and max-pool's gradient (jax-free).

Registers slot rules (see :mod:`autoshard.intra.rules.strategies`) for:

* ``conv_general_dilated`` -- read through its dimension numbers, so the forward conv and
  both of its gradients (which JAX writes as convolutions with the roles of the dims
  swapped) get the same three kinds of split:

  - **batch**: the lhs batch dim with the output batch dim (data parallel);
  - **output channel**: the kernel's output-feature dim with the output feature dim;
  - **input channel**: the lhs feature dim with the kernel's input-feature dim, a
    ``reduce`` slot -- every device sums over its channels and the output is a partial
    sum (the weight gradient's data-parallel all-reduce is this slot: there the
    contracted "feature" dim is the batch);
  - **spatial**, only where no window crosses a shard boundary: a 1x1 window with
    stride 1, no padding and no dilation, where a spatial dim is split like an
    elementwise dim.  Wider windows need halo exchanges (collective-permutes) that the
    cost model does not price, so those splits are not offered.

  Grouped convolutions split whole groups, where XLA's SPMD partitioner does too.
  ``feature_group_count`` G > 1 with one input channel per group (depthwise convs and
  their input gradients): the lhs feature dim, the kernel's output-feature dim and the
  output feature dim together, on axes whose size divides G (each device holds G/n
  groups: their channels, kernels and outputs). ``batch_group_count`` B > 1 (the weight
  gradient of a grouped conv: the lhs "batch" is the channels, its "feature" the
  images): with one input channel per group, the lhs batch dim, the kernel's
  output-feature dim and the output feature dim together, on axes whose size divides B.
  Not offered: the image (feature) split of a batch-grouped conv (on the ResNeXt-style
  block below XLA all-gathers its operand, 2 x 262 KB, instead of the partial sum), the input-channel split of a feature-grouped conv (it would
  cut a group), and group splits of convs with several channels per group: on a
  ResNeXt-style block (8 groups of 32 channels, 4 devices, 2 groups each) XLA 0.10's
  partitioner all-gathers the grouped convs' operands and kernel (4 all-gathers, 1.1 MB,
  and a second all-to-all the plan did not predict) instead of partitioning them. Nor,
  for those convs, the batch split: XLA's partitioner (jaxlib 0.10.2 and 0.12) gathers
  the batch of a batch-split grouped conv with several channels per group and computes
  it whole (a depthwise conv, one channel per group, it splits by the batch), so such a
  conv is planned whole, its all-gather priced and predicted.

* ``rev`` (the flipped kernel of an input gradient): split on the dims it keeps.

* ``reduce_window_max`` / ``reduce_window_min`` / ``reduce_window_sum`` / ``reduce_window``
  (pooling) and ``select_and_scatter_add`` / ``select_and_gather_add`` (max pooling's
  gradient): every dim the window does not touch (window 1, stride 1, no padding, no
  dilation: the batch and channel dims of a 2-D pool) is split on every operand and the
  result together.  Pooled (spatial) dims stay whole for the same reason as above.

Guarantees: every offered split computes exactly what the unsplit op computes, with no
collective inside the op other than the partial sum a ``reduce`` slot declares.
"""

from __future__ import annotations

from autoshard.intra.rules.registry import OUT, NodeContext, Slot, register
from autoshard.ir.graph import conv_dimension_numbers

__all__ = ["conv_slots", "rev_slots", "select_window_slots", "window_slots"]


def _pointwise_spatial(params: dict, rhs_shape: tuple[int, ...], rhs_spec, k: int) -> bool:
    """Is spatial dim ``k`` of a convolution a pointwise map (no window, stride, pad)?"""

    def at(name: str, default: int):
        value = params.get(name)
        return default if value is None else value[k]

    return (
        rhs_shape[rhs_spec[2 + k]] == 1
        and at("window_strides", 1) == 1
        and tuple(at("padding", (0, 0))) == (0, 0)
        and at("lhs_dilation", 1) == 1
        and at("rhs_dilation", 1) == 1
    )


@register("conv_general_dilated")
def conv_slots(ctx: NodeContext) -> list[Slot]:
    """Batch, output-channel, input-channel (partial sum), group and pointwise-spatial
    slots."""
    params = ctx.node.params
    lhs_spec, rhs_spec, out_spec = conv_dimension_numbers(params)
    groups = int(params.get("feature_group_count", 1) or 1)
    batch_groups = int(params.get("batch_group_count", 1) or 1)
    slots: list[Slot] = []
    rhs = ctx.in_shapes[1]
    # XLA's partitioner gathers the batch of a grouped conv with several channels per group
    if batch_groups == 1 and (groups == 1 or rhs[rhs_spec[1]] == 1):
        slots.append(Slot("shard", ((0, lhs_spec[0]), (OUT, out_spec[0]))))
    if groups == 1 and batch_groups == 1:
        slots.append(Slot("shard", ((1, rhs_spec[0]), (OUT, out_spec[1]))))
    if groups == 1 and batch_groups == 1:
        slots.append(Slot("reduce", ((0, lhs_spec[1]), (1, rhs_spec[1]))))
    # whole feature groups (their input channels, kernels and outputs), depthwise only
    if groups > 1 and rhs[rhs_spec[1]] == 1:
        where = ((0, lhs_spec[1]), (1, rhs_spec[0]), (OUT, out_spec[1]))
        slots.append(Slot("shard", where, groups=groups))
    # whole batch groups (their lhs "batch", kernels and outputs), depthwise only
    if batch_groups > 1 and ctx.out_shapes[0][out_spec[0]] == 1:
        where = ((0, lhs_spec[0]), (1, rhs_spec[0]), (OUT, out_spec[1]))
        slots.append(Slot("shard", where, groups=batch_groups))
    for k in range(len(lhs_spec) - 2):
        if _pointwise_spatial(params, rhs, rhs_spec, k):
            slots.append(Slot("shard", ((0, lhs_spec[2 + k]), (OUT, out_spec[2 + k]))))
    return slots


def _untouched_dims(params: dict, rank: int) -> list[int]:
    """Dims a window op leaves alone: window 1, stride 1, no padding, no dilation."""
    window = params["window_dimensions"]
    strides = params.get("window_strides") or (1,) * rank
    padding = params.get("padding") or ((0, 0),) * rank
    base = params.get("base_dilation") or (1,) * rank
    dil = params.get("window_dilation") or (1,) * rank
    return [
        d
        for d in range(rank)
        if window[d] == 1
        and strides[d] == 1
        and tuple(padding[d]) == (0, 0)
        and base[d] == 1
        and dil[d] == 1
    ]


@register("reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window")
def window_slots(ctx: NodeContext) -> list[Slot]:
    """Pooling: every untouched dim split on every array operand and the result."""
    rank = len(ctx.out_shapes[0])
    arrays = [i for i, s in enumerate(ctx.in_shapes) if len(s) == rank and not ctx.in_literal[i]]
    return [
        Slot(
            "shard",
            tuple((i, d) for i in arrays) + tuple((OUT - k, d) for k in range(len(ctx.out_shapes))),
        )
        for d in _untouched_dims(ctx.node.params, rank)
    ]


@register("select_and_scatter_add", "select_and_gather_add")
def select_window_slots(ctx: NodeContext) -> list[Slot]:
    """Max pooling's gradient: (source or tangent, operand) -> result, split on the dims
    the window does not touch (the pooled dims need halos and stay whole)."""
    rank = len(ctx.out_shapes[0])
    return [
        Slot("shard", ((0, d), (1, d), (OUT, d)))
        for d in _untouched_dims(ctx.node.params, rank)
        if all(len(s) == rank for s in ctx.in_shapes[:2])
    ]


@register("rev")
def rev_slots(ctx: NodeContext) -> list[Slot]:
    """``rev`` (a kernel flipped for the input gradient of a conv): every dim it does not
    reverse is split on the operand and the result alike; reversed dims stay whole (a
    reversed split dim would swap shards between devices)."""
    flipped = set(ctx.node.params["dimensions"])
    return [
        Slot("shard", ((0, d), (OUT, d))) for d in range(len(ctx.out_shapes[0])) if d not in flipped
    ]
