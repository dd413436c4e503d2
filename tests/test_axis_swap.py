"""A unit planned on (tp, dp) reused on (dp, tp) (autoshard.inter.axis_swap): every axis
name swapped, sub-axes included."""

import pytest

from autoshard.inter.axis_swap import swap_axes, swap_axis_name
from autoshard.inter.submesh import cluster_for, logical_mesh_costs
from autoshard.inter.unit_cost import UnitCost
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Collective, ShardingSpec

NAMES = {"data": "model", "model": "data"}


def test_a_sub_axis_is_renamed_with_its_axis():
    assert swap_axis_name("model", NAMES) == "data"
    assert swap_axis_name("model:(2)2", NAMES) == "data:(2)2"
    assert swap_axis_name("data:(1)2", NAMES) == "model:(1)2"
    with pytest.raises(ValueError, match="AXIS:\\(PRE\\)SIZE"):
        swap_axis_name("model:(2)", NAMES)


def test_swapped_units_collectives_and_seconds_name_the_axes_of_the_new_mesh():
    """On (2, 4) an all-to-all over part of the 4-device 'model' axis (``model:(2)2``,
    as XLA groups it) is, on (4, 2), over part of the 4-device 'data' axis: the plan's
    collective and the unit's seconds by axis say so (before, the sub-axis kept its name,
    a part of 'model' that has 2 devices there; the step breakdown then read
    ``comm_model:(2)2`` on gpt-2.6b's TP2 DP4 grid point)."""
    mesh_for = logical_mesh_costs(cluster_for(None, 1, 8))
    planned, target = mesh_for((2, 4)), mesh_for((4, 2))
    spec = ShardingSpec((("data",), (), ("model",)))
    a2a = Collective("all-to-all", ("model:(2)2",), 1024)
    plan = ParallelPlan(
        name="stage", mesh=planned.mesh, input_specs=(spec,), input_paths=("x",),
        output_specs=(spec,), tensor_specs={}, operand_specs={}, node_strategies=(),
        predicted_collectives=(a2a, Collective("all-reduce", ("data", "model"), 64)),
        predicted_peak_bytes=0.0, objective=0.0,
    )  # fmt: skip
    unit = UnitCost(plan, 0.0, 0.0, 3.0, 0.0, {}, 0.0, communication_by_axis={
        "model:(2)2": 1.0, "data": 1.0, "model": 1.0})  # fmt: skip
    got = swap_axes(unit, target)
    axes = [c.axes for c in got.plan.predicted_collectives]
    assert axes == [("data:(2)2",), ("model", "data")]
    assert got.communication_by_axis == {"data:(2)2": 1.0, "model": 1.0, "data": 1.0}
    assert got.plan.input_specs == (ShardingSpec((("model",), (), ("data",))),)
    for c in got.plan.predicted_collectives:  # each names devices of the new mesh
        assert target.mesh.size(c.axes) == planned.mesh.size(
            tuple(swap_axis_name(x, NAMES) for x in c.axes)
        )
