"""``grad_reduce="step"``: a stage runs ``dp`` data-parallel replicas and reduces its
gradient over ``data`` once a step, in the update (autoshard/runtime/stage.py).

Trains like ``grad_reduce="microbatch"`` and like one device from the same weights; its
compiled backward holds no collective over ``data`` (today's holds one per gradient), its
update holds the step's one reduction: a reduce-scatter per gradient, the optimizer state
sharded over ``data`` (ZeRO-1), an all-gather per updated weight; bad requests are refused
with a message.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from autoshard.api_pipeline import auto_pipeline
from autoshard.inter.plan import Stage
from autoshard.inter.stage_memory import zero_dim
from autoshard.intra.cost.collectives import ring_volume
from autoshard.ir.spec import Mesh
from autoshard.models import get_workload, make_optimizer, make_train_step
from autoshard.runtime.stage import zero_spec
from autoshard.verify.collectives import analyze_collectives

NUM_STEPS = 3
NUM_MICROBATCHES = 2
BATCH = 32  # 2 microbatches of 16: 8 rows a replica on dp = 2, 2 on dp = 8
# the same cuts both modes run: 2 stages on (2, 2) (tensor parallel inside each
# replica), and 1 stage of 8 pure data-parallel replicas
TWO_STAGES = {"stages": ((0, 2), (2, 4)), "logical_meshes": ((2, 2), (2, 2))}
ONE_STAGE = {"stages": ((0, 4),), "layout": "data-parallel"}
# f32, 3 steps: the modes sum the same per-row gradients in another order (per replica
# then over data, against over data per microbatch; one device: all rows at once), a few
# ulps of each gradient. AdamW's m / sqrt(v) divides that rounding by the gradient's own
# size, so an element near zero moves by up to ~1e-3 of lr (1e-3) over 3 steps: the study
# saw 7.2e-7, hence 1e-6 on the parameters. Measured here (jax 0.10.2): parameters within
# 6.8e-8 of one device's and 4.5e-8 of the microbatch mode's; the losses 7.4e-7 and 3.1e-7
# relative, where the microbatch pipeline itself is 9.5e-7 from one device (8 ulps of a
# loss near 1.2): 2e-6. SGD (lr 0.1) is in the test as AdamW is nearly blind to a
# gradient's scale (a replica's share summed D times would pass under AdamW alone).
PARAM_ATOL = 1e-6
LOSS_RTOL = 2e-6


@functools.cache
def _setup(optimizer: str = "adamw"):
    workload = get_workload("mlp", hidden=32, num_layers=4, batch_size=BATCH)
    opt = make_optimizer("sgd", 0.1) if optimizer == "sgd" else make_optimizer("adamw")
    params, opt_state, batch = workload.init_train_args(opt, seed=1)
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    p, losses = params, []
    for _ in range(NUM_STEPS):
        p, opt_state, loss = step(p, opt_state, batch)
        losses.append(float(loss))
    return workload, opt, params, batch, losses, jax.device_get(p)


@functools.cache
def _train(grad_reduce: str, cut: str, optimizer: str = "adamw", microbatches=NUM_MICROBATCHES):
    workload, opt, params, batch, _, _ = _setup(optimizer)
    kw = TWO_STAGES if cut == "two" else ONE_STAGE
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        num_microbatches=microbatches,
        grad_reduce=grad_reduce,
        **kw,
    )
    losses = [float(trainer.step(batch)) for _ in range(NUM_STEPS)]
    return trainer, losses, trainer.params


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _data_collectives(trainer, stage: int, compiled) -> list:
    """The collectives of ``compiled`` (one of ``stage``'s executables) over ``data``."""
    st = trainer.stage_executables[stage]
    shape = tuple(int(n) for n in st.mesh.devices.shape)
    ids = [d.id for d in st.mesh.devices.flat]
    found = analyze_collectives(compiled.as_text(), Mesh(("data", "model"), shape), ids)
    return [c for c in found.compared() if "data" in c.axes]


@pytest.mark.parametrize(("cut", "optimizer"), [("two", "adamw"), ("one", "adamw"), ("two", "sgd")])
def test_step_reduction_trains_like_microbatch_and_one_device(cut, optimizer):
    _, _, initial, _, single_losses, single = _setup(optimizer)
    trainer, losses, params = _train("step", cut, optimizer)
    _, today_losses, today = _train("microbatch", cut, optimizer)
    stages = trainer.plan.stages
    assert all(s.stage.grad_reduce == "step" for s in stages)
    assert all(st.replicas is not None for st in trainer.stage_executables)
    assert _max_diff(params, initial) > 1e-4  # trained
    np.testing.assert_allclose(losses, today_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose(losses, single_losses, rtol=LOSS_RTOL)
    assert _max_diff(params, today) < PARAM_ATOL
    assert _max_diff(params, single) < PARAM_ATOL
    assert "replicas reduced once a step" in str(trainer.plan)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_replicas_train_like_one_device_at_other_microbatch_counts(microbatches):
    # 1 microbatch: the replicas' backward and update run as one program
    # (backward_update), the stacked gradients summed there; 4: one row a replica (the
    # whole step's trace at one row has other backward equations, the loss's are the same)
    _, _, initial, _, single_losses, single = _setup("sgd")
    trainer, losses, params = _train("step", "one", "sgd", microbatches)
    assert trainer.stage_executables[0].replicas.replicas == 8
    np.testing.assert_allclose(losses, single_losses, rtol=LOSS_RTOL)
    assert _max_diff(params, single) < PARAM_ATOL
    assert _max_diff(params, initial) > 1e-3


@pytest.mark.parametrize(
    "extra", [{"recompute": "full"}, {"schedule": "interleaved", "virtual_stages": 2}]
)
def test_replicas_recompute_and_interleave_like_one_device(extra):
    # the inner layer's forward under jax.checkpoint inside the replicas' shard_map; and 4
    # chunks on the two (2, 2) stages, each chunk's replicas reduced in its update
    workload, opt, params, batch, single_losses, single = _setup("sgd")
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        num_microbatches=NUM_MICROBATCHES,
        grad_reduce="step",
        **TWO_STAGES,
        **extra,
    )
    losses = [float(trainer.step(batch)) for _ in range(NUM_STEPS)]
    stages = trainer.stage_executables
    assert all(st.replicas is not None for st in stages)
    if "recompute" in extra:
        assert stages[0].recomputed_layers == ("dense_1",)
    else:
        assert len(stages) == 4
    np.testing.assert_allclose(losses, single_losses, rtol=LOSS_RTOL)
    assert _max_diff(trainer.params, single) < PARAM_ATOL


@pytest.mark.heavy  # gpt-tiny's two stages plan and compile for ~30 s; CI's heavy step
def test_gpt_replicas_with_a_tied_embedding_train_like_one_device():
    # the LM head's wte is owned by stage 0 and sent to stage 1 (no batch dim): the
    # replicas' mean sends it on, their cotangents for it are summed; the loss likewise
    workload = get_workload("gpt-tiny", num_layers=4)
    opt = make_optimizer("sgd", 0.1)
    params, opt_state, batch = workload.init_train_args(opt, seed=1)
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    p, want = params, []
    for _ in range(NUM_STEPS):
        p, opt_state, loss = step(p, opt_state, batch)
        want.append(float(loss))
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        num_microbatches=NUM_MICROBATCHES,
        stages=((0, 2), (2, 6)),
        logical_meshes=((2, 2), (2, 2)),
        grad_reduce="step",
    )
    got = [float(trainer.step(batch)) for _ in range(NUM_STEPS)]
    assert trainer.plan.stages[1].received_params == ("['embedding']['wte']",)
    # measured 2.6e-7 (losses) and 1.3e-8 (parameters, which move by ~1e-2)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    assert _max_diff(trainer.params, p) < PARAM_ATOL
    assert _data_collectives(trainer, 0, trainer.compiled_backward(0)) == []


