"""Shaping the intra-operator problem before a solver sees it (jax-free).

Takes the strategies :func:`autoshard.intra.problem.build.build_problem` listed and writes, in
place, what makes the problem small and its answer unique:

* :func:`follower_ties` -- a light op with one array operand takes the strategy that
  matches its operand's (exact: the op has no other way to avoid a resharding);
* :func:`layer_ties` -- every node of a layer identical to an earlier one (same primitives
  and shapes) shares that layer's variables, and so do its parameters (optionally but the
  first and last of each run);
* :func:`apply_alpa_options` -- Alpa's ``AutoShardingOption`` knobs as forbidden strategies;
* :func:`shard_largest_dims` -- ``shard_largest_dim``: every operator keeps only the
  strategies that split the largest dimension of its output (Alpa's heuristic baseline);
* :func:`keep_data_parallel` -- ``data_parallel_axes``: reshardings that move data off
  those axes forbidden, edge by edge;
* :func:`keep_weight_layout` -- ``keep_weight_layout``: no resharding of a weight, its
  gradient on its way into the update, or its optimizer state, edge by edge;
* :func:`preferences` -- the tie-break between equal-cost plans.
"""

from __future__ import annotations

import math
import re

from autoshard.intra.ilp import Tie
from autoshard.ir.spec import ShardingSpec

NOT_FOLLOWERS = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "gather",
        "scatter-add",
        "scatter_add",
        "iota",
        "broadcast_in_dim",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
    }
)


def apply_alpa_options(graph, strategies, node_costs, n_in, mesh, options) -> None:
    """Forbid (infinite cost) the strategies that ``options``' Alpa knobs rule out:
    ``allow_mixed_mesh_shape=False`` (a dim split over several mesh axes),
    ``force_batch_dim_to_mesh_axis`` (:func:`force_batch_dim`) and ``data_parallel_axes``
    (a data input whose batch dim is not split over all those axes). Raises ValueError,
    naming the input or op and what would work, where an axis is unknown, a batch does
    not divide or no strategy is left."""
    names = mesh.mesh.axis_names
    axis = options.force_batch_dim_to_mesh_axis
    if axis is not None and axis not in names:
        raise ValueError(
            f"force_batch_dim_to_mesh_axis={axis!r} is not an axis of the mesh {mesh.mesh}; "
            f"choose one of {list(names)}"
        )
    unknown = [a for a in options.data_parallel_axes if a not in names]
    if unknown:
        raise ValueError(
            f"data_parallel_axes={options.data_parallel_axes!r}: {unknown} not axes of the "
            f"mesh {mesh.mesh}; choose among {list(names)}"
        )
    forced = force_batch_dim(graph, n_in, mesh.mesh, axis) if axis is not None else {}
    dp_axes = options.data_parallel_axes
    dp_size = mesh.mesh.size(dp_axes) if dp_axes else 1

    def mixed(s) -> bool:
        specs = [*s.input_specs, *s.output_specs]
        return any(len(d) > 1 for spec in specs if spec is not None for d in spec.dims)

    for i, strats in enumerate(strategies):
        costs = list(node_costs[i])
        if not options.allow_mixed_mesh_shape:
            costs = [math.inf if mixed(s) else c for s, c in zip(strats, costs, strict=True)]
        if i in forced:
            d = forced[i]
            costs = [
                c if _split_only_over(s.output_specs[0].dims[d], axis, mesh.mesh) else math.inf
                for s, c in zip(strats, costs, strict=True)
            ]  # fmt: skip
        t = graph.tensors[graph.inputs[i]] if i < n_in else None
        if dp_axes and t is not None and t.kind == "data" and t.shape:
            if t.shape[0] % dp_size:
                where = f"axis {dp_axes[0]!r}" if len(dp_axes) == 1 else f"axes {dp_axes}"
                raise ValueError(
                    f"data_parallel_axes={dp_axes!r}: the batch dim of data input {i} (shape "
                    f"{t.shape}) is not divisible by the {dp_size} devices of {where}; use a "
                    f"batch that is a multiple of {dp_size}, or other axes"
                )
            costs = [
                c if _batch_dim_kept(s.output_specs[0].dims[0], dp_axes, dp_size) else math.inf
                for s, c in zip(strats, costs, strict=True)
            ]
        if costs != list(node_costs[i]):
            if all(math.isinf(c) for c in costs):
                what = f"input {i}" if i < n_in else f"node {graph.nodes[i - n_in].primitive}"
                raise ValueError(
                    f"the intra-op options leave {what} no strategy (force_batch_dim_to_mesh_axis"
                    f"={axis!r}, data_parallel_axes={options.data_parallel_axes!r}, "
                    f"allow_mixed_mesh_shape={options.allow_mixed_mesh_shape}); a pinned spec "
                    "may contradict them"
                )
            node_costs[i] = tuple(costs)


