"""A readable GPT in Flax linen, with the presets of Alpa's GPT suite.

Architecture (GPT-2 style): learned token and position embeddings, L pre-LayerNorm blocks
(causal multi-head attention, then a GELU MLP of width 4h, each with a residual
connection; every Dense has a bias), a final LayerNorm and an LM head that is **tied** to
the token embedding (logits = x @ wte^T, no head bias).  So the parameter count is

    N = 12 L h^2 + 13 L h + V h + s h + 2 h

(per block: qkv 3h^2+3h, attention projection h^2+h, MLP 8h^2+5h, two LayerNorms 4h;
embeddings V h + s h; final LayerNorm 2h).

Parameters are always float32 ("master weights"); ``dtype`` is the compute dtype
(float32, or bfloat16 for mixed precision: weights are cast at use, softmax, LayerNorm
statistics and the loss stay in float32).

Top-level modules are named after the layer tags the tracer uses: ``embedding``,
``block_0`` ... ``block_{L-1}``, ``head``.  With ``scan_layers=True`` the blocks are one
``nn.scan`` named ``block`` (parameters stacked ``[L, ...]`` under ``params["block"]``,
as MaxText and Levanter write deep models); the tracer unrolls the scan and tags its
iterations ``block_0`` ... ``block_{L-1}``, so both forms get the same plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autoshard.models.attention import fused_attention
from autoshard.models.config import ModelConfig

_DTYPES = ("float32", "bfloat16")
ATTENTION_KINDS = ("fused", "unfused")


def check_attention(kind) -> None:
    """ValueError unless ``kind`` is one of :data:`ATTENTION_KINDS`."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")