def test_replica_backward_reduces_nothing_over_data_and_the_update_once():
    # one stage of 8 data-parallel devices: today every microbatch's backward all-reduces
    # each gradient over data; the replicas' backward nothing, their update (ZeRO-1)
    # reduce-scatters each gradient once and all-gathers each updated weight once
    step, _, _ = _train("step", "one")
    today, _, _ = _train("microbatch", "one")
    num_params = len(jax.tree.leaves(step.stage_executables[0].params))  # 4 kernels, 4 biases
    now = _data_collectives(today, 0, today.compiled_backward(0))
    assert len(now) == num_params and {c.kind for c in now} == {"all-reduce"}
    assert _data_collectives(step, 0, step.compiled_backward(0)) == []
    assert _data_collectives(today, 0, today.compiled_update(0)) == []
    once = _data_collectives(step, 0, step.compiled_update(0))
    kinds = [c.kind for c in once]
    assert kinds.count("reduce-scatter") == kinds.count("all-gather") == num_params
    assert len(once) == 2 * num_params
    # per gradient: a reduce-scatter of it and an all-gather back, each of its bytes
    # (XLA:CPU, jax 0.10.2: 4 x 4096 + 4 x 128 each) -- on a ring the bytes today's
    # all-reduce sends, moved once a step instead of once a microbatch
    for kind in ("reduce-scatter", "all-gather"):
        assert sorted(c.bytes for c in once if c.kind == kind) == sorted(c.bytes for c in now)
    assert sum(ring_volume(c.kind, 8, c.bytes) for c in once) == pytest.approx(
        sum(ring_volume(c.kind, 8, c.bytes) for c in now)
    )


