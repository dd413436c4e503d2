"""A readable Wide-ResNet in Flax linen, with the presets of Alpa's Wide-ResNet suite.

Architecture (ResNet v1 with bottleneck blocks, widened as in Alpa's benchmark): a stem
(7x7 conv with stride 2, batch norm, ReLU, 3x3 max pool with stride 2), four stages of
bottleneck blocks, then a global average pool and a dense classifier.  A block of stage
``i`` has ``f = num_channels * 2**i`` filters:

    1x1 conv -> f,  BN, ReLU
    3x3 conv -> f * width_factor (stride 2 in the first block of stages 1-3), BN, ReLU
    1x1 conv -> 4 f, BN
    + the input (through a 1x1 conv and BN with the block's stride when shapes differ), ReLU

``num_layers`` counts the weighted layers: 3 per block plus the stem conv and the
classifier, so 50 is stages of (3, 4, 6, 3) blocks.  Convolutions have no bias.

Batch norm: always in training mode, i.e. normalised with the statistics of the batch
being trained on (mean and variance over batch and image, per channel, in float32), with a
learned scale and offset.  That is exactly what the forward and backward passes of Flax's
``BatchNorm(use_running_average=False)`` compute.  The running averages such a layer also
keeps are evaluation-time state: they never enter the loss or the gradients, and the step
autoshard traces, ``step(params, opt_state, batch) -> (params, opt_state, loss)``, has no
slot for mutable state besides the optimizer's, so they are left out.  Their update (a
per-channel moving average, two vectors per layer) is a negligible part of a step.  Every
scale starts at one (Alpa zero-initialises each block's last scale; starting at one gives
every convolution a gradient in the first step, which the sharded == single-device tests
need).  Under a batch split the statistics are reduced over all devices, as in Alpa.

Parameters are float32; ``dtype`` is the compute dtype (float32, as in Alpa's suite, or
bfloat16 with float32 statistics and loss).  ``float64`` (parameters, statistics and loss
too; needs ``jax.enable_x64``) is a numerical reference: batch norm's gradients cancel
(a shift of a channel feeding a later batch norm is nearly undone by it), so float32
gradients of some leaves carry relative rounding errors of ~1e-2 however they are summed.  Top-level modules are named after the layer
tags the tracer uses: ``stem``, ``block_0`` ... ``block_{n-1}``, ``head``.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autoshard.models.config import ModelConfig

_DTYPES = ("float32", "bfloat16", "float64")

# num_layers -> blocks per stage (3 weighted layers per block + stem conv + classifier)
STAGE_SIZES: dict[int, tuple[int, ...]] = {
    5: (1,),
    8: (1, 1),
    14: (1, 1, 1, 1),
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}


@dataclass(frozen=True)
class WResNetConfig(ModelConfig):
    """Shape of a Wide-ResNet and of the batch of images it trains on."""

    name: str
    image_size: int
    num_layers: int
    num_channels: int  # base channels: filters of the first stage
    width_factor: int
    num_classes: int = 1024
    batch_size: int = 1536
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.check_positive_ints(
            "Wide-ResNet",
            ("image_size", "num_channels", "width_factor", "num_classes", "batch_size"),
        )
        if self.num_layers not in STAGE_SIZES:  # checked first: the image check needs it
            raise ValueError(
                f"num_layers must be one of {sorted(STAGE_SIZES)} (3 per bottleneck block + 2), "
                f"got {self.num_layers!r}"
            )
        halvings = 1 + len(self.stage_sizes)  # stem conv and pool, then stages 1, 2, ...
        if self.image_size % 2**halvings:
            raise ValueError(
                f"image_size must be a multiple of {2**halvings} (a {self.num_layers}-layer "
                f"network halves it {halvings} times), got {self.image_size}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def param_dtype(self) -> str:
        """Parameters and statistics: float64 in a float64 model, else float32."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return STAGE_SIZES[self.num_layers]

    @property
    def num_blocks(self) -> int:
        return sum(self.stage_sizes)


def _preset(name: str, image: int, layers: int, channels: int, width: int, **kw) -> WResNetConfig:
    return WResNetConfig(name, image, layers, channels, width, **kw)


# Alpa's Wide-ResNet suite (224x224 images, 1024 classes, batch 1536, float32), plus tiny
# ones for tests.
WRESNET_PRESETS: dict[str, WResNetConfig] = {
    c.name: c
    for c in (
        _preset("wresnet-tiny", 32, 14, 8, 2, num_classes=16, batch_size=8),
        _preset("wresnet-small", 64, 26, 16, 2, num_classes=64, batch_size=16),
        _preset("wresnet-250m", 224, 50, 160, 2),
        _preset("wresnet-500m", 224, 50, 224, 2),
        _preset("wresnet-1b", 224, 50, 320, 2),
        _preset("wresnet-2b", 224, 50, 448, 2),
        _preset("wresnet-4b", 224, 50, 640, 2),
        _preset("wresnet-6.8b", 224, 50, 320, 16),
        _preset("wresnet-13b", 224, 50, 320, 32),
    )
}