@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """Shape of a GPT and of the batch it trains on."""

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    vocab_size: int = 51200
    seq_len: int = 1024
    batch_size: int = 8
    dtype: str = "float32"
    scan_layers: bool = False  # the blocks as one nn.scan over stacked parameters
    # "fused": the fused-kernel program (one attention operator: cuDNN flash attention on
    # GPUs, the same algorithm in XLA elsewhere, autoshard.models.attention; the GELU and
    # the cross-entropy saving their inputs; the default: docs/fused.md); "unfused":
    # einsums and a float32 softmax that keep the S x S probabilities
    attention: str = "fused"
    # with attention="fused": q, k, v from one GEMM, split (1), or from three GEMMs on
    # slices of the same kernel (3: no split copy, but three input-gradient partial sums
    # that a tensor-parallel plan all-reduces one by one; docs/fused.md)
    qkv_gemms: int = 1

    def __post_init__(self) -> None:
        self.check_positive_ints(
            "GPT", ("hidden", "num_layers", "num_heads", "vocab_size", "seq_len", "batch_size")
        )
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_attention(self.attention)
        if self.qkv_gemms not in (1, 3):
            raise ValueError(f"qkv_gemms must be 1 or 3, got {self.qkv_gemms!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {self.scan_layers!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_params(self) -> int:
        """Closed-form parameter count of this architecture (see module docstring)."""
        h, L, V, s = self.hidden, self.num_layers, self.vocab_size, self.seq_len
        return 12 * L * h * h + 13 * L * h + V * h + s * h + 2 * h

    @property
    def matmul_flops_per_step(self) -> int:
        """Megatron's forward+backward matmul FLOPs: 72 B s L h^2 (1 + s/6h + V/12Lh).

        Written in integers: 72 B s L h^2 + 12 B s^2 L h + 6 B s h V.
        """
        B, s, L, h, V = self.batch_size, self.seq_len, self.num_layers, self.hidden, self.vocab_size
        return 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V


def _preset(name: str, hidden: int, layers: int, heads: int, **kw) -> GPTConfig:
    return GPTConfig(name=name, hidden=hidden, num_layers=layers, num_heads=heads, **kw)


# Alpa's GPT suite (seq 1024, vocab 51200), plus a tiny one for tests.
GPT_PRESETS: dict[str, GPTConfig] = {
    c.name: c
    for c in (
        _preset("gpt-tiny", 64, 2, 4, vocab_size=256, seq_len=32, batch_size=8),
        _preset("gpt-125m", 768, 12, 12),
        _preset("gpt-350m", 1024, 24, 16),
        _preset("gpt-760m", 1536, 24, 16),
        _preset("gpt-1.3b", 2048, 24, 32),
        _preset("gpt-2.6b", 2560, 32, 32),
        _preset("gpt-6.7b", 4096, 32, 32),
        _preset("gpt-15b", 5120, 48, 40),
        _preset("gpt-39b", 8192, 48, 64),
        _preset("gpt-76b", 10240, 60, 80),
    )
}


def _dense(features: int, cfg: GPTConfig, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(0.02),
        name=name,
    )


def _layer_norm(cfg: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-5, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32, name=name
    )


class Embedding(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        init = nn.initializers.normal(0.02)
        wte = self.param("wte", init, (cfg.vocab_size, cfg.hidden), jnp.float32)
        wpe = self.param("wpe", init, (cfg.seq_len, cfg.hidden), jnp.float32)
        x = jnp.take(wte, tokens, axis=0) + wpe[None, :, :]  # [B, S, h]
        return x.astype(cfg.dtype)


class HeadsQKV(nn.Module):
    """The qkv projection as three GEMMs, each writing its own ``[B, S, H, D]``.

    Same parameters as ``nn.Dense(3h)`` named ``qkv`` (kernel ``[h, 3h]`` laid out head by
    head, ``[H, 3, D]``; bias ``[3h]``), so checkpoints and plans read the same tree; but a
    fused attention kernel takes ``q``, ``k``, ``v`` as dense arrays, and slicing them out
    of one ``[B, S, H, 3D]`` result costs a copy of all three forward and a concatenation
    of their gradients backward (on one H100, 1.5 ms of gpt-350m's 54.5 ms step).  Here
    the kernel is sliced instead (``[h, H, D]`` each: weight-sized, not activation-sized).
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        h, H, D = cfg.hidden, cfg.num_heads, cfg.head_dim
        dt = jnp.dtype(cfg.dtype)
        kernel = self.param("kernel", nn.initializers.normal(0.02), (h, 3 * h), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (3 * h,), jnp.float32)
        w = kernel.astype(dt).reshape(h, H, 3, D)
        b = bias.astype(dt).reshape(H, 3, D)
        x = x.astype(dt)
        return tuple(jnp.einsum("bsh,hnd->bsnd", x, w[:, :, i, :]) + b[:, i, :] for i in range(3))


def gelu_saving_input(y: jax.Array) -> jax.Array:
    """tanh-GELU whose backward keeps only its input and recomputes the rest, as
    Megatron-LM's fused bias-GELU kernel does (JAX's own derivative keeps the tanh too:
    one more ``[B, S, 4h]`` written and read per layer)."""
    return jax.checkpoint(functools.partial(jax.nn.gelu, approximate=True))(y)


def mlp_activation(cfg, y: jax.Array) -> jax.Array:
    """The MLP's GELU: saving only its input with the fused kernels
    (``attention="fused"``), as JAX differentiates it otherwise."""
    if getattr(cfg, "attention", "unfused") == "fused":
        return gelu_saving_input(y)
    return jax.nn.gelu(y, approximate=True)


class CausalSelfAttention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, S, h = x.shape
        H, D = cfg.num_heads, cfg.head_dim
        # qkv columns are laid out head by head ([H, 3, D]), as in Megatron, so that a
        # column split of the kernel keeps whole heads on a device
        fused = getattr(cfg, "attention", "unfused") == "fused"
        if fused and getattr(cfg, "qkv_gemms", 1) == 3:
            q, k, v = HeadsQKV(cfg, name="qkv")(x)
        else:
            qkv = _dense(3 * h, cfg, "qkv")(x).reshape(B, S, H, 3 * D)
            q, k, v = jnp.split(qkv, 3, axis=-1)  # each [B, S, H, D]
        if fused:
            out = fused_attention(q, k, v, causal=True).reshape(B, S, h)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(D))  # [B, H, S, S]
            causal = jnp.tril(jnp.ones((S, S), dtype=bool))
            scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, h)
        return _dense(h, cfg, "proj")(out)


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.cfg.hidden
        y = _dense(4 * h, self.cfg, "fc")(x)
        y = mlp_activation(self.cfg, y)
        return _dense(h, self.cfg, "proj")(y)


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.cfg, name="attn")(_layer_norm(self.cfg, "ln_1")(x))
        x = x + MLP(self.cfg, name="mlp")(_layer_norm(self.cfg, "ln_2")(x))
        return x


class ScannedBlock(nn.Module):
    """One block in ``nn.scan``'s calling convention: ``(carry, x) -> (carry, y)``."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return Block(self.cfg, name="layer")(x), None


class Head(nn.Module):
    """Final LayerNorm and the LM head, tied to the token embedding ``wte``."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, wte: jax.Array) -> jax.Array:
        x = _layer_norm(self.cfg, "ln_f")(x)
        return jnp.einsum("bsh,vh->bsv", x, wte.astype(self.cfg.dtype))  # [B, S, V]


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embedding = Embedding(self.cfg, name="embedding")
        x = embedding(tokens)
        if self.cfg.scan_layers:
            blocks = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.cfg.num_layers,
            )
            x, _ = blocks(self.cfg, name="block")(x, None)
        else:
            for i in range(self.cfg.num_layers):
                x = Block(self.cfg, name=f"block_{i}")(x)
        wte = embedding.variables["params"]["wte"]
        return Head(self.cfg, name="head")(x, wte)


def token_loss_fn(model: nn.Module):
    """``loss(params, batch)`` of a language model ``model`` (tokens -> logits): mean
    next-token cross-entropy in float32. The GPT and the GPT-MoE share it; with the fused
    kernels (``attention="fused"``) through :func:`cross_entropy_saving_logits`."""

    fused = getattr(model.cfg, "attention", "unfused") == "fused"

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        if fused:
            return jnp.mean(cross_entropy_saving_logits(logits, batch["labels"]))
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["labels"]
        )
        return jnp.mean(losses)

    return loss


@jax.custom_vjp
def cross_entropy_saving_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``logsumexp(x) - x[label]`` in float32 over logits of any
    float dtype, whose backward keeps the logits as they came (bf16 under mixed precision)
    and the per-token log-sum-exp, and computes ``softmax - onehot`` in one pass.

    JAX's derivative of the float32 loss keeps the float32 copy of the logits (``[B, S,
    V]``: 1.7 GB at batch 8, seq 1024, vocab 51200) and reads it back; on one H100 the
    cross-entropy then cost 2.7 ms of gpt-350m's 54.5 ms step.  Same values as
    ``optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), labels)``.
    """
    return _ce_fwd(logits, labels)[0]


def _ce_fwd(logits, labels):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    target = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    return lse - target, (logits, labels, lse)


def _ce_bwd(saved, g):
    logits, labels, lse = saved
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    onehot = jnp.arange(logits.shape[-1]) == labels[..., None]
    return ((probs - onehot) * g[..., None]).astype(logits.dtype), None


cross_entropy_saving_logits.defvjp(_ce_fwd, _ce_bwd)


def token_init_fn(model: nn.Module, cfg):
    """``init(rng) -> params`` of ``model`` for ``cfg``'s batch of tokens (jit-able; use
    ``jax.eval_shape`` for abstract params)."""

    def init(rng):
        tokens = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)
        return model.init(rng, tokens)["params"]

    return init


def gpt_loss_fn(cfg: GPTConfig):
    """``loss(params, batch)``: mean next-token cross-entropy in float32."""
    return token_loss_fn(GPT(cfg))


def gpt_init_fn(cfg: GPTConfig):
    """``init(rng) -> params`` (jit-able; use ``jax.eval_shape`` for abstract params)."""
    return token_init_fn(GPT(cfg), cfg)


def gpt_batch_spec(cfg: GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.batch_size, cfg.seq_len)
    return {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "labels": jax.ShapeDtypeStruct(shape, jnp.int32),
    }


def gpt_random_batch(cfg: GPTConfig, rng: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(rng)
    shape = (cfg.batch_size, cfg.seq_len)
    return {
        "tokens": jax.random.randint(k1, shape, 0, cfg.vocab_size, jnp.int32),
        "labels": jax.random.randint(k2, shape, 0, cfg.vocab_size, jnp.int32),
    }
