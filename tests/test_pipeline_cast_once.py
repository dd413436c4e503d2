"""Weights cast once a step: the pipeline runtime casts each f32 weight a stage reads once,
through a convert to 16 bits, in one program per step (``StageExecutable.live_params``),
and every microbatch reads the 16-bit copy; the gradient w.r.t. the copy is cast to f32
as the convert's transpose did.  The values are the per-microbatch cast's, bit for bit;
the copies are held all step, which the stage search prices, and the casts are priced
once a step."""

import jax
import numpy as np
import pytest

from autoshard.api_pipeline import auto_pipeline, microbatch_graph
from autoshard.models import get_workload, make_optimizer

_STAGES = ((0, 2), (2, 4))  # gpt-tiny with two blocks: embedding, block_0 | block_1, head


def _train(cast_once, microbatches, recompute="none", meshes=((1, 2), (1, 2)), steps=2):
    workload = get_workload("gpt-tiny", num_layers=2, dtype="bfloat16")
    opt = make_optimizer("adamw")
    params, _, batch = workload.init_train_args(opt, seed=0)
    trainer = auto_pipeline(
        workload.loss_fn, opt, params, batch, devices=jax.devices()[:4],
        num_microbatches=microbatches, stages=_STAGES, logical_meshes=meshes,
        cluster="dgx-a100", recompute=recompute, cast_once=cast_once,
    )  # fmt: skip
    losses = [float(trainer.step(batch)) for _ in range(steps)]
    return trainer, losses


