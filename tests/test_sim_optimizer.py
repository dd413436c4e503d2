"""The optimizer of the traced step in ``simulate(plan="auto")`` (issue #15: moe-70b on 64
V100s). Alpa's GPT-MoE benchmark trains with Adafactor (factored second moments, no
momentum), whose state is a small fraction of AdamW's two fp32 moments; with AdamW the 70B
model's state alone (16 bytes per parameter) is over 64 x 16 GiB."""

from __future__ import annotations

import pytest

from autoshard.api_pipeline import trace_microbatch
from autoshard.hardware.clusters import load_cluster
from autoshard.ir.spec import ShardingSpec
from autoshard.models import OPTIMIZERS, make_optimizer
from autoshard.models.moe import MOE_PRESETS
from autoshard.sim.auto import search_stage_cost
from autoshard.sim.simulate import simulate


def _state_bytes(graph, kind: str) -> int:
    return sum(t.nbytes for t in graph.tensors if t.kind == kind)


def test_adafactor_state_is_factored_at_moe_380m_dimensions():
    """At moe-380m's dimensions (every weight's two largest dims >= 128) Adafactor keeps
    row and column statistics: under 1% of the parameters' bytes, where AdamW keeps two
    full fp32 moments (2 x the parameters' bytes, plus its step count)."""
    adamw = trace_microbatch("moe-380m", 64, "adamw", batch_size=1024).graph
    adafactor = trace_microbatch("moe-380m", 64, "adafactor", batch_size=1024).graph
    params = _state_bytes(adamw, "param")
    assert params == _state_bytes(adafactor, "param") == 4 * MOE_PRESETS["moe-380m"].num_params
    assert _state_bytes(adamw, "opt_state") == 2 * params + 4  # mu, nu and an int32 count
    assert _state_bytes(adafactor, "opt_state") < 0.01 * params


def test_stage_costs_count_the_optimizer_state_of_the_traced_step():
    """One MoE block on one device (nothing split), two microbatches a step: AdamW owns
    params + grads (accumulated all step) + two moments (16 B per parameter); Adafactor at
    moe-tiny's small dims (< 128, not factored) one second moment (12 B per parameter).
    One microbatch a step: the gradients go into the update as they are made, working
    bytes of the block while it runs, not owned. Each weight cast to fp16 once a step
    (``cast_once``) adds its 2-byte copy, held all step."""
    from autoshard.intra.offload.placement import cast_once_params

    cluster = load_cluster("alpa-v100", 1)
    costs = {
        opt: search_stage_cost("moe-tiny", cluster, 16, 2, "fp16", 20.0, {}, optimizer=opt)
        for opt in ("adamw", "adafactor")
    }
    graph = costs["adamw"].graph
    block = graph.layers.index("block_0")
    n = sum(t.size for t in graph.tensors if t.kind == "param" and "['block_0']" in t.path)
    once = cast_once_params(graph)
    copies = 2 * sum(graph.tensors[t].size for t in once if "['block_0']" in graph.tensors[t].path)
    assert 0 < copies < 2 * n
    owned = {opt: c.range_cost(block, block + 1, (1, 1)).param_bytes for opt, c in costs.items()}
    assert owned["adamw"] == 16 * n + copies
    assert 12 * n + copies <= owned["adafactor"] < 12.1 * n + copies
    one = search_stage_cost("moe-tiny", cluster, 16, 1, "fp16", 20.0, {}, optimizer="adamw")
    streamed = one.range_cost(block, block + 1, (1, 1))
    assert streamed.param_bytes == 12 * n + copies and streamed.working_bytes >= 4 * n


def test_simulate_takes_the_optimizer_for_auto_only():
    report = simulate("moe-tiny", "alpa-v100", 2, "auto", global_batch=16, optimizer="adafactor")
    assert report.plan["optimizer"] == "adafactor" and not report.oom
    with pytest.raises(ValueError, match="optimizer must be one of"):
        simulate("moe-tiny", "alpa-v100", 2, "auto", optimizer="lamb")
    with pytest.raises(ValueError, match="plan='auto' only"):
        simulate("gpt-350m", "alpa-v100", 1, "megatron", optimizer="adafactor")
    assert OPTIMIZERS == ("adamw", "adafactor", "sgd", "sgd-momentum")
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        make_optimizer("lamb")


