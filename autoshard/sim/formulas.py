"""Closed-form FLOPs, utilisation and memory of GPT training (jax-free).

Notation (Megatron-LM): B global batch (sequences), s sequence length, L layers, h hidden
size, a heads, V vocabulary, b micro-batch, t tensor-parallel degree.

* Model FLOPs per step (Narayanan et al. 2021, eq. 3 without recompute)::

      72 B s L h^2 (1 + s/(6h) + V/(12 L h))  =  B s (6 N + 12 L h s),   N = 12 L h^2 + V h

  computed here in integers, term by term, so the identity holds exactly.
* Hardware FLOPs add what recomputation runs again. Full recompute repeats the forward of
  every transformer layer (24 B s L h^2 + 4 B s^2 L h), giving Megatron's
  ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))`` (the logit layer is not recomputed, so only the
  layer terms go from 72 to 96). Selective recompute (Korthikanti et al. 2022) repeats only
  the attention-score GEMMs, Q K^T and softmax(.) V: 4 B s^2 L h extra.
* MFU (PaLM, appendix B) = model FLOPs per second / (devices x peak); HFU uses hardware
  FLOPs. They differ exactly by the recompute FLOPs.
* Model-state bytes per device: mixed-precision Adam keeps 2 (fp16/bf16 weights) + 2
  (grads) + 12 (fp32 master weights, momentum, variance) bytes per parameter; ZeRO-1/2/3
  divide the last 12 / 14 / 16 bytes by the data-parallel degree. fp32 training keeps
  4 (weights) + 4 (grads) + 8 (Adam moments) bytes; ZeRO-1/2/3 then divide 8 / 12 / 16.
* Activation bytes per layer, 16-bit (Korthikanti et al. 2022, Table 2).
"""

from __future__ import annotations

from autoshard.inter.stages import RECOMPUTE_MODES


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")


def gpt_flop_params(hidden: int, layers: int, vocab: int) -> int:
    """N = 12 L h^2 + V h: the parameters that take part in matmuls (no biases, no norms)."""
    return 12 * layers * hidden**2 + vocab * hidden


def gpt_params(hidden: int, layers: int, vocab: int, seq_len: int) -> int:
    """All parameters of a Megatron GPT (eq. 2 of Narayanan et al. 2021)::

    12 L h^2 (1 + 13/(12 h) + (V + s)/(12 L h)) = 12 L h^2 + 13 L h + (V + s) h
    """
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq_len) * hidden


def model_flops_per_step(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> int:
    """72 B s L h^2 (1 + s/6h + V/12Lh): forward + backward, no recomputation."""
    b, s, n_layers, h, v = batch, seq_len, layers, hidden, vocab
    return 72 * b * s * n_layers * h**2 + 12 * b * s**2 * n_layers * h + 6 * b * s * h * v


def recompute_flops_per_step(
    batch: int, seq_len: int, layers: int, hidden: int, recompute: str
) -> int:
    """FLOPs that recomputation adds: none 0; selective 4 B s^2 L h; full one more forward."""
    _check_recompute(recompute)
    b, s, n_layers, h = batch, seq_len, layers, hidden
    attention_scores = 4 * b * s**2 * n_layers * h  # Q K^T and P V, forward
    if recompute == "none":
        return 0
    if recompute == "selective":
        return attention_scores
    return 24 * b * s * n_layers * h**2 + attention_scores


def hardware_flops_per_step(
    batch: int, seq_len: int, layers: int, hidden: int, vocab: int, recompute: str
) -> int:
    """Model FLOPs plus recompute FLOPs (full: 96 B s L h^2 (1 + s/6h + V/16Lh))."""
    return model_flops_per_step(batch, seq_len, layers, hidden, vocab) + recompute_flops_per_step(
        batch, seq_len, layers, hidden, recompute
    )


def flops_utilization(
    flops_per_step: float, step_time_s: float, num_devices: int, peak_flops: float
) -> float:
    """Achieved fraction of the devices' aggregate peak."""
    if step_time_s <= 0 or num_devices < 1 or peak_flops <= 0:
        raise ValueError(
            f"need step_time_s > 0, num_devices >= 1, peak_flops > 0; got {step_time_s}, "
            f"{num_devices}, {peak_flops}"
        )
    return flops_per_step / step_time_s / (num_devices * peak_flops)


def model_flops_utilization(
    tokens_per_s: float,
    hidden: int,
    layers: int,
    vocab: int,
    seq_len: int,
    num_devices: int,
    peak_flops: float,
) -> float:
    """PaLM's MFU: tokens/s x (6 N + 12 L h s) / (devices x peak)."""
    per_token = 6 * gpt_flop_params(hidden, layers, vocab) + 12 * layers * hidden * seq_len
    return tokens_per_s * per_token / (num_devices * peak_flops)


def model_state_bytes_per_param(
    dp: int = 1, zero_stage: int = 0, precision: str = "mixed"
) -> float:
    """Bytes per parameter per device for weights, gradients and Adam state."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    if precision == "mixed":
        weights, grads, optimizer = 2, 2, 12
    elif precision == "fp32":
        weights, grads, optimizer = 4, 4, 8
    else:
        raise ValueError(f"precision must be 'mixed' or 'fp32', got {precision!r}")
    sharded = (0, optimizer, grads + optimizer, weights + grads + optimizer)[zero_stage]
    return weights + grads + optimizer - sharded + sharded / dp


def model_state_bytes(
    num_params: float, dp: int = 1, zero_stage: int = 0, precision: str = "mixed"
) -> float:
    """Model-state bytes per device for ``num_params`` parameters held by that device."""
    return num_params * model_state_bytes_per_param(dp, zero_stage, precision)


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. Table 2).

    none:      s b h (10 + 24/t + 5 a s/(h t));   with sequence parallel s b h/t (34 + 5 a s/h)
    selective: s b h (10 + 24/t);                 with sequence parallel 34 s b h / t
    full:      2 s b h (the layer input);         with sequence parallel 2 s b h / t
    (t = 1 gives the unsharded s b h (34 + 5 a s/h).)
    """
    _check_recompute(recompute)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 5 * a * s / h if recompute == "none" else 0.0
    if sequence_parallel:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)
