"""GPT-MoE in Flax linen: the GPT of :mod:`autoshard.models.gpt` with GShard's
mixture-of-experts feed-forward in every other block, and the presets of Alpa's GPT-MoE
suite.

Architecture: token and position embeddings, L pre-LayerNorm blocks and a tied LM head,
exactly as the GPT (the same modules, the same layer tags ``embedding``, ``block_0`` ...
``block_{L-1}``, ``head``), except for the feed-forward layer of each block:

* even blocks (0, 2, ...) have a **mixture of E experts** (``moe``), as in GShard and
  Alpa's MoE model: tokens are cut into groups of ``S = expert_group_size``; a gate
  ``wg [h, E]`` and a softmax give each token a distribution over experts; GShard's
  top-2 gating sends each token to its two best experts, at most ``C = 2 S / E`` tokens of
  a group per expert (capacity factor 1: later tokens over capacity are dropped, in the
  order of ``cumsum`` along the group); dispatch and combine are einsums with one-hot
  ``[G, S, E, C]`` tensors, and the experts are two weights with a leading expert
  dimension, ``wi [E, h, r h]`` and ``wo [E, r h, h]`` (ReLU between, no biases);
* odd blocks have a dense MLP ``h -> r h -> h`` (GELU, biases).

``r = ffn_ratio`` is 8 in Alpa's suite (its parameter counts, 380M ... 70B, assume it).
As in Alpa's model there is no auxiliary load-balancing loss. Parameter count::

    N = L_moe (4h^2 + 4h + 4h + hE + 2 r h^2 E) + L_dense (4h^2 + 4h + 4h + 2 r h^2 + r h + h)
        + V h + s h + 2h

with ``L_moe = ceil(L / 2)`` and ``L_dense = floor(L / 2)``.

Expert parallelism is what the plan makes of ``wi``/``wo`` split on their expert
dimension: the dispatched ``[E, G, C, h]`` tokens are then exchanged by all-to-all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from autoshard.models.config import ModelConfig
from autoshard.models.gpt import (
    CausalSelfAttention,
    Embedding,
    Head,
    _dense,
    _layer_norm,
    check_attention,
    mlp_activation,
    token_init_fn,
    token_loss_fn,
)

_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """Shape of a GPT-MoE and of the batch it trains on."""

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    num_experts: int
    expert_group_size: int = 2048
    vocab_size: int = 32000
    seq_len: int = 1024
    batch_size: int = 8
    ffn_ratio: int = 8
    dtype: str = "float32"
    attention: str = "fused"  # as GPTConfig.attention

    def __post_init__(self) -> None:
        self.check_positive_ints(
            "MoE",
            (
                "hidden",
                "num_layers",
                "num_heads",
                "num_experts",
                "expert_group_size",
                "vocab_size",
                "seq_len",
                "batch_size",
                "ffn_ratio",
            ),
        )
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        tokens = self.batch_size * self.seq_len
        if tokens % self.expert_group_size:
            step = self.expert_group_size // math.gcd(self.expert_group_size, self.seq_len)
            raise ValueError(
                f"batch_size x seq_len = {tokens} tokens must be a multiple of "
                f"expert_group_size ({self.expert_group_size}): with seq_len {self.seq_len} "
                f"use a batch_size that is a multiple of {step}"
            )
        if 2 * self.expert_group_size < self.num_experts:
            raise ValueError(
                f"expert_group_size ({self.expert_group_size}) gives experts no capacity "
                f"(2 S / E < 1 with E = {self.num_experts}); use a group of at least "
                f"{math.ceil(self.num_experts / 2)} tokens"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_attention(self.attention)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_groups(self) -> int:
        """G: how many groups of ``expert_group_size`` tokens a batch makes."""
        return self.batch_size * self.seq_len // self.expert_group_size

    def data_parallel_hint(self, devices: int) -> str | None:
        """What batch lets ``devices`` data-parallel devices each hold whole expert groups
        (the gating's cumsum runs along a group); None when this batch already does."""
        if self.num_groups % devices == 0:
            return None
        tokens = self.expert_group_size * devices
        step = tokens // math.gcd(tokens, self.seq_len)
        return (
            f"batch_size {self.batch_size} x seq_len {self.seq_len} makes "
            f"{self.num_groups} expert groups of {self.expert_group_size} tokens, and data "
            f"parallelism over {devices} devices needs a multiple of {devices} groups: use "
            f"a batch_size that is a multiple of {step}"
        )

    @property
    def capacity(self) -> int:
        """C: tokens of one group an expert takes (top-2, capacity factor 1)."""
        return 2 * self.expert_group_size // self.num_experts

    @property
    def num_moe_layers(self) -> int:
        return (self.num_layers + 1) // 2

    @property
    def num_params(self) -> int:
        """Closed-form parameter count (see the module docstring)."""
        h, r, E = self.hidden, self.ffn_ratio, self.num_experts
        moe, dense = self.num_moe_layers, self.num_layers - self.num_moe_layers
        common = 4 * h * h + 4 * h + 4 * h  # attention with biases, two LayerNorms
        per_moe = common + h * E + 2 * r * h * h * E
        per_dense = common + 2 * r * h * h + r * h + h
        return moe * per_moe + dense * per_dense + self.vocab_size * h + self.seq_len * h + 2 * h


def _preset(name: str, hidden: int, layers: int, heads: int, experts: int, **kw) -> MoEConfig:
    return MoEConfig(
        name=name, hidden=hidden, num_layers=layers, num_heads=heads, num_experts=experts, **kw
    )


# Alpa's GPT-MoE suite (benchmark/alpa/suite_manual_moe.py: seq 1024, vocab 32000, 16
# heads, expert group 2048, FFN 8h), plus a tiny one for tests (G = 8 groups of 64 tokens,
# so that 8 devices split the groups, and 8 experts, so that 8 devices split the experts).
MOE_PRESETS: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        _preset(
            "moe-tiny",
            64,
            2,
            4,
            8,
            expert_group_size=64,
            vocab_size=256,
            seq_len=32,
            batch_size=16,
            ffn_ratio=4,
        ),  # fmt: skip
        _preset("moe-380m", 768, 8, 16, 8),
        _preset("moe-690m", 768, 8, 16, 16),
        _preset("moe-1.3b", 768, 16, 16, 16),
        _preset("moe-2.4b", 1024, 16, 16, 16),
        _preset("moe-10b", 1536, 16, 16, 32),
        _preset("moe-27b", 2048, 16, 16, 48),
        _preset("moe-70b", 2048, 32, 16, 64),
    )
}


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """GShard's top-2 gating: ``gates [G, S, E]`` (a softmax) -> ``(combine, dispatch)``,
    both ``[G, S, E, C]``: ``dispatch`` is 1 where token s of group g takes slot c of expert
    e, ``combine`` is that times the token's renormalised gate for the expert.

    Slots are given in token order, first choices before second choices; a choice past an
    expert's capacity is dropped (its gate is 0).
    """
    num_experts = gates.shape[-1]
    # two argmaxes rather than lax.top_k: XLA's partitioner runs a TopK whole (it gathers
    # the operand, docs/moe.md), an argmax it splits on the token dimensions
    mask_1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.int32)
    second = jnp.argmax(gates * (1 - mask_1), axis=-1)
    mask_2 = jax.nn.one_hot(second, num_experts, dtype=jnp.int32)  # [G, S, E]
    # position of each token in its expert's queue: first choices, then second choices
    pos_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (pos_2 < capacity)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)  # [G, S]; 0 if dropped
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    denom = gate_1 + gate_2
    denom = jnp.where(denom > 0, denom, jnp.ones_like(denom))
    slot_1 = jax.nn.one_hot(jnp.sum(pos_1 * mask_1, axis=-1), capacity, dtype=gates.dtype)
    slot_2 = jax.nn.one_hot(jnp.sum(pos_2 * mask_2, axis=-1), capacity, dtype=gates.dtype)
    combine = jnp.einsum("GSE,GSC->GSEC", (gate_1 / denom)[..., None] * mask_1, slot_1)
    combine += jnp.einsum("GSE,GSC->GSEC", (gate_2 / denom)[..., None] * mask_2, slot_2)
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch


