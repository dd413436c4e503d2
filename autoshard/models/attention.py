"""Multi-head attention as one fused operator: the forward and the backward are each one
named ``jit`` that the tracer keeps whole (:data:`FUSED_ATTENTION_CALLS`).

Why: written as einsums and a softmax, attention materialises the ``[B, H, S, S]`` scores
in float32, keeps the probabilities for the backward and costs 1.3-1.7x the fused kernel in
time and ~1.8x in memory on a GPU.  Here the forward saves only what a flash-attention
kernel saves -- ``q``, ``k``, ``v``, the output and the softmax's log-sum-exp
(``[B, H, S]`` float32) -- and the backward recomputes the probabilities from them.

Implementations (``implementation=``):

* ``"cudnn"`` -- ``jax.nn.dot_product_attention(..., implementation="cudnn")``: cuDNN's
  flash attention on NVIDIA GPUs, its own forward and backward kernels (the backward is
  ``jax.vjp``'s pullback of the forward, rebuilt from the saved tensors: see
  :class:`_Pullback`).
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
import warnings

import jax
import jax.numpy as jnp

# jit names the tracer keeps as one equation -> (primitive name in the op graph, causal)
from autoshard.ir.primitives import FUSED_ATTENTION_CALLS  # noqa: F401

IMPLEMENTATIONS = ("xla", "cudnn")


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


class _Pullback:
    """How cuDNN's saved tensors map onto the fused operator's interface.

    ``jax.vjp`` of cuDNN's attention gives a pullback whose leaves are what cuDNN saves:
    ``q``, ``k``, ``v``, its output and its softmax statistics.  The forward jit returns
    only the output and the leaves that are none of ``q, k, v, out`` (the statistics), so
    its results are ``(out, stats)`` as on every backend; the backward jit rebuilds the
    pullback from ``q, k, v, out`` and those leaves.  ``where[i]`` names leaf ``i``: 0-3
    for ``q, k, v, out``, ``4 + j`` for the ``j``-th extra leaf.  A single extra leaf of
    ``B H S`` elements (cuDNN's ``[B, H, S, 1]`` statistics) travels as ``[B, H, S]``, the
    shape the XLA implementation's log-sum-exp has.  A zero-size leaf (cuDNN's pullback
    carries a ``bf16[0]`` beside its statistics on jax 0.11 / H100) is not passed at all:
    ``where`` holds its ``(shape, dtype)`` and the backward makes it anew, so the forward
    operator has the same two results on a GPU as on a CPU (and a plan file made on one
    binds on the other).
    """

    def __init__(self) -> None:
        self.by_shape: dict = {}

    def split(self, key, pullback, q, k, v, out) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        known = (q, k, v, out)
        where, extra = [], []
        for leaf in leaves:
            hit = next((i for i, x in enumerate(known) if leaf is x), None)
            if hit is None and getattr(leaf, "size", None) == 0:
                hit = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
            elif hit is None:
                hit = 4 + len(extra)
                extra.append(leaf)
            where.append(hit)
        shapes = tuple(x.shape for x in extra)
        self.by_shape[key] = (treedef, tuple(where), shapes)
        b, sq, h = q.shape[:3]
        if len(extra) == 1 and extra[0].size == b * h * sq:  # the statistics, as [B, H, S]
            return [extra[0].reshape(b, h, sq)]
        return extra

    def join(self, key, q, k, v, out, extra):
        treedef, where, shapes = self.by_shape[key]
        extra = [x.reshape(shape) for x, shape in zip(extra, shapes)]
        known = (q, k, v, out, *extra)
        leaves = [known[i] if isinstance(i, int) else jnp.zeros(*i) for i in where]
        return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.cache
def _fused(causal: bool, implementation: str):
    """The custom-vjp attention for one (causal, implementation), its two named jits."""
    suffix = "_causal" if causal else ""
    pullbacks = _Pullback()

    def _key(q, k, v):
        return tuple((x.shape, str(x.dtype)) for x in (q, k, v))

    def fwd_body(q, k, v):
        if implementation == "cudnn":
            try:
                out, pullback = jax.vjp(functools.partial(_cudnn, causal=causal), q, k, v)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                # cuDNN refuses at trace time (its version, the GPU, the shape): say so
                warnings.warn(
                    f"cuDNN flash attention refused q/k/v {q.shape} {q.dtype}: {err}; "
                    "running the XLA implementation of the same algorithm",
                    stacklevel=2,
                )
                pullbacks.by_shape[_key(q, k, v)] = None
                return _xla_fwd(q, k, v, causal)
            return out, pullbacks.split(_key(q, k, v), pullback, q, k, v, out)
        return _xla_fwd(q, k, v, causal)

    def bwd_body(q, k, v, out, stats, d_out):
        if implementation == "cudnn" and pullbacks.by_shape.get(_key(q, k, v)) is not None:
            return pullbacks.join(_key(q, k, v), q, k, v, out, stats)(d_out)
        return _xla_bwd(q, k, v, out, stats, d_out, causal)

    fwd_body.__name__ = fwd_body.__qualname__ = f"autoshard_attention_fwd{suffix}"
    bwd_body.__name__ = bwd_body.__qualname__ = f"autoshard_attention_bwd{suffix}"
    fwd_jit, bwd_jit = jax.jit(fwd_body), jax.jit(bwd_body)

    @jax.custom_vjp
    def attend(q, k, v):
        return fwd_jit(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, stats = fwd_jit(q, k, v)
        return out, (q, k, v, out, stats)

    def attend_bwd(saved, d_out):
        return tuple(bwd_jit(*saved, d_out))

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
