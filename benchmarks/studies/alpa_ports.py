"""Alpa's intra-operator (shard_parallel) test cases, ported: each case's model, mesh and
options as Alpa's test sets them, Alpa's expected objective (its test's formula, on its
logical mesh's alpha-beta costs) and what Alpa asserts of the layouts and collectives,
checked against autoshard's default plan.  tests/test_alpa_ports.py asserts them; this
script prints the table and writes it as JSON:

    python benchmarks/studies/alpa_ports.py [--cases NAME ...] [--out benchmarks/results/alpa_ports.json]

Source of the facts: alpa-projects/alpa tests/shard_parallel/{test_mlp,test_bert,test_moe,
test_conv}.py (commit b8078a9, 2023-12-09).  Shapes, mesh costs, expected-cost formulas
and the asserted layouts and collective counts carry over; the models are written here.

How autoshard's terms differ from Alpa's, for every case:

* Alpa counts the collectives of the compiled HLO after XLA's all-reduce combiner (one
  all-reduce for all of a data-parallel step's gradients); autoshard's predicted
  collectives are one per value, so "1 all-reduce" reads "only all-reduces, over the data
  axis, one per gradient".
* Alpa's objective charges a penalty, int(all_reduce_cost(1, 0) + all_reduce_cost(1, 1)),
  per replicated parameter and optimizer-state leaf of a data-parallel plan (3 per leaf on
  these meshes); autoshard has no such term.  Alpa's formulas include it; it is < 0.3% of
  each.
* Alpa's BERT runs dropout (``deterministic=False``); the layers here have none (no
  random bits in the traced step).  Dropout adds no collective to any of Alpa's plans.
* Alpa's train step returns the new state only (no loss), and so do the steps here.
"""

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# --- Alpa's logical-mesh costs -----------------------------------------------------------


@dataclass(frozen=True)
class AlpaMesh:
    """A logical mesh of Alpa's tests: its shape and per-dim alpha and beta, with the
    alpha-beta costs Alpa's objective is made of (each with Alpa's tie-breaking constant)."""

    shape: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]

    def _volume(self, dim: int, factor: float, nbytes: float) -> float:
        n = self.shape[dim]
        return self.alpha[dim] + self.beta[dim] * factor * (n - 1) / n * nbytes

    def all_reduce(self, nbytes: float, dim: int) -> float:
        return self._volume(dim, 2.0, nbytes) + 0.01

    def all_to_all(self, nbytes: float, dim: int) -> float:
        # on the whole tensor: (n-1)/n^2 of it, times Alpa's n/2 penalty
        n = self.shape[dim]
        return self._volume(dim, 1.0 / n * n / 2.0, nbytes) + 0.001

    def flatten(self) -> "AlpaMesh":
        """One dim of every device: the largest alpha, the smallest beta (Alpa's rule)."""
        return AlpaMesh((math.prod(self.shape), 1), (max(self.alpha),) * 2, (min(self.beta),) * 2)

    def replicated_penalty(self) -> int:
        return int(self.all_reduce(1, 0) + self.all_reduce(1, 1))

    def autoshard(self):
        """The same costs as autoshard's priced mesh (axes ``x`` and ``y``)."""
        from autoshard.hardware.mesh import uniform_mesh

        return uniform_mesh(self.shape, ("x", "y"), self.alpha, self.beta)


AXES = ("x", "y")


def _nbytes(leaf) -> int:
    return 4 * math.prod(leaf.shape)


def _leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def data_parallel_cost(mesh: AlpaMesh, dim: int, params, opt_state) -> float:
    """test_mlp's assert_data_parallel_cost: every gradient all-reduced over ``dim``, and
    the replicated penalty per parameter and optimizer-state leaf."""
    penalty = mesh.replicated_penalty()
    grads = sum(mesh.all_reduce(_nbytes(p), dim) for p in _leaves(params))
    return grads + penalty * (len(_leaves(params)) + len(_leaves(opt_state)))


def conv_data_parallel_cost(mesh: AlpaMesh, dim: int, params, batch_stats) -> float:
    """test_conv's assert_data_parallel_cost: the weights' all-reduces and two all-reduces
    per batch statistic (its forward mean and variance, their backward), each with the
    replicated penalty."""
    penalty = mesh.replicated_penalty()
    weights = sum(mesh.all_reduce(_nbytes(p), dim) + penalty for p in _leaves(params))
    stats = sum(mesh.all_reduce(_nbytes(s), dim) + penalty for s in _leaves(batch_stats))
    return weights + 2 * stats


# --- the models (Alpa's shapes; our code) --------------------------------------------------


def _adam():
    import optax

    return optax.adam(1e-2)


def _state_step(apply_loss, tx):
    """``step(params, opt_state, batch) -> (params, opt_state)``: Alpa's steps return the
    new state, not the loss."""
    import jax
    import optax

    def step(params, opt_state, batch):
        grads = jax.grad(apply_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def mlp_step(num_layers, batch, hidden, optimizer="adam", use_bias=True):
    """test_mlp's run_n_layer_mlp: ``num_layers`` Dense layers (relu between), squared
    error against ones, Adam (or Adafactor, min_dim_size_to_factor=4)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(num_layers - 1):
                x = nn.relu(nn.Dense(hidden, use_bias=use_bias)(x))
            return nn.Dense(hidden, use_bias=use_bias)(x)

    model = Model()
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    if optimizer == "adam":
        tx = _adam()
    elif optimizer == "adafactor":
        tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    else:
        raise ValueError(f"optimizer {optimizer!r}: 'adam' or 'adafactor'")

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    return _state_step(loss, tx), (params, jax.eval_shape(tx.init, params), {"x": x, "y": x})


def _bert_layer_module(hidden, heads):
    """One BERT layer as Alpa's FlaxBertLayer computes it: a combined q/v/k projection
    whose columns interleave the three (feature-major), attention with an additive mask
    bias, an output projection and a post-LayerNorm residual, a 4x feed-forward with gelu
    and a post-LayerNorm residual.  No dropout (see the module's docstring)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class BertLayer(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            b, s, _ = x.shape
            d = hidden // heads
            qvk = nn.Dense(3 * hidden, name="qvk_combined")(x).reshape(b, s, hidden, 3)
            q, v, k = (t.reshape(b, s, heads, d) for t in jnp.split(qvk, 3, axis=3))
            bias = jnp.where(mask[:, None, None, :] > 0, 0.0, -1e10)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(d).astype(q.dtype), k)
            probs = jax.nn.softmax(scores + bias, axis=-1)
            attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, hidden)
            attn = nn.Dense(hidden, name="attention_output")(attn)
            x = nn.LayerNorm(epsilon=1e-12, name="attention_ln")(attn + x)
            y = nn.gelu(nn.Dense(4 * hidden, name="intermediate")(x))
            y = nn.Dense(hidden, name="output")(y)
            return nn.LayerNorm(epsilon=1e-12, name="output_ln")(y + x)

    return BertLayer


