"""A stage's tensor-level plan from its units' plans: each unit's plan (made for its own
sub-graph, or for an identical layer and reused position by position) mapped to the whole
graph's ids through the unit's range ids, and checked to fit."""

from __future__ import annotations

from autoshard.inter.plan import Shape2, StageSpecs
from autoshard.intra.cost.resharding import _valid_spec
from autoshard.ir.graph import Graph
from autoshard.ir.spec import Mesh, ShardingSpec


def assemble_stage_specs(
    graph: Graph, pieces, logical: Shape2, mesh: Mesh, start: int, end: int
) -> StageSpecs:
    """``pieces``: (unit, its range ids) per unit of layers ``[start, end)`` on
    ``logical``, in order.  Raises where a unit has no finite plan, and where a reused
    plan does not match or fit its range."""
    tensor_specs: dict[int, ShardingSpec] = {}
    input_specs: dict[int, ShardingSpec] = {}
    operand_specs: dict[int, dict[int, ShardingSpec]] = {}
    for unit, rg in pieces:
        if unit.plan is None:
            raise ValueError(
                f"layers {list(graph.layers[start:end])} have no finite intra-op plan "
                f"on the logical mesh {logical}"
            )
        plan = unit.plan
        if len(plan.input_specs) != len(rg.inputs) or len(plan.node_strategies) != len(rg.node_ids):
            raise AssertionError(f"the plan reused for layers [{rg.start}, {rg.end}) differs")
        for tid, spec in zip(rg.inputs, plan.input_specs, strict=True):
            input_specs.setdefault(rg.tensor_ids[tid], spec)
        for tid, spec in plan.tensor_specs.items():
            tensor_specs[rg.tensor_ids[tid]] = spec
        for node, ops in plan.operand_specs.items():
            operand_specs[rg.node_ids[node]] = dict(ops)
    for tid, spec in (*input_specs.items(), *tensor_specs.items()):
        _valid_spec(spec, mesh, graph.tensors[tid].shape)  # a reused plan must fit
    return StageSpecs(logical, tensor_specs, input_specs, operand_specs)