def test_tensor_parallel_replicas_reduce_over_data_only_in_the_update():
    # 2 stages on (2, 2): each replica's plan splits over model (its ILP plan on (1, 2));
    # nothing crosses data in the backward; in the update each gradient is reduce-scattered
    # over data within its model shard and each weight all-gathered back, nothing permuted
    # (data minor to model on a dim both split: data major would move the shards)
    step, _, _ = _train("step", "two")
    for stage, st in enumerate(step.stage_executables):
        assert step.plan.stages[stage].tensor_parallel
        assert _data_collectives(step, stage, step.compiled_backward(stage)) == []
        once = _data_collectives(step, stage, step.compiled_update(stage))
        kinds = [c.kind for c in once]
        num_params = len(jax.tree.leaves(st.params))
        assert kinds.count("reduce-scatter") == kinds.count("all-gather") == num_params
        assert len(once) == 2 * num_params
        assert {c.axes for c in once} == {("data",)}


def test_replica_optimizer_state_is_sharded_over_data():
    # AdamW's mu and nu rest 1/8 per device on 8 replicas (every MLP leaf has a dim of
    # 32: its ZeRO dim is 0); the step count stays whole
    step, _, _ = _train("step", "one")
    today, _, _ = _train("microbatch", "one")
    (a,), (b,) = step.stage_executables, today.stage_executables
    sharded = 0
    for mine, theirs in zip(jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)):
        mine_bytes = mine.addressable_shards[0].data.nbytes
        theirs_bytes = theirs.addressable_shards[0].data.nbytes
        if mine.ndim:
            assert mine.sharding.spec[0] == "data"
            assert mine_bytes * 8 == theirs_bytes
            sharded += 1
        else:
            assert mine_bytes == theirs_bytes
    assert sharded == 2 * len(jax.tree.leaves(a.params))
    # the weights themselves rest whole on every replica
    for p in jax.tree.leaves(a.params):
        assert p.addressable_shards[0].data.nbytes == p.nbytes