BERT_KERNELS = ("qvk_combined", "attention_output", "intermediate", "output")


def bert_layers_step(batch, seq, num_layers, hidden, heads):
    """test_bert's run_bert_layers: ``num_layers`` BERT layers on [batch, seq, hidden]
    hidden states with an all-ones int mask, squared error, Adam."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    layer = _bert_layer_module(hidden, heads)

    class Layers(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            for i in range(num_layers):
                x = layer(name=f"layer_{i}")(x, mask)
            return x

    model = Layers()
    x = jax.ShapeDtypeStruct((batch, seq, hidden), jnp.float32)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), x, mask)["params"]
    tx = _adam()

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"], b["mask"]) - b["y"]) ** 2)

    batch_args = {"x": x, "mask": mask, "y": x}
    return _state_step(loss, tx), (params, jax.eval_shape(tx.init, params), batch_args)


def tied_embedding_step(vocab, hidden, batch, seq):
    """test_bert's test_embedding_2d_mesh: tokens embedded and projected back through the
    same table, summed cross-entropy, Adam."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(vocab, hidden, name="embed")
            return embed(tokens) @ embed.embedding.T

    model = Model()
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    tx = _adam()

    def loss(p, b):
        logits = model.apply({"params": p}, b["x"])
        target = jax.nn.one_hot(b["y"], vocab)
        return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1))

    args = (params, jax.eval_shape(tx.init, params), {"x": tokens, "y": tokens})
    return _state_step(loss, tx), args


def bert_mlm_step(batch, seq, num_layers, hidden, heads, vocab):
    """test_bert's run_bert_mlm: BERT for masked LM (word, position and token-type
    embeddings with a LayerNorm, the layers, a dense-gelu-LayerNorm transform and a decoder
    tied to the word embeddings plus a bias), masked cross-entropy, Adam."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    layer = _bert_layer_module(hidden, heads)

    class BertMLM(nn.Module):
        @nn.compact
        def __call__(self, ids, mask, types, positions):
            words = nn.Embed(vocab, hidden, name="word_embeddings")
            x = words(ids) + nn.Embed(seq, hidden, name="position_embeddings")(positions)
            x = nn.LayerNorm(epsilon=1e-12, name="embeddings_ln")(
                x + nn.Embed(2, hidden, name="token_type_embeddings")(types)
            )
            for i in range(num_layers):
                x = layer(name=f"layer_{i}")(x, mask)
            x = nn.gelu(nn.Dense(hidden, name="transform")(x))
            x = nn.LayerNorm(epsilon=1e-12, name="transform_ln")(x)
            bias = self.param("decoder_bias", nn.initializers.zeros, (vocab,))
            return x @ words.embedding.T + bias

    model = BertMLM()
    ints = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    inputs = {"ids": ints, "mask": ints, "types": ints, "positions": ints}
    params = jax.eval_shape(model.init, jax.random.key(0), *inputs.values())["params"]
    tx = _adam()

    def loss(p, b):
        logits = model.apply({"params": p}, b["ids"], b["mask"], b["types"], b["positions"])
        label_mask = jnp.where(b["labels"] > 0, 1.0, 0.0)
        target = jax.nn.one_hot(b["labels"], vocab)
        token_loss = -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        return (label_mask * token_loss).sum() / label_mask.sum() * 0.1234

    args = (params, jax.eval_shape(tx.init, params), {**inputs, "labels": ints})
    return _state_step(loss, tx), args


def conv_step(num_layers, batch, image, channel, depthwise=False):
    """test_conv's run_n_layer_conv: ``num_layers`` times a 3x3/2 conv (no bias), batch
    norm, relu and a 2x2/1 max pool (or the depthwise stack: 3x3 conv to 8C, depthwise
    3x3 conv, 3x3 conv back to C, relu, batch norm); squared error; SGD with momentum 0.9.
    The batch statistics are state: the step returns them updated, carried beside the
    optimizer's state (``opt_state`` is ``(momentum, batch_stats)``)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            if depthwise:
                x = nn.Conv(8 * channel, (3, 3), use_bias=False)(x)
                x = nn.Conv(8 * channel, (3, 3), feature_group_count=8 * channel,
                            use_bias=False)(x)  # fmt: skip
                x = nn.relu(nn.Conv(channel, (3, 3), use_bias=False)(x))
                return nn.BatchNorm(use_running_average=False)(x)
            for _ in range(num_layers):
                x = nn.Conv(channel, (3, 3), strides=(2, 2), use_bias=False)(x)
                x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
                x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
            return x

    model = Model()
    x = jax.ShapeDtypeStruct((batch, image, image, channel), jnp.float32)
    side = image if depthwise else image // 2**num_layers
    y = jax.ShapeDtypeStruct((batch, side, side, channel), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(p, s, b):
        out, new = model.apply({"params": p, "batch_stats": s}, b["x"], mutable=["batch_stats"])
        return jnp.mean((out - b["y"]) ** 2), new["batch_stats"]

    def step(p, state, b):
        opt_state, s = state
        grads, s = jax.grad(loss, has_aux=True)(p, s, b)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), (opt_state, s)

    return step, (params, (jax.eval_shape(tx.init, params), stats), {"x": x, "y": y})


def moe_layer_step():
    """test_moe's run_moe_layer (autoshard.models.moe.alpa_moe_layer_step: batch 64,
    sequence 16, hidden 64, 16 heads, groups of 32 tokens, 16 experts, Adam)."""
    from autoshard.models.moe import alpa_moe_layer_step

    return alpa_moe_layer_step()


