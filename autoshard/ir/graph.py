"""The op graph of a traced step (jax-free).

Takes :class:`autoshard.trace.jaxpr.TraceRecords` and returns a frozen :class:`Graph`: one
:class:`Node` per equation (primitive, input and output tensors, FLOPs, layer, phase,
module path), the tensors with their bytes, kind (param / opt_state / data / const /
literal / intermediate) and liveness (first and last use in program order), the
producer -> consumer edges, and the aliases between state inputs and their updated
outputs.

FLOP rules (``flops_of``; a registry keyed by primitive name):

* ``dot_general``: exactly 2 x batch x lhs-free x rhs-free x contracting sizes.
* elementwise arithmetic, comparisons and transcendentals: 1 per output element
  (``exp`` counts 1, not a weighted cost; ``integer_pow`` with exponent y counts
  max(|y| - 1, 1) multiplications per element; jax 0.11's ``one_minus_square``, 1 - x^2,
  counts 2, as the square and subtraction earlier JAX wrote for it; ``polynomial`` of
  degree n counts Horner's 2n).  Elementwise by kind, not by name: a primitive with no
  rule of its own that is elementwise (:func:`autoshard.ir.primitives.is_elementwise`)
  counts 1 per element too, and ``Node.elementwise`` says so to the passes after.
* ``conv_general_dilated``: 2 x output elements x (kernel elements / output features) /
  the product of ``lhs_dilation``: one multiply-add per kernel tap that meets a real
  input element (an input gradient of a strided conv dilates its input with zeros).
* reductions (``reduce_sum``, ``reduce_max``, ...): 1 per input element.
* pooling (``reduce_window_*``): 1 per output element per window tap; max pooling's
  gradient (``select_and_scatter_add``, ``select_and_gather_add``): 2 per pooled element
  per window tap (the comparison that selects and the add).
* ``scatter-add``: 1 per update element; ``cumsum`` and friends: 1 per element.
* fused attention (``attention_fwd[_causal]``, ``attention_bwd[_causal]``, one kernel
  each): forward ``4 B H Sq Sk D`` (``QK^T`` and ``PV``, the whole square even when causal,
  as MFU conventions and the unfused graph's two batched dots count it); backward 2.5x
  that, ``10 B H Sq Sk D``: ``dV``, ``dP``, ``dQ``, ``dK`` (8, what the unfused graph's
  backward dots count) plus ``QK^T`` again (2), since a flash backward recomputes the
  scores.  Those 2 are recompute: hardware FLOPs, not model FLOPs
  (:func:`recomputed_flops`, :meth:`Graph.model_flops_where`).  The softmax's
  elementwise work (a few FLOPs per score, which the unfused graph counts) is not
  counted, as in MFU conventions.
* data movement and bookkeeping (reshape, transpose, broadcast, gather, slicing,
  concatenate, convert, iota, select_n, copy, stop_gradient): 0.
* anything else: 0, and it is listed in ``Graph.unknown_flops`` so callers can say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoshard.ir.primitives import (
    ALL_REDUCTIONS,
    ATTENTION_BWD,
    ATTENTION_FWD,
    ELEMENTWISE,
    ZERO_FLOP,
    is_elementwise,
)
from autoshard.ir.records import EqnRecord, TensorRecord, TraceRecords

FlopRule = Callable[[EqnRecord, list[TensorRecord], list[TensorRecord]], float]
FLOP_RULES: dict[str, FlopRule] = {}


def register_flops(*names: str):
    def deco(rule: FlopRule) -> FlopRule:
        for name in names:
            FLOP_RULES[name] = rule
        return rule

    return deco


@register_flops("dot_general")
def _dot_flops(eqn, ins, outs) -> float:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins[0].shape, ins[1].shape
    batch = int(np.prod([lhs[d] for d in lb], dtype=np.int64))
    contract = int(np.prod([lhs[d] for d in lc], dtype=np.int64))
    lhs_free = int(
        np.prod([s for d, s in enumerate(lhs) if d not in lc and d not in lb], dtype=np.int64)
    )
    rhs_free = int(
        np.prod([s for d, s in enumerate(rhs) if d not in rc and d not in rb], dtype=np.int64)
    )
    return 2.0 * batch * lhs_free * rhs_free * contract


def conv_dimension_numbers(params: dict) -> tuple[tuple[int, ...], ...]:
    """A ``conv_general_dilated``'s (lhs_spec, rhs_spec, out_spec): the input's (batch,
    feature, spatial...) dims, the kernel's (out feature, in feature, spatial...) dims
    and the result's (batch, feature, spatial...) dims."""
    dn = params["dimension_numbers"]
    if isinstance(dn, dict):
        return tuple(dn["lhs_spec"]), tuple(dn["rhs_spec"]), tuple(dn["out_spec"])
    return tuple(tuple(d) for d in dn)