def test_tensor_parallel_replica_state_shards_over_data_within_model():
    step, _, _ = _train("step", "two")
    for st in step.stage_executables:
        for leaf in jax.tree.leaves(st.opt_state):
            if not leaf.ndim:
                continue
            # every dim is 32: data joins dim 0, after model where model is there too
            axes = [a for e in leaf.sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
            assert leaf.sharding.spec[0] in ("data", ("data",), ("model", "data"))
            split = 2 * (2 if "model" in axes else 1)  # 1/2 of the replica plan's shard
            assert leaf.addressable_shards[0].data.nbytes * split == leaf.nbytes


def test_zero_dim_is_the_first_dim_dividing_by_dp_times_its_split():
    assert zero_dim((32, 32), (1, 1), 8) == 0
    assert zero_dim((6, 32), (1, 1), 4) == 1  # 6 does not divide by 4
    assert zero_dim((8, 32), (2, 1), 8) == 1  # 8 does not by 8 * 2 (model already on 0)
    assert zero_dim((16, 32), (2, 4), 8) == 0
    assert zero_dim((12, 6), (1, 2), 4) == 0
    assert zero_dim((2, 6), (1, 2), 4) is None  # nothing divides: stays replicated
    assert zero_dim((), (), 8) is None  # a step count
    with pytest.raises(ValueError, match="one entry per dim"):
        zero_dim((8, 8), (1,), 2)


def test_zero_spec_adds_data_minor_on_the_zero_dim():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert zero_spec(P(None, "model"), (6, 8), mesh) == P(None, ("model", "data"))
    assert zero_spec(P(None, "model"), (8, 8), mesh) == P(("data",), "model")
    assert zero_spec(P(), (3,), mesh) == P()
    assert zero_spec(P(), (), mesh) == P()


def test_replica_accumulator_is_stacked_over_data_at_todays_bytes():
    step, _, _ = _train("step", "one")
    today, _, _ = _train("microbatch", "one")
    (a,), (b,) = step.stage_executables, today.stage_executables
    for acc, grad in zip(jax.tree.leaves(a.zero_grads()), jax.tree.leaves(b.zero_grads())):
        assert acc.shape == (8, *grad.shape)
        assert acc.sharding.spec[0] == "data"
        # per device the bytes of today's (a parameter replicated over data)
        assert acc.addressable_shards[0].data.nbytes == grad.addressable_shards[0].data.nbytes


def test_stage_grad_reduce_round_trips_and_is_checked():
    stage = Stage(0, 2, (1, 4), (2, 2), 1.0, 2.0, 1, grad_reduce="step")
    assert Stage.from_json(stage.to_json()) == stage
    old = stage.to_json()
    del old["grad_reduce"]
    assert Stage.from_json(old).grad_reduce == "microbatch"
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        Stage(0, 2, (1, 4), (2, 2), 1.0, 2.0, 1, grad_reduce="layer")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        # 32 rows in 8 microbatches of 4: not a row for each of 8 replicas
        (
            {**ONE_STAGE, "num_microbatches": 8},
            r"batch size 32 must divide by num_microbatches \* dp = 8 \* 8; use "
            r"num_microbatches in \[1, 2, 4\]",
        ),
        (
            {"stages": "auto", "layout": "data-parallel", "grad_reduce": "auto"},
            "grad_reduce='auto' lets the stage search choose per stage",
        ),
        ({**TWO_STAGES, "offload": "optimizer"}, "grad_reduce='step' with offload"),
        (
            {**ONE_STAGE, "offload": "none", "num_microbatches": 8},
            r"num_microbatches \* dp = 8 \* 8",
        ),
        ({**TWO_STAGES, "grad_reduce": "layer"}, "unknown grad_reduce 'layer'"),
    ],
)
def test_bad_step_reduction_requests_are_rejected(kw, message):
    workload, opt, params, batch, _, _ = _setup()
    kw = {"num_microbatches": NUM_MICROBATCHES, "grad_reduce": "step", **kw}
    with pytest.raises(ValueError, match=message):
        auto_pipeline(workload.loss_fn, opt, params, batch, **kw)