def test_sgd_momentum_keeps_one_f32_buffer_per_parameter():
    """Alpa's Wide-ResNet benchmark trains with optax.sgd(momentum=0.9, nesterov=True): the
    traced step's optimizer state is one momentum buffer per parameter, same shape, f32;
    plain SGD keeps none."""
    graph = trace_microbatch("wresnet-tiny", 1, "sgd-momentum").graph
    params = sorted((t.shape for t in graph.tensors if t.kind == "param"), key=repr)
    state = [t for t in graph.tensors if t.kind == "opt_state"]
    assert params and sorted((t.shape for t in state), key=repr) == params
    assert {t.dtype for t in state} == {"float32"}
    assert sum(t.nbytes for t in state) == sum(t.nbytes for t in graph.tensors if t.kind == "param")
    plain = trace_microbatch("wresnet-tiny", 1, "sgd").graph
    assert not [t for t in plain.tensors if t.kind == "opt_state" and t.shape]


def test_simulate_memory_orders_sgd_below_sgd_momentum_below_adamw():
    """One GPU, one plan: the predicted peak grows with the optimizer's state (none, one
    buffer, two moments)."""
    peak = {
        opt: simulate("wresnet-tiny", "alpa-v100", 1, "auto", optimizer=opt).peak_bytes_per_device
        for opt in ("sgd", "sgd-momentum", "adamw")
    }
    assert peak["sgd"] < peak["sgd-momentum"] < peak["adamw"]
    n_bytes = 4 * sum(
        t.size
        for t in trace_microbatch("wresnet-tiny", 1, "sgd").graph.tensors
        if t.kind == "param"
    )
    # each step up is one more f32 copy of the parameters (not split on one GPU)
    assert peak["sgd-momentum"] - peak["sgd"] == pytest.approx(n_bytes, rel=0.05)
    assert peak["adamw"] - peak["sgd-momentum"] == pytest.approx(n_bytes, rel=0.05)


def test_simulate_cli_offers_every_optimizer():
    """The CLI keeps a literal choice list (building the parser imports no jax): it must
    be models.OPTIMIZERS."""
    from autoshard.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    opt = next(a for a in sub.choices["simulate"]._actions if a.dest == "optimizer")
    assert tuple(opt.choices) == OPTIMIZERS


def test_expert_zero2_pins_adafactors_expert_state_and_not_its_placeholder():
    """Adafactor keeps, for a factored expert weight wi [E, h, f], row and column statistics
    [E, h] and [E, f] (split on E like the weight) and a placeholder v of shape (1,) under
    the same path: expert-zero2 refused the placeholder ("its 1 experts do not divide"), so
    the MoE weak-scaling baseline had no plan at 2-64 GPUs with Adafactor."""
    from autoshard.api import device_mesh_for
    from autoshard.intra.baselines.tables import EXPERT_RULE, baseline_inputs

    graph = trace_microbatch("moe-380m", 64, "adafactor", batch_size=1024).graph
    mesh = device_mesh_for((2,), ("data",))
    pinned = baseline_inputs(graph, mesh.mesh, "expert-zero2")
    experts = MOE_PRESETS["moe-380m"].num_experts
    seen = {"placeholder": 0, "factored": 0}
    for pos, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        if t.kind != "opt_state" or not EXPERT_RULE.search(t.path):
            continue
        if t.shape == (1,):
            seen["placeholder"] += 1
            assert pinned[pos] == ShardingSpec.replicated(1), t.path
        else:
            seen["factored"] += 1
            assert t.shape[0] == experts and pinned[pos].dims[0] == ("data",), t.path
    assert seen["placeholder"] and seen["factored"] == 2 * seen["placeholder"]
