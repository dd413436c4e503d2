"""Replicas must not change the math where rows couple (autoshard/ir/row_coupling.py):
``grad_reduce="step"`` runs ``dp`` replicas each on ``1/dp`` of the rows, which is the
microbatch's program only when no batch statistic flows back into rows or through a
non-linear op. Wide-ResNet's batch norm is such a statistic: "step" refuses it, "auto"
keeps its stages off replicas (the GPT and MLP stay offered)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.api_pipeline import auto_pipeline, trace_microbatch
from autoshard.hardware.mesh import uniform_mesh
from autoshard.inter.options import StageSearchOptions
from autoshard.inter.plan import LOGICAL_AXES
from autoshard.inter.search import search_stages
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stage_replicas import refuse_coupled_replicas
from autoshard.inter.stages import GRAD_REDUCES
from autoshard.ir.row_coupling import first_coupling_within, row_couplings, row_literals
from autoshard.models import get_workload, make_optimizer, make_train_step
from autoshard.runtime.stage_layout import loss_program
from autoshard.runtime.stage_replicas import ReplicaShapes
from autoshard.trace.jaxpr import trace_train_step

ROWS, DP = 8, 2
# wresnet-tiny at its smallest: 5 layers (stem, one block, head), 32 images, 2
# microbatches of 16: 8 rows a replica on dp = 2
WRESNET = {"batch_size": 32, "num_layers": 5}


def _couplings(loss):
    """``row_couplings`` of ``loss(params, batch)`` traced at ``ROWS`` and ``ROWS / DP`` rows."""
    opt = make_optimizer("sgd", 0.1)
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}

    def program(rows):
        batch = {"x": jax.ShapeDtypeStruct((rows, 4), jnp.float32)}
        state = jax.eval_shape(opt.init, params)
        step = trace_train_step(make_train_step(loss, opt), params, state, batch)
        return loss_program(step).program

    full, local = program(ROWS), program(ROWS // DP)
    shapes = ReplicaShapes.compare(full, local, DP)
    a = full.records
    literals = row_literals(a, local.records, DP, {t for e in a.eqns for t in e.inputs})
    return row_couplings(
        a.eqns, shapes.batch_dims, a.layers, loss=a.outputs[-1], row_literals=literals
    )


def _rows(params, batch):
    return batch["x"] @ params["w"]  # [rows, 3]


def test_a_mean_of_per_row_losses_does_not_couple():
    assert _couplings(lambda p, b: jnp.mean(jnp.sum(jnp.tanh(_rows(p, b)) ** 2, axis=1))) == ()
    # linear in the means: a constant times one, plus another
    assert _couplings(lambda p, b: 2.0 * jnp.mean(_rows(p, b)) + jnp.mean(_rows(p, b) ** 2)) == ()


def test_a_batch_statistic_fed_back_into_rows_couples():
    def bn_like(p, b):
        h = _rows(p, b)
        return jnp.mean((h - jnp.mean(h, axis=0)) ** 2)

    (first, *_) = _couplings(bn_like)
    assert first.primitive == "sub"
    assert "flows back into per-row values" in first.reason


@pytest.mark.parametrize(
    ("loss", "primitive"),
    [
        (lambda p, b: jnp.log(jnp.mean(_rows(p, b) ** 2)), "log"),
        (lambda p, b: jnp.mean(_rows(p, b)) * jnp.mean(_rows(p, b) ** 2), "mul"),
    ],
)
def test_a_non_linear_function_of_a_batch_statistic_couples(loss, primitive):
    (first,) = _couplings(loss)
    assert first.primitive == primitive
    assert "non-linear" in first.reason


def test_a_loss_summed_over_rows_couples():
    # the pipeline averages the replicas' losses: each would be 1/dp of the sum
    (first,) = _couplings(lambda p, b: jnp.sum(jnp.sum(_rows(p, b) ** 2, axis=1)))
    assert first.primitive == "reduce_sum"
    assert "sums over rows" in first.reason
    # divided by the rows (however written) it is a mean
    assert _couplings(lambda p, b: jnp.sum(_rows(p, b) ** 2) / b["x"].shape[0]) == ()
    assert _couplings(lambda p, b: jnp.sum(_rows(p, b) ** 2 / b["x"].shape[0])) == ()


def test_a_per_row_value_scaled_by_the_row_count_then_non_linear_couples():
    (first,) = _couplings(lambda p, b: jnp.mean(jnp.exp(_rows(p, b) / b["x"].shape[0])))
    assert first.primitive == "exp"


def test_a_reduction_over_rows_that_is_no_sum_couples():
    (first,) = _couplings(lambda p, b: jnp.max(jnp.sum(_rows(p, b), axis=1)))
    assert first.primitive == "reduce_max"


@functools.cache
def _wresnet():
    workload = get_workload("wresnet-tiny", **WRESNET)
    opt = make_optimizer("sgd", 0.1)
    params, _, batch = workload.init_train_args(opt, seed=1)
    return workload, opt, params, batch


def test_wresnet_batch_norm_couples_rows_in_its_stages_not_its_head():
    workload, opt, params, batch = _wresnet()
    programs = []
    for rows in (16, 8):  # a microbatch, and its half
        shapes = jax.tree.map(
            lambda x, r=rows: jax.ShapeDtypeStruct((r, *x.shape[1:]), x.dtype), batch
        )
        state = jax.eval_shape(opt.init, params)
        step = trace_train_step(make_train_step(workload.loss_fn, opt), params, state, shapes)
        programs.append(loss_program(step).program)
    full, local = programs
    found = row_couplings(
        full.records.eqns, ReplicaShapes.compare(full, local, 2).batch_dims, full.records.layers
    )
    assert full.records.layers == ("stem", "block_0", "head")
    assert "WideResNet/stem/bn" in first_coupling_within(found, 0, 1).module_path
    assert "WideResNet/block_0/bn" in first_coupling_within(found, 1, 2).module_path
    assert first_coupling_within(found, 2, 3) is None  # pooling over the image, then per row


def test_step_refuses_wresnet_naming_the_batch_norm():
    workload, opt, params, batch = _wresnet()
    with pytest.raises(
        ValueError, match=r"couples rows at equation \d+ \(sub\) in WideResNet/stem/bn"
    ) as err:
        auto_pipeline(
            workload.loss_fn, opt, params, batch, num_microbatches=2, grad_reduce="step",
            stages=((0, 3),), layout="data-parallel",
        )  # fmt: skip
    assert "grad_reduce='microbatch'" in str(err.value)


def test_simulate_refuses_step_on_wresnet():
    from autoshard.sim.simulate import simulate

    with pytest.raises(
        ValueError, match=r"couples rows at equation \d+ \(sub\) in WideResNet/stem/bn"
    ):
        simulate(
            "wresnet-tiny", "dgx-a100", 8, "auto", num_microbatches=2, global_batch=64,
            grad_reduce="step",
        )  # fmt: skip


def _mesh_for(data_beta: float):
    """Logical meshes whose ``data`` axis moves a byte in ``data_beta`` seconds."""

    def mesh_for(logical):
        return uniform_mesh(
            logical, LOGICAL_AXES, 1e-6, (data_beta, 1e-11), peak_flops=1e12, hbm_bandwidth=1e12
        )

    return mesh_for


def _cost(workload, batch: int, m: int = 2, data_beta: float = 1e-11, **overrides):
    """``workload``'s step at ``m`` microbatches, its replicas traced at 1/dp of one."""
    memo: dict = {}
    mesh_for = _mesh_for(data_beta)

    def cost_at(trace_m, replicas=None):
        graph = trace_microbatch(workload, trace_m, "sgd", **overrides).graph
        return IntraStageCost(
            graph, mesh_for, time_limit_s=30, num_microbatches=m, replicas=replicas
        )

    def replicas(dp):
        if dp not in memo:
            memo[dp] = cost_at(m * dp) if batch % (m * dp) == 0 else None
        return memo[dp]

    return cost_at(m, replicas)