def test_the_stage_search_chooses_replicas_per_stage_and_the_runtime_runs_them():
    """``stages="auto"`` with ``grad_reduce="auto"`` on the MLP on 8 H100-priced devices,
    4 microbatches (at 2, this small MLP's reductions are latency-bound, and a sharded
    update's reduce-scatter and all-gather pay two latencies where one all-reduce pays one:
    the search keeps the reduction every microbatch):
    the search takes replicas reduced once a step for some stages and not others (a lower
    objective than the search without them), and the runtime runs the stages it chose as
    replicas -- only those -- training like one device."""
    workload, opt, params, batch, single_losses, single = _setup("sgd")

    def trainer(grad_reduce):
        return auto_pipeline(
            workload.loss_fn, opt, params, batch, num_microbatches=4,
            grad_reduce=grad_reduce, cluster="dgx-h100",
        )  # fmt: skip

    chosen, every = trainer("auto"), trainer("microbatch")
    reduces = [s.grad_reduce for s in chosen.inter_plan.stages]
    assert "step" in reduces and "microbatch" in reduces
    assert chosen.inter_plan.objective_s < every.inter_plan.objective_s
    for planned, st in zip(chosen.plan.stages, chosen.stage_executables, strict=True):
        assert (st.replicas is not None) == (planned.stage.grad_reduce == "step")
    losses = [float(chosen.step(batch)) for _ in range(NUM_STEPS)]
    np.testing.assert_allclose(losses, single_losses, rtol=LOSS_RTOL)
    assert _max_diff(chosen.params, single) < PARAM_ATOL
    # predicted against compiled: each replica stage's update reduce-scatters and
    # all-gathers over data the gradient bytes the search priced, and all-reduces the rest
    cost = chosen.intra_cost
    for index, planned in enumerate(chosen.plan.stages):
        st = planned.stage
        if st.grad_reduce != "step":
            continue
        priced = [
            cost.replica_layer(i, tuple(st.logical_mesh))
            for i in range(st.start_layer, st.end_layer)
        ]
        found = _data_collectives(chosen, index, chosen.compiled_update(index))
        by_kind = {k: sum(c.bytes for c in found if c.kind == k) for k in {c.kind for c in found}}
        sharded = sum(x.sharded_grad_bytes for x in priced)
        assert by_kind.pop("reduce-scatter") == sharded == by_kind.pop("all-gather")
        assert by_kind.pop("all-reduce", 0) == sum(x.whole_grad_bytes for x in priced)
        assert by_kind == {}


def test_stage_memory_counts_the_stacked_accumulator_and_the_sharded_state():
    from autoshard.runtime.stage_memory import stage_memory

    step, _, _ = _train("step", "one")
    today, _, _ = _train("microbatch", "one")
    (a,), (b,) = stage_memory(step), stage_memory(today)
    # the stacked accumulator holds today's bytes; AdamW's mu and nu (2 x the f32
    # weights, replicated today) 1/8 of theirs
    weights = sum(p.nbytes for p in jax.tree.leaves(today.stage_executables[0].params))
    assert b.state_bytes - a.state_bytes == 2 * weights * 7 // 8


def test_a_loss_with_other_equations_per_replica_is_rejected():
    def loss(p, b):
        y = b["x"] @ p["w"]
        if b["x"].shape[0] > 4:  # the program itself depends on the rows
            return jnp.mean(y * y)
        return jnp.mean(jnp.abs(y))

    params, batch = {"w": jnp.ones((8, 4))}, {"x": jnp.ones((16, 8))}
    with pytest.raises(ValueError, match=r"other equations than at the microbatch \(equation 1"):
        auto_pipeline(
            loss,
            optax.sgd(0.1),
            params,
            batch,
            num_microbatches=2,
            stages=((0, 1),),
            layout="data-parallel",
            grad_reduce="step",
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--devices", "8", "--pipeline", "auto", "--offload", "optimizer"]
            + ["--cluster", "dgx-h100"],
            "grad_reduce='step' with offload",
        ),
        (["--mesh", "8"], "--grad-reduce set pipeline stages; add --pipeline"),
    ],
)
def test_cli_grad_reduce_flag_reaches_the_pipeline(argv, message, capsys):
    from autoshard.cli.main import main

    rc = main(["run", "--model", "mlp", *argv, "--grad-reduce", "step", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_replicas_that_cannot_run_are_refused_under_step_and_not_offered_under_auto():
    # gpt-tiny at one row a replica squeezes a batch dim ([2, 32, 1, 1] -> [32, 1, 1]):
    # asked for, the replicas are refused with the tensor; under "auto" the search is
    # not offered them and the stage reduces every microbatch
    workload = get_workload("gpt-tiny", num_layers=1)
    opt = make_optimizer("sgd", 0.1)
    params, _, batch = workload.init_train_args(opt, seed=1)
    kw = {"num_microbatches": 4, "stages": ((0, 3),), "logical_meshes": ((2, 4),)}
    with pytest.raises(ValueError, match="not one batch dim split 2 ways"):
        auto_pipeline(workload.loss_fn, opt, params, batch, grad_reduce="step", **kw)
    trainer = auto_pipeline(workload.loss_fn, opt, params, batch, grad_reduce="auto", **kw)
    assert [s.stage.grad_reduce for s in trainer.plan.stages] == ["microbatch"]
    assert trainer.stage_executables[0].replicas is None