class MoEFeedForward(nn.Module):
    """GShard's mixture of experts on ``[B, T, h]``: gate, dispatch, experts, combine."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        E, h, f = cfg.num_experts, cfg.hidden, cfg.ffn_ratio * cfg.hidden
        init = nn.initializers.normal(0.02)
        wg = self.param("wg", init, (h, E), jnp.float32)
        wi = self.param("wi", init, (E, h, f), jnp.float32)
        wo = self.param("wo", init, (E, f, h), jnp.float32)
        dt = jnp.dtype(cfg.dtype)
        tokens = x.reshape(-1, cfg.expert_group_size, h)  # [G, S, h]
        logits = jnp.einsum("GSM,ME->GSE", tokens, wg.astype(dt))
        gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        combine, dispatch = top2_gating(gates, cfg.capacity)  # [G, S, E, C]
        expert_in = jnp.einsum("GSEC,GSM->EGCM", dispatch.astype(dt), tokens)
        hidden = nn.relu(jnp.einsum("EGCM,EMH->EGCH", expert_in, wi.astype(dt)))
        expert_out = jnp.einsum("EGCH,EHM->GECM", hidden, wo.astype(dt))
        out = jnp.einsum("GSEC,GECM->GSM", combine.astype(dt), expert_out)
        return out.reshape(x.shape)


class DenseFeedForward(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = _dense(self.cfg.ffn_ratio * self.cfg.hidden, self.cfg, "fc")(x)
        return _dense(self.cfg.hidden, self.cfg, "proj")(mlp_activation(self.cfg, y))


class MoEBlock(nn.Module):
    cfg: MoEConfig
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.cfg, name="attn")(_layer_norm(self.cfg, "ln_1")(x))
        ffn = MoEFeedForward(self.cfg, name="moe") if self.moe else None
        ffn = ffn or DenseFeedForward(self.cfg, name="mlp")
        return x + ffn(_layer_norm(self.cfg, "ln_2")(x))


class GPTMoE(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embedding = Embedding(self.cfg, name="embedding")
        x = embedding(tokens)
        for i in range(self.cfg.num_layers):
            x = MoEBlock(self.cfg, moe=i % 2 == 0, name=f"block_{i}")(x)
        wte = embedding.variables["params"]["wte"]
        return Head(self.cfg, name="head")(x, wte)


class AlpaMoELayer(nn.Module):
    """The layer of Alpa's MoE tests (``tests/shard_parallel/test_moe.py``): attention,
    then the MoE, each with a residual and a LayerNorm after it (BERT-style)."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        a = _layer_norm(cfg, "ln_1")(x + CausalSelfAttention(cfg, name="attn")(x))
        return _layer_norm(cfg, "ln_2")(a + MoEFeedForward(cfg, name="moe")(a))