@pytest.fixture(scope="module")
def wresnet_cost():
    return _cost("wresnet-tiny", 32, **WRESNET)


def test_auto_does_not_offer_replicas_to_wresnets_batch_norm_stages(wresnet_cost):
    cost = wresnet_cost
    for start, end in ((0, 1), (1, 2), (0, 3)):
        assert math.isinf(cost(start, end, (1, 2), (2, 1), grad_reduce="step").latency_s)
        assert math.isfinite(cost(start, end, (1, 2), (2, 1)).latency_s)  # microbatch
    # the head pools each image and classifies it: its replicas are the microbatch's math
    assert math.isfinite(cost(2, 3, (1, 2), (2, 1), grad_reduce="step").latency_s)
    with pytest.raises(ValueError, match=r"\(sub\) in WideResNet/stem/bn"):
        refuse_coupled_replicas(cost, 8)


def test_the_search_keeps_wresnets_batch_norm_stage_off_replicas():
    # slow data links: replicas (one reduction a step) would win the batch-norm stage
    cost = _cost("wresnet-tiny", 32, data_beta=1e-6, **WRESNET)
    options = StageSearchOptions(
        2, stages=((0, 2), (2, 3)), logical_meshes=((4, 1), (4, 1)), grad_reduces=GRAD_REDUCES
    )
    plan = search_stages(cost.graph, 1, 8, options, cost=cost)
    assert plan.stages[0].grad_reduce == "microbatch"  # stem and block_0: batch norm
    with pytest.raises(ValueError, match=r"couples rows .* WideResNet/stem/bn"):
        search_stages(
            cost.graph, 1, 8, dataclasses.replace(options, grad_reduces=("step",)), cost=cost
        )


