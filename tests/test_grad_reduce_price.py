"""Pricing a stage's data-parallel gradients reduced once per step (``grad_reduce="step"``):
``dp`` replicas of a plan over ``model`` on 1/dp of the micro-batch, their gradients
reduced over ``data`` once a step and their update sharded over it (ZeRO-1;
``IntraStageCost.replica_range_cost``), offered to the stage DP beside the reduction every
micro-batch, and to the simulator."""

from __future__ import annotations

import math

import pytest

from autoshard.api_pipeline import trace_microbatch
from autoshard.hardware.mesh import uniform_mesh
from autoshard.inter.plan import LOGICAL_AXES, Stage
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.inter.stages import optimal_stage_plan

BATCH = 8  # gpt-tiny's global batch


def _mesh_for(data_beta: float):
    """Logical meshes whose ``data`` axis moves a byte in ``data_beta`` seconds (``model``
    in 1e-11 s), devices of 1e12 FLOP/s and 1e12 B/s."""

    def mesh_for(logical):
        return uniform_mesh(
            logical, LOGICAL_AXES, 1e-6, (data_beta, 1e-11), peak_flops=1e12, hbm_bandwidth=1e12
        )

    return mesh_for


def _cost(m: int, data_beta: float = 1e-10) -> IntraStageCost:
    """gpt-tiny's step at ``m`` micro-batches, its replicas traced at 1/dp of one."""
    mesh_for = _mesh_for(data_beta)

    def cost_at(trace_m, replicas=None):
        graph = trace_microbatch("gpt-tiny", trace_m).graph
        return IntraStageCost(
            graph, mesh_for, time_limit_s=30, num_microbatches=m, replicas=replicas
        )

    memo: dict = {}

    def replicas(dp):
        if dp not in memo:
            memo[dp] = cost_at(m * dp) if BATCH % (m * dp) == 0 else None
        return memo[dp]

    return cost_at(m, replicas)


@pytest.fixture(scope="module")
def cost2():
    return _cost(2)


def _param_bytes(graph) -> float:
    return sum(graph.tensors[t].nbytes for t in graph.inputs if graph.tensors[t].kind == "param")


def _grads(cost, logical) -> float:
    found = [cost.replica_layer(i, logical) for i in range(cost.num_layers)]
    return sum(x.sharded_grad_bytes + x.whole_grad_bytes for x in found)


def test_a_replica_reduces_every_parameters_gradient_once(cost2):
    """With one device per replica (tp = 1) the replicas' gradients are the whole model's,
    each parameter once (the tied embedding too); split over ``model`` (tp = 2), less."""
    whole = _grads(cost2, (4, 1))
    assert whole == _param_bytes(cost2.graph)
    assert _grads(cost2, (2, 2)) < whole
    # every gpt-tiny weight has a dim 4 divides (kernels, embeddings, and the biases and
    # LayerNorm scales of 64): every gradient is reduce-scattered
    found = [cost2.replica_layer(i, (4, 1)) for i in range(cost2.num_layers)]
    assert sum(x.sharded_grad_bytes for x in found) == whole


def test_the_replicas_shard_their_optimizer_state_over_data(cost2):
    """A replica stage's memory is its plan's less the optimizer state sharded over
    ``data`` (1 - 1/dp of each leaf with a ZeRO dim): four replicas hold less than two."""
    last = cost2.num_layers
    held = {}
    for logical in ((2, 1), (4, 1)):
        base = cost2.replica_cost(logical).range_cost(0, last, (1, 1))
        saved = sum(cost2.replica_layer(i, logical).state_saved_bytes for i in range(last))
        step = cost2(0, last, (1, 4), logical, grad_reduce="step")
        assert saved > 0
        assert step.param_bytes == pytest.approx(base.param_bytes - saved, rel=1e-12)
        held[logical] = step.param_bytes
    assert held[4, 1] < held[2, 1]


def test_the_step_is_a_replicas_plus_its_reductions_once_a_step(cost2):
    """Latency = a replica's plan of the range on ``(1, tp)`` at 1/dp of the micro-batch,
    plus the step's reductions over ``data`` less what its sharded update saves, spread
    over its micro-batches; activations are the replica's. The reductions do not depend
    on the micro-batch count: the gradients do not."""
    last = cost2.num_layers
    step = cost2(0, last, (1, 4), (4, 1), grad_reduce="step")
    replica = cost2.replica_cost((4, 1))
    base = replica.range_cost(0, last, (1, 1))
    reduce_s = cost2.replica_reduce_s(0, last, (4, 1))
    saved_s = sum(cost2.replica_layer(i, (4, 1)).update_saved_s for i in range(last))
    assert reduce_s > 0 and saved_s > 0
    assert step.latency_s == pytest.approx(base.latency_s + (reduce_s - saved_s) / 2, rel=1e-12)
    assert step.activation_bytes == base.activation_bytes
    cost4 = _cost(4)
    assert cost4.replica_reduce_s(0, last, (2, 1)) == pytest.approx(
        cost2.replica_reduce_s(0, last, (2, 1)), rel=1e-12
    )


