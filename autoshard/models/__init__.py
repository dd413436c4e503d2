"""Models autoshard plans for, and the training step around them.

A :class:`Workload` bundles what a planner needs: a loss ``loss(params, batch)``, a
parameter initialiser, the batch's abstract shapes and a way to draw a random batch.
``make_train_step`` turns a loss and an optax optimizer into the step autoshard traces:
``step(params, opt_state, batch) -> (params, opt_state, loss)``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax

from autoshard.models.gpt import (
    GPT_PRESETS,
    GPTConfig,
    gpt_batch_spec,
    gpt_init_fn,
    gpt_loss_fn,
    gpt_random_batch,
)
from autoshard.models.mlp import (
    MLPConfig,
    mlp_batch_spec,
    mlp_init_fn,
    mlp_loss_fn,
    mlp_random_batch,
)
from autoshard.models.moe import MOE_PRESETS, MoEConfig, moe_init_fn, moe_loss_fn
from autoshard.models.wresnet import (
    WRESNET_PRESETS,
    WResNetConfig,
    wresnet_batch_spec,
    wresnet_init_fn,
    wresnet_loss_fn,
    wresnet_random_batch,
)

__all__ = [
    "GPT_PRESETS",
    "GPTConfig",
    "MLPConfig",
    "MOE_PRESETS",
    "MoEConfig",
    "WRESNET_PRESETS",
    "WResNetConfig",
    "Workload",
    "get_workload",
    "make_optimizer",
    "make_train_step",
    "model_names",
]


@dataclass(frozen=True)
class Workload:
    """A model with its loss, initialiser and batch shapes."""

    name: str
    config: Any
    loss_fn: Callable
    init_fn: Callable
    batch_spec: dict
    random_batch: Callable

    def abstract_params(self):
        """Parameter shapes without allocating anything (``jax.eval_shape``)."""
        return jax.eval_shape(self.init_fn, jax.random.key(0))

    def abstract_train_args(self, optimizer: optax.GradientTransformation):
        """(params, opt_state, batch) as ``jax.ShapeDtypeStruct`` trees."""
        params = self.abstract_params()
        opt_state = jax.eval_shape(optimizer.init, params)
        return params, opt_state, self.batch_spec

    def init_train_args(self, optimizer: optax.GradientTransformation, seed: int = 0):
        """Concrete (params, opt_state, batch) for running a small model."""
        k_params, k_batch = jax.random.split(jax.random.key(seed))
        params = self.init_fn(k_params)
        return params, optimizer.init(params), self.random_batch(k_batch)


def model_names() -> list[str]:
    return [*GPT_PRESETS, *MOE_PRESETS, "mlp", *WRESNET_PRESETS]


def get_workload(
    name: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    num_layers: int | None = None,
    hidden: int | None = None,
    dtype: str | None = None,
    scan_layers: bool | None = None,
    num_heads: int | None = None,
    num_experts: int | None = None,
    attention: str | None = None,
    qkv_gemms: int | None = None,
) -> Workload:
    """Build a workload by preset name with optional overrides (``num_heads``: GPT and
    GPT-MoE presets; ``num_experts``: GPT-MoE presets; ``attention``: ``"fused"`` (the
    default) or ``"unfused"``, GPT and GPT-MoE presets; ``qkv_gemms``: 1 or 3, the GPT's
    fused q/k/v projection, ``GPTConfig.qkv_gemms``).

    Raises ValueError listing the presets for an unknown name, and naming the field for a
    bad size.
    """
    if name not in MOE_PRESETS and num_experts is not None:
        raise ValueError(
            f"num_experts (--experts) is for the GPT-MoE presets ({', '.join(MOE_PRESETS)}); "
            f"{name!r} has no experts"
        )
    if name == "mlp" or name in WRESNET_PRESETS:
        if attention is not None:
            raise ValueError(
                f"{name!r} has no attention; attention (--attention) is for the GPT and "
                "GPT-MoE presets"
            )
        if num_heads is not None:
            raise ValueError(
                f"{name!r} has no attention heads; num_heads (--heads) is for the GPT and "
                "GPT-MoE presets"
            )
    if name == "mlp":
        cfg = MLPConfig().replace(
            batch_size=batch_size, num_layers=num_layers, hidden=hidden, dtype=dtype
        )
        if seq_len is not None or vocab_size is not None:
            raise ValueError("the MLP has no sequence length or vocabulary; drop --seq/--vocab")
        if scan_layers:
            raise ValueError("the MLP has no scanned form; --scan-layers is for the GPT presets")
        return Workload(
            name,
            cfg,
            mlp_loss_fn(cfg),
            mlp_init_fn(cfg),
            mlp_batch_spec(cfg),
            lambda rng: mlp_random_batch(cfg, rng),
        )
    if name in WRESNET_PRESETS:
        if scan_layers:
            raise ValueError(
                "a Wide-ResNet has no scanned form; --scan-layers is for the GPT presets"
            )
        return _wresnet_workload(name, batch_size, seq_len, vocab_size, num_layers, hidden, dtype)
    if name in MOE_PRESETS and scan_layers:
        raise ValueError(
            "the MoE presets have no scanned form; --scan-layers is for the GPT presets"
        )
    if name not in GPT_PRESETS and name not in MOE_PRESETS:
        close = difflib.get_close_matches(name, model_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model {name!r}.{hint} Presets: {', '.join(model_names())}")
    for field, value in (
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("vocab_size", vocab_size),
        ("num_layers", num_layers),
        ("hidden", hidden),
        ("num_heads", num_heads),
        ("num_experts", num_experts),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    cfg = (GPT_PRESETS.get(name) or MOE_PRESETS[name]).replace(
        batch_size=batch_size,
        seq_len=seq_len,
        vocab_size=vocab_size,
        num_layers=num_layers,
        hidden=hidden,
        dtype=dtype,
        scan_layers=scan_layers,
        num_heads=num_heads,
        num_experts=num_experts,  # None unless a GPT-MoE (refused above otherwise)
        attention=attention,
    )
    if qkv_gemms is not None:
        if not isinstance(cfg, GPTConfig):
            raise ValueError("qkv_gemms is for the GPT presets")
        cfg = cfg.replace(qkv_gemms=qkv_gemms)
    moe = isinstance(cfg, MoEConfig)
    return Workload(
        name,
        cfg,
        moe_loss_fn(cfg) if moe else gpt_loss_fn(cfg),
        moe_init_fn(cfg) if moe else gpt_init_fn(cfg),
        gpt_batch_spec(cfg),
        lambda rng: gpt_random_batch(cfg, rng),
    )


def _wresnet_workload(name, batch_size, seq_len, vocab_size, num_layers, hidden, dtype) -> Workload:
    """A Wide-ResNet preset; ``hidden`` overrides its base channels."""
    if seq_len is not None or vocab_size is not None:
        raise ValueError(
            "a Wide-ResNet has no sequence length or vocabulary; drop --seq/--vocab "
            "(--hidden sets its base channels, --layers its depth)"
        )
    cfg = WRESNET_PRESETS[name].replace(
        batch_size=batch_size, num_layers=num_layers, num_channels=hidden, dtype=dtype
    )
    return Workload(
        name,
        cfg,
        wresnet_loss_fn(cfg),
        wresnet_init_fn(cfg),
        wresnet_batch_spec(cfg),
        lambda rng: wresnet_random_batch(cfg, rng),
    )


def make_optimizer(
    name: str = "adamw", learning_rate: float = 1e-3
) -> optax.GradientTransformation:
    """``adamw`` (weight decay 0.01), ``adafactor`` (optax's defaults: factored second
    moments, no momentum -- what Alpa's GPT-MoE benchmark trains with), ``sgd-momentum``
    (Nesterov momentum 0.9, one momentum buffer per parameter -- what Alpa's Wide-ResNet
    benchmark trains with) or ``sgd`` (plain, for exact comparisons)."""
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=0.01)
    if name == "adafactor":
        return optax.adafactor(learning_rate)
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "sgd-momentum":
        return optax.sgd(learning_rate, momentum=0.9, nesterov=True)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


OPTIMIZERS = ("adamw", "adafactor", "sgd", "sgd-momentum")


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step