@pytest.mark.parametrize(("workload", "batch"), [("gpt-tiny", 8), ("mlp", 32)])
def test_gpt_and_mlp_replicas_stay_offered(workload, batch):
    overrides = {"batch_size": batch} if workload == "mlp" else {}
    cost = _cost(workload, batch, **overrides)
    assert cost.replica_couplings(2) == ()
    refuse_coupled_replicas(cost, 8)  # nothing to refuse
    last = cost.num_layers
    assert math.isfinite(cost(0, last, (1, 2), (2, 1), grad_reduce="step").latency_s)


@pytest.mark.heavy
def test_wresnets_head_alone_as_replicas_trains_like_the_microbatch_mode(monkeypatch):
    """The rule is per stage: a statistic made in an earlier stage reaches the next one
    exact, so the head (global pooling per image, then per row) may run as replicas
    behind the batch-norm stages. "step" refuses the model as a whole; lifted here, the
    stages on (1, 4) and the head on 4 replicas train as the microbatch mode does."""
    import autoshard.api_replicas
    import autoshard.inter.search

    monkeypatch.setattr(autoshard.api_replicas, "refuse_row_coupling", lambda *a: None)
    monkeypatch.setattr(autoshard.inter.search, "refuse_coupled_replicas", lambda *a: None)
    workload, opt, params, batch = _wresnet()
    losses = {}
    for mode in ("microbatch", "step"):
        trainer = auto_pipeline(
            workload.loss_fn, opt, params, batch, num_microbatches=2, grad_reduce=mode,
            stages=((0, 2), (2, 3)), logical_meshes=((1, 4), (4, 1)),
        )  # fmt: skip
        modes = [s.stage.grad_reduce for s in trainer.plan.stages]
        assert modes == ["microbatch", mode]
        losses[mode] = [float(trainer.step(batch)) for _ in range(3)]
    # measured (jax 0.10.2): 8.2e-8 relative at the first step, equal after
    np.testing.assert_allclose(losses["step"], losses["microbatch"], rtol=1e-6)
