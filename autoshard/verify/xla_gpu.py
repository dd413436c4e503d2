"""XLA:GPU's collective rewrites, applied to a plan's predicted collectives (jax-free).

A plan predicts the collectives XLA's SPMD partitioner emits (``plan.predicted_collectives``,
checked against XLA:CPU). XLA:GPU then runs passes XLA:CPU does not (its
``collective-optimizations`` pipeline, ``gpu_compiler.cc``) that change what is moved,
not only how it is batched:

* **AllReduceFolder**: ``all-reduce(all-reduce(x, A), B)`` -> ``all-reduce(x, A + B)``.
  The partitioner reduces a sum over dims split on different axes one group at a time
  (``reduce_first`` in :func:`autoshard.intra.cost.consumers.reshard_to_consumers`: an all-reduce
  over model, then one over data, of the same buffer); XLA:GPU folds them into one
  all-reduce over both (gpt-1.3b auto 2x4: ``ln_f``'s gradient, 8,192 B moved once, not
  twice). A reduce-scatter the partitioner makes is an all-reduce and a dynamic-slice, so
  an all-reduce over A followed by a reduce-scatter over B of the same buffer folds the
  same way, into one all-reduce over A + B whose result is sliced 1/|B|; that slice is no
  reduce-scatter of the folded groups, so ReduceScatterCreator leaves it (gpt-6.7b zero2
  2x8: ``ln_f``'s gradient, 16,384 B over model, then over data, is one all-reduce over
  both on the H100).
* **AllReduceReassociate**: ``add(all-reduce(a), all-reduce(b))`` ->
  ``all-reduce(add(a, b))`` where both all-reduces have the same groups and shape and the
  add is each one's only user (chains included). gpt-1.3b megatron 2x4: the tied
  embedding's two gradients (the LM head's dot and the lookup's scatter-add, each
  ``[51200/4, 2048]`` partial over data) are added before one all-reduce of 104,857,600 B
  instead of two. XLA looks through a chain of reshapes between an all-reduce and the add
  (each with one user); the program's reshapes, squeezes, expand_dims and sums over
  size-1 dims only are such a chain. BatchNorm's backward adds the mean's two cotangents
  that way (each summed over the batch, reshaped to ``[1, 1, 1, C]`` and summed back):
  wresnet-1b dp 2x4 moves one all-reduce fewer per BatchNorm, 53 in all, on the H100.

The combiners (tuples, concatenation) only batch collectives; the verifier reads them
one value at a time (:mod:`autoshard.verify.collectives`), so they need no rewrite here.

:func:`xla_gpu_collectives` recomputes each value's collectives the way
:func:`autoshard.intra.problem.predict.collectives_by_value` does (from the plan's specs and the
program's graph), finds the two patterns, and returns the plan's predicted collectives with
each rewrite applied where the collectives it removes are in the prediction, with one note
per rewrite. ``verify_plan`` compares against these on a GPU target.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from autoshard.hardware.mesh import uniform_mesh
from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.cost.resharding import DEFAULT_COST_OPTIONS
from autoshard.intra.problem.predict import dot_batch_dims, reduce_steps
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Collective, ShardingSpec

_ADDS = ("add", "add_any")
_RESHAPES = ("reshape", "squeeze")


@dataclass(frozen=True)
class GpuPrediction:
    """The plan's predicted collectives after XLA:GPU's rewrites, and what was rewritten."""

    collectives: tuple[Collective, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Specs:  # the two fields of a Strategy that reduce_steps reads
    input_specs: tuple
    output_specs: tuple


def _values(graph, plan: ParallelPlan) -> dict[int, tuple[Collective, ...]]:
    """tensor id -> the collectives that reshard it for its consumers (as predicted)."""
    import numpy as np

    specs = plan.specs_by_tensor(graph.inputs)
    mesh = uniform_mesh(plan.mesh.shape, plan.mesh.axis_names, 1e-6, 1e-10)
    wants: dict[int, list[ShardingSpec]] = {}
    for node in graph.nodes:
        for k, tid in enumerate(node.inputs):
            src = specs.get(tid)
            want = plan.operand_specs.get(node.index, {}).get(k, src)
            if src is not None and want is not None and want != src:
                wants.setdefault(tid, [])
                if want not in wants[tid]:
                    wants[tid].append(want)
    out = {}
    for tid, dsts in wants.items():
        t = graph.tensors[tid]
        steps, batch = (), ()
        if t.producer is not None:
            node = graph.nodes[t.producer]
            operand = None
            if node.inputs:
                first = specs.get(node.inputs[0])
                operand = plan.operand_specs.get(node.index, {}).get(0, first)
            made = _Specs((operand,), tuple(specs.get(o) for o in node.outputs))
            steps = reduce_steps(node, made) if operand is not None else ()
            batch = dot_batch_dims(node)
        r = reshard_to_consumers(
            specs[tid],
            dsts,
            t.shape,
            np.dtype(t.dtype).itemsize,
            mesh,
            DEFAULT_COST_OPTIONS,
            reduce_first=steps,
            batch_dims=batch,
        )
        out[tid] = tuple(r.collectives)
    return out


def _name(graph, tid: int) -> str:
    """A value in words: its pytree path, else the op that makes it."""
    t = graph.tensors[tid]
    if t.path:
        return t.path
    if t.producer is None:
        return f"tensor {tid}"
    node = graph.nodes[t.producer]
    return f"{node.primitive} in {node.module_path or '?'} (tensor {tid})"


def _folded(cols: tuple[Collective, ...], axis_order) -> tuple[Collective, ...] | None:
    """``cols`` with each run of all-reduces of one buffer folded into one, a reduce-scatter
    (an all-reduce and a slice) that follows included (None: no run)."""
    out: list[Collective] = []
    folded = False
    for c in cols:
        last = out[-1] if out else None
        if (
            last is not None
            and last.kind == "all-reduce"
            and c.kind in ("all-reduce", "reduce-scatter")
            and c.bytes == last.bytes
            and not set(c.axes) & set(last.axes)
        ):
            axes = tuple(a for a in axis_order if a in set(c.axes) | set(last.axes))
            out[-1] = Collective("all-reduce", axes, c.bytes)
            folded = True
        else:
            out.append(c)
    return tuple(out) if folded else None


def _reshape_only(graph, node) -> bool:
    """Whether ``node`` only reshapes its one operand (XLA makes it a reshape)."""
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return False
    if node.primitive in _RESHAPES:  # a reshape that also transposes is no plain reshape
        return node.params.get("dimensions") is None
    shape = graph.tensors[node.inputs[0]].shape
    if node.primitive == "reduce_sum":  # over size-1 dims only: a reshape once simplified
        return all(shape[a] == 1 for a in node.params.get("axes", ()))
    if node.primitive == "broadcast_in_dim":  # adding size-1 dims only (expand_dims)
        return math.prod(graph.tensors[node.outputs[0]].shape) == math.prod(shape)
    return False


def _reduced_source(graph, tid: int, reduced: dict) -> int | None:
    """The all-reduced value ``tid`` is, through a chain of reshapes each read once (as
    XLA's AllReduceReassociate looks through them); None where it is none."""
    while True:
        t = graph.tensors[tid]
        if len(t.consumers) != 1:
            return None
        if tid in reduced:
            return tid
        if t.producer is None or not _reshape_only(graph, graph.nodes[t.producer]):
            return None
        tid = graph.nodes[t.producer].inputs[0]


def xla_gpu_collectives(graph, plan: ParallelPlan) -> GpuPrediction:
    """The collectives XLA:GPU compiles for ``plan`` on ``graph`` (the plan's program):
    its predicted collectives with AllReduceFolder and AllReduceReassociate applied."""
    order = plan.mesh.axis_names
    by_value = _values(graph, plan)
    removed: Counter = Counter()
    added: list[Collective] = []
    notes: list[str] = []
    for tid, cols in by_value.items():
        folded = _folded(cols, order)
        if folded is not None:
            removed.update(c for c in cols if c not in folded)
            added += [c for c in folded if c not in cols]
            by_value[tid] = folded
            path = _name(graph, tid)
            notes.append(
                "AllReduceFolder: "
                + " then ".join(f"{c.kind} over {','.join(c.axes)}" for c in cols)
                + f" of {path} ({cols[0].bytes:,} B) -> one all-reduce"
            )
    # AllReduceReassociate, in program order: an add's output reduced this way is itself an
    # all-reduce's result for the next add of a chain
    reduced: dict[int, Collective] = {}
    specs = plan.specs_by_tensor(graph.inputs)
    for tid, cols in by_value.items():
        src = specs.get(tid)
        if len(cols) == 1 and cols[0].kind == "all-reduce" and src and src.partial_op == "sum":
            reduced[tid] = cols[0]
    for node in graph.nodes:
        if node.primitive not in _ADDS or len(node.inputs) != 2 or len(set(node.inputs)) != 2:
            continue
        sources = [_reduced_source(graph, t, reduced) for t in node.inputs]
        if None in sources or sources[0] == sources[1]:
            continue
        ars = [reduced[t] for t in sources]
        if ars[0] != ars[1]:
            continue
        removed[ars[0]] += 1
        notes.append(
            f"AllReduceReassociate: add({node.module_path or node.index}) of two all-reduces "
            f"over {','.join(ars[0].axes)} ({ars[0].bytes:,} B each) -> one all-reduce of the sum"
        )
        out = node.outputs[0]
        if specs.get(out) is not None and not specs[out].partial:
            reduced[out] = ars[0]
    predicted = Counter(plan.predicted_collectives)
    if any(predicted[c] < n for c, n in removed.items()):
        missing = sorted(f"{c.kind}@{','.join(c.axes)} {c.bytes:,} B" for c in removed)
        return GpuPrediction(
            plan.predicted_collectives,
            (
                "XLA:GPU rewrites not applied: the plan's predicted collectives lack "
                f"some they would remove ({'; '.join(missing)})",
            ),
        )
    left = predicted - removed
    kept = []
    for c in plan.predicted_collectives:  # in the plan's order, less what was removed
        if left[c] > 0:
            kept.append(c)
            left[c] -= 1
    return GpuPrediction(tuple(kept) + tuple(added), tuple(notes))