class BatchNorm(nn.Module):
    """Training-mode batch norm over every dim but the last (see the module docstring)."""

    dtype: str
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (c,), self.param_dtype)
        x32 = x.astype(self.param_dtype)
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x32, axis=axes)  # [C]
        var = jnp.mean(jnp.square(x32 - mean), axis=axes)  # [C]
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias
        return y.astype(self.dtype)


def _norm(cfg: WResNetConfig, name: str) -> BatchNorm:
    return BatchNorm(cfg.dtype, cfg.param_dtype, name=name)


def _conv(features: int, kernel: int, stride: int, cfg: WResNetConfig, name: str, padding="SAME"):
    return nn.Conv(
        features,
        (kernel, kernel),
        (stride, stride),
        padding=padding,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        name=name,
    )


class Stem(nn.Module):
    cfg: WResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.astype(self.cfg.dtype)  # [B, I, I, 3]
        x = _conv(self.cfg.num_channels, 7, 2, self.cfg, "conv", ((3, 3), (3, 3)))(x)
        x = nn.relu(_norm(self.cfg, "bn")(x))  # [B, I/2, I/2, C]
        return nn.max_pool(x, (3, 3), (2, 2), "SAME")  # [B, I/4, I/4, C]


class Bottleneck(nn.Module):
    cfg: WResNetConfig
    filters: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, f = self.cfg, self.filters
        y = nn.relu(_norm(cfg, "bn1")(_conv(f, 1, 1, cfg, "conv1")(x)))
        y = _conv(f * cfg.width_factor, 3, self.stride, cfg, "conv2")(y)
        y = nn.relu(_norm(cfg, "bn2")(y))
        y = _norm(cfg, "bn3")(_conv(4 * f, 1, 1, cfg, "conv3")(y))
        if x.shape != y.shape:
            x = _conv(4 * f, 1, self.stride, cfg, "proj")(x)
            x = _norm(cfg, "bn_proj")(x)
        return nn.relu(x + y)  # [B, H/stride, W/stride, 4 f]


class Head(nn.Module):
    cfg: WResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.mean(x, axis=(1, 2))  # global average pool: [B, 4 f]
        dense = nn.Dense(
            self.cfg.num_classes,
            dtype=jnp.dtype(self.cfg.dtype),
            param_dtype=jnp.dtype(self.cfg.param_dtype),
        )
        return dense(x)  # [B, classes]


class WideResNet(nn.Module):
    cfg: WResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = Stem(cfg, name="stem")(images)
        k = 0
        for stage, blocks in enumerate(cfg.stage_sizes):
            for j in range(blocks):
                stride = 2 if stage > 0 and j == 0 else 1
                x = Bottleneck(cfg, cfg.num_channels * 2**stage, stride, name=f"block_{k}")(x)
                k += 1
        return Head(cfg, name="head")(x)


def wresnet_loss_fn(cfg: WResNetConfig):
    """``loss(params, batch)``: mean softmax cross-entropy over the classes, in float32."""
    model = WideResNet(cfg)

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["images"])
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(cfg.param_dtype), batch["labels"]
        )
        return jnp.mean(losses)

    return loss


def wresnet_init_fn(cfg: WResNetConfig):
    """``init(rng) -> params`` (jit-able; use ``jax.eval_shape`` for abstract params)."""
    model = WideResNet(cfg)

    def init(rng):
        images = jnp.zeros((1, cfg.image_size, cfg.image_size, 3), cfg.param_dtype)
        return model.init(rng, images)["params"]

    return init


def wresnet_batch_spec(cfg: WResNetConfig) -> dict[str, jax.ShapeDtypeStruct]:
    B, size = cfg.batch_size, cfg.image_size
    return {
        "images": jax.ShapeDtypeStruct((B, size, size, 3), cfg.param_dtype),
        "labels": jax.ShapeDtypeStruct((B,), jnp.int32),
    }


def wresnet_random_batch(cfg: WResNetConfig, rng: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(rng)
    B, size = cfg.batch_size, cfg.image_size
    return {
        "images": jax.random.normal(k1, (B, size, size, 3), cfg.param_dtype),
        "labels": jax.random.randint(k2, (B,), 0, cfg.num_classes, jnp.int32),
    }
