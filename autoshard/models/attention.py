"""Multi-head attention as one fused operator: the forward and the backward are each one
named ``jit`` that the tracer keeps whole (:data:`FUSED_ATTENTION_CALLS`).

Why: written as einsums and a softmax, attention materialises the ``[B, H, S, S]`` scores
in float32, keeps the probabilities for the backward and costs 1.3-1.7x the fused kernel in
time and ~1.8x in memory on a GPU.  Here the forward saves only what a flash-attention
kernel saves -- ``q``, ``k``, ``v``, the output and the softmax's log-sum-exp
(``[B, H, S]`` float32) -- and the backward recomputes the probabilities from them.

Implementations (``implementation=``):

* ``"cudnn"`` -- ``jax.nn.dot_product_attention(..., implementation="cudnn")``: cuDNN's
  flash attention on NVIDIA GPUs (its own forward and backward kernels; what it saves for
  the backward is cuDNN's: the same tensors and its softmax statistics).
* ``"xla"`` -- the same algorithm written for XLA (any backend): a forward that keeps the
  log-sum-exp, and the flash backward (``dV = P^T dO``, ``dP = dO V^T``,
  ``dS = P (dP - rowsum(dO * O))``, ``dQ = dS K``, ``dK = dS^T Q``).  The ``S x S`` block is a
  temporary inside each operator, never a saved value.
* ``None`` -- ``"cudnn"`` when the default backend is a GPU, else ``"xla"``.

Whatever the implementation, the traced step holds two equations per attention: a ``jit``
named ``autoshard_attention_fwd[_causal]`` reading ``q, k, v`` (``[B, S, H, D]``) and
writing ``out`` (``[B, S, H, D]``) plus its saved statistics, and a ``jit`` named
``autoshard_attention_bwd[_causal]`` reading the saved tensors and ``d_out`` and writing
``dq, dk, dv``.  So a plan made on a CPU laptop for a GPU cluster sees the same operator
that the GPU runs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn")

# jit names the tracer keeps as one equation -> (primitive name in the op graph, causal)
FUSED_ATTENTION_CALLS = {
    "autoshard_attention_fwd": ("attention_fwd", False),
    "autoshard_attention_fwd_causal": ("attention_fwd", True),
    "autoshard_attention_bwd": ("attention_bwd", False),
    "autoshard_attention_bwd_causal": ("attention_bwd", True),
}


def default_implementation() -> str:
    """``"cudnn"`` on a GPU backend, ``"xla"`` elsewhere."""
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


def _scores(q: jax.Array, k: jax.Array, causal: bool) -> jax.Array:
    """Scaled scores ``[B, H, Sq, Sk]`` in float32, masked above the diagonal if causal."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = jnp.tril(jnp.ones((sq, sk), dtype=bool), k=sk - sq)
        s = jnp.where(keep, s, jnp.finfo(jnp.float32).min)
    return s


def _xla_fwd(q, k, v, causal: bool):
    s = _scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, H, Sq]
    p = jnp.exp(s - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def _xla_bwd(q, k, v, out, lse, d_out, causal: bool):
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = jnp.exp(_scores(q, k, causal) - lse[..., None])  # [B, H, Sq, Sk] f32
    dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(v.dtype), d_out)
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, v, preferred_element_type=jnp.float32)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", d_out, out, preferred_element_type=jnp.float32
    )  # rowsum(dO * O)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, dk, dv


def _cudnn(q, k, v, causal: bool):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


@functools.cache
def _fused(causal: bool, implementation: str):
    """The custom-vjp attention for one (causal, implementation), its two named jits."""
    suffix = "_causal" if causal else ""

    def fwd_body(q, k, v):
        if implementation == "cudnn":
            out, pullback = jax.vjp(functools.partial(_cudnn, causal=causal), q, k, v)
            return out, pullback  # a Partial: its leaves are cuDNN's saved tensors
        return _xla_fwd(q, k, v, causal)

    def bwd_body(saved, d_out):
        if implementation == "cudnn":
            return saved(d_out)
        q, k, v, out, lse = saved
        return _xla_bwd(q, k, v, out, lse, d_out, causal)

    fwd_body.__name__ = fwd_body.__qualname__ = f"autoshard_attention_fwd{suffix}"
    bwd_body.__name__ = bwd_body.__qualname__ = f"autoshard_attention_bwd{suffix}"
    fwd_jit, bwd_jit = jax.jit(fwd_body), jax.jit(bwd_body)

    @jax.custom_vjp
    def attend(q, k, v):
        return fwd_jit(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, stats = fwd_jit(q, k, v)
        saved = stats if implementation == "cudnn" else (q, k, v, out, stats)
        return out, saved

    def attend_bwd(saved, d_out):
        return tuple(bwd_jit(saved, d_out))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    implementation: str | None = None,
) -> jax.Array:
    """Softmax attention of ``q, k, v`` (``[B, S, H, D]`` each) -> ``[B, S, H, D]``, scaled by
    ``1/sqrt(D)``, the softmax in float32; one fused operator forward and backward."""
    if implementation is None:
        implementation = default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation must be one of {IMPLEMENTATIONS} or None, "
            f"got {implementation!r}"
        )
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"fused_attention takes q, k, v as [B, S, H, D] with the same B, H, D; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    return _fused(bool(causal), implementation)(q, k, v)


def unfused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True):
    """The same attention written out (einsums, a float32 softmax, the probabilities kept
    for the backward): what the models ran before the fused operator, and the reference."""
    s = _scores(q, k, causal)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
