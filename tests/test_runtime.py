"""Runtime: hand-built plans run on 8 fake CPU devices and match the single-device step."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Mesh, ShardingSpec
from autoshard.models import get_workload, make_optimizer, make_train_step
from autoshard.runtime.reference_check import check_against_single_device
from autoshard.runtime.sharded import (
    abstract_args,
    build_sharded_step,
    make_mesh,
    named_sharding,
    run_steps,
    to_partition_spec,
)
from autoshard.trace.jaxpr import trace_train_step

MESHES = [
    Mesh(("data",), (8,)),
    Mesh(("data", "model"), (2, 4)),
    Mesh(("data", "model"), (4, 2)),
    Mesh(("data", "model"), (1, 8)),
]
MESH_IDS = [str(m) for m in MESHES]


@functools.cache
def _setup(model: str, optimizer: str, **overrides):
    """(workload, optimizer, traced program) for a small model; cached across tests."""
    workload = get_workload(model, **overrides)
    opt = optax.sgd(0.1) if optimizer == "sgd" else make_optimizer(optimizer)
    program = trace_train_step(
        make_train_step(workload.loss_fn, opt), *workload.abstract_train_args(opt)
    )
    return workload, opt, program


def _mlp(optimizer: str = "sgd", **overrides):
    return _setup(
        "mlp", optimizer, **{"batch_size": 16, "hidden": 32, "num_layers": 2, **overrides}
    )


def _plan(program, mesh: Mesh, name: str, tensor_specs=None) -> ParallelPlan:
    """dp: state replicated; zero3: state split on dim 0 where it divides; data split on dim 0."""
    records = program.records
    all_axes = mesh.axis_names
    state_specs: dict[int, ShardingSpec] = {}

    def spec_of(tid: int) -> ShardingSpec:
        t = records.tensors[tid]
        spec = ShardingSpec.replicated(len(t.shape))
        if t.kind == "data" or (name == "zero3" and t.kind in ("param", "opt_state")):
            if t.shape and t.shape[0] % mesh.num_devices == 0:
                spec = spec.with_dim(0, all_axes)
        return spec

    inputs = tuple(spec_of(tid) for tid in records.inputs)
    for in_id, out_id in records.aliases:
        state_specs[out_id] = inputs[records.inputs.index(in_id)]
    outputs = tuple(
        state_specs.get(tid, ShardingSpec.replicated(len(records.tensors[tid].shape)))
        for tid in records.outputs
    )
    return ParallelPlan(
        name=name,
        mesh=mesh,
        input_specs=inputs,
        input_paths=tuple(records.tensors[t].path for t in records.inputs),
        output_specs=outputs,
        tensor_specs=dict(tensor_specs or {}),
        operand_specs={},
        node_strategies=(),
        predicted_collectives=(),
        predicted_peak_bytes=0.0,
        objective=0.0,
    )


def _first_forward_dot(program) -> int:
    eqn = next(e for e in program.records.eqns if e.primitive == "dot_general")
    return eqn.outputs[0]


# --- meshes and specs ---------------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)
def test_make_mesh_has_the_plan_axes_and_every_device(mesh):
    jmesh = make_mesh(mesh)
    assert tuple(jmesh.axis_names) == mesh.axis_names
    assert jmesh.devices.shape == mesh.shape
    assert sorted(d.id for d in jmesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert all("Auto" in str(t) for t in jmesh.axis_types)


def test_make_mesh_says_how_many_devices_are_missing():
    with pytest.raises(
        ValueError, match=r"needs 16 devices but 8.*--devices 16.*jax_num_cpu_devices"
    ):
        make_mesh(Mesh(("data", "model"), (4, 4)))
    with pytest.raises(ValueError, match=r"needs 8 devices but 4"):
        make_mesh(Mesh(("data",), (8,)), jax.devices()[:4])
    with pytest.raises(ValueError, match=r"devices=jax.devices\(\)\[:4\]"):
        make_mesh(Mesh(("data",), (4,)))
    assert make_mesh(Mesh(("data",), (4,)), jax.devices()[:4]).devices.size == 4


def test_to_partition_spec_maps_each_dim():
    spec = ShardingSpec((("data",), (), ("data", "model")))
    assert to_partition_spec(spec) == PartitionSpec("data", None, ("data", "model"))
    assert to_partition_spec(ShardingSpec.replicated(2)) == PartitionSpec(None, None)
    jmesh = make_mesh(Mesh(("data", "model"), (2, 4)))
    sharding = named_sharding(jmesh, ShardingSpec(((), ("model",))))
    assert sharding.shard_shape((16, 32)) == (16, 8)
    with pytest.raises(ValueError, match="partial sum"):
        to_partition_spec(ShardingSpec(((),), partial=("model",)))


# --- sharded == single device ---------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)
def test_data_parallel_sgd_matches_single_device(mesh):
    workload, opt, program = _mlp()
    plan = _plan(program, mesh, "dp")
    jmesh = make_mesh(mesh)
    report = check_against_single_device(
        program, plan, jmesh, workload.init_train_args(opt), num_steps=2, rtol=1e-5
    )
    assert report.ok, report
    assert report.update_rel_error <= 1e-5 and report.loss_rel_error <= 1e-5
    # the gradient of replicated weights is summed over the data-parallel devices
    assert "all-reduce" in build_sharded_step(program, plan, jmesh).compiled_text()


@pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)
def test_zero3_sgd_matches_single_device_and_keeps_state_sharded(mesh):
    workload, opt, program = _mlp()
    plan = _plan(program, mesh, "zero3")
    jmesh = make_mesh(mesh)
    args = workload.init_train_args(opt)
    report = check_against_single_device(program, plan, jmesh, args, num_steps=2, rtol=1e-5)
    assert report.ok, report

    step = build_sharded_step(program, plan, jmesh)
    params, _, loss = step(*args)
    kernel = params["dense_0"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (32 // 8, 32)
    assert loss.sharding.is_fully_replicated
    text = step.compiled_text()
    assert "all-gather" in text or "all-reduce" in text


@pytest.mark.parametrize("name", ["dp", "zero3"])
def test_gpt_tiny_matches_single_device(name):
    mesh = Mesh(("data", "model"), (2, 4))
    workload, opt, program = _setup("gpt-tiny", "sgd")
    report = check_against_single_device(
        program,
        _plan(program, mesh, name),
        make_mesh(mesh),
        workload.init_train_args(opt),
        num_steps=2,
        rtol=1e-5,
    )
    assert report.ok, report

    # AdamW: the key bias has an exactly-zero gradient (softmax ignores a shift shared by
    # all keys), so Adam scales rounding noise up to updates of ~lr/100 there and
    # per-leaf errors are ill-posed; the loss after an AdamW step is well-posed.
    workload, opt, program = _setup("gpt-tiny", "adamw")
    report = check_against_single_device(
        program,
        _plan(program, mesh, name),
        make_mesh(mesh),
        workload.init_train_args(opt),
        num_steps=2,
        rtol=1e-4,
    )
    assert report.loss_rel_error <= 1e-4, report


def test_adamw_mlp_matches_single_device_over_steps():
    workload, opt, program = _mlp("adamw")
    mesh = Mesh(("data", "model"), (4, 2))
    report = check_against_single_device(
        program,
        _plan(program, mesh, "zero3"),
        make_mesh(mesh),
        workload.init_train_args(opt),
        num_steps=3,
        rtol=1e-4,
    )
    assert report.ok, report
    assert report.num_steps == 3


def test_check_report_catches_a_wrong_sharded_step(monkeypatch):
    """If the sharded side ran a different step (lr 0.2, not 0.1) the report says so."""
    import autoshard.runtime.reference_check as runtime  # where the check looks it up

    workload, opt, program = _mlp()
    mesh = Mesh(("data", "model"), (2, 4))
    plan = _plan(program, mesh, "dp")
    wrong_opt = optax.sgd(0.2)
    wrong = trace_train_step(
        make_train_step(workload.loss_fn, wrong_opt), *workload.abstract_train_args(wrong_opt)
    )
    real_build = runtime.build_sharded_step
    monkeypatch.setattr(
        runtime, "build_sharded_step", lambda _program, *a, **k: real_build(wrong, *a, **k)
    )
    report = check_against_single_device(
        program, plan, make_mesh(mesh), workload.init_train_args(opt), num_steps=2
    )
    assert not report.ok
    assert report.update_rel_error == pytest.approx(1.0, rel=1e-3)  # update doubled
    assert report.loss_rel_error > 1e-5  # the second step starts from other params
    assert report.worst_output.startswith("[0]")


# --- sharding constraints ------------------------------------------------------------------


def test_tensor_specs_constrain_node_outputs_in_the_compiled_program():
    workload, opt, program = _mlp()
    mesh = Mesh(("data", "model"), (2, 4))
    jmesh = make_mesh(mesh)
    base = dataclasses.replace(
        _plan(program, mesh, "dp"),
        input_specs=tuple(
            ShardingSpec.replicated(len(program.records.tensors[t].shape))
            for t in program.records.inputs
        ),
    )
    dot_out = _first_forward_dot(program)  # x @ W0: [16, 32]
    constrained = dataclasses.replace(base, tensor_specs={dot_out: ShardingSpec(((), ("model",)))})

    step = build_sharded_step(program, constrained, jmesh)
    assert step.num_constraints == 1
    local_dot = re.compile(r"f32\[16,8\]\{[0-9,]*\} dot\(")
    assert local_dot.search(step.compiled_text())
    assert not local_dot.search(build_sharded_step(program, base, jmesh).compiled_text())
    report = check_against_single_device(
        program, constrained, jmesh, workload.init_train_args(opt), rtol=1e-5
    )
    assert report.ok, report


def test_partial_sum_specs_are_left_unconstrained():
    workload, opt, program = _mlp()
    mesh = Mesh(("data", "model"), (2, 4))
    dot_out = _first_forward_dot(program)
    plan = _plan(
        program,
        mesh,
        "dp",
        tensor_specs={dot_out: ShardingSpec((("data",), ()), partial=("model",))},
    )
    step = build_sharded_step(program, plan, make_mesh(mesh))
    assert step.num_constraints == 0
    report = check_against_single_device(
        program, plan, make_mesh(mesh), workload.init_train_args(opt), rtol=1e-5
    )
    assert report.ok, report


# --- running, donation, abstract compilation -----------------------------------------------


def test_donation_consumes_state_and_reruns_with_fresh_args():
    workload, opt, program = _mlp()
    mesh = Mesh(("data", "model"), (2, 4))
    plan = _plan(program, mesh, "zero3")
    step = build_sharded_step(program, plan, make_mesh(mesh))
    assert step.donate_argnums == (0,)  # SGD has an empty optimizer state: nothing to donate

    results = []
    for _ in range(2):
        placed = step.place(*workload.init_train_args(opt))
        params, _, loss = step(*placed)
        assert jax.tree_util.tree_leaves(placed[0])[0].is_deleted()
        assert not jax.tree_util.tree_leaves(placed[2])[0].is_deleted()  # the batch is kept
        results.append((np.asarray(loss), np.asarray(params["dense_1"]["kernel"])))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])

    keep = build_sharded_step(program, plan, make_mesh(mesh), donate=False)
    placed = keep.place(*workload.init_train_args(opt))
    keep(*placed)
    assert not jax.tree_util.tree_leaves(placed[0])[0].is_deleted()


def test_adamw_donates_params_and_optimizer_state():
    _, _, program = _mlp("adamw")
    step = build_sharded_step(program, _plan(program, MESHES[1], "dp"), make_mesh(MESHES[1]))
    assert step.donate_argnums == (0, 1)


def test_run_steps_matches_a_plain_loop():
    workload, opt, program = _mlp()
    mesh = Mesh(("data",), (8,))
    step = build_sharded_step(program, _plan(program, mesh, "dp"), make_mesh(mesh))
    args = workload.init_train_args(opt)
    final, losses = run_steps(step, args, 4)

    plain = jax.jit(make_train_step(workload.loss_fn, opt))
    params, opt_state, batch = args
    expected = []
    for _ in range(4):
        params, opt_state, loss = plain(params, opt_state, batch)
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(
        np.asarray(final[0]["dense_0"]["kernel"]),
        np.asarray(params["dense_0"]["kernel"]),
        rtol=1e-5,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match="num_steps"):
        run_steps(step, args, 0)


def test_run_steps_places_the_state_once(monkeypatch):
    """run_steps places the arguments once: the updated state comes back in the shardings
    the step takes (feeds_back_in_place), so each later step runs the executable on it
    as it is -- the same losses as placing every step (ShardedStep.__call__)."""
    workload, opt, program = _mlp()
    mesh = Mesh(("data",), (8,))
    step = build_sharded_step(program, _plan(program, mesh, "dp"), make_mesh(mesh))
    assert step.feeds_back_in_place()
    args = workload.init_train_args(opt)
    placed = []
    place = step.place
    monkeypatch.setattr(step, "place", lambda *a, **k: placed.append(1) or place(*a, **k))
    _, losses = run_steps(step, args, 3)
    assert len(placed) == 1
    state, expected = step.place(*args, copy=True), []
    for _ in range(3):  # placed again every step
        out = step(*state)
        expected.append(float(out[2]))
        state = (out[0], out[1], state[2])
    assert losses == expected


def test_abstract_args_compile_a_large_step_without_allocating():
    # 2 x 16384^2 float32 weights = 2 GiB of parameters, never allocated: the step
    # compiles from ShapeDtypeStructs.
    _, _, program = _mlp(batch_size=64, hidden=16384)
    mesh = Mesh(("data", "model"), (2, 4))
    plan = _plan(program, mesh, "zero3")
    jmesh = make_mesh(mesh)
    abstract = abstract_args(program, plan, jmesh)
    kernel = abstract[0]["dense_0"]["kernel"]
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.sharding.shard_shape(kernel.shape) == (16384 // 8, 16384)

    step = build_sharded_step(program, plan, jmesh)
    compiled = step.compile()
    total = sum(program.records.tensors[t].nbytes for t in program.records.inputs)
    memory = compiled.memory_analysis()
    if memory is not None:  # per-device arguments: every input is split 8 ways
        assert memory.argument_size_in_bytes <= total / 8 * 1.01
    assert step.lower(*abstract).as_text()


# --- bad plans -----------------------------------------------------------------------------


def test_plan_and_mesh_mismatches_are_reported():
    _, _, program = _mlp()
    mesh = Mesh(("data", "model"), (2, 4))
    plan = _plan(program, mesh, "dp")
    with pytest.raises(ValueError, match="make_mesh"):
        build_sharded_step(program, plan, make_mesh(Mesh(("data", "model"), (4, 2))))
    jmesh = make_mesh(mesh)
    with pytest.raises(ValueError, match="input specs"):
        build_sharded_step(
            program, dataclasses.replace(plan, input_specs=plan.input_specs[1:]), jmesh
        )
    bad_input = (ShardingSpec(((), ()), partial=("data",)),) + plan.input_specs[1:]
    with pytest.raises(ValueError, match="partial-sum"):
        build_sharded_step(program, dataclasses.replace(plan, input_specs=bad_input), jmesh)
    dot_out = _first_forward_dot(program)
    with pytest.raises(ValueError, match="rank"):
        build_sharded_step(
            program,
            dataclasses.replace(plan, tensor_specs={dot_out: ShardingSpec.replicated(3)}),
            jmesh,
        )
    with pytest.raises(ValueError, match="tensors 0"):
        build_sharded_step(
            program,
            dataclasses.replace(plan, tensor_specs={10**6: ShardingSpec.replicated(1)}),
            jmesh,
        )