def force_batch_dim(graph, n_in, mesh, axis) -> dict[int, int]:
    """``force_batch_dim_to_mesh_axis=axis``, Alpa's ``force_batch_dim_to_mesh_dim``: the
    problem nodes whose strategies must split their output's batch dim over ``axis`` and
    over no other axis (on an axis of one device: leave it unsplit), as node -> that dim.

    Alpa's rule: the batch-dim map of the whole program
    (:func:`autoshard.intra.problem.batch_dims.batch_dim_map`), and the strategies of the
    ops it filters -- the program inputs (Alpa's parameters) with a batch dim, and the
    dots and convolutions (here also the fused attention, two batched dots in Alpa's
    HLO) whose result has one -- kept where their *output* splits that dim so. Other ops
    with a batch dim are not filtered (in Alpa they follow an operand; in autoshard a
    light op takes its operand's layout, and any other op pays for a resharding to or
    from the filtered ones). Raises ValueError where ``axis`` does not divide the batch
    dim of such an input or op (Alpa refuses it too)."""
    from autoshard.intra.problem.batch_dims import FILTERED, batch_dim_map

    batch = batch_dim_map(graph)
    size = mesh.size(axis)
    out: dict[int, int] = {}
    for i in range(n_in + len(graph.nodes)):
        if i < n_in:
            tid, what = graph.inputs[i], f"input {i}"
        else:
            node = graph.nodes[i - n_in]
            if node.primitive not in FILTERED or not node.outputs:
                continue
            tid, what = node.outputs[0], f"{node.primitive} (node {node.index})"
        if tid not in batch:
            continue
        d, shape = batch[tid], graph.tensors[tid].shape
        if shape[d] % size:
            kind = graph.tensors[tid].kind
            raise ValueError(
                f"force_batch_dim_to_mesh_axis={axis!r}: the batch dim (dim {d}) of {kind} "
                f"{what} (shape {shape}) is not divisible by the {size} devices of axis "
                f"{axis!r}; use a batch that is a multiple of {size}, or another axis"
            )
        out[i] = d
    return out


def _split_only_over(dim_axes, axis, mesh) -> bool:
    """Whether a batch dim split over ``dim_axes`` obeys ``force_batch_dim_to_mesh_axis=
    axis``: split over that axis and no other (axes of one device aside); where the axis
    holds one device, not split at all (Alpa: the batch replicated on a mesh dim of size
    1, so that the other dims serve the model)."""
    real = tuple(a for a in dim_axes if mesh.size(a) > 1)
    return real == ((axis,) if mesh.size(axis) > 1 else ())


def _batch_dim_kept(batch_axes, axes, size) -> bool:
    """Whether a data input whose batch dim is split over ``batch_axes`` obeys
    ``data_parallel_axes=axes`` (of ``size`` devices): split over them all; where they
    hold one device, not split at all."""
    if size == 1:
        return not batch_axes
    return set(axes) <= set(batch_axes)


def largest_dim_spec(shape, mesh) -> ShardingSpec:
    """The spec that shards the largest dimension of ``shape`` over ``mesh`` (a
    :class:`~autoshard.ir.spec.Mesh`): the first dim in order of size (the lower index on a
    tie) that the mesh's axes divide, split over all of them together, or -- where only
    some divide it -- over the largest single axis that does; replicated where no dim
    divides (a scalar, sizes smaller than the axes)."""
    axes = tuple(a for a in mesh.axis_names if mesh.size(a) > 1)
    choices = [axes] if axes else []
    singles = sorted(axes, key=lambda a: (-mesh.size(a), axes.index(a)))
    choices += [(a,) for a in singles if (a,) != axes]
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        for split in choices:
            if shape[d] % mesh.size(split) == 0:
                return ShardingSpec.replicated(len(shape)).with_dim(d, split)
    return ShardingSpec.replicated(len(shape))


