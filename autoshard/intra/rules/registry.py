"""The per-primitive rule registry (jax-free): what a sharding rule is and where it is kept.

A rule (:data:`SlotRule`) takes a node's :class:`NodeContext` and returns its
:class:`Slot` list (or None: no rule applies, the node is planned replicated); rules join
:data:`RULES` by primitive name through :func:`register`.  The rule families are the
modules of :mod:`autoshard.intra.rules` that import this one (the core primitives' in
:mod:`~autoshard.intra.rules.strategies`; ``attention``, ``conv``, ``moe``, ``reduce``,
``slice``); the package's ``__init__`` imports them all, so every rule is registered
whatever module of the package is imported first (a later family wins a primitive two
register: ``rev``, ``moe`` after ``conv``).  :mod:`autoshard.intra.rules.strategies`
turns slots into :class:`Strategy` candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoshard.ir.graph import Node
from autoshard.ir.spec import ShardingSpec

OUT = -1  # slot position "operand" index meaning the node's (first) output


@dataclass(frozen=True)
class Slot:
    kind: str  # shard | reduce | through
    positions: tuple[
        tuple[int, int], ...
    ]  # (operand index or OUT-k for output k, dim); dim -1 for "through"
    op: str = "sum"  # reduce: how the partial results combine (ShardingSpec.partial_op)
    # the axes' size must also divide this: a split of grouped dims that keeps whole
    # groups on a device (a grouped convolution's channels)
    groups: int = 1

    def __post_init__(self) -> None:
        assert self.kind in ("shard", "reduce", "through"), self.kind


@dataclass(frozen=True)
class Strategy:
    name: str
    input_specs: tuple[ShardingSpec | None, ...]  # None: scalar/literal operand, no constraint
    output_specs: tuple[ShardingSpec, ...]
    compute_cost: float
    parallel_factor: int  # how many ways the work is split


@dataclass(frozen=True)
class NodeContext:
    """A node with its operand shapes and what it streams through memory.

    ``in_bytes`` / ``out_bytes``: global bytes of each operand / result the node reads
    from or writes to memory (materialised buffers, :func:`autoshard.intra.memory.model.
    materialized_tensors`; 0 for values fused away); empty when not modelled.
    ``itemsize``: bytes per element of the first operand (a dot's GEMM dtype).
    """

    node: Node
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_literal: tuple[bool, ...]
    in_bytes: tuple[float, ...] = ()
    out_bytes: tuple[float, ...] = ()
    itemsize: int = 4


SlotRule = Callable[[NodeContext], list[Slot] | None]
RULES: dict[str, SlotRule] = {}


def register(*names: str):
    def deco(rule: SlotRule) -> SlotRule:
        for name in names:
            RULES[name] = rule
        return rule

    return deco


def _out(k: int = 0) -> int:
    return OUT - k