@register_flops("conv_general_dilated")
def _conv_flops(eqn, ins, outs) -> float:
    _, rhs_spec, _ = conv_dimension_numbers(eqn.params)
    rhs = ins[1].shape
    per_output = int(np.prod(rhs, dtype=np.int64)) // max(rhs[rhs_spec[0]], 1)
    zeros = int(np.prod(eqn.params.get("lhs_dilation") or (1,), dtype=np.int64))
    return 2.0 * outs[0].size * per_output / zeros


@register_flops("reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window")
def _pool_flops(eqn, ins, outs) -> float:
    return float(outs[0].size) * int(np.prod(eqn.params["window_dimensions"], dtype=np.int64))


@register_flops("select_and_scatter_add", "select_and_gather_add")
def _select_window_flops(eqn, ins, outs) -> float:
    window = int(np.prod(eqn.params["window_dimensions"], dtype=np.int64))
    return 2.0 * min(ins[0].size, outs[0].size) * window  # the pooled side


@register_flops(*ELEMENTWISE)
def _elementwise_flops(eqn, ins, outs) -> float:
    n = float(outs[0].size)
    if eqn.primitive == "integer_pow":
        return n * max(abs(int(eqn.params.get("y", 2))) - 1, 1)
    if eqn.primitive == "one_minus_square":
        return 2 * n
    if eqn.primitive == "polynomial":  # operands: x and the n + 1 coefficients
        return 2 * n * max(len(ins) - 2, 0)
    return n


