"""Shaping the intra-operator problem before a solver sees it (jax-free).

Takes the strategies :func:`autoshard.intra.problem.build_problem` listed and writes, in
place, what makes the problem small and its answer unique:

* :func:`follower_ties` -- a light op with one array operand takes the strategy that
  matches its operand's (exact: the op has no other way to avoid a resharding);
* :func:`layer_ties` -- every node of a layer identical to an earlier one (same primitives
  and shapes) shares that layer's variables, and so do its parameters;
* :func:`apply_alpa_options` -- Alpa's ``AutoShardingOption`` knobs as forbidden strategies;
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
    ``allow_mixed_mesh_shape=False`` (a dim split over several mesh axes) and
    ``force_batch_dim_to_mesh_axis`` (a data input whose batch dim is not split over that
    axis). Raises ValueError, naming the input, where no strategy is left."""
    axis = options.force_batch_dim_to_mesh_axis
    names = mesh.mesh.axis_names
    if axis is not None and axis not in names:
        raise ValueError(
            f"force_batch_dim_to_mesh_axis={axis!r} is not an axis of the mesh {mesh.mesh}; "
            f"choose one of {list(names)}"
        )

    def mixed(s) -> bool:
        specs = [*s.input_specs, *s.output_specs]
        return any(len(d) > 1 for spec in specs if spec is not None for d in spec.dims)

    for i, strats in enumerate(strategies):
        costs = list(node_costs[i])
        if not options.allow_mixed_mesh_shape:
            costs = [math.inf if mixed(s) else c for s, c in zip(strats, costs, strict=True)]
        if axis is not None and i < n_in:
            t = graph.tensors[graph.inputs[i]]
            if t.kind == "data" and t.shape:
                size = mesh.mesh.shape[names.index(axis)]
                if t.shape[0] % size:
                    raise ValueError(
                        f"force_batch_dim_to_mesh_axis={axis!r}: the batch dim of data input "
                        f"{i} (shape {t.shape}) is not divisible by the {size} devices of axis "
                        f"{axis!r}; use a batch that is a multiple of {size}, or another axis"
                    )
                costs = [
                    c if axis in s.output_specs[0].dims[0] else math.inf
                    for s, c in zip(strats, costs, strict=True)
                ]
        if costs != list(node_costs[i]):
            if all(math.isinf(c) for c in costs):
                what = f"input {i}" if i < n_in else f"node {graph.nodes[i - n_in].primitive}"
                raise ValueError(
                    f"the intra-op options leave {what} no strategy (force_batch_dim_to_mesh_axis"
                    f"={axis!r}, allow_mixed_mesh_shape={options.allow_mixed_mesh_shape}); a "
                    f"pinned spec may contradict them"
                )
            node_costs[i] = tuple(costs)


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


def layer_ties(graph, strategies, n_in, ties) -> None:
    by_layer: dict[str, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.index)
    signature_owner: dict[tuple, str] = {}
    rep_of: dict[str, str] = {}
    for layer in graph.layers:
        idx = by_layer.get(layer, [])
        sig = tuple(
            (
                graph.nodes[i].primitive,
                graph.nodes[i].phase,
                tuple(graph.tensors[t].shape for t in graph.nodes[i].inputs),
                tuple(graph.tensors[t].shape for t in graph.nodes[i].outputs),
            )
            for i in idx
        )
        owner = signature_owner.setdefault(sig, layer)
        if owner == layer:
            continue
        rep_of[layer] = owner
        for a, b in zip(by_layer[owner], idx):
            me = n_in + b
            if ties[me] is None and len(strategies[me]) > 1:
                ties[me] = Tie(n_in + a, tuple(range(len(strategies[me]))))
    # parameters and optimizer state of a shared layer follow the first layer's
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