# Alpa's test_moe_layer: batch 64, sequence 16, hidden 64, 16 heads, 16 experts, groups of 32
ALPA_MOE_LAYER = MoEConfig(
    name="alpa-moe-layer", hidden=64, num_layers=1, num_heads=16, num_experts=16,
    expert_group_size=32, vocab_size=32, seq_len=16, batch_size=64, ffn_ratio=4,
)  # fmt: skip


def alpa_moe_layer_step(cfg: MoEConfig = ALPA_MOE_LAYER):
    """``(step, abstract args)`` of Alpa's MoE-layer test: an MSE loss on ``[B, s, h]``
    hidden states, Adam (lr 1e-2), as ``step(params, opt_state, batch)``."""
    import optax

    model = AlpaMoELayer(cfg)
    x = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len, cfg.hidden), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    opt = optax.adam(1e-2)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, jax.eval_shape(opt.init, params), {"x": x, "y": x})


def moe_loss_fn(cfg: MoEConfig):
    """``loss(params, batch)``: mean next-token cross-entropy in float32."""
    return token_loss_fn(GPTMoE(cfg))


def moe_init_fn(cfg: MoEConfig):
    """``init(rng) -> params`` (use ``jax.eval_shape`` for abstract params)."""
    return token_init_fn(GPTMoE(cfg), cfg)
