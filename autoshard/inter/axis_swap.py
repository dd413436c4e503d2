"""A stage unit planned on a 2-axis mesh, reused on the mesh with its axis sizes exchanged.

:meth:`autoshard.inter.stage_cost.IntraStageCost._twin` decides when (:func:`swappable`);
:func:`swap_axes` renames the plan's axes.  Jax-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoshard.hardware.mesh import DeviceMesh
from autoshard.ir.spec import ShardingSpec, sub_axis, sub_axis_name


def swappable(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether two 2-axis meshes are one mesh with its axes' sizes exchanged: uniform
    links, devices in one node (or no node layout), every other figure equal."""
    if len(a.mesh.shape) != 2 or a.mesh.axis_names != b.mesh.axis_names:
        return False
    if a.mesh.shape != b.mesh.shape[::-1]:
        return False
    if len(set(a.alpha)) != 1 or len(set(a.beta)) != 1:
        return False
    if a.nodes is not None and a.mesh.num_devices > a.nodes.devices_per_node:
        return False
    return dataclasses.replace(a, mesh=b.mesh) == b


def swap_axis_name(name: str, names: Mapping[str, str]) -> str:
    """``name`` with its axis renamed by ``names``; a sub-axis (``model:(2)2``, a part of
    ``model`` that a collective may run over) renamed with its axis, so that it names a
    part of the axis of the size it was planned on."""
    sub = sub_axis(name)
    if sub is None:
        return names.get(name, name)
    axis, pre, size = sub
    return sub_axis_name(names.get(axis, axis), pre, size)


def _swap_spec(spec: ShardingSpec, names: Mapping[str, str]) -> ShardingSpec:
    return ShardingSpec(
        tuple(tuple(names[x] for x in d) for d in spec.dims),
        tuple(names[x] for x in spec.partial),
        spec.partial_op,
    )


def swap_axes(unit, mesh: DeviceMesh):
    """``unit`` (planned on the mesh with the two axis sizes exchanged) on ``mesh``: its
    plan's specs and collectives with the two axis names swapped; every cost the same."""
    plan = unit.plan
    if plan is None:
        return unit
    a, b = mesh.mesh.axis_names
    names = {a: b, b: a}
    memo: dict[ShardingSpec, ShardingSpec] = {}

    def sw(spec: ShardingSpec) -> ShardingSpec:
        if spec not in memo:
            memo[spec] = _swap_spec(spec, names)
        return memo[spec]

    swapped = dataclasses.replace(
        plan,
        mesh=mesh.mesh,
        input_specs=tuple(sw(x) for x in plan.input_specs),
        output_specs=tuple(sw(x) for x in plan.output_specs),
        tensor_specs={t: sw(x) for t, x in plan.tensor_specs.items()},
        operand_specs={
            n: {k: sw(x) for k, x in ops.items()} for n, ops in plan.operand_specs.items()
        },
        predicted_collectives=tuple(
            dataclasses.replace(c, axes=tuple(swap_axis_name(x, names) for x in c.axes))
            for c in plan.predicted_collectives
        ),
    )
    by_axis = unit.communication_by_axis
    if by_axis is not None:
        by_axis = {swap_axis_name(x, names): sec for x, sec in by_axis.items()}
    return dataclasses.replace(unit, plan=swapped, communication_by_axis=by_axis)