def test_slow_data_links_make_the_stage_dp_reduce_once_a_step():
    """Where the ``data`` axis is slow, reducing 4 micro-batches' gradients once beats
    reducing each: the DP offered both takes "step" on a stage with replicas, at a lower
    objective than the DP offered only the reduction every micro-batch."""
    cost = _cost(4, data_beta=1e-6)
    last = cost.num_layers
    every = cost(0, last, (1, 4), (2, 2))  # 4 micro-batches of 2 sequences: 2 replicas
    once = cost(0, last, (1, 4), (2, 2), grad_reduce="step")
    assert once.latency_s < every.latency_s
    plans = {
        g: optimal_stage_plan(
            last,
            1,
            4,
            cost,
            4,
            num_stages=1,
            grad_reduces=g,
            logical_meshes=lambda submesh: [(2, 2)] if submesh == (1, 4) else [submesh],
        )  # fmt: skip
        for g in (("microbatch",), ("microbatch", "step"))
    }
    chosen = plans["microbatch", "step"]
    assert [s.grad_reduce for s in chosen.stages] == ["step"]
    assert chosen.objective_s < plans["microbatch",].objective_s
    assert [s.grad_reduce for s in plans["microbatch",].stages] == ["microbatch"]


def test_nothing_to_save_with_one_replica_or_one_microbatch(cost2):
    last = cost2.num_layers
    assert math.isinf(cost2(0, last, (1, 4), (1, 4), grad_reduce="step").latency_s)
    one = _cost(1)
    assert math.isinf(one(0, last, (1, 4), (4, 1), grad_reduce="step").latency_s)
    plan = optimal_stage_plan(last, 1, 4, one, 1, grad_reduces=("microbatch", "step"))
    assert {s.grad_reduce for s in plan.stages} == {"microbatch"}


def test_a_microbatch_the_replicas_cannot_split_is_not_offered():
    """gpt-tiny's 8 sequences in 4 micro-batches of 2: 4 replicas would need half a
    sequence each."""
    cost = _cost(4)
    assert cost.replicas(4) is None
    assert math.isinf(cost(0, cost.num_layers, (1, 4), (4, 1), grad_reduce="step").latency_s)


def test_a_cost_without_replica_traces_says_what_it_needs():
    graph = trace_microbatch("gpt-tiny", 2).graph
    cost = IntraStageCost(graph, _mesh_for(1e-10), num_microbatches=2)
    with pytest.raises(ValueError, match="replicas=dp"):
        cost(0, cost.num_layers, (1, 4), (4, 1), grad_reduce="step")
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        cost(0, cost.num_layers, (1, 4), (4, 1), grad_reduce="sometimes")


def test_a_stage_keeps_where_it_reduces_in_its_json():
    stage = Stage(0, 3, (1, 4), (4, 1), 1.0, 2.0, 1, grad_reduce="step")
    assert Stage.from_json(stage.to_json()) == stage
    old = stage.to_json()
    del old["grad_reduce"]  # a plan file written before the field
    assert Stage.from_json(old).grad_reduce == "microbatch"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_reduce": "never"}, "grad_reduce must be one of"),
        ({"plan": "megatron:1x1x8", "grad_reduce": "step"}, "Megatron-LM's own"),
        ({"plan": "auto", "grad_reduce": "step", "offload": "optimizer"}, "without offload"),
    ],
)
def test_simulate_refuses_a_grad_reduce_it_cannot_price(kwargs, match):
    from autoshard.sim.simulate import simulate

    kwargs = {"plan": "auto", **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate("gpt-350m", "dgx-h100", 8, **kwargs)


def test_the_traced_grid_reduces_once_a_step_and_shows_it():
    """gpt-350m's DP-8 point on 8 H100s, 16 micro-batches: reducing once a step moves
    less over ``data`` than reducing each micro-batch's gradient; the stage says so and
    the breakdown's ``comm_data`` is the once-a-step all-reduce."""
    from autoshard.sim.simulate import simulate

    reports = {
        g: simulate(
            "gpt-350m",
            "dgx-h100",
            8,
            plan="megatron:1x1x8",
            program="traced",
            num_microbatches=16,
            global_batch=256,
            grad_reduce=g,
        )  # fmt: skip
        for g in ("microbatch", "step")
    }
    every, once = reports["microbatch"], reports["step"]
    assert every.plan["stages"][0]["grad_reduce"] == "microbatch"
    assert once.plan["stages"][0]["grad_reduce"] == "step"
    assert once.step_breakdown["comm_data"] < every.step_breakdown["comm_data"] / 4
    assert sum(once.step_breakdown.values()) == pytest.approx(once.step_time_s, rel=1e-9)