def moe_lm_step(batch=64, seq=16, num_layers=2, hidden=64, heads=16, vocab=32, group=32,
                experts=16):  # fmt: skip
    """test_moe's run_moe_lm at its sizes, on autoshard's GPT-MoE (autoshard.models.moe:
    token and position embeddings, blocks alternating MoE and dense feed-forwards, the
    head tied to the embedding; Alpa's is BERT-like: post-LayerNorm, bidirectional
    attention, a masked loss), Adafactor (min_dim_size_to_factor=4, weight decay on the
    matrices) as Alpa's."""
    import jax
    import jax.numpy as jnp
    import optax

    from autoshard.models.gpt import token_loss_fn
    from autoshard.models.moe import GPTMoE, MoEConfig

    cfg = MoEConfig(
        name="alpa-moe-lm", hidden=hidden, num_layers=num_layers, num_heads=heads,
        num_experts=experts, expert_group_size=group, vocab_size=vocab, seq_len=seq,
        batch_size=batch, ffn_ratio=4, attention="unfused",
    )  # fmt: skip
    model = GPTMoE(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def matrices(tree):
        return jax.tree_util.tree_map(lambda x: x.ndim > 1, tree)

    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4, weight_decay_rate=1e-4,
                         weight_decay_mask=matrices)  # fmt: skip
    loss = token_loss_fn(model)
    args = (params, jax.eval_shape(tx.init, params), {"tokens": tokens, "labels": tokens})
    return _state_step(loss, tx), args