def _assert_same_training(microbatches, recompute):
    once, losses_once = _train(True, microbatches, recompute)
    each, losses_each = _train(False, microbatches, recompute)
    assert all(st.cast_once for st in once.stage_executables)
    assert not any(st.cast_once for st in each.stage_executables)
    assert losses_once == losses_each
    for a, b in zip(jax.tree.leaves(once.params), jax.tree.leaves(each.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return once, each


def test_cast_once_trains_bit_for_bit_with_tensor_parallelism_and_recompute():
    """Two microbatches, each stage on a (1, 2) mesh (weights split over ``model``), full
    recompute: the same losses and weights as casting every microbatch; the compiled
    forward takes the cast weights in bf16 and casts none of them."""
    once, each = _assert_same_training(2, "full")
    _, graph = microbatch_graph("gpt-tiny", 2, "adamw", dtype="bfloat16", num_layers=2)
    for i, st in enumerate(once.stage_executables):
        live = dict(zip(st.param_ids, jax.tree.leaves(st.live_params()), strict=True))
        assert {str(live[t].dtype) for t in st.cast_once} == {"bfloat16"}
        assert {str(live[t].dtype) for t in live if t not in st.cast_once} == {"float32"}
        assert {str(g.dtype) for g in jax.tree.leaves(st.zero_grads())} == {"float32"}
        # the forward's arguments: the cast weights in bf16 (as many more bf16 as are cast)
        args = [
            once.compiled_forward(i).as_text().split("entry_computation_layout={(")[1],
            each.compiled_forward(i).as_text().split("entry_computation_layout={(")[1],
        ]
        bf16 = [a.split(")->")[0].count("bf16[") for a in args]
        assert bf16[0] == bf16[1] + len(st.cast_once)
        # the traced step converts each of these weights once, in the forward
        for t in st.cast_once:
            readers = [n for n in graph.tensors[t].consumers if graph.nodes[n].phase != "update"]
            assert [graph.nodes[n].primitive for n in readers] == ["convert_element_type"]


@pytest.mark.heavy  # the other microbatch counts (the default run has 2)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_cast_once_trains_bit_for_bit_at_one_and_four_microbatches(microbatches):
    _assert_same_training(microbatches, "none")


def test_cast_once_holds_the_copies_and_the_planner_prices_them():
    """The compiled stage holds each cast weight's bf16 copy beside its f32 master (state
    bytes up by the copies' bytes) and no longer keeps the copies its backward reads as
    residuals per microbatch in flight (the forward passes the copy through); the
    planner's peak moves by the same bytes, to the byte."""
    from autoshard.runtime.stage_memory import stage_memory

    once, _ = _train(True, 2, steps=0)
    each, _ = _train(False, 2, steps=0)
    rows = zip(once.stage_executables, stage_memory(once), stage_memory(each), strict=True)
    for st, m1, m0 in rows:
        live = dict(zip(st.param_ids, jax.tree.leaves(st.live_params()), strict=True))
        copies = sum(
            int(np.prod(live[t].sharding.shard_shape(live[t].shape))) * 2 for t in st.cast_once
        )
        assert copies > 0
        assert m1.state_bytes - m0.state_bytes == copies
        assert 0 < m0.residual_bytes - m1.residual_bytes <= copies  # the weights' copies
        assert m1.working_bytes == m0.working_bytes
        assert m1.predicted_bytes - m0.predicted_bytes == pytest.approx(
            m1.compiled_bytes - m0.compiled_bytes, abs=1.0
        )


def test_cast_once_with_data_parallel_replicas_trains_bit_for_bit_and_prices_memory():
    """``grad_reduce="step"``: each stage as 2 replicas of a plan over ``model`` (2); the
    weights cast once a step are passed through inside the replicas' ``shard_map`` too:
    the same losses and weights, and the planner's peak moves as the compiled one."""
    from autoshard.runtime.stage_memory import stage_memory

    def train(cast_once):
        workload = get_workload("gpt-tiny", num_layers=2, dtype="bfloat16")
        opt = make_optimizer("adamw")
        params, _, batch = workload.init_train_args(opt, seed=0)
        trainer = auto_pipeline(
            workload.loss_fn, opt, params, batch, devices=jax.devices(), num_microbatches=2,
            stages=_STAGES, logical_meshes=((2, 2), (2, 2)), cluster="dgx-a100",
            grad_reduce="step", cast_once=cast_once,
        )  # fmt: skip
        return trainer, [float(trainer.step(batch)) for _ in range(2)]

    (once, losses_once), (each, losses_each) = train(True), train(False)
    assert all(st.replicas is not None and st.cast_once for st in once.stage_executables)
    assert losses_once == losses_each
    for a, b in zip(jax.tree.leaves(once.params), jax.tree.leaves(each.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for m1, m0 in zip(stage_memory(once), stage_memory(each), strict=True):
        assert m1.residual_bytes < m0.residual_bytes
        assert m1.predicted_bytes - m0.predicted_bytes == pytest.approx(
            m1.compiled_bytes - m0.compiled_bytes, abs=1.0
        )


def test_masters_resting_in_host_memory_pass_their_copies_through_as_priced():
    """``optimizer,master``: the masters' bf16 copies were made once a step already; with
    ``cast_once`` their converts pass the copies through too, so the backward keeps none
    per microbatch in flight (state unchanged), and the planner's peak moves by the
    compiled bytes."""
    from autoshard.runtime.stage_memory import stage_memory

    def stages(cast_once):
        workload = get_workload("gpt-tiny", num_layers=2, dtype="bfloat16")
        opt = make_optimizer("adamw")
        params, _, batch = workload.init_train_args(opt, seed=0)
        trainer = auto_pipeline(
            workload.loss_fn, opt, params, batch, devices=jax.devices()[:4],
            num_microbatches=2, stages=_STAGES, logical_meshes=((1, 2), (1, 2)),
            cluster="alpa-v100", offload="optimizer,master", cast_once=cast_once,
        )  # fmt: skip
        assert all(st.masters_on_host for st in trainer.stage_executables)
        return stage_memory(trainer)

    for m1, m0 in zip(stages(True), stages(False), strict=True):
        assert m1.state_bytes == m0.state_bytes
        assert m1.residual_bytes < m0.residual_bytes
        assert m1.predicted_bytes - m0.predicted_bytes == pytest.approx(
            m1.compiled_bytes - m0.compiled_bytes, abs=1.0
        )
