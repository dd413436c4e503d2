"""The records of an intra-operator problem (jax-free), shared by its builder
(:mod:`autoshard.intra.problem.build`), the exact per-value program
(:mod:`autoshard.intra.problem.exact_values`) and the plan reader
(:mod:`autoshard.intra.problem.predict`): :class:`IntraProblem` (the ILP with what maps
it back to the graph), its :class:`Operand` edges and ``_Common``, what the exact and the
per-demand programs share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoshard.hardware.mesh import DeviceMesh
from autoshard.intra.ilp import ShardingProblem
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.problem.value_edges import ValueEdges
from autoshard.intra.rules.strategies import Strategy
from autoshard.ir.graph import Graph


@dataclass(frozen=True)
class Operand:
    """One use of a tensor: ILP node ``src`` produces it, node ``dst`` reads it."""

    src: int
    dst: int
    tensor: int
    slot: int  # operand index on dst (-1: alias edge)


@dataclass(frozen=True)
class IntraProblem:
    graph: Graph
    mesh: DeviceMesh
    problem: ShardingProblem
    # ILP node -> its candidate (input specs, output specs) ; inputs first, then graph nodes
    strategies: tuple[tuple[Strategy, ...], ...]
    operands: tuple[Operand, ...]
    num_inputs: int
    # problem.edges[i] prices the reads of these ILP nodes (() for an alias edge); ILP
    # nodes past len(strategies) only price values (autoshard.intra.problem.value_edges)
    edge_consumers: tuple[tuple[int, ...], ...] = ()
    values: ValueEdges | None = None  # the values' extra nodes (exact_values)
    # offload (options.offload): tensors in host memory, and the device's staging bytes
    host_tensors: frozenset[int] = frozenset()
    staging_bytes: float = 0.0

    def node_of(self, graph_node: int) -> int:
        return self.num_inputs + graph_node


@dataclass(frozen=True)
class _Common:
    """What the exact and the per-demand programs share: everything but the values'
    edges (strategies, node costs, preferences, operands, feasibility and alias edges,
    ties, memory rows), built once for both (:func:`auto_shard_graph`)."""

    graph: Graph
    mesh: DeviceMesh
    options: IntraOptions
    cost_options: object
    strategies: tuple
    n_in: int
    node_costs: tuple
    prefs: tuple
    operands: tuple
    values: tuple
    edges: tuple
    edge_consumers: tuple
    ties: tuple
    memory: object
    notes: tuple = ()  # what shaping the problem did that the plan should say
    host: frozenset = frozenset()  # offloaded tensors (options.offload)
    staging_bytes: float = 0.0  # the device's staging buffers for them
    chains: tuple = ()  # value_edges.SliceChain: partial sums a layout op's reader may slice
    # value_edges' cost matrices and distinct demands, shared by the two programs
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