def shard_largest_dims(graph, strategies, node_costs, n_in, mesh, ties) -> tuple[str, ...]:
    """``shard_largest_dim``: forbid (infinite cost) every strategy of an operator whose
    output is not :func:`largest_dim_spec` of that output's shape -- the heuristic Alpa's
    intra-op ablation compares with. Applies to the operators that choose (tie roots):
    followers take their operand's layout and identical layers their twin's, as in every
    plan. An operator none of whose strategies gives that spec keeps its strategies (the
    ILP places it); the returned notes count those, so the plan says so."""
    kept: list[str] = []
    checked = 0
    for i in range(n_in, len(strategies)):
        node = graph.nodes[i - n_in]
        if ties[i] is not None or not node.outputs:
            continue
        shape = graph.tensors[node.outputs[0]].shape
        want = largest_dim_spec(shape, mesh)
        if want.is_replicated:
            continue  # nothing to split: a scalar, or sizes no axis divides
        checked += 1
        costs = [
            c if s.output_specs[0] == want else math.inf
            for s, c in zip(strategies[i], node_costs[i], strict=True)
        ]
        if all(math.isinf(c) for c in costs):
            kept.append(f"{node.primitive} {tuple(shape)}")
            continue
        node_costs[i] = tuple(costs)
    if not kept:
        return (f"heuristic: {checked} operators split the largest dim of their output",)
    listed = ", ".join(sorted(set(kept))[:5])
    return (
        f"heuristic: {checked - len(kept)} of {checked} operators split the largest dim of "
        f"their output; {len(kept)} have no strategy that does (the ILP placed them: {listed})",
    )


def keep_data_parallel(matrix, src_strategies, k, dst_strategies, slot, axes):
    """``matrix`` (output ``k`` of the source strategies into operand ``slot`` of the
    destination strategies) with every pair that moves a split off one of ``axes``
    forbidden (``math.inf``): a dim split over such an axis must stay split over it.
    Partial sums may still be reduced over them (the gradient all-reduces of data
    parallelism) and replicated dims may be sliced. ``axes`` empty: ``matrix`` as is."""
    if not axes:
        return matrix
    forced = set(axes)

    def moves(a: ShardingSpec, b: ShardingSpec | None) -> bool:
        if b is None:
            return False
        return any(x in forced and x not in db for da, db in zip(a.dims, b.dims) for x in da)

    wants = [s.input_specs[slot] for s in dst_strategies]
    return tuple(
        tuple(
            math.inf if moves(s.output_specs[k], b) else c for b, c in zip(wants, row, strict=True)
        )
        for s, row in zip(src_strategies, matrix, strict=True)
    )


def keep_weight_layout(matrix, src_strategies, k, dst_strategies, slot, exact, reduce_over):
    """``matrix`` (as :func:`keep_data_parallel`'s) with every pair forbidden (``math.inf``)
    that reshards a weight: with ``exact`` (the source is a parameter or optimizer-state
    input) the use must read the source's spec itself; otherwise (the use is an operand
    of the optimizer update) it must read the source's dims, and a partial source may be
    partial only over ``reduce_over`` (the data-parallel axes: the gradient all-reduce),
    which the use reads reduced."""

    def moves(a: ShardingSpec, b: ShardingSpec | None) -> bool:
        if b is None:
            return False
        if exact:
            return a != b
        return a.dims != b.dims or bool(b.partial) or not set(a.partial) <= set(reduce_over)

    wants = [s.input_specs[slot] for s in dst_strategies]
    return tuple(
        tuple(
            math.inf if moves(s.output_specs[k], b) else c for b, c in zip(wants, row, strict=True)
        )
        for s, row in zip(src_strategies, matrix, strict=True)
    )


def preferences(graph, strategies, n_in, mesh) -> tuple[tuple[float, ...], ...]:
    """The tie-break between equal-cost plans (:class:`ShardingProblem` ``preferences``):
    a node's strategies ranked by the bytes per device of its outputs, then by their
    order. So equal-cost plans keep data split and state sharded (Alpa, too, adds a small
    penalty for replicated parameters), and resolve the same way on every solver."""
    ranked: dict[int, tuple[float, ...]] = {}  # by strategy tuple: identical layers share
    out = []
    for i, strats in enumerate(strategies):
        tids = (graph.inputs[i],) if i < n_in else graph.nodes[i - n_in].outputs
        key = (id(strats), tuple(graph.tensors[t].nbytes for t in tids))
        if key not in ranked:
            held = [
                sum(
                    graph.tensors[t].nbytes * spec.shard_fraction(mesh.mesh)
                    for t, spec in zip(tids, s.output_specs, strict=False)
                    if spec is not None
                )
                for s in strats
            ]
            order = sorted(range(len(strats)), key=lambda p: (round(held[p]), p))
            rank = [0.0] * len(strats)
            for r, p in enumerate(order):
                rank[p] = float(r)
            ranked[key] = tuple(rank)
        out.append(ranked[key])
    return tuple(out)


