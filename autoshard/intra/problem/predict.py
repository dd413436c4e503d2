"""Reading a solved intra-operator problem (jax-free): the plan, and the collectives XLA
will emit for it.

Takes an :class:`autoshard.intra.problem.build.IntraProblem` and a solver's assignment; returns
the :class:`~autoshard.ir.plan.ParallelPlan` with its predicted collectives (each value
resharded once per distinct spec its consumers want) and predicted peak memory.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.cost.reshard_tiles import sliced_dims, slices_again
from autoshard.intra.cost.resharding import DEFAULT_COST_OPTIONS
from autoshard.intra.ilp import Solution
from autoshard.intra.memory.model import predicted_peak_bytes
from autoshard.intra.problem.options import held_forbidden
from autoshard.intra.rules.strategies import Strategy
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.primitives import ELEMENTWISE, SUM_MAX_MIN_REDUCTIONS
from autoshard.ir.spec import Collective, ShardingSpec

if TYPE_CHECKING:
    from autoshard.intra.problem.records import IntraProblem


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def plan_from_solution(
    ip: IntraProblem,
    solution: Solution,
    name: str = "auto",
    notes: tuple[str, ...] = (),
    forbidden: frozenset[str] = frozenset(),
) -> ParallelPlan:
    """The plan of ``solution`` with its predictions. ``forbidden``: collective kinds the
    options forbid; the plan's ``solver["forbidden_held"]`` then lists those its
    reshardings use as the ILP priced them (an all-reduce XLA reads as a reduce-scatter
    counts as the all-reduce), for :func:`autoshard.intra.problem.alpa_passes.checked_forbidden`."""
    graph, mesh = ip.graph, ip.mesh
    choice = solution.strategy
    chosen = [ip.strategies[i][choice[i]] for i in range(len(ip.strategies))]
    input_specs = tuple(chosen[i].output_specs[0] for i in range(ip.num_inputs))
    tensor_specs: dict[int, ShardingSpec] = {}
    names = []
    for node in graph.nodes:
        s = chosen[ip.num_inputs + node.index]
        names.append(s.name)
        for tid, spec in zip(node.outputs, s.output_specs):
            tensor_specs[tid] = spec
    spec_of = dict(zip(graph.inputs, input_specs))
    spec_of.update(tensor_specs)
    output_specs = tuple(spec_of[t] for t in graph.outputs)
    relabelled: set[int] = set()
    by_value = collectives_by_value(ip, choice, relabelled)
    collectives = tuple(c for _, cols in by_value for c in cols)
    solver = json.loads(solution.to_json())
    # seconds of compute per phase under the chosen strategies (offload hides transfers
    # behind the backward's: autoshard.intra.offload.placement)
    by_phase: dict[str, float] = {}
    for node in graph.nodes:
        cost = ip.problem.node_costs[ip.node_of(node.index)][choice[ip.node_of(node.index)]]
        if math.isfinite(cost):
            by_phase[node.phase] = by_phase.get(node.phase, 0.0) + cost
    solver["compute_s_by_phase"] = by_phase
    if forbidden:
        priced = {
            ("all-reduce" if tid in relabelled else c.kind, c.axes)
            for tid, cols in by_value
            for c in cols
        }
        solver["forbidden_held"] = held_forbidden(priced, forbidden)
    operand_specs: dict[int, dict[int, ShardingSpec]] = {}
    for op in ip.operands:
        if op.slot < 0 or op.dst < ip.num_inputs:
            continue
        want = chosen[op.dst].input_specs[op.slot]
        if want is not None and want != spec_of.get(op.tensor):
            operand_specs.setdefault(op.dst - ip.num_inputs, {})[op.slot] = want
    return ParallelPlan(
        name=name,
        mesh=mesh.mesh,
        input_specs=input_specs,
        input_paths=tuple(graph.tensors[t].path for t in graph.inputs),
        output_specs=output_specs,
        tensor_specs=tensor_specs,
        operand_specs=operand_specs,
        node_strategies=tuple(names),
        predicted_collectives=collectives,
        predicted_peak_bytes=predicted_peak_bytes(
            graph, spec_of, mesh, operand_specs, ip.host_tensors
        )
        + ip.staging_bytes,
        objective=solution.objective,
        solver=solver,
        notes=notes,
    )


def predicted_collectives(ip: IntraProblem, choice) -> tuple[Collective, ...]:
    """The collectives XLA will emit for the plan ``choice``: every value is resharded
    once per distinct spec its consumers want (:func:`autoshard.intra.cost.consumers.reshard_to_consumers`),
    in program order of first use."""
    return tuple(c for _, cols in collectives_by_value(ip, choice) for c in cols)


def collectives_by_value(
    ip: IntraProblem, choice, relabelled: set[int] | None = None
) -> list[tuple[int, tuple[Collective, ...]]]:
    """:func:`predicted_collectives` per resharded value: (tensor id, its collectives), in
    program order of first use (``benchmarks/studies/collectives_by_op.py`` groups them by op).
    ``relabelled``: a set that receives the values whose all-reduce (as the ILP priced it)
    is predicted as the reduce-scatter XLA makes of it, being sliced after."""
    graph = ip.graph
    source: dict[int, ShardingSpec] = {}
    steps: dict[int, tuple[tuple[str, ...], ...]] = {}
    batch: dict[int, tuple[int, ...]] = {}
    targets: dict[int, list[ShardingSpec]] = {}
    for op in ip.operands:
        if op.slot < 0:
            continue
        src_s = ip.strategies[op.src][choice[op.src]]
        dst_s = ip.strategies[op.dst][choice[op.dst]]
        k = (
            0
            if op.src < ip.num_inputs
            else graph.nodes[op.src - ip.num_inputs].outputs.index(op.tensor)
        )
        b = dst_s.input_specs[op.slot]
        if b is None:
            continue
        source[op.tensor] = src_s.output_specs[k]
        if op.src >= ip.num_inputs:
            steps[op.tensor] = reduce_steps(graph.nodes[op.src - ip.num_inputs], src_s)
            batch[op.tensor] = dot_batch_dims(graph.nodes[op.src - ip.num_inputs])
        wants = targets.setdefault(op.tensor, [])
        if b not in wants:
            wants.append(b)
    out: list[tuple[int, tuple[Collective, ...]]] = []
    readers: dict[int, list] = {}
    for op in ip.operands:
        if op.slot >= 0:
            readers.setdefault(op.tensor, []).append(op)
    for tid, wants in targets.items():
        t = graph.tensors[tid]
        r = reshard_to_consumers(
            source[tid],
            wants,
            t.shape,
            _itemsize(t.dtype),
            ip.mesh,
            DEFAULT_COST_OPTIONS,
            reduce_first=steps.get(tid, ()),
            batch_dims=batch.get(tid, ()),
        )
        cols = tuple(r.collectives)
        if _scatter_folded_into_a_slice(ip, choice, tid, wants, cols, readers):
            cols = cols[:-1] + (Collective("all-reduce", cols[-1].axes, cols[-1].bytes),)
        if _sliced_after_all_reduce(ip, choice, tid, source[tid], cols, readers):
            cols = (Collective("reduce-scatter", cols[0].axes, cols[0].bytes),)
            if relabelled is not None:
                relabelled.add(tid)
        out.append((tid, cols))
    return out


# ops that only relabel a value's elements (XLA: a bitcast, a copy or a convert, which
# its partitioner's dynamic-slice passes through); a gather qualifies when it keeps every
# element (``x[..., 0]`` of a trailing dim of one: a squeeze)
_RELABELS = {"reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "gather"}
# ops ahead of which XLA moves a slice of their one result on a chain of values each read
# once (_sliced_after_all_reduce); the ILP prices such a chain of one op
# (autoshard.intra.problem.value_edges.SliceChain)
SLICE_PASSES = frozenset(_RELABELS | {"transpose"})
RELABELS = frozenset(_RELABELS)


def _sliced_after_all_reduce(ip: IntraProblem, choice, tid: int, src, cols, readers) -> bool:
    """Is ``tid``'s one predicted all-reduce (over axes A) read only where it is sliced
    over A, directly or through ops that relabel its elements, computed as they come, or
    through a chain of transposes and such ops on which every value has one reader?

    XLA compiles that all-reduce and the later local slice as one all-reduce whose every
    use is a dynamic-slice keeping each device's 1/|A| block: GSPMD's reduce-scatter
    (the pattern XLA:GPU's ReduceScatterCreator pass turns into one; on XLA:CPU the
    verifier reads it as one, :mod:`autoshard.verify.xla_cpu`), with the all-reduce's
    bytes. The strict ``megatron`` makes it where the loss splits the batch over the
    tensor-parallel axis: the target logit of the cross-entropy is all-reduced over that
    axis, squeezed, and sliced over it by the loss. XLA moves the slice ahead of a
    transpose too (moe-1.3b megatron 2x4: the gradient of the experts' input, partial over
    model, is all-reduced for a transpose whose one reader, a dot, splits the expert dim
    over model). Values that reach several readers through a transpose may be sliced on
    different dims of the reduced buffer, which XLA then needs whole, so a transpose
    passes the slice only on a chain where every value has one reader. ``src``: the
    value's spec as made (partial over A); ``readers``: tensor -> the operands reading it
    (slot >= 0)."""
    if len(cols) != 1 or cols[0].kind != "all-reduce" or set(cols[0].axes) != set(src.partial):
        return False
    axes = tuple(cols[0].axes)
    graph, nin = ip.graph, ip.num_inputs
    outputs = set(graph.outputs)
    todo, seen, sliced, transposed = [(tid, tuple(src.dims))], set(), False, False
    while todo:
        t, dims = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in outputs:
            return False
        for op in readers.get(t, ()):
            want = ip.strategies[op.dst][choice[op.dst]].input_specs[op.slot]
            if want is None or want.partial or len(want.dims) != len(dims):
                return False
            grown = [j for j, (w, d) in enumerate(zip(want.dims, dims)) if w != d]
            if len(grown) == 1 and want.dims[grown[0]] == dims[grown[0]] + axes:
                sliced = True  # a local slice of one dim over exactly A
                continue
            if grown and _slice_then_permute_over(dims, want, axes, ip.mesh.mesh):
                sliced = True  # XLA's slice-then-permute, the slice over exactly A
                continue
            if grown or op.dst < nin:
                return False
            node = graph.nodes[op.dst - nin]
            if len(node.outputs) != 1:
                return False
            if node.primitive == "transpose":
                transposed = True
            elif not _passes_slice(graph, node, op.slot):
                return False
            out = node.outputs[0]
            if _numel(graph.tensors[out].shape) != _numel(graph.tensors[t].shape):
                return False
            spec = ip.strategies[op.dst][choice[op.dst]].output_specs[0]
            if spec.partial or any(a in axes for d in spec.dims for a in d):
                return False
            todo.append((out, tuple(spec.dims)))
    if transposed and any(len(readers.get(t, ())) != 1 for t in seen):
        return False  # its readers may keep different dims of the reduced buffer
    return sliced


def _scatter_folded_into_a_slice(ip: IntraProblem, choice, tid: int, wants, cols, readers) -> bool:
    """Is ``tid``'s last predicted collective a reduce-scatter whose result is read, as
    it is or through ops that relabel its elements, only where XLA slices it again before
    a permute (:func:`~autoshard.intra.cost.reshard_tiles.slices_then_permutes`)?  XLA then
    all-reduces and makes the two slices one, which the verifier reads as an all-reduce
    (wresnet-tiny auto on 2x4: ``[8]{U:data,model}`` reduced into ``[8@data]``, read
    reshaped as ``[..., 8@model]``)."""
    if not cols or cols[-1].kind != "reduce-scatter" or len(wants) != 1:
        return False
    graph, nin, mesh = ip.graph, ip.num_inputs, ip.mesh.mesh
    outputs = set(graph.outputs)
    todo, seen, sliced = [(tid, wants[0].dims)], set(), False
    while todo:
        t, dims = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in outputs:
            return False
        for op in readers.get(t, ()):
            want = ip.strategies[op.dst][choice[op.dst]].input_specs[op.slot]
            if want is None or want.partial or len(want.dims) != len(dims):
                return False
            if want.dims != tuple(dims):
                if not slices_again(ShardingSpec(tuple(dims)), want, mesh):
                    return False
                sliced = True
                continue
            if op.dst < nin:
                return False
            node = graph.nodes[op.dst - nin]
            if not _relabels(graph, node) or op.slot != 0 or len(node.outputs) != 1:
                return False
            spec = ip.strategies[op.dst][choice[op.dst]].output_specs[0]
            if spec.partial:
                return False
            todo.append((node.outputs[0], tuple(spec.dims)))
    return sliced


def _relabels(graph, node) -> bool:
    """Does ``node`` only relabel its operand's elements: one of :data:`RELABELS`, or a sum
    over dims of size 1 (XLA makes it a bitcast; wresnet-tiny zero3 on 2x4: a BatchNorm
    scale's gradient reshaped to ``[1, 1, 1, 16]`` and summed back to ``[16]``)?"""
    if node.primitive in _RELABELS:
        return True
    if node.primitive != "reduce_sum" or len(node.inputs) != 1 or len(node.outputs) != 1:
        return False
    return _numel(graph.tensors[node.inputs[0]].shape) == _numel(
        graph.tensors[node.outputs[0]].shape
    )


def _passes_slice(graph, node, slot: int) -> bool:
    """Does XLA move a slice of ``node``'s result onto its operand ``slot``: an op that
    relabels elements (operand 0), or an elementwise op whose other operands are scalars
    (the learning rate times a gradient)?"""
    if node.primitive in _RELABELS:
        return slot == 0
    if node.primitive not in ELEMENTWISE:
        return False
    return all(not graph.tensors[t].shape for k, t in enumerate(node.inputs) if k != slot)


def _slice_then_permute_over(dims, want: ShardingSpec, axes, mesh) -> bool:
    """Is ``dims`` -> ``want`` XLA's slice-then-permute whose slice adds exactly ``axes``
    to one dim (:func:`~autoshard.intra.cost.reshard_tiles.sliced_dims`)?"""
    cut = sliced_dims(ShardingSpec(tuple(dims)), ShardingSpec(want.dims), mesh)
    if cut is None:
        return False
    grown = [j for j, (c, d) in enumerate(zip(cut, dims)) if c != d]
    return len(grown) == 1 and cut[grown[0]] == tuple(dims[grown[0]]) + tuple(axes)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dot_batch_dims(node) -> tuple[int, ...]:
    """The batch dims of a ``dot_general``'s result (its leading dims), () for any other
    op: :func:`autoshard.intra.cost.resharding.reshard` resolves such a partial sum XLA:CPU's way."""
    if node.primitive != "dot_general":
        return ()
    return tuple(range(len(node.params["dimension_numbers"][1][0])))


# ops whose partial sums XLA reduces where they are made, before any new split
REDUCED_IN_PLACE = SUM_MAX_MIN_REDUCTIONS | {"scatter-add", "scatter_add"}


def reduce_steps(node, strategy: Strategy) -> tuple[tuple[str, ...], ...]:
    """For a reduce or scatter-add whose output is partial: its partial axes, reduced
    where the op makes them; for a reduce grouped by the summed dim of the operand they
    split, last dim first (the order XLA all-reduces them in, see
    :func:`autoshard.intra.cost.consumers.reshard_to_consumers`); otherwise ()."""
    out = strategy.output_specs[0] if strategy.output_specs else None
    operand = strategy.input_specs[0] if strategy.input_specs else None
    if node.primitive == "dot_general" and out is not None and out.partial and operand:
        return _dot_reduce_steps(node, operand, out)
    if node.primitive not in REDUCED_IN_PLACE or out is None or not out.partial:
        return ()
    groups = ()
    if node.primitive in SUM_MAX_MIN_REDUCTIONS and operand is not None:
        groups = tuple(
            g
            for g in (tuple(a for a in d if a in out.partial) for d in reversed(operand.dims))
            if g
        )
    return groups or (tuple(out.partial),)  # a scatter-add: all at once, where it is made


def _dot_reduce_steps(node, lhs, out) -> tuple[tuple[str, ...], ...]:
    """A dot whose contracting dims are split over different mesh axes: XLA's partitioner
    sums one contracting dim's axes at a time, last dim first, as for a reduce (moe-1.3b's
    gate kernel gradient ``GSM,GSE->ME`` with G split over model and S over data: an
    all-reduce over data, then one over model, not one over both). () where one group
    (or none) is summed: the dot's partial sum is resolved like any other."""
    contracting = node.params["dimension_numbers"][0][0]
    groups = tuple(
        g
        for g in (tuple(a for a in lhs.dims[d] if a in out.partial) for d in reversed(contracting))
        if g
    )
    return groups if len(groups) > 1 else ()