# --- the cases -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One of Alpa's test cases on one mesh.

    ``build``: ``() -> (step, args)``; ``options``: IntraOptions fields Alpa's test sets
    (in autoshard's names); ``expected``: ``(mesh, args) -> float``, Alpa's expected
    objective (None where Alpa asserts none); ``layouts``: ``(case, plan) -> list of
    what differs from Alpa's asserted layouts``; ``collectives``: the same for the
    collectives Alpa counts, in autoshard's terms; ``note``: how the port differs."""

    name: str
    alpa_test: str
    mesh: AlpaMesh
    dim: int  # the mesh dim Alpa's formula names (for a 1-D case: the real one)
    build: Callable
    options: tuple = ()
    expected: Callable | None = None
    layouts: Callable | None = None
    collectives: Callable | None = None
    note: str = ""
    metadata: dict = field(default_factory=dict)
    baseline: str | None = None  # autoshard's baseline pins (Alpa's force_zero_stage_3)


def _mesh(shape, alpha=(1, 1), beta=(1, 1)) -> AlpaMesh:
    return AlpaMesh(tuple(shape), tuple(map(float, alpha)), tuple(map(float, beta)))


def _specs(plan) -> dict:
    return dict(zip(plan.input_paths, plan.input_specs, strict=True))


def _param_specs(plan) -> dict:
    return {p: s for p, s in _specs(plan).items() if p.startswith("[0]")}


def _kinds(plan) -> Counter:
    return Counter(c.kind for c in plan.predicted_collectives)


def _nonscalar(plan) -> list:
    return [c for c in plan.predicted_collectives if c.bytes > 4]


# layouts, as Alpa asserts them ------------------------------------------------------------


def _replicated(plan, paths=None) -> list[str]:
    specs = _param_specs(plan)
    return [f"{p}: {s.dims}" for p, s in specs.items() if (paths is None or p in paths)
            and not s.is_replicated]  # fmt: skip


def all_params_replicated(case, plan) -> list[str]:
    """assert_all_replicated on every parameter."""
    return _replicated(plan)


def _alternating(plan, kernels, column, row) -> list[str]:
    specs = _param_specs(plan)
    bad = []
    for k, path in enumerate(kernels):
        want = column if k % 2 == 0 else row
        if specs[path].dims != want:
            bad.append(f"{path}: {specs[path].dims}, Alpa's {want}")
    return bad


def _mlp_kernels(n):
    return [f"[0]['Dense_{k}']['kernel']" for k in range(n)]


def _bert_kernels(n):
    return [f"[0]['layer_{i}']['{w}']['kernel']" for i in range(n) for w in BERT_KERNELS]


def megatron_1d(kernels):
    """Column-partitioned, then row-partitioned, alternately, over the case's real axis
    (assert_column_partitioned / assert_row_partitioned)."""

    def check(case, plan):
        axis = (AXES[case.dim],)
        return _alternating(plan, kernels(case), ((), axis), (axis, ()))

    return check


def megatron_2d(kernels):
    """Replicated over dim 0, column- then row-partitioned over dim 1
    (assert_replicated_column_partitioned / assert_replicated_row_partitioned)."""

    def check(case, plan):
        return _alternating(plan, kernels(case), ((), ("y",)), (("y",), ()))

    return check


def moe_layout(case, plan) -> list[str]:
    """test_moe_layer: attention kernels and the gate replicated, the experts' weights
    split on their expert dim over the case's real axis."""
    specs = _param_specs(plan)
    bad = _replicated(plan, {"[0]['attn']['proj']['kernel']", "[0]['attn']['qkv']['kernel']",
                             "[0]['moe']['wg']"})  # fmt: skip
    for w in ("wi", "wo"):
        s = specs[f"[0]['moe']['{w}']"]
        if s.dims[0] != (AXES[case.dim],) or any(s.dims[1:]):
            bad.append(f"moe {w}: {s.dims}")
    return bad


# collectives, as Alpa counts them (in autoshard's terms) ----------------------------------


def only_gradient_all_reduces(case, plan) -> list[str]:
    """Alpa: 1 all-reduce and nothing else (XLA combines the gradients' all-reduces); here:
    only all-reduces, each over the case's data axis (or axes), one per parameter."""
    axes = _data_axes(case)
    bad = [f"{c.kind} over {c.axes}" for c in plan.predicted_collectives
           if c.kind != "all-reduce" or set(c.axes) != axes]  # fmt: skip
    n_params = sum(1 for p in plan.input_paths if p.startswith("[0]"))
    if len(plan.predicted_collectives) != n_params:
        bad.append(f"{len(plan.predicted_collectives)} all-reduces, {n_params} parameters")
    return bad


def _data_axes(case) -> set:
    if dict(case.options).get("data_parallel_axes"):
        return set(dict(case.options)["data_parallel_axes"])
    return {AXES[case.dim]}


def activation_all_reduces(count: Callable) -> Callable:
    """Alpa: ``count(case)`` all-reduces and nothing else (model parallel: one per
    row-partitioned forward and column-partitioned backward matmul)."""

    def check(case, plan):
        want = count(case)
        kinds = _kinds(plan)
        bad = [] if kinds == Counter({"all-reduce": want}) else [f"{dict(kinds)}, Alpa's {want}"]
        return bad + [f"over {c.axes}" for c in plan.predicted_collectives
                      if c.axes != (AXES[case.dim],)]  # fmt: skip

    return check


def only_all_reduces(case, plan) -> list[str]:
    """Alpa: every collective an all-reduce (n_total == n_all_reduce)."""
    kinds = _kinds(plan)
    return [] if set(kinds) <= {"all-reduce"} else [str(dict(kinds))]


def moe_collectives(case, plan) -> list[str]:
    """Alpa: 4 all-to-alls and 1 (combined) all-reduce: here 4 all-to-alls and the rest
    all-reduces over the case's axis."""
    kinds = _kinds(plan)
    bad = [] if kinds["all-to-all"] == 4 else [f"{kinds['all-to-all']} all-to-alls"]
    return bad + [f"{k} x{n}" for k, n in kinds.items() if k not in ("all-to-all", "all-reduce")]


def conv_data_parallel_collectives(case, plan) -> list[str]:
    """Alpa: 1 + 2 x (batch norms) all-reduces (the gradients combined into one; each batch
    norm's statistics in the forward and the backward), nothing else; here only
    all-reduces over the data axis, one per parameter and 2 per batch norm beyond them."""
    axes = _data_axes(case)
    bad = [f"{c.kind} over {c.axes}" for c in _nonscalar(plan)
           if c.kind != "all-reduce" or set(c.axes) != axes]  # fmt: skip
    return bad


def conv_activation_all_reduces(count: Callable) -> Callable:
    """Alpa: ``count(case)`` non-scalar all-reduces, nothing else."""

    def check(case, plan):
        got = _nonscalar(plan)
        kinds = Counter(c.kind for c in got)
        want = count(case)
        return [] if kinds == Counter({"all-reduce": want}) else [f"{dict(kinds)}, Alpa's {want}"]

    return check


def zero2_collectives(case, plan) -> list[str]:
    """Alpa (prefer_reduce_scatter, data parallel): 1 reduce-scatter, 1 all-gather, no
    all-reduce (each combined); here: reduce-scatters and all-gathers over the data axis,
    some of each, no all-reduce but of a scalar."""
    axes = _data_axes(case)
    kinds = Counter(c.kind for c in _nonscalar(plan))
    bad = [f"{c.kind} over {c.axes}" for c in plan.predicted_collectives
           if set(c.axes) != axes]  # fmt: skip
    if set(kinds) != {"reduce-scatter", "all-gather"}:
        bad.append(str(dict(kinds)))
    return bad


def adafactor_zero2_collectives(case, plan) -> list[str]:
    """Alpa (prefer_reduce_scatter, Adafactor): 1 reduce-scatter, at most 2 all-gathers
    and 2 all-reduces (combined); here: some reduce-scatter, nothing but reduce-scatters,
    all-gathers and all-reduces."""
    kinds = _kinds(plan)
    bad = [] if kinds["reduce-scatter"] else ["no reduce-scatter"]
    return bad + [k for k in kinds if k not in ("reduce-scatter", "all-gather", "all-reduce")]


def megatron_reduce_scatter_collectives(count: Callable) -> Callable:
    """Alpa (prefer_reduce_scatter, model parallel): all-reduces + reduce-scatters ==
    ``count(case)``, as many all-gathers as reduce-scatters, nothing else."""

    def check(case, plan):
        k = _kinds(plan)
        bad = [] if k["all-reduce"] + k["reduce-scatter"] == count(case) else [str(dict(k))]
        bad += [] if k["reduce-scatter"] == k["all-gather"] else [f"{dict(k)}: RS != AG"]
        return bad + [x for x in k if x not in ("all-reduce", "reduce-scatter", "all-gather")]

    return check


def state_fully_sharded(case, plan) -> list[str]:
    """Alpa (prefer_reduce_scatter, 2-D): every optimizer-state leaf of rank > 1 split over
    every mesh axis (assert_fully_sharded)."""
    bad = []
    for path, spec in _specs(plan).items():
        if path.startswith("[1]") and len(spec.dims) > 1:
            used = {a for d in spec.dims for a in d}
            if used != set(AXES):
                bad.append(f"{path}: {spec.dims}")
    return bad


def moe_2d_collectives(case, plan) -> list[str]:
    """Alpa (test_moe_layer_2d): all-reduces (2, combined) and all-to-alls (some), nothing
    else."""
    kinds = _kinds(plan)
    bad = [] if kinds["all-to-all"] else ["no all-to-all"]
    return bad + [k for k in kinds if k not in ("all-reduce", "all-to-all")]


def moe_2d_reduce_scatter_collectives(case, plan) -> list[str]:
    """Alpa (test_moe_layer_2d_reduce_scatter): some all-to-all, some reduce-scatter, no
    all-reduce (here: none but of a scalar), nothing but those and all-gathers."""
    kinds = _kinds(plan)
    bad = [f"no {k}" for k in ("all-to-all", "reduce-scatter") if not kinds[k]]
    bad += [f"all-reduce of {c.bytes} B" for c in _nonscalar(plan) if c.kind == "all-reduce"]
    return bad + [k for k in kinds if k not in ("all-reduce", "all-to-all", "reduce-scatter",
                                                 "all-gather")]  # fmt: skip


def zero3_collectives(case, plan) -> list[str]:
    """Alpa (force_zero_stage_3): 2 all-gathers and 1 reduce-scatter (combined), no
    all-reduce; every parameter and state leaf of rank > 1 sharded.  Here: all-gathers
    and reduce-scatters only (but scalars), every rank > 1 parameter and state input
    split."""
    kinds = Counter(c.kind for c in _nonscalar(plan))
    bad = [] if set(kinds) == {"all-gather", "reduce-scatter"} else [str(dict(kinds))]
    for path, spec in _specs(plan).items():
        if path[:3] in ("[0]", "[1]") and len(spec.dims) > 1 and spec.is_replicated:
            bad.append(f"{path} replicated")
    return bad


def moe_lm_collectives(case, plan) -> list[str]:
    """Alpa (test_moe_lm): 4 all-to-alls, at most 4 all-reduces (combined), nothing
    else; here 4 all-to-alls and all-reduces."""
    kinds = _kinds(plan)
    bad = [] if kinds["all-to-all"] == 4 else [f"{kinds['all-to-all']} all-to-alls"]
    return bad + [f"{k} x{n}" for k, n in kinds.items() if k not in ("all-to-all", "all-reduce")]


def moe_lm_data_parallel_collectives(case, plan) -> list[str]:
    """Alpa (test_moe_lm_data_parallel): 1 all-reduce (combined), nothing else."""
    kinds = _kinds(plan)
    return [] if set(kinds) == {"all-reduce"} else [str(dict(kinds))]


def conv_zero2_collectives(case, plan) -> list[str]:
    """Alpa (test_n_layer_conv_data_parallel_reduce_scatter): all-reduces only for the
    batch norms' statistics (2 a batch norm), some reduce-scatter, at most 2 all-gathers
    (combined), nothing else; the optimizer state of rank > 1 sharded.  Here: every
    collective over the data axis, some reduce-scatter, nothing but all-reduces,
    reduce-scatters and all-gathers, the momentum of the kernels split."""
    kinds = _kinds(plan)
    bad = [] if kinds["reduce-scatter"] else ["no reduce-scatter"]
    bad += [k for k in kinds if k not in ("all-reduce", "reduce-scatter", "all-gather")]
    for path, spec in _specs(plan).items():
        if path.startswith("[1]") and len(spec.dims) > 1 and spec.is_replicated:
            bad.append(f"{path} replicated")
    return bad


def some_all_to_all(case, plan) -> list[str]:
    """Alpa (allow_mixed_mesh_shape=True on 2-D): some all-to-all."""
    return [] if _kinds(plan)["all-to-all"] else [f"no all-to-all: {dict(_kinds(plan))}"]


def some_all_to_all_and_reduce_scatter(case, plan) -> list[str]:
    """Alpa (mixed mesh shape and prefer_reduce_scatter on 2-D): some all-to-all and some
    reduce-scatter."""
    kinds = _kinds(plan)
    return [f"no {k}: {dict(kinds)}" for k in ("all-to-all", "reduce-scatter") if not kinds[k]]


# expected objectives ----------------------------------------------------------------------


def dp_expected(case, args):
    return data_parallel_cost(case.mesh, case.dim, args[0], args[1])


def dp_flat_expected(case, args):
    return data_parallel_cost(case.mesh.flatten(), 0, args[0], args[1])


def mlp_mp_expected(case, args):
    layers, batch, hidden = case.metadata["layers"], case.metadata["batch"], case.metadata["hidden"]
    return (layers - 1) * case.mesh.all_reduce(batch * hidden * 4, case.dim)


def mlp_2d_expected(case, args):
    m, md = case.mesh, case.metadata
    layers, batch, hidden = md["layers"], md["batch"], md["hidden"]
    return layers * (m.all_reduce(hidden * hidden * 4 / m.shape[1], 0)
                     + m.all_reduce(hidden * 4, 0)) + (layers - 1) * m.all_reduce(
        batch * hidden * 4 / m.shape[0], 1)  # fmt: skip


def bert_mp_expected(case, args):
    md = case.metadata
    act = md["batch"] * md["seq"] * md["hidden"] * 4
    return (md["layers"] * 4 - 1) * case.mesh.all_reduce(act, case.dim)


def bert_2d_expected(case, args):
    m, md = case.mesh, case.metadata
    act = md["batch"] * md["seq"] * md["hidden"] * 4 / m.shape[0]
    weights = sum(m.all_reduce(_nbytes(p) / m.shape[1], 0) for p in _leaves(args[0]))
    return weights + m.all_reduce(act, 1) * (md["layers"] * 4 - 1)


def embedding_2d_expected(case, args):
    m, md = case.mesh, case.metadata
    b, s, h, v = md["batch"], md["seq"], md["hidden"], md["vocab"]
    return (m.all_reduce(v * h * 4 / m.shape[1], 0)
            + m.all_reduce(b * s * h * 4 / m.shape[0], 1) * 2
            + m.all_reduce(b * s * 4 / m.shape[0], 1) * 2)  # fmt: skip


def moe_expected(case, args):
    m, i = case.mesh, case.dim
    b, s, h, e = 64, 16, 64, 16
    return (m.all_to_all(b * s * h * 2 * 4, i) * 4 + m.all_reduce(h * h * 3 * 4, i)
            + m.all_reduce(h * 3 * 4, i) + m.all_reduce(h * h * 4, i)
            + m.all_reduce(h * 4, i) + m.all_reduce(h * 4, i) * 4
            + m.all_reduce(h * e * 4, i))  # fmt: skip


def conv_dp_expected(case, args):
    params, (_, stats) = args[0], args[1]
    return conv_data_parallel_cost(case.mesh, case.dim, params, stats)


def _one_d(shape):
    return 0 if shape[0] > 1 else 1


def _cases() -> list[Case]:
    cases: list[Case] = []
    mlp = "tests/shard_parallel/test_mlp.py::"
    bert = "tests/shard_parallel/test_bert.py::"
    moe = "tests/shard_parallel/test_moe.py::"
    conv = "tests/shard_parallel/test_conv.py::"
    one_d = [(4, 1), (1, 4)]

    def label(shape):
        return "x".join(map(str, shape))

    # test_mlp --------------------------------------------------------------------------
    for shape in one_d:
        dp = {"layers": 6, "batch": 256, "hidden": 32}
        cases.append(Case(
            f"mlp_data_parallel[{label(shape)}]", mlp + "test_n_layer_mlp_data_parallel",
            _mesh(shape), _one_d(shape), functools.partial(mlp_step, 6, 256, 32),
            expected=dp_expected, layouts=all_params_replicated,
            collectives=only_gradient_all_reduces, metadata=dp,
        ))  # fmt: skip
        mp = {"layers": 6, "batch": 32, "hidden": 256}
        cases.append(Case(
            f"mlp_model_parallel[{label(shape)}]", mlp + "test_n_layer_mlp_model_parallel",
            _mesh(shape), _one_d(shape), functools.partial(mlp_step, 6, 32, 256),
            expected=mlp_mp_expected, layouts=megatron_1d(lambda c: _mlp_kernels(6)),
            collectives=activation_all_reduces(lambda c: 5), metadata=mp,
        ))  # fmt: skip
    cases.append(Case(
        "mlp_2d_mesh[2x2]", mlp + "test_n_layer_mlp_2d_mesh",
        _mesh((2, 2), beta=(1, 0.1)), 0, functools.partial(mlp_step, 6, 256, 32),
        expected=mlp_2d_expected, layouts=megatron_2d(lambda c: _mlp_kernels(6)),
        metadata={"layers": 6, "batch": 256, "hidden": 32},
    ))  # fmt: skip
    for shape in [(4, 1), (2, 2)]:
        # Alpa flattens the mesh to one dim of all devices: the batch over both axes
        axes = tuple(a for a, n in zip(AXES, shape, strict=True) if n > 1)
        dp_options = (("data_parallel_axes", axes), ("allow_mixed_mesh_shape", True))
        cases.append(Case(
            f"mlp_force_data_parallel[{label(shape)}]",
            mlp + "test_n_layer_mlp_force_data_parallel", _mesh(shape), 0,
            functools.partial(mlp_step, 6, 32, 256), options=dp_options,
            expected=dp_flat_expected, layouts=all_params_replicated,
            collectives=only_gradient_all_reduces,
        ))  # fmt: skip
    cases.append(Case(
        "mlp_force_batch_dim_mapping[4x1]", mlp + "test_n_layer_mlp_force_batch_dim_mapping",
        _mesh((4, 1)), 0, functools.partial(mlp_step, 6, 32, 256),
        options=(("force_batch_dim_to_mesh_axis", "x"),), expected=dp_expected,
        layouts=all_params_replicated, collectives=only_gradient_all_reduces,
    ))  # fmt: skip
    cases.append(Case(
        "mlp_force_batch_dim_mapping[1x4]", mlp + "test_n_layer_mlp_force_batch_dim_mapping",
        _mesh((1, 4)), 1, functools.partial(mlp_step, 6, 32, 256),
        options=(("force_batch_dim_to_mesh_axis", "x"),), expected=mlp_mp_expected,
        metadata={"layers": 6, "batch": 32, "hidden": 256},
    ))  # fmt: skip
    # the reduce-scatter variants: Alpa's objective is the ILP's, before the rewrite
    for shape in one_d:
        cases.append(Case(
            f"mlp_data_parallel_reduce_scatter[{label(shape)}]",
            mlp + "test_n_layer_mlp_data_parallel_reduce_scatter", _mesh(shape), _one_d(shape),
            functools.partial(mlp_step, 6, 256, 32), options=(("prefer_reduce_scatter", True),),
            expected=dp_expected, collectives=zero2_collectives,
        ))  # fmt: skip
        cases.append(Case(
            f"mlp_model_parallel_reduce_scatter[{label(shape)}]",
            mlp + "test_n_layer_mlp_model_parallel_reduce_scatter", _mesh(shape), _one_d(shape),
            functools.partial(mlp_step, 6, 32, 256), options=(("prefer_reduce_scatter", True),),
            expected=mlp_mp_expected, layouts=megatron_1d(lambda c: _mlp_kernels(6)),
            collectives=megatron_reduce_scatter_collectives(lambda c: 5),
            metadata={"layers": 6, "batch": 32, "hidden": 256},
        ))  # fmt: skip
        cases.append(Case(
            f"mlp_data_parallel_reduce_scatter_adafactor[{label(shape)}]",
            mlp + "test_n_layer_mlp_data_parallel_reduce_scatter_adafactor", _mesh(shape),
            _one_d(shape), functools.partial(mlp_step, 6, 256, 32, "adafactor"),
            options=(("prefer_reduce_scatter", True),), expected=dp_expected,
            collectives=adafactor_zero2_collectives,
        ))  # fmt: skip
    cases.append(Case(
        "mlp_2d_mesh_reduce_scatter[2x2]", mlp + "test_n_layer_mlp_2d_mesh_reduce_scatter",
        _mesh((2, 2), beta=(1, 0.1)), 0, functools.partial(mlp_step, 6, 256, 32),
        options=(("prefer_reduce_scatter", True),), expected=mlp_2d_expected,
        layouts=state_fully_sharded, metadata={"layers": 6, "batch": 256, "hidden": 32},
    ))  # fmt: skip

    for shape in one_d:
        cases.append(Case(
            f"mlp_data_parallel_zero_stage_3[{label(shape)}]",
            mlp + "test_n_layer_mlp_data_parallel_reduce_scatter_zero_stage_3", _mesh(shape),
            _one_d(shape), functools.partial(mlp_step, 6, 256, 32), baseline="zero3",
            expected=dp_expected, collectives=zero3_collectives,
        ))  # fmt: skip

    # test_bert ----------------------------------------------------------------------------
    for shape in one_d:
        cases.append(Case(
            f"bert_layer_data_parallel[{label(shape)}]", bert + "test_bert_layer_data_parallel",
            _mesh(shape), _one_d(shape), functools.partial(bert_layers_step, 64, 64, 2, 32, 8),
            expected=dp_expected, layouts=all_params_replicated,
            collectives=only_gradient_all_reduces,
        ))  # fmt: skip
        md = {"batch": 8, "seq": 8, "layers": 2, "hidden": 128}
        cases.append(Case(
            f"bert_layer_model_parallel[{label(shape)}]", bert + "test_bert_layer_model_parallel",
            _mesh(shape), _one_d(shape), functools.partial(bert_layers_step, 8, 8, 2, 128, 8),
            expected=bert_mp_expected, layouts=megatron_1d(lambda c: _bert_kernels(2)),
            collectives=activation_all_reduces(lambda c: 7), metadata=md,
        ))  # fmt: skip
    cases.append(Case(
        "bert_layer_2d_mesh[2x2]", bert + "test_bert_layer_2d_mesh",
        _mesh((2, 2), alpha=(2, 2), beta=(1, 0.1)), 0,
        functools.partial(bert_layers_step, 8, 8, 2, 128, 8), expected=bert_2d_expected,
        layouts=megatron_2d(lambda c: _bert_kernels(2)),
        metadata={"batch": 8, "seq": 8, "layers": 2, "hidden": 128},
    ))  # fmt: skip
    force = (("force_batch_dim_to_mesh_axis", "x"),)
    cases.append(Case(
        "bert_layer_force_batch_dim_mapping[4x1]", bert + "test_bert_layer_force_batch_dim_mapping",
        _mesh((4, 1)), 0, functools.partial(bert_layers_step, 64, 64, 2, 32, 8), options=force,
        expected=dp_expected, layouts=all_params_replicated,
        collectives=only_gradient_all_reduces,
    ))  # fmt: skip
    for batch in (64, 1):
        cases.append(Case(
            f"bert_layer_force_batch_dim_mapping_mp_b{batch}[1x4]",
            bert + "test_bert_layer_force_batch_dim_mapping", _mesh((1, 4)), 1,
            functools.partial(bert_layers_step, batch, 64, 2, 32, 8), options=force,
            expected=bert_mp_expected,
            metadata={"batch": batch, "seq": 64, "layers": 2, "hidden": 32},
        ))  # fmt: skip
    cases.append(Case(
        "embedding_2d_mesh[2x2]", bert + "test_embedding_2d_mesh", _mesh((2, 2)), 0,
        functools.partial(tied_embedding_step, 1024, 8, 8, 8), expected=embedding_2d_expected,
        collectives=only_all_reduces,
        metadata={"vocab": 1024, "hidden": 8, "batch": 8, "seq": 8},
    ))  # fmt: skip
    for shape in one_d:
        cases.append(Case(
            f"bert_mlm_data_parallel[{label(shape)}]", bert + "test_bert_mlm_data_parallel",
            _mesh(shape), _one_d(shape),
            functools.partial(bert_mlm_step, 32, 32, 2, 16, 4, 128), expected=dp_expected,
        ))  # fmt: skip

    # allow_recompute_heavy_op=True in Alpa's test: autoshard has no such knob (it never
    # recomputes a dot on every device), so the case runs without it
    cases.append(Case(
        "bert_mlm_2d_mesh[2x2]", bert + "test_bert_mlm_2d_mesh",
        _mesh((2, 2), alpha=(2, 2), beta=(1, 0.1)), 0,
        functools.partial(bert_mlm_step, 4, 4, 2, 512, 4, 4096),
        options=(("allow_all_gather", False), ("allow_mixed_mesh_shape", False)),
        collectives=only_all_reduces,
    ))  # fmt: skip

    # test_moe ----------------------------------------------------------------------------
    for shape in one_d:
        cases.append(Case(
            f"moe_layer[{label(shape)}]", moe + "test_moe_layer", _mesh(shape), _one_d(shape),
            moe_layer_step, expected=moe_expected, layouts=moe_layout,
            collectives=moe_collectives,
        ))  # fmt: skip

    moe_2d = (("allow_mixed_mesh_shape", True), ("allow_all_gather", False))
    cases.append(Case(
        "moe_layer_2d[2x2]", moe + "test_moe_layer_2d", _mesh((2, 2)), 0, moe_layer_step,
        options=moe_2d, collectives=moe_2d_collectives,
    ))  # fmt: skip
    cases.append(Case(
        "moe_layer_2d_reduce_scatter[2x2]", moe + "test_moe_layer_2d_reduce_scatter",
        _mesh((2, 2)), 0, moe_layer_step, options=(*moe_2d, ("prefer_reduce_scatter", True)),
        collectives=moe_2d_reduce_scatter_collectives,
    ))  # fmt: skip

    for shape in one_d:
        cases.append(Case(
            f"moe_lm[{label(shape)}]", moe + "test_moe_lm", _mesh(shape), _one_d(shape),
            moe_lm_step, collectives=moe_lm_collectives,
        ))  # fmt: skip
        axes = (AXES[_one_d(shape)],)
        cases.append(Case(
            f"moe_lm_data_parallel[{label(shape)}]", moe + "test_moe_lm_data_parallel",
            _mesh(shape), _one_d(shape), moe_lm_step, options=(("data_parallel_axes", axes),),
            collectives=moe_lm_data_parallel_collectives,
        ))  # fmt: skip
    cases.append(Case(
        "moe_lm_2d[2x2]", moe + "test_moe_lm_2d", _mesh((2, 2)), 0, moe_lm_step,
        options=(("allow_mixed_mesh_shape", True),), collectives=moe_lm_collectives,
    ))  # fmt: skip

    # test_conv ---------------------------------------------------------------------------
    for shape in one_d:
        cases.append(Case(
            f"conv_data_parallel[{label(shape)}]", conv + "test_n_layer_conv_data_parallel",
            _mesh(shape), _one_d(shape), functools.partial(conv_step, 3, 16, 16, 4),
            expected=conv_dp_expected, layouts=all_params_replicated,
            collectives=conv_data_parallel_collectives,
        ))  # fmt: skip
        cases.append(Case(
            f"conv_model_parallel[{label(shape)}]", conv + "test_n_layer_conv_model_parallel",
            _mesh(shape), _one_d(shape), functools.partial(conv_step, 4, 8, 16, 256),
            collectives=conv_activation_all_reduces(lambda c: 3),
        ))  # fmt: skip
        cases.append(Case(
            f"depthwise_conv_model_parallel[{label(shape)}]",
            conv + "test_n_layer_depthwise_conv_model_parallel", _mesh(shape), _one_d(shape),
            functools.partial(conv_step, 2, 4, 8, 256, True),
            collectives=conv_activation_all_reduces(lambda c: 1),
        ))  # fmt: skip
        cases.append(Case(
            f"conv_data_parallel_reduce_scatter[{label(shape)}]",
            conv + "test_n_layer_conv_data_parallel_reduce_scatter", _mesh(shape),
            _one_d(shape), functools.partial(conv_step, 3, 16, 16, 4),
            options=(("prefer_reduce_scatter", True),), expected=conv_dp_expected,
            collectives=conv_zero2_collectives,
        ))  # fmt: skip
    conv_2d = functools.partial(conv_step, 4, 8, 32, 8)
    cases.append(Case(
        "conv_2d_mesh[2x2]", conv + "test_n_layer_conv_2d_mesh",
        _mesh((2, 2), beta=(1, 0.1)), 0, conv_2d, options=(("allow_mixed_mesh_shape", False),),
    ))  # fmt: skip
    cases.append(Case(
        "conv_2d_mesh_mixed_shape[2x2]", conv + "test_n_layer_conv_2d_mesh_mixed_shape",
        _mesh((2, 2), beta=(1, 0.1)), 0, conv_2d, options=(("allow_mixed_mesh_shape", True),),
        collectives=some_all_to_all,
    ))  # fmt: skip
    cases.append(Case(
        "conv_2d_mesh_mixed_shape_reduce_scatter[2x2]",
        conv + "test_n_layer_conv_2d_mesh_mixed_shape_reduce_scatter",
        _mesh((2, 2), beta=(1, 0.1)), 0, conv_2d,
        options=(("allow_mixed_mesh_shape", True), ("prefer_reduce_scatter", True)),
        collectives=some_all_to_all_and_reduce_scatter,
    ))  # fmt: skip
    return cases


CASES = {c.name: c for c in _cases()}


# --- planning and the table ------------------------------------------------------------


@functools.cache
def traced(name: str):
    """The case's (step, args) and its graph (traced once per process)."""
    from autoshard.ir.graph import build_graph
    from autoshard.trace.jaxpr import trace_train_step

    step, args = CASES[name].build()
    program = trace_train_step(step, *args)
    return args, program, build_graph(program.records)


def alpa_options(name: str):
    """autoshard's default options but for the settings Alpa's test runs with, in
    autoshard's names: the knobs the test sets, Alpa's default
    ``allow_mixed_mesh_shape=False`` where it leaves it, and Alpa's all-to-all price
    (its n/2 penalty on the whole tensor: part of its mesh's costs)."""
    from autoshard.intra.cost.resharding import CostOptions
    from autoshard.intra.problem.options import IntraOptions

    settings = {"allow_mixed_mesh_shape": False, **dict(CASES[name].options)}
    return IntraOptions(cost=CostOptions(all_to_all_penalty_scales_with_n=True), **settings)


@functools.cache
def plan_case(name: str, defaults: bool = False):
    """autoshard's plan of the case with :func:`alpa_options` (``defaults``: with
    autoshard's own defaults but for the knobs the test sets)."""
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions

    case = CASES[name]
    _, _, graph = traced(name)
    options = IntraOptions(**dict(case.options)) if defaults else alpa_options(name)
    mesh = case.mesh.autoshard()
    if case.baseline is None:
        return auto_shard_graph(graph, mesh, options)
    pins = baseline_inputs(graph, mesh.mesh, case.baseline)
    options = baseline_options(options, mesh.mesh, case.baseline)
    return auto_shard_graph(graph, mesh, options, pinned_inputs=pins, name=case.baseline)


def plan_pinned(name: str, layouts: dict, **changes):
    """The case planned with :func:`alpa_options` (and ``changes``), the parameters named
    in ``layouts`` (path -> dims, as ``ShardingSpec.dims``) pinned there."""
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.ir.spec import ShardingSpec

    case = CASES[name]
    paths = plan_case(name).input_paths
    missing = set(layouts) - set(paths)
    if missing:
        raise ValueError(f"{name}: no input {sorted(missing)}")
    pins = {pos: ShardingSpec(tuple(layouts[p])) for pos, p in enumerate(paths) if p in layouts}
    options = alpa_options(name).replace(**changes)
    return auto_shard_graph(traced(name)[2], case.mesh.autoshard(), options, pinned_inputs=pins)


def expected_objective(name: str) -> float | None:
    case = CASES[name]
    if case.expected is None:
        return None
    return case.expected(case, traced(name)[0])


def row(name: str) -> dict:
    case = CASES[name]
    t0 = time.perf_counter()
    plan = plan_case(name)
    seconds = time.perf_counter() - t0
    expected = expected_objective(name)
    default = plan_case(name, defaults=True).objective
    layouts = case.layouts(case, plan) if case.layouts else None
    collectives = case.collectives(case, plan) if case.collectives else None
    return {
        "case": name,
        "alpa_test": case.alpa_test,
        "mesh": list(case.mesh.shape),
        "alpha": list(case.mesh.alpha),
        "beta": list(case.mesh.beta),
        "options": dict(case.options),
        "objective": plan.objective,
        "objective_autoshard_defaults": default,
        "alpa_expected": expected,
        "ratio": None if expected is None else plan.objective / expected,
        "within_1pct": None if expected is None else abs(plan.objective / expected - 1) <= 0.01,
        "layouts_as_alpa": None if layouts is None else not layouts,
        "layout_differences": layouts,
        "collectives_as_alpa": None if collectives is None else not collectives,
        "collective_differences": collectives,
        "collectives": dict(
            Counter(f"{c.kind} {','.join(c.axes)}" for c in plan.predicted_collectives)
        ),  # fmt: skip
        "plan_seconds": round(seconds, 2),
    }


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _yes(v):
    return "-" if v is None else ("yes" if v else "NO")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    rows = []
    head = (f"{'case':48} {'mesh':5} {'autoshard':>12} {'alpa':>12} {'ratio':>7} layouts "
            f"colls {'defaults':>12}")  # fmt: skip
    print(head)
    for name in args.cases:
        r = row(name)
        rows.append(r)
        print(f"{name:48} {'x'.join(map(str, r['mesh'])):5} {r['objective']:12.2f} "
              f"{_fmt(r['alpa_expected'], '12.2f'):>12} {_fmt(r['ratio'], '7.4f'):>7} "
              f"{_yes(r['layouts_as_alpa']):7} {_yes(r['collectives_as_alpa']):5} "
              f"{r['objective_autoshard_defaults']:12.2f}",
              flush=True)  # fmt: skip
    if args.out:
        import jax

        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        doc = {
            "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": commit.stdout.strip(),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "alpa_source": "alpa-projects/alpa b8078a9 tests/shard_parallel",
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
