"""Pipeline runtime: pipelined training equals single-device training, stage cutting, errors.

Parameters are compared (SGD and AdamW) with ``rtol=1e-5`` plus an absolute floor of ``1e-5 x`` the
largest magnitude in the leaf: biases start at exactly zero, so a few elements are tiny
and only float32 rounding of the leaf's scale is meaningful there.  Parameter *updates*
(new - initial) are compared too; a wrong microbatch scaling changes them by 2x or more.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import optax
import pytest

from autoshard.api_pipeline import auto_pipeline
from autoshard.inter.flops_cost import LayerStats, flops_stage_cost, layer_stats
from autoshard.inter.program_cut import split_stages
from autoshard.models import get_workload, make_optimizer, make_train_step
from autoshard.trace.jaxpr import trace

NUM_STEPS = 3
NUM_MICROBATCHES = 4


def _optimizer(name: str) -> optax.GradientTransformation:
    return make_optimizer("sgd", 0.1) if name == "sgd" else make_optimizer("adamw")


def _workload(name: str):
    if name == "mlp":
        return get_workload("mlp", hidden=32, num_layers=4, batch_size=16)
    return get_workload("gpt-tiny", num_layers=4)


@functools.cache
def _setup(model: str, optimizer: str):
    """Initial params, a fixed batch, and the single-device run: losses and final params."""
    workload = _workload(model)
    opt = _optimizer(optimizer)
    params, opt_state, batch = workload.init_train_args(opt, seed=1)
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    p, losses = params, []
    for _ in range(NUM_STEPS):
        p, opt_state, loss = step(p, opt_state, batch)
        losses.append(float(loss))
    return workload, opt, params, batch, losses, jax.device_get(p)


def _assert_params_close(got, want, initial, rtol: float) -> None:
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    leaves = zip(flat_got, jax.tree.leaves(want), jax.tree.leaves(initial), strict=True)
    for (path, g), w, p0 in leaves:
        w, p0 = np.asarray(w), np.asarray(p0)
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)
        update, want_update = g - p0, w - p0
        scale = np.abs(want_update).max()
        assert scale > 0, f"{name} was never updated"
        # an update is only known to one ulp of the parameter it was added to (g and w are
        # rounded there: a layer-norm scale near 1.0 has ulp 1.2e-7, more than 20 * rtol * a
        # small update); a different summation order may move it by that ulp
        ulp = float(np.spacing(np.abs(w).max()))
        np.testing.assert_allclose(update, want_update, atol=20 * rtol * scale + ulp, err_msg=name)


def _train(model: str, optimizer: str, **kw):
    """Pipelined run: (trainer, losses, single-device losses, params, theirs, initial)."""
    return _cached_train(model, optimizer, tuple(sorted(kw.items())))


@functools.cache
def _intra_cost(model: str, optimizer: str):
    """The solved intra-op ILPs of one model's microbatch step, shared by the tests."""
    return _cached_train(model, optimizer, (("num_stages", 2), ("stages", "equal-layer")))[
        0
    ].intra_cost


@functools.cache
def _cached_train(model: str, optimizer: str, kw: tuple):
    workload, opt, params, batch, losses, final = _setup(model, optimizer)
    kw = dict(kw)
    if kw.get("layout", "intra-op") == "intra-op" and kw != {
        "num_stages": 2,
        "stages": "equal-layer",
    }:
        kw["intra_cost"] = _intra_cost(model, optimizer)
    trainer = auto_pipeline(
        workload.loss_fn, opt, params, batch, num_microbatches=NUM_MICROBATCHES, **kw
    )
    got = [float(trainer.step(batch)) for _ in range(NUM_STEPS)]
    return trainer, got, losses, trainer.params, final, params


