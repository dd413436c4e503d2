"""Tie-breaks never buy cost (issue #31): the two plans the weighted tie-break made dearer
than the optimum, planned by default, now cost exactly what the same planner finds with
the preferences off, and are the plans Alpa asserts."""

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard.intra.problem.build as intra_problem
from autoshard.api import auto_shard
from autoshard.hardware.mesh import alpa_test_mesh, uniform_mesh
from autoshard.intra.cost.resharding import CostOptions
from autoshard.intra.problem.options import IntraOptions
from autoshard.models.gpt import CausalSelfAttention, _layer_norm
from autoshard.models.moe import DenseFeedForward, MoEConfig, alpa_moe_layer_step

HIGHS = IntraOptions(solver="highs")

# Alpa's test_bert_layer_data_parallel: batch 64, sequence 64, hidden 32, 8 heads, 2 layers
BERT = MoEConfig(
    name="bert-layer", hidden=32, num_layers=2, num_heads=8, num_experts=1,
    expert_group_size=64, vocab_size=32, seq_len=64, batch_size=64, ffn_ratio=4,
)  # fmt: skip


class BertLayer(nn.Module):
    """Attention and a dense feed-forward, each with a residual and a LayerNorm after it."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        a = _layer_norm(self.cfg, "ln_1")(x + CausalSelfAttention(self.cfg, name="attn")(x))
        return _layer_norm(self.cfg, "ln_2")(a + DenseFeedForward(self.cfg, name="mlp")(a))


class Bert(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        for i in range(self.cfg.num_layers):
            x = BertLayer(self.cfg, name=f"layer_{i}")(x)
        return x


def bert_step():
    """``(step, args)``: MSE on the layers' output, Adam (its state is what a ZeRO-style
    plan would shard)."""
    model = Bert(BERT)
    x = jax.ShapeDtypeStruct((BERT.batch_size, BERT.seq_len, BERT.hidden), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    opt = optax.adam(1e-2)

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, jax.eval_shape(opt.init, params), {"x": x, "y": x})


def _without_preferences(monkeypatch):
    def none(graph, strategies, n_in, mesh):
        return tuple((0.0,) * len(s) for s in strategies)

    monkeypatch.setattr(intra_problem, "preferences", none)


def test_bert_layer_on_4_devices_is_data_parallel_at_the_optimum(monkeypatch):
    """With the preferences weighted (1e-8 of the largest cost per step) this plan came
    back ZeRO-style (24 reduce-scatters + 24 all-gathers), 26 cost units dearer than
    plain data parallelism."""
    step, args = bert_step()
    mesh = alpa_test_mesh((4,), ("data",))
    plan = auto_shard(step, *args, mesh=mesh, options=HIGHS).plan
    kinds = Counter(c.kind for c in plan.predicted_collectives)
    assert set(kinds) == {"all-reduce"}, kinds
    _without_preferences(monkeypatch)
    plain = auto_shard(step, *args, mesh=mesh, options=HIGHS).plan
    assert plan.objective == pytest.approx(plain.objective, rel=1e-12)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_alpa_moe_layer_keeps_qkv_replicated_at_the_optimum(monkeypatch, shape):
    """Alpa's MoE layer on 4 devices (Alpa's all-to-all pricing, the default exact
    program): the weighted tie-break split the attention's qkv kernel at +3.3."""
    step, args = alpa_moe_layer_step()
    options = HIGHS.replace(cost=CostOptions(all_to_all_penalty_scales_with_n=True))
    mesh = uniform_mesh(shape, ("x", "y"), 1.0, 1.0)
    plan = auto_shard(step, *args, mesh=mesh, options=options).plan
    specs = dict(zip(plan.input_paths, plan.input_specs, strict=True))
    assert specs["[0]['attn']['qkv']['kernel']"].is_replicated
    _without_preferences(monkeypatch)
    plain = auto_shard(step, *args, mesh=mesh, options=options).plan
    assert plan.objective == pytest.approx(plain.objective, rel=1e-12)