@register_flops(*ALL_REDUCTIONS, "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _reduction_flops(eqn, ins, outs) -> float:
    return float(ins[0].size)


@register_flops("scatter-add", "scatter_add", "scatter")
def _scatter_flops(eqn, ins, outs) -> float:
    return float(ins[-1].size)


def _attention_dims(primitive: str, ins, outs) -> tuple[int, int, int, int, int]:
    """(B, H, Sq, Sk, D) of a fused attention: from q and k forward, dq and dk backward
    (each ``[B, S, H, D]``)."""
    q, k = (ins[0], ins[1]) if primitive in ATTENTION_FWD else (outs[0], outs[1])
    b, sq, h, d = q.shape
    return b, h, sq, k.shape[1], d


# Of a fused attention backward's FLOPs, the share that recomputes the forward's scores
# (QK^T: 2 of its 10 B H Sq Sk D).
ATTENTION_BWD_RECOMPUTE_SHARE = 0.2


@register_flops(*ATTENTION_FWD)
def _attention_fwd_flops(eqn, ins, outs) -> float:
    b, h, sq, sk, d = _attention_dims(eqn.primitive, ins, outs)
    return 4.0 * b * h * sq * sk * d


@register_flops(*ATTENTION_BWD)
def _attention_bwd_flops(eqn, ins, outs) -> float:
    b, h, sq, sk, d = _attention_dims(eqn.primitive, ins, outs)
    return 10.0 * b * h * sq * sk * d


@register_flops(*ZERO_FLOP)
def _no_flops(eqn, ins, outs) -> float:
    return 0.0


@dataclass(frozen=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    path: str
    producer: int | None  # node index, None for program inputs/constants
    consumers: tuple[int, ...]
    first_use: int  # node index where it becomes live (-1: live from the start)
    last_use: int  # last node that reads it (len(nodes): a program output)
    literal: float | int | bool | None = None  # a scalar literal's value

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class Node:
    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any] = field(hash=False, compare=False)
    flops: float
    layer: str | None
    phase: str
    module_path: str
    elementwise: bool = False  # by kind (is_elementwise), whatever the primitive's name


@dataclass(frozen=True)
class Edge:
    src: int  # producing node
    dst: int  # consuming node
    tensor: int


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    tensors: tuple[Tensor, ...]
    edges: tuple[Edge, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    aliases: tuple[tuple[int, int], ...]
    layers: tuple[str, ...]
    unknown_flops: tuple[str, ...]  # primitives with no FLOP rule (counted as 0)

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def flops_where(
        self, primitive: str | None = None, phases: tuple[str, ...] = ("forward", "backward")
    ) -> float:
        return sum(
            n.flops
            for n in self.nodes
            if n.phase in phases and (primitive is None or n.primitive == primitive)
        )

    def model_flops_where(
        self, primitive: str | None = None, phases: tuple[str, ...] = ("forward", "backward")
    ) -> float:
        """:meth:`flops_where` less the FLOPs a node runs again (:func:`recomputed_flops`):
        the model FLOPs MFU counts."""
        return sum(
            n.flops - recomputed_flops(n)
            for n in self.nodes
            if n.phase in phases and (primitive is None or n.primitive == primitive)
        )

    def matmul_flops(self, phases: tuple[str, ...] = ("forward", "backward")) -> float:
        """Model FLOPs of the step's matrix products: every ``dot_general``, and the two
        products a fused attention forward runs and the four of its backward (its
        recomputed scores left out), so the count is the same fused or unfused."""
        return sum(
            n.flops - recomputed_flops(n)
            for n in self.nodes
            if n.phase in phases
            and (n.primitive == "dot_general" or n.primitive in ATTENTION_FWD | ATTENTION_BWD)
        )

    def inputs_of_kind(self, kind: str) -> tuple[int, ...]:
        return tuple(t for t in self.inputs if self.tensors[t].kind == kind)

    def num_params(self) -> int:
        return sum(self.tensors[t].size for t in self.inputs_of_kind("param"))

    def dead_nodes(self) -> frozenset[int]:
        """Indices of the nodes whose results nothing reads, directly or through other
        dead nodes, and that are no program output: XLA's dead-code elimination drops
        them before its partitioner runs (jax's ``logsumexp`` makes a ``sign`` of the sum
        that only ``return_sign=True`` reads), so they ask for no resharding."""
        read = set(self.outputs)
        dead = set()
        for node in reversed(self.nodes):
            if any(t in read for t in node.outputs):
                read.update(node.inputs)
            else:
                dead.add(node.index)
        return frozenset(dead)


def eqn_is_elementwise(eqn: EqnRecord, ins: list[TensorRecord], outs: list[TensorRecord]) -> bool:
    """Whether ``eqn`` is elementwise by kind (:func:`~autoshard.ir.primitives.is_elementwise`)."""
    return is_elementwise(
        eqn.primitive, eqn.elementwise, tuple(t.shape for t in ins), tuple(t.shape for t in outs)
    )


def recomputed_flops(node: Node) -> float:
    """FLOPs ``node`` spends recomputing what an earlier node computed (hardware FLOPs,
    not model FLOPs): a fused attention backward's scores, 0 for every other node."""
    if node.primitive in ATTENTION_BWD:
        return ATTENTION_BWD_RECOMPUTE_SHARE * node.flops
    return 0.0


def flops_of(eqn: EqnRecord, ins: list[TensorRecord], outs: list[TensorRecord]) -> float | None:
    rule = FLOP_RULES.get(eqn.primitive)
    if rule is None and eqn_is_elementwise(eqn, ins, outs):
        rule = _elementwise_flops
    return None if rule is None else rule(eqn, ins, outs)


def build_graph(records: TraceRecords) -> Graph:
    """Nodes, edges, FLOPs and liveness of a traced program."""
    tensors = records.tensors
    producer: dict[int, int] = {}
    consumers: dict[int, list[int]] = {}
    nodes = []
    unknown: set[str] = set()
    for eqn in records.eqns:
        ins = [tensors[t] for t in eqn.inputs]
        outs = [tensors[t] for t in eqn.outputs]
        flops = flops_of(eqn, ins, outs)
        if flops is None:
            unknown.add(eqn.primitive)
            flops = 0.0
        nodes.append(
            Node(
                eqn.index,
                eqn.primitive,
                eqn.inputs,
                eqn.outputs,
                eqn.params,
                flops,
                eqn.layer,
                eqn.phase,
                eqn.module_path,
                elementwise=eqn_is_elementwise(eqn, ins, outs),
            )
        )
        for t in eqn.outputs:
            producer[t] = eqn.index
        for t in dict.fromkeys(eqn.inputs):
            consumers.setdefault(t, []).append(eqn.index)
    n = len(nodes)
    outputs = set(records.outputs)
    out_tensors = []
    for rec in tensors:
        users = tuple(consumers.get(rec.id, ()))
        first = producer.get(rec.id, -1)
        last = n if rec.id in outputs else (max(users) if users else first)
        out_tensors.append(
            Tensor(
                rec.id,
                rec.shape,
                rec.dtype,
                rec.nbytes,
                rec.kind,
                rec.path,
                producer.get(rec.id),
                users,
                first,
                last,
                rec.literal,
            )
        )
    edges = tuple(
        Edge(producer[t], node.index, t)
        for node in nodes
        for t in dict.fromkeys(node.inputs)
        if t in producer
    )
    return Graph(
        tuple(nodes),
        tuple(out_tensors),
        edges,
        records.inputs,
        records.outputs,
        records.aliases,
        records.layers,
        tuple(sorted(unknown)),
    )