def follower_ties(graph, strategies, producer, n_in, ties, follow_deepest=False) -> None:
    for node in graph.nodes:
        if node.primitive in NOT_FOLLOWERS or len(node.outputs) != 1:
            continue
        out_shape = graph.tensors[node.outputs[0]].shape
        arrays = [
            (k, t) for k, t in enumerate(node.inputs) if t in producer and graph.tensors[t].shape
        ]
        if not arrays:
            continue
        if len(arrays) > 1:
            # only operands broadcast along size-1 dims besides one full-shape operand
            full = [(k, t) for k, t in arrays if graph.tensors[t].shape == out_shape]
            # (with follow_deepest: Alpa's rule, the latest-made of several full operands)
            if not full or (len(full) > 1 and not follow_deepest):
                continue
            arrays = [max(full, key=lambda kt: producer[kt[1]][0])]
        slot, tid = arrays[0]
        src, k = producer[tid]
        if any(s.output_specs[k].partial for s in strategies[src]):
            continue  # the reduction's target (all-reduce or reduce-scatter) stays a choice
        me = n_in + node.index
        by_input: dict[ShardingSpec, int] = {}
        for q, s in enumerate(strategies[me]):
            spec = s.input_specs[slot]
            if spec is not None:
                by_input.setdefault(spec, q)
        mapping = []
        for p in range(len(strategies[src])):
            want = strategies[src][p].output_specs[k]
            q = by_input.get(want)
            if q is None:
                break
            mapping.append(q)
        else:
            ties[me] = Tie(src, tuple(mapping))


_LAYER_KEY = re.compile(r"\['([^']+)'\]")


def layer_ties(graph, strategies, n_in, ties, period: int = 2, ends: bool = False) -> None:
    """Tie identical layers, ``period`` at a time: the k-th layer of a run of layers with
    the same equations (primitives, phases, shapes) and the same pinned parameter specs
    takes the variables of the (k mod ``period``)-th, and so do its parameters.

    Period 1 ties every identical layer to the first: a plan where all layers agree.
    Period 2 also reaches the plans that alternate (Alpa's column, row, column, row split
    of an MLP) and still contains every period-1 plan (both representatives agree), so its
    optimum is never worse; the problem grows by ``period`` layers, not with depth.
    ``ends``: the first and the last layer of every run stay untied (the first reads what
    precedes the run, the last feeds what follows it) and the layers between them are
    tied ``period`` at a time among themselves: ``period + 2`` representatives whatever
    the depth, and every plan of the plain tying is still reachable.
    Layers whose pinned parameters differ (a baseline's alternating pins) are never tied.
    """
    by_layer: dict[str, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.index)
    params_of: dict[str, list[tuple[str, int]]] = {}  # layer -> (path within, input pos)
    for pos, tid in enumerate(graph.inputs):
        path = graph.tensors[tid].path
        for key in dict.fromkeys(_LAYER_KEY.findall(path)):
            params_of.setdefault(key, []).append((path.replace(f"['{key}']", "['*']"), pos))
    runs: dict[tuple, list[str]] = {}  # signature -> its layers, in order
    for layer in graph.layers:
        idx = by_layer.get(layer, [])
        pins = tuple(
            (within, strategies[pos][0].output_specs[0] if len(strategies[pos]) == 1 else None)
            for within, pos in sorted(params_of.get(layer, []))
        )
        sig = (
            pins,
            tuple(
                (
                    graph.nodes[i].primitive,
                    graph.nodes[i].phase,
                    tuple(graph.tensors[t].shape for t in graph.nodes[i].inputs),
                    tuple(graph.tensors[t].shape for t in graph.nodes[i].outputs),
                )
                for i in idx
            ),
        )
        runs.setdefault(sig, []).append(layer)
    rep_of: dict[str, str] = {}
    for run in runs.values():
        tied = run[1:-1] if ends else run
        for k in range(period, len(tied)):
            rep_of[tied[k]] = tied[k % period]
    for layer, owner in rep_of.items():
        for a, b in zip(by_layer[owner], by_layer[layer]):
            me = n_in + b
            if ties[me] is None and len(strategies[me]) > 1:
                ties[me] = Tie(n_in + a, tuple(range(len(strategies[me]))))
    # parameters and optimizer state of a shared layer follow its representative's
    path_index = {graph.tensors[t].path: pos for pos, t in enumerate(graph.inputs)}
    for pos, tid in enumerate(graph.inputs):
        path = graph.tensors[tid].path
        keys = _LAYER_KEY.findall(path)
        layer = next((k for k in keys if k in rep_of), None)
        if layer is None:
            continue
        twin = path_index.get(path.replace(f"['{layer}']", f"['{rep_of[layer]}']"))
        if twin is not None and len(strategies[twin]) == len(strategies[pos]) and ties[pos] is None:
            ties[pos] = Tie(twin, tuple(range(len(strategies[pos]))))
