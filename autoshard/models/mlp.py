"""Alpa's test MLP: L Dense layers with ReLU between them and an MSE loss.

Layers are top-level modules ``dense_0`` ... ``dense_{L-1}`` (so each is one layer tag);
every layer is ``hidden -> hidden`` with a bias, batch input ``x`` and target ``y`` are
``[batch, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from autoshard.models.config import ModelConfig


@dataclass(frozen=True)
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden: int = 1024
    num_layers: int = 2
    batch_size: int = 64
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.check_positive_ints("MLP", ("hidden", "num_layers", "batch_size"))
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")

    @property
    def num_params(self) -> int:
        return self.num_layers * (self.hidden * self.hidden + self.hidden)


class MLP(nn.Module):
    cfg: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.cfg.num_layers):
            x = nn.Dense(
                self.cfg.hidden,
                dtype=jnp.dtype(self.cfg.dtype),
                param_dtype=jnp.float32,
                name=f"dense_{i}",
            )(x)
            if i < self.cfg.num_layers - 1:
                x = nn.relu(x)
        return x


def mlp_loss_fn(cfg: MLPConfig):
    model = MLP(cfg)

    def loss(params, batch):
        out = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)

    return loss


def mlp_init_fn(cfg: MLPConfig):
    model = MLP(cfg)

    def init(rng):
        return model.init(rng, jnp.zeros((cfg.batch_size, cfg.hidden), jnp.float32))["params"]

    return init


def mlp_batch_spec(cfg: MLPConfig) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.batch_size, cfg.hidden)
    return {
        "x": jax.ShapeDtypeStruct(shape, jnp.float32),
        "y": jax.ShapeDtypeStruct(shape, jnp.float32),
    }


def mlp_random_batch(cfg: MLPConfig, rng: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(rng)
    shape = (cfg.batch_size, cfg.hidden)
    return {"x": jax.random.normal(k1, shape), "y": jax.random.normal(k2, shape)}