# 4 stages: heavy (CI's heavy step); 2 stages of each schedule run by default
@pytest.mark.parametrize("num_stages", [2, pytest.param(4, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_pipeline_matches_single_device_sgd(num_stages, schedule):
    trainer, got, want, params, final, initial = _train(
        "gpt", "sgd", stages="equal-layer", num_stages=num_stages, schedule=schedule
    )
    assert len(trainer.plan.stages) == num_stages
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_params_close(params, final, initial, rtol=1e-5)


@pytest.mark.parametrize(
    ("stages", "num_stages", "schedule"),
    [
        (((0, 2), (2, 6)), None, "1f1b"),
        ("equal-flops", 4, "gpipe"),
        # heavy (CI's heavy step): the auto cut at a fixed count; by default the auto cut
        # whose count is searched (below) and 1f1b on the explicit cut and in the test above
        pytest.param("auto", 2, "1f1b", marks=pytest.mark.heavy),
        ("auto", None, "gpipe"),
    ],
)
def test_gpt_stage_choices_match_single_device_sgd(stages, num_stages, schedule):
    trainer, got, want, params, final, initial = _train(
        "gpt", "sgd", stages=stages, num_stages=num_stages, schedule=schedule
    )
    plan = trainer.plan
    if isinstance(stages, tuple):
        assert tuple((s.stage.start_layer, s.stage.end_layer) for s in plan.stages) == stages
    if stages == "auto":
        assert plan.stage_plan is not None
        assert [(s.stage.start_layer, s.stage.end_layer) for s in plan.stages] == [
            (a.start_layer, a.end_layer) for a in plan.stage_plan.stages
        ]
    if num_stages is not None:
        assert len(plan.stages) == num_stages
    # every device is used exactly once
    assert sorted(d for s in plan.stages for d in s.stage.device_ids) == sorted(
        d.id for d in jax.devices()
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_params_close(params, final, initial, rtol=1e-5)


def test_forced_logical_meshes_run_tensor_parallel_stages():
    # stage 0 on a (1, 4) sub-mesh viewed as (1, 4), stage 1 viewed as (2, 2): the intra-op
    # plans split the block weights over "model" (Megatron's column/row split), and the
    # step still equals the single-device step
    trainer, got, want, params, final, initial = _train(
        "gpt",
        "sgd",
        stages=((0, 3), (3, 6)),
        logical_meshes=((1, 4), (2, 2)),
        schedule="1f1b",
    )
    plan = trainer.plan
    assert [s.stage.logical_mesh for s in plan.stages] == [(1, 4), (2, 2)]
    assert [s.layout for s in plan.stages] == ["intra-op", "intra-op"]
    assert all(s.tensor_parallel for s in plan.stages)
    for stage, block in ((0, "block_0"), (1, "block_2")):
        compiled = trainer.compiled_forward(stage)
        sharding = compiled.input_shardings[0][0][block]["attn"]["qkv"]["kernel"]
        assert "model" in jax.tree.leaves(sharding.spec[1])  # columns split over "model"
        tp = plan.stages[stage].stage.logical_mesh[1]
        assert sharding.shard_shape((64, 192))[1] <= 192 // tp
        text = compiled.as_text()
        entry = text[text.index("ENTRY") :]
        # the executable takes the kernel's shard as a parameter, and reduces partial sums
        # of the row-split projections across devices
        assert re.search(r"f32\[64,(48|24)\]\{[0-9,]*\} parameter\(", entry)
        assert "all-reduce(" in text
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_params_close(params, final, initial, rtol=1e-5)


def test_data_parallel_layout_replicates_parameters():
    trainer, got, want, params, final, initial = _train(
        "gpt", "sgd", stages="equal-layer", num_stages=2, schedule="gpipe", layout="data-parallel"
    )
    assert [s.layout for s in trainer.plan.stages] == ["data-parallel"] * 2
    assert [s.stage.logical_mesh for s in trainer.plan.stages] == [(4, 1), (4, 1)]
    assert trainer.inter_plan is None
    compiled = trainer.compiled_forward(0)
    specs = [s.spec for s in jax.tree.leaves(compiled.input_shardings[0][0])]
    assert specs and all(not any(spec) for spec in specs)  # every parameter replicated
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_params_close(params, final, initial, rtol=1e-5)


def test_adamw_per_stage_updates_equal_the_whole_model_update():
    # Each stage runs AdamW on its own leaves. Fed the same gradients, the stages' updates
    # must equal one whole-model AdamW update (state, step count, weight decay per leaf).
    # The gradients are captured from the stages themselves: compared with the
    # single-device step's instead, Adam's per-element scaling magnifies the rounding of a
    # forward and a backward compiled apart (1.04x the bound on one element of 64 once the
    # stages kept their activations), which says nothing about the optimizer. The losses
    # are still compared with the single-device step.
    workload = _workload("gpt")
    opt = make_optimizer("adamw")
    params, opt_state, batch = workload.init_train_args(opt, seed=1)
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    trainer = auto_pipeline(
        workload.loss_fn,
        opt,
        params,
        batch,
        devices=jax.devices()[:2],
        num_microbatches=2,  # (one microbatch runs the update inside the backward)
        stages="equal-layer",
        num_stages=2,
    )
    captured: dict[int, object] = {}
    for st in trainer._stages:
        update = st.update

        def recording(p, state, grads, st=st, update=update):
            captured.update(zip(st.param_ids, jax.tree.leaves(grads), strict=True))
            return update(p, state, grads)

        st.update = recording
    p, ref_params, ref_state = params, params, opt_state
    for _ in range(NUM_STEPS):
        p, opt_state, want = step(p, opt_state, batch)
        np.testing.assert_allclose(float(trainer.step(batch)), float(want), rtol=1e-5)
        grads = jax.tree.unflatten(
            trainer._params_treedef, [np.asarray(captured[t]) for t in trainer._param_ids]
        )
        updates, ref_state = opt.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    _assert_params_close(trainer.params, jax.device_get(ref_params), params, rtol=1e-5)


def test_one_microbatch_updates_inside_the_backward_like_one_device():
    # one microbatch a step: each stage's backward and update are one program, the state
    # donated, no gradient accumulator (as the stage search prices it: no f32 gradient
    # buffer held all step); the training is one device's
    workload, opt, params, batch, losses, final = _setup("gpt", "sgd")
    trainer = auto_pipeline(
        workload.loss_fn, opt, params, batch, devices=jax.devices()[:2], num_microbatches=1,
        stages="equal-layer", num_stages=2,
    )  # fmt: skip

    def unused(*args):
        raise AssertionError("one microbatch needs no accumulator nor separate update")

    for st in trainer.stage_executables:
        st.zero_grads = st.backward = st.update = unused
    before = [jax.tree.leaves(st.params)[0] for st in trainer.stage_executables]
    got = [float(trainer.step(batch)) for _ in range(NUM_STEPS)]
    assert all(x.is_deleted() for x in before)  # donated: updated in place
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    _assert_params_close(trainer.params, final, params, rtol=1e-5)


def _key_bias_mask(workload) -> np.ndarray:
    """The key columns of the qkv bias (laid out head by head as [H, 3, D])."""
    cfg = workload.config
    heads, d = cfg.num_heads, cfg.head_dim
    mask = np.zeros((heads, 3, d), bool)
    mask[:, 1, :] = True
    return mask.reshape(-1)


def test_key_bias_gradient_is_float32_residue():
    """The attention key bias has a gradient that is zero in exact arithmetic.

    It adds ``q . b_k`` to every score of query ``q``, the same for every key, and softmax
    ignores a shift shared by a row.  Computed in float32 the gradient is what is left of
    per-row sums that cancel: about 1e-9 of the query/value bias gradients.  That residue
    is not random across batch summation orders (the mean of four microbatch gradients
    gives nearly the same value as the full batch, measured), so it is a rounding
    artifact of each row's softmax, not a signal: it is asserted small, not unstable.
    """
    workload, _, params, batch, _, _ = _setup("gpt", "sgd")
    grad = jax.jit(jax.grad(workload.loss_fn))
    full = grad(params, batch)
    parts = [
        grad(params, jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], batch)) for k in range(4)
    ]
    mean = jax.tree.map(lambda *g: sum(g) / 4, *parts)
    key = _key_bias_mask(workload)
    for block in ("block_0", "block_3"):
        a = np.asarray(full[block]["attn"]["qkv"]["bias"], np.float64)
        b = np.asarray(mean[block]["attn"]["qkv"]["bias"], np.float64)
        scale = np.abs(a[~key]).max()
        assert np.abs(a[key]).max() < 1e-6 * scale  # noise next to the real gradients
        np.testing.assert_allclose(b[~key], a[~key], atol=1e-5 * scale)
        assert np.abs(b[key]).max() < 1e-6 * scale


def _adamw_errors():
    """Per leaf (path -> relative L2 error) of the AdamW pipeline run after 3 steps, with
    the qkv bias split into its key part and the rest, and how far the key bias moved."""
    workload, _, _, _, _, _ = _setup("gpt", "adamw")
    _, got, want, params, final, initial = _train(
        "gpt", "adamw", stages="equal-layer", num_stages=2, schedule="1f1b"
    )
    key = _key_bias_mask(workload)
    errors, key_moves = {}, []
    for (path, g), w, p0 in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(final),
        jax.tree.leaves(initial),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        g, w, p0 = (np.asarray(x, np.float64) for x in (g, w, p0))
        if name.endswith("['qkv']['bias']"):
            key_moves += [np.abs(x[key] - p0[key]).max() for x in (g, w)]
            g, w = g[~key], w[~key]
        errors[name] = np.linalg.norm(g - w) / np.linalg.norm(w)
    return got, want, errors, key_moves


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_gpt_pipeline_matches_single_device_adamw_loss():
    """AdamW as ``make_optimizer("adamw")`` builds it (lr 1e-3, eps 1e-8, weight decay
    0.01): 2 stages, tensor parallel inside, 4 microbatches, 3 steps.  The losses agree
    to 1e-4; the key part of the qkv bias (zero gradient in exact arithmetic, a float32
    residue: see above) moves by less than ``lr`` per step in both runs, whatever Adam
    makes of the residue.  The parameters are the strict xfail below.
    """
    got, want, _, key_moves = _adamw_errors()
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert max(key_moves) < NUM_STEPS * 1e-3


@pytest.mark.heavy  # with the AdamW loss test above (one AdamW pipeline run for both)
@pytest.mark.xfail(
    strict=True,
    reason="Adam amplifies float32 summation-order differences where a gradient element "
    "is near eps=1e-8: measured relative L2 errors 1.7e-3 (block_1 qkv bias, key part "
    "excluded) and 2.6e-4 (block_2 ln_1 bias) with tensor-parallel stages",
)
def test_gpt_pipeline_adamw_parameters_within_1e4():
    """The issue's "AdamW within 1e-4", per leaf in relative L2 norm (key bias excluded).

    Does not hold with eps=1e-8: Adam's step ``m / (sqrt(v) + eps)`` is ill-conditioned
    where a gradient element is near eps or cancels across steps.  The gradients
    themselves match (the SGD tests, 1e-5), and with one microbatch and one device per
    stage AdamW matches elementwise at 1e-5 (the per-stage test above), so what is left
    is the summation order of data/tensor parallelism, amplified by Adam.
    """
    _, _, errors, _ = _adamw_errors()
    name, worst = max(errors.items(), key=lambda item: item[1])
    assert worst < 1e-4, f"{name}: relative error {worst:.2e}"


def test_mlp_pipeline_matches_single_device():
    _, got, want, params, final, initial = _train(
        "mlp", "sgd", stages="equal-layer", num_stages=4, schedule="gpipe"
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_params_close(params, final, initial, rtol=1e-5)


def test_tied_embedding_owned_once_and_updated_like_single_device():
    # the same run as the explicit-stages case above (cached): embedding + 1 block | rest
    trainer, _, _, params, final, initial = _train(
        "gpt", "sgd", stages=((0, 2), (2, 6)), num_stages=None, schedule="1f1b"
    )
    wte = "['embedding']['wte']"
    owners = [s.index for s in trainer.plan.stages if wte in s.owned_params]
    receivers = [s.index for s in trainer.plan.stages if wte in s.received_params]
    assert owners == [0] and receivers == [1]  # embedding stage owns it, the head receives it
    owned = [p for s in trainer.plan.stages for p in s.owned_params]
    assert len(owned) == len(set(owned)) == len(jax.tree.leaves(initial))
    got = params["embedding"]["wte"]
    want, start = np.asarray(final["embedding"]["wte"]), np.asarray(initial["embedding"]["wte"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the head's gradient reached wte: rows of tokens never seen still moved (through the
    # LM head), exactly as on one device
    np.testing.assert_allclose(got - start, want - start, atol=1e-4 * np.abs(want - start).max())


def _traced_gpt():
    workload, _, params, batch, _, _ = _setup("gpt", "sgd")
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape[1:]), x.dtype), batch)
    return trace(workload.loss_fn, params, mb, arg_kinds=("param", "data")).records


@pytest.mark.parametrize("ranges", [[(0, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 2), (2, 5), (5, 6)]])
def test_split_stages_partitions_the_program(ranges):
    records = _traced_gpt()
    stages = split_stages(records, ranges)
    all_eqns = sorted(i for s in stages for i in s.eqns)
    assert all_eqns == list(range(len(records.eqns)))
    params = [t for t in records.inputs if records.tensors[t].kind == "param"]
    assert sorted(t for s in stages for t in s.params) == sorted(params)
    made_in = {t: s.index for s in stages for i in s.eqns for t in records.eqns[i].outputs}
    made_in.update({t: s.index for s in stages for t in s.params})
    for s in stages:
        for t, src in zip(s.received, s.received_from, strict=True):
            assert src < s.index and made_in[t] == src
            sender = stages[src]
            assert s.index in sender.output_consumers[sender.outputs.index(t)]
        reads = {t for i in s.eqns for t in records.eqns[i].inputs}
        assert set(s.received) | set(s.params) | set(s.data) >= {
            t for t in reads if records.tensors[t].kind in ("param", "data")
        } | {t for t in reads if made_in.get(t, s.index) != s.index}
    assert records.outputs[0] in stages[-1].outputs


def test_flops_stage_cost_scales_with_devices_and_rejects_tensor_parallel():
    stats = LayerStats(("a", "b"), (4e12, 2e12), (100.0, 50.0), (0.0, 64.0))
    cost = flops_stage_cost(stats, peak_flops=1e12)
    one = cost(0, 2, (1, 1), (1, 1))
    four = cost(0, 2, (1, 4), (4, 1))
    assert one.latency_s == pytest.approx(3 * 6.0)
    assert four.latency_s == pytest.approx(one.latency_s / 4)
    assert four.param_bytes == one.param_bytes == 4 * 150.0
    assert cost(1, 2, (1, 4), (4, 1)).activation_bytes == pytest.approx(16.0)
    assert cost(0, 2, (1, 4), (2, 2)).latency_s == float("inf")


def test_layer_stats_of_gpt():
    records = _traced_gpt()
    stats = layer_stats(records)
    assert stats.layers == ("embedding", "block_0", "block_1", "block_2", "block_3", "head")
    blocks = stats.forward_flops[1:5]
    assert min(blocks) == max(blocks) > 0  # identical blocks cost the same
    # wte is first read by the embedding: counted there, not again at the tied head
    param_bytes = sum(
        records.tensors[t].nbytes for t in records.inputs if records.tensors[t].kind == "param"
    )
    assert sum(stats.param_bytes) == param_bytes


def _gpt_args():
    workload, opt, params, batch, _, _ = _setup("gpt", "sgd")
    return workload.loss_fn, opt, params, batch


def test_microbatches_that_do_not_divide_the_batch_are_rejected():
    with pytest.raises(ValueError, match=r"batch size 8.*\[1, 2, 4, 8\]"):
        auto_pipeline(*_gpt_args(), num_microbatches=3, stages="equal-layer", num_stages=2)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"stages": "equal-layer", "num_stages": 7}, "7 stages for 6 layers"),
        (
            {"stages": "equal-layer", "num_stages": 3},
            r"8 devices cannot be split evenly.*\[1, 2, 4\]",
        ),
        (
            {"stages": "equal-layer", "num_stages": 4, "devices": "first 2"},
            "4 stages for 2 devices",
        ),
        ({"stages": [(0, 2), (3, 6)]}, "contiguous"),
        ({"stages": [(0, 2), (2, 5)]}, "end at layer 5"),
        ({"stages": "equal-layers", "num_stages": 2}, "unknown stages"),
        ({"stages": "equal-layer"}, "needs num_stages"),
        ({"stages": "equal-layer", "num_stages": 2, "schedule": "zb"}, "unknown schedule"),
    ],
)
def test_bad_pipeline_requests_are_rejected(kw, message):
    if kw.get("devices") == "first 2":
        kw = {**kw, "devices": jax.devices()[:2]}
    with pytest.raises(ValueError, match=message):
        auto_pipeline(*_gpt_args(), num_microbatches=4, **kw)
