"""Pipeline runtime: stored activations, recompute per stage, interleaved 1F1B.

Forward executions are counted with the runtime's ``probe`` (a ``jax.debug.callback`` at
the start of every layer's forward equations, inside the layer's checkpoint when it is
recomputed): with stored activations every layer runs once per microbatch; under full
recompute the inner layers run again in the backward.  Every configuration also matches
the single-device SGD step (rtol 1e-5, as in test_pipeline.py).
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest

from autoshard.api_pipeline import auto_pipeline
from autoshard.models import get_workload, make_optimizer, make_train_step

NUM_MICROBATCHES = 2
LAYERS = ("embedding", "block_0", "block_1", "block_2", "block_3", "head")
INNER = LAYERS[1:-1]


@functools.cache
def _setup():
    workload = get_workload("gpt-tiny", num_layers=4)
    opt = make_optimizer("sgd", 0.1)
    params, opt_state, batch = workload.init_train_args(opt, seed=1)
    p, loss = jax.jit(make_train_step(workload.loss_fn, opt))(params, opt_state, batch)[::2]
    return workload, opt, params, batch, float(loss), jax.device_get(p)


def _run(**kw):
    """One pipelined step: (trainer, forward executions per layer), checked against one
    device. Run once per worker for the same keywords (``recompute`` defaults to
    auto_pipeline's own "none"): the tests only read the trainer after its step (its plan,
    executables, compiled memory), so those asking about one run share it."""
    kw.setdefault("layout", "data-parallel")
    kw.setdefault("recompute", "none")
    return _cached_run(tuple(sorted(kw.items())))


@functools.cache
def _cached_run(kw: tuple):
    kw = dict(kw)
    workload, opt, params, batch, want_loss, want_params = _setup()
    counts: collections.Counter = collections.Counter()
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        num_microbatches=NUM_MICROBATCHES,
        probe=lambda stage, layer: counts.update([layer]),
        **kw,
    )
    loss = float(trainer.step(batch))
    jax.effects_barrier()  # every callback has run
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(trainer.params), jax.tree.leaves(want_params), strict=True
    ):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    return trainer, dict(counts)


def _backward_flops(trainer, stage: int) -> float:
    """FLOPs XLA counts in a stage's compiled backward (one microbatch)."""
    st = trainer.stage_executables[stage]
    params, received, data = st.abstract_args()
    outs, residuals = jax.eval_shape(st.forward, params, received, data)
    cts = [jax.ShapeDtypeStruct(st.tensors[t].shape, st.tensors[t].dtype) for t in st.float_out]
    compiled = st.backward.lower(params, received, data, residuals, cts, params).compile()
    return float(compiled.cost_analysis()["flops"])


def test_stored_activations_run_each_forward_once_and_match_one_device():
    trainer, counts = _run(stages="equal-layer", num_stages=2, schedule="1f1b")
    assert counts == {layer: NUM_MICROBATCHES for layer in LAYERS}
    assert all(s.stage.recompute == "none" for s in trainer.plan.stages)
    assert all(st.recomputed_layers == () for st in trainer.stage_executables)


def test_full_recompute_runs_inner_layers_again_and_matches_one_device():
    trainer, counts = _run(stages="equal-layer", num_stages=2, schedule="1f1b", recompute="full")
    # inner layers (the blocks) twice per microbatch; the embedding and head once
    assert counts == {layer: NUM_MICROBATCHES * (2 if layer in INNER else 1) for layer in LAYERS}
    assert [st.recomputed_layers for st in trainer.stage_executables] == [
        ("block_0", "block_1"),
        ("block_2", "block_3"),
    ]


@pytest.mark.slow
def test_selective_recompute_redoes_less_than_full_and_matches_one_device():
    flops = {}
    for mode in ("none", "selective", "full"):
        trainer, _ = _run(stages="equal-layer", num_stages=2, schedule="1f1b", recompute=mode)
        flops[mode] = _backward_flops(trainer, 0)
    # the attention core is a small part of a block's forward: more work than none,
    # less than redoing the whole forward
    assert flops["none"] < flops["selective"] < flops["full"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data-parallel", "intra-op"])
def test_interleaved_1f1b_runs_chunks_round_robin_and_matches_one_device(layout):
    trainer, counts = _run(
        stages="equal-layer",
        num_stages=2,
        schedule="interleaved",
        virtual_stages=2,
        layout=layout,
    )
    assert counts == {layer: NUM_MICROBATCHES for layer in LAYERS}
    plan = trainer.plan
    assert plan.virtual_stages == 2 and len(plan.stages) == 4
    # chunk c of stage s is virtual stage c * S + s: chunks 0 and 2 share stage 0's devices
    devices = [s.stage.device_ids for s in plan.stages]
    assert devices[0] == devices[2] and devices[1] == devices[3]
    assert set(devices[0]).isdisjoint(devices[1])


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_auto_stages_with_each_recompute_mode_match_one_device(recompute):
    trainer, counts = _run(stages="auto", num_stages=2, layout="intra-op", recompute=recompute)
    assert {s.stage.recompute for s in trainer.plan.stages} == {recompute}
    again = 2 if recompute != "none" else 1  # a checkpointed layer's callback reruns
    assert counts == {
        layer: NUM_MICROBATCHES * (again if layer in INNER else 1) for layer in LAYERS
    }


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"schedule": "1f1b", "virtual_stages": 2}, "needs schedule='interleaved'"),
        ({"schedule": "interleaved", "virtual_stages": 0}, "positive int"),
        ({"recompute": "some"}, "unknown recompute"),
        ({"recompute": "auto", "layout": "data-parallel"}, "needs layout='intra-op'"),
        (
            {"schedule": "interleaved", "virtual_stages": 4, "layout": "data-parallel"},
            "model chunks for 6 layers",
        ),
    ],
)
def test_bad_runtime_requests_are_rejected(kw, message):
    workload, opt, params, batch, _, _ = _setup()
    kw = {"stages": "equal-layer", "num_stages": 2, **kw}
    with pytest.raises(ValueError, match=message):
        auto_pipeline(workload.loss_fn, opt, params, batch, num_microbatches=2, **kw)


def test_stage_memory_reads_the_compiled_terms_and_recompute_shrinks_residuals():
    from autoshard.runtime.stage_memory import stage_memory

    kept = {}
    for mode in ("none", "full"):
        trainer, _ = _run(stages="equal-layer", num_stages=2, schedule="1f1b", recompute=mode)
        rows = stage_memory(trainer)
        assert [m.in_flight for m in rows] == [2, 1]  # 1F1B: S - i, capped by microbatches
        for m, planned in zip(rows, trainer.plan.stages, strict=True):
            assert m.predicted_bytes == planned.stage.peak_bytes > 0
            assert m.state_bytes > 0 and m.residual_bytes > 0 and m.working_bytes >= 0
            assert m.compiled_bytes == (
                m.state_bytes + m.in_flight * m.residual_bytes + m.working_bytes
            )
        kept[mode] = [m.residual_bytes for m in rows]
    # stage 0 holds two blocks: full recompute keeps only their inputs
    assert kept["full"][0] < kept["none"][0] / 4
