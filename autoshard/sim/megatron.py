"""Analytic step time and memory of Megatron-LM GPT training on a cluster (jax-free).

Takes a :class:`GPTShape`, a :class:`MegatronConfig` (TP x PP x DP grid, micro-batch,
global batch, recompute, sequence parallel, interleaving) and a
:class:`~autoshard.hardware.clusters.Cluster`; returns a frozen :class:`SimResult` whose
``breakdown`` adds up to ``step_time_s``.

The model, per micro-batch and per device:

* GEMMs (timed with the device's GEMM table): QKV ``[bs, h] x [h, 3h/t]``, attention scores
  ``(ba/t) x [s, h/a] x [h/a, s]``, attention over values ``(ba/t) x [s, s] x [s, h/a]``,
  projection ``[bs, h/t] x [h/t, h]``, MLP ``[bs, h] x [h, 4h/t]`` and ``[bs, 4h/t] x [4h/t, h]``;
  backward runs two GEMMs per forward GEMM (input gradient ``(M, K, N)`` and weight gradient
  ``(K, N, M)``). The last stage adds the logit GEMM ``[bs, h] x [h, V/t]`` (not recomputed).
* Memory-bound elementwise work, bytes over HBM bandwidth (e = bytes per element), with
  Megatron's fused kernels: two layernorms (read + write, 4 e sbh), two bias-dropout-adds
  (read input and residual, write output and a 1-byte mask, 2 (3e + 1) sbh), bias-GeLU on the
  4h/t MLP activation (8 e sbh / t), fused scale-mask-softmax (2 e bas^2 / t) and attention
  dropout ((2e + 1) bas^2 / t). The sbh terms are divided by t with sequence parallelism.
  Backward streams twice the forward bytes. Cross-entropy streams (2e + 8) bs V/t bytes.
  ``MegatronConfig.elementwise="megatron-lm-2019"`` prices the unfused eager-PyTorch passes
  of Megatron-LM's 2019 code instead (:data:`ELEMENTWISE_PASSES`, counted from its
  ``mpu/transformer.py``; a what-if, no preset uses it: docs/validation.md).
* Recompute: full repeats each layer's forward (GEMMs, elementwise, TP collectives);
  selective repeats the attention-score GEMMs and the softmax/dropout bytes.
* Attention (``MegatronConfig.attention``): ``"softmax"`` (the default) is the 2021 kernels
  above, two batched GEMMs and the fused scale-mask-softmax and dropout. ``"flash"`` is
  today's Megatron-LM (``--use-flash-attn``, Transformer Engine): one fused kernel per
  micro-batch and TP shard, ``(b a / t)`` heads of ``[s, h/a]``, timed from the device's
  attention table (:class:`~autoshard.hardware.attention.AttentionTiming`: forward
  ``4 (b a / t) s^2 (h/a)`` FLOPs, backward 2.5x that, the full square even though GPT is
  causal, as the table counts them; breakdown key ``compute_attention``). No ``att_t``
  bytes (softmax, mask and dropout run inside the kernel), no ``5 a s / h`` activation
  term (the kernel keeps no scores: the layer stashes what selective recompute stashes),
  selective recompute adds nothing (the flash backward already recomputes the scores,
  its 2.5x) and full recompute repeats the forward kernel. Model and hardware FLOPs (MFU,
  HFU) keep their conventions: the full square, selective's ``4 B s^2 L h`` counted as
  recompute. A device without an attention table (V100: no flash kernel before Ampere)
  refuses it.
* Tensor parallel: 2 all-reduces of the sbh activation per layer forward and 2 backward
  (with sequence parallel: an all-gather + reduce-scatter pair instead of each all-reduce),
  plus one for the vocab-parallel embedding (first stage) and one for the logit input
  gradient (last stage). Costs come from :mod:`autoshard.intra.cost.resharding` (ring alpha-beta, no
  tie-breakers) on the mesh ``(pipe=p, data=d, model=t)`` laid out row-major on the cluster,
  so TP <= 8 stays on NVLink (Megatron's rank order: TP fastest, then DP, then PP).
  Backward, the column-parallel linears (QKV, MLP up) reduce their input gradient while
  their weight-gradient GEMM runs (``MegatronConfig.tp_comm_overlap``; by default as
  Megatron-LM's sequence-parallel code does, its reduce-scatter): only what outlasts the
  GEMM is charged.
* Pipeline: point-to-point send of the activation, alpha + beta x bytes, forward and
  backward at every chunk boundary; with t > 1 the scatter-gather optimisation sends sbh/t
  over the pipe link and all-gathers it over the TP group (not needed with sequence
  parallel). Step = m x (slowest stage's time per micro-batch) + the bubble, which is the
  time of the *other* p - 1 stages per micro-batch, divided by v when interleaved: 1F1B's
  critical path is the first micro-batch's forward through them, the slowest stage's m
  micro-batches, the last backward back through them (with equal stages: (p-1)/(v m) of
  the busy time; the last stage's logits make it the slowest). Sends are not overlapped
  with compute (Megatron's schedule blocks on them).
* Gradient accumulation (``MegatronConfig.grad_accumulation``): "fused" (default; Megatron-LM
  since Feb 2022) accumulates in the weight-gradient GEMM; "unfused" (2021 code:
  ``main_grad.add_(grad)``) adds a memory-bound pass per micro-batch over the stage's
  parameters, reading the gradient and reading + writing the 16-bit buffer (fp32 with bf16).
* Data parallel: one ring all-reduce of the 16-bit gradients after the pipeline flush, not
  overlapped with backward (a pessimistic choice for torch-DDP runs, which overlap it);
  with p > 1 the tied embedding gradient is all-reduced between the first and last stage.
* Optimizer: mixed-precision Adam is memory-bound, 32 bytes per parameter (read 16-bit
  gradient, read + write fp32 master weight, momentum and variance, write 16-bit weight,
  plus the gradient-norm pass) over HBM bandwidth.
* Memory of the fullest stage: 16 bytes/param model state, the stashed activations of the
  micro-batches in flight (Korthikanti et al. Table 2 per layer), one un-recomputed layer's
  working set under full recompute, and the logits on the last stage. No allowance for the
  CUDA context, workspaces or fragmentation, so ``oom`` is flagged only when even this
  lower bound exceeds HBM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from autoshard.hardware.attention import (
    BWD_FLOPS_RATIO,
    AttentionTiming,
    load_attention_table,
)
from autoshard.hardware.clusters import Cluster, available_presets, load_cluster
from autoshard.hardware.gemm import GemmTable, memory_bound_time
from autoshard.hardware.mesh import DeviceMesh, to_device_mesh
from autoshard.intra.cost.resharding import (
    CostOptions,
    all_gather_cost,
    all_reduce_cost,
    reduce_scatter_cost,
)
from autoshard.ir.spec import Mesh
from autoshard.sim import formulas
from autoshard.sim.breakdown import step_breakdown

NO_TIE_BREAKERS = CostOptions(tie_breakers=False)
OPTIMIZER_BYTES_PER_PARAM = 32
GRAD_ALLREDUCE_BYTES_PER_PARAM = 2
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4}
MESH_AXES = ("pipe", "data", "model")
ATTENTION_KERNELS = ("softmax", "flash")  # MegatronConfig.attention (module docstring)
FLASH_DTYPES = ("fp16", "bf16")  # what flash attention kernels run
GRAD_ACCUMULATION = ("fused", "unfused")  # MegatronConfig.grad_accumulation


def _fused_passes(e: int) -> dict[str, tuple[float, float]]:
    fwd = {"sbh": 10 * e + 2, "sbh_t": 0, "mlp_t": 2 * e, "att_t": 4 * e + 1}
    return {k: (v, 2 * v) for k, v in fwd.items()}


def _megatron_2019_passes(e: int) -> dict[str, tuple[float, float]]:
    # NVIDIA/Megatron-LM a0368ddf (Aug 2019), mpu/transformer.py + mpu/layers.py, fp16
    # tensors, 1-byte dropout masks. Forward, per element: sbh -- 2 layernorms (apex, read +
    # write) 4e, 2 RowParallel `output_ + bias` 4e, 2 dropouts 2(2e+1), 2 residual adds 6e;
    # sbh_t -- QKV bias add (F.linear on a 3-D input: `output += bias`) 3 x 2e, Q and K made
    # contiguous for torch.matmul 2 x 2e, V likewise 2e, context permute().contiguous() 2e;
    # mlp_t -- h->4h bias add 2e, GeLU (one TorchScript kernel) 2e; att_t -- scale 2e,
    # torch.mul by the mask 2e, subtract 10000(1 - mask) 2e, softmax 2e, dropout 2e+1.
    # Backward: sbh -- 2 layernorm backwards (grad-input: read grad and input, write; gamma /
    # beta: read both again) 2 x 5e, 2 bias gradients (read) 2e, 2 dropouts 2(2e+1), 2
    # gradient accumulations (a layer input feeds a layernorm and a residual) 2 x 3e;
    # sbh_t -- QKV bias gradient 3e, the Q/K/V gradients joined (cat) 3 x 2e, the context
    # gradient made contiguous for the projection GEMM 2e; mlp_t -- GeLU backward (read grad
    # and input, write) 3e, bias gradient e; att_t -- dropout 2e+1, softmax (read grad and
    # output, write) 3e, mask multiply 2e, scale 2e (the subtraction's gradient is a no-op).
    return {
        "sbh": (18 * e + 2, 22 * e + 2),
        "sbh_t": (14 * e, 11 * e),
        "mlp_t": (4 * e, 4 * e),
        "att_t": (10 * e + 1, 9 * e + 1),
    }


# Bytes moved per element of each tensor, per layer and micro-batch, (forward, backward),
# for element size e: sbh = [s, b, h] (on every TP rank; / t with sequence parallelism),
# sbh_t = [s, b, h/t], mlp_t = [s, b, 4h/t], att_t = [b, a/t, s, s].
ELEMENTWISE_PASSES = {"fused": _fused_passes, "megatron-lm-2019": _megatron_2019_passes}
# Megatron-LM 2019 outside the layers, bytes per element (same commit), on sbh: embedding
# lookups, zeroing of out-of-partition rows, position add and dropout forward (11e + 1),
# dropout and the two embedding gradients backward (4e + 1); the final layernorm 2e + 5e.
# The loss converts the fp16 logits to fp32 (`output.contiguous().float()`,
# pretrain_gpt2.py) before mpu/cross_entropy.py's clone, max, sub_, exp, sum and div_: 46
# bytes per logit forward, 14 backward (mul_ and the cast back).
MEGATRON_2019_EMBEDDING_BYTES = (15, 2)  # (times e, plus) per sbh element
MEGATRON_2019_FINAL_LAYERNORM_BYTES = 7  # times e, per sbh element
MEGATRON_2019_LOSS_BYTES_PER_LOGIT = 46 + 14


@dataclass(frozen=True)
class GPTShape:
    """A GPT: hidden size, layers, heads, vocabulary and sequence length."""

    hidden: int
    layers: int
    heads: int
    vocab: int = 51200
    seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")


@dataclass(frozen=True)
class MegatronConfig:
    """A Megatron-LM training configuration on tp x pp x dp GPUs."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    recompute: str = "full"
    sequence_parallel: bool = False
    virtual_stages: int = 1
    dtype: str | None = None  # None: the device's default 16-bit dtype
    elementwise: str = "fused"  # a key of ELEMENTWISE_PASSES
    attention: str = "softmax"  # one of ATTENTION_KERNELS
    # Megatron-LM's software generation, where it changes the step (module docstring):
    # "fused" -- the weight-gradient GEMM accumulates into the gradient buffer (Feb 2022 on);
    # "unfused" -- a separate add per micro-batch (``main_grad.add_(grad)``, 2021 code)
    grad_accumulation: str = "fused"
    # the column-parallel linears' backward collective runs under their weight-gradient
    # GEMM: None -- as Megatron-LM's sequence-parallel code always does (its reduce-scatter);
    # True also without sequence parallel (the all-reduce, ``--async-tensor-model-parallel-
    # allreduce``, Sept 2021 on); False -- blocking (2021 code)
    tp_comm_overlap: bool | None = None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(frozen=True)
class SimResult:
    """Predicted step of one configuration.

    ``tflops_per_device`` counts hardware FLOPs (recompute included), the figure Megatron-LM
    reports; ``mfu`` uses model FLOPs (PaLM), ``hfu`` hardware FLOPs. ``breakdown`` gives
    seconds per step on the critical path and sums to ``step_time_s``.
    """

    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hfu: float
    memory_bytes_per_device: float
    oom: bool
    breakdown: Mapping[str, float]
    # compute, recompute, comm per mesh axis, bubble, optimizer (autoshard.sim.breakdown)
    step_breakdown: Mapping[str, float] = field(default_factory=dict)


def _validate(model: GPTShape, cfg: MegatronConfig, cluster: Cluster) -> None:
    problems = []
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, cfg.virtual_stages) < 1:
        problems.append("tp, pp, dp, micro_batch and virtual_stages must be >= 1")
    if cfg.global_batch % (cfg.micro_batch * cfg.dp):
        problems.append(
            f"global_batch {cfg.global_batch} is not a multiple of micro_batch x dp = "
            f"{cfg.micro_batch * cfg.dp}"
        )
    if model.layers % (cfg.pp * cfg.virtual_stages):
        problems.append(
            f"layers {model.layers} do not split into pp x virtual_stages = "
            f"{cfg.pp * cfg.virtual_stages} equal chunks"
        )
    if model.heads % cfg.tp or model.vocab % cfg.tp:
        problems.append(f"heads {model.heads} and vocab {model.vocab} must be divisible by tp")
    if cfg.virtual_stages > 1 and (cfg.pp == 1 or cfg.num_microbatches % cfg.pp):
        problems.append("interleaving needs pp > 1 and a number of micro-batches divisible by pp")
    if cfg.elementwise not in ELEMENTWISE_PASSES:
        problems.append(f"elementwise must be one of {sorted(ELEMENTWISE_PASSES)}")
    if cfg.recompute not in formulas.RECOMPUTE_MODES:
        problems.append(f"recompute must be one of {formulas.RECOMPUTE_MODES}")
    if cfg.grad_accumulation not in GRAD_ACCUMULATION:
        problems.append(f"grad_accumulation must be one of {GRAD_ACCUMULATION}")
    if cfg.attention not in ATTENTION_KERNELS:
        problems.append(f"attention must be one of {ATTENTION_KERNELS}")
    if cfg.attention == "flash" and cfg.elementwise != "fused":
        problems.append(
            f"attention 'flash' runs with Megatron-LM's fused kernels, not elementwise "
            f"{cfg.elementwise!r} (2019's code had no flash attention)"
        )
    if cfg.num_gpus > cluster.num_gpus:
        problems.append(
            f"the grid needs {cfg.num_gpus} GPUs but cluster {cluster.name} has "
            f"{cluster.num_gpus}; load it with num_gpus={cfg.num_gpus}"
        )
    if problems:
        raise ValueError(f"bad Megatron configuration {cfg}: " + "; ".join(problems))


def presets_with_attention_table() -> tuple[str, ...]:
    """The shipped cluster presets whose device names an attention table."""
    return tuple(p for p in available_presets() if load_cluster(p).device.attention_table)


def flash_attention_timing(cluster: Cluster, dtype: str) -> AttentionTiming:
    """The fused attention kernel's timing on ``cluster``'s device; a ``ValueError`` that
    names the presets with an attention table where the device has none."""
    device = cluster.device
    if device.attention_table is None:
        raise ValueError(
            f"attention 'flash' is timed from the device's attention table, and cluster "
            f"{cluster.name}'s {device.name} names none (no fused attention kernel before "
            f"Ampere); presets with one: {', '.join(presets_with_attention_table()) or 'none'} "
            "(or name a table in a preset file's device.attention_table)"
        )
    if dtype not in FLASH_DTYPES:
        raise ValueError(
            f"attention 'flash' runs 16-bit kernels ({', '.join(FLASH_DTYPES)}), not {dtype!r}"
        )
    return AttentionTiming.for_device(
        load_attention_table(device.attention_table), device.peak_flops
    )


def _gemm_times(table: GemmTable, dtype: str, peak: float, gemms) -> tuple[float, float]:
    """(forward, backward) seconds of a list of (batch, M, N, K) GEMMs."""
    fwd = sum(table.gemm_time(m, n, k, dtype, peak, batch) for batch, m, n, k in gemms)
    bwd = sum(
        table.gemm_time(m, k, n, dtype, peak, batch) + table.gemm_time(k, n, m, dtype, peak, batch)
        for batch, m, n, k in gemms
    )
    return fwd, bwd


def _tp_collective_pair(mesh: DeviceMesh, nbytes: float, sequence_parallel: bool) -> float:
    """One TP reduction point: an all-reduce, or all-gather + reduce-scatter with SP."""
    if sequence_parallel:
        return all_gather_cost(mesh, "model", nbytes, NO_TIE_BREAKERS) + reduce_scatter_cost(
            mesh, "model", nbytes, NO_TIE_BREAKERS
        )
    return all_reduce_cost(mesh, "model", nbytes, NO_TIE_BREAKERS)


def _inflight_layers(model: GPTShape, cfg: MegatronConfig) -> float:
    """Layer-micro-batches whose activations the first stage keeps at its peak."""
    p, v, m = cfg.pp, cfg.virtual_stages, cfg.num_microbatches
    if v == 1:
        return min(m, p) * model.layers / p
    chunks = min(m * v, 2 * (p - 1) + (v - 1) * p + 1)  # Megatron's interleaved warm-up + 1
    return chunks * model.layers / (p * v)


def simulate_megatron(
    model: GPTShape,
    cfg: MegatronConfig,
    cluster: Cluster,
    gemm_table: GemmTable | None = None,
) -> SimResult:
    """Predict step time, throughput, utilisation and memory of ``cfg`` on ``cluster``."""
    _validate(model, cfg, cluster)
    device = cluster.device
    dtype = cfg.dtype or device.default_dtype
    peak = device.peak_flops_for(dtype)
    e = _ELEMENT_BYTES.get(dtype, 2)
    if gemm_table is None:
        if device.gemm_table is None:
            raise ValueError(f"cluster {cluster.name} names no GEMM table; pass gemm_table=")
        gemm_table = GemmTable.load(device.gemm_table)
    mesh = to_device_mesh(cluster, (cfg.pp, cfg.dp, cfg.tp), MESH_AXES, dtype)
    hbm = device.hbm_bandwidth

    h, s, a, v_size, n_layers = model.hidden, model.seq_len, model.heads, model.vocab, model.layers
    b, t, p, v, m = cfg.micro_batch, cfg.tp, cfg.pp, cfg.virtual_stages, cfg.num_microbatches
    sp = cfg.sequence_parallel and t > 1
    sbh = s * b * h
    bas2 = b * a * s * s

    flash = cfg.attention == "flash"
    timing = flash_attention_timing(cluster, dtype) if flash else None

    # --- one transformer layer, one micro-batch ---------------------------------------
    attention_gemms = [] if flash else [(b * a // t, s, s, h // a), (b * a // t, s, h // a, s)]
    dense_gemms = [
        (1, b * s, 3 * h // t, h),
        (1, b * s, h, h // t),
        (1, b * s, 4 * h // t, h),
        (1, b * s, h, 4 * h // t),
    ]
    att_fwd, att_bwd = _gemm_times(gemm_table, dtype, peak, attention_gemms)
    kernel_fwd = kernel_bwd = 0.0  # the flash kernel, forward and backward
    if flash:
        heads, head_dim = b * a // t, h // a
        flops = 4 * heads * s * s * head_dim  # the full square (the table's convention)
        kernel_fwd = timing.seconds(flops, heads, s, head_dim, backward=False)
        kernel_bwd = timing.seconds(BWD_FLOPS_RATIO * flops, heads, s, head_dim, backward=True)
    dense_fwd, dense_bwd = _gemm_times(gemm_table, dtype, peak, dense_gemms)
    structure = cfg.elementwise
    passes = ELEMENTWISE_PASSES[structure](e)
    sizes = {
        "sbh": sbh / (t if sp else 1),
        "sbh_t": sbh / t,
        "mlp_t": 4 * sbh / t,
        "att_t": 0 if flash else bas2 / t,  # flash: softmax and dropout in the kernel
    }
    softmax_bytes = passes["att_t"][0] * sizes["att_t"]
    ew_fwd = memory_bound_time(sum(passes[k][0] * n for k, n in sizes.items()), hbm)
    ew_bwd = memory_bound_time(sum(passes[k][1] * n for k, n in sizes.items()), hbm)
    tp_fwd = 2 * _tp_collective_pair(mesh, sbh * e, sp)

    gemm = att_fwd + dense_fwd + att_bwd + dense_bwd
    kernel = kernel_fwd + kernel_bwd
    elementwise = ew_fwd + ew_bwd
    tp_comm = 2 * tp_fwd
    overlap = sp if cfg.tp_comm_overlap is None else cfg.tp_comm_overlap
    if overlap and t > 1:
        # backward: the column-parallel linears (QKV, MLP up) reduce their input gradient
        # while the weight-gradient GEMM runs; only what outlasts that GEMM is exposed.
        # With sequence parallelism that is the reduce-scatter (the all-gather of the
        # row-parallel linears' output gradient stays blocking); without, the all-reduce.
        hidden = (
            reduce_scatter_cost(mesh, "model", sbh * e, NO_TIE_BREAKERS)
            if sp
            else all_reduce_cost(mesh, "model", sbh * e, NO_TIE_BREAKERS)
        )
        for _, m_, n_, k_ in (dense_gemms[0], dense_gemms[2]):  # QKV, MLP up
            wgrad = gemm_table.gemm_time(k_, n_, m_, dtype, peak, 1)
            tp_comm -= min(hidden, wgrad)
    recomputed = 0.0  # GEMM, kernel and elementwise seconds recompute adds per layer
    if cfg.recompute == "full":
        recomputed = att_fwd + dense_fwd + ew_fwd + kernel_fwd
        gemm += att_fwd + dense_fwd
        kernel += kernel_fwd
        elementwise += ew_fwd
        tp_comm += tp_fwd
    elif cfg.recompute == "selective" and not flash:  # flash: the backward recomputes
        recomputed = att_fwd + memory_bound_time(softmax_bytes, hbm)
        gemm += att_fwd
        elementwise += memory_bound_time(softmax_bytes, hbm)
    layers_per_device = n_layers // p
    layer_params = (12 * h * h + 13 * h) * layers_per_device / t
    embed_params = v_size * h / t

    def accumulation_s(params: float) -> float:
        """Per micro-batch: the unfused gradient accumulation reads the new gradient and
        reads and writes the buffer (16-bit, fp32 with bf16 as Megatron-LM forces)."""
        if cfg.grad_accumulation == "fused":
            return 0.0
        buffer_e = 4 if dtype == "bf16" else e
        return memory_bound_time((e + 2 * buffer_e) * params, hbm)

    # --- embedding (first stage) and logits + loss (last stage) -------------------------
    logit_fwd, logit_bwd = _gemm_times(gemm_table, dtype, peak, [(1, b * s, v_size // t, h)])
    last_gemm = logit_fwd + logit_bwd
    last_ew = memory_bound_time((2 * e + 8) * b * s * v_size / t, hbm)
    last_tp = _tp_collective_pair(mesh, sbh * e, sp)
    first_ew = memory_bound_time(6 * e * sbh, hbm)  # lookup + position add, fwd and bwd
    if structure == "megatron-lm-2019":
        times_e, plus = MEGATRON_2019_EMBEDDING_BYTES
        first_ew = memory_bound_time((times_e * e + plus) * sbh, hbm)
        last_ew = memory_bound_time(
            MEGATRON_2019_LOSS_BYTES_PER_LOGIT * b * s * v_size / t
            + MEGATRON_2019_FINAL_LAYERNORM_BYTES * e * sbh,
            hbm,
        )
    first_tp = _tp_collective_pair(mesh, sbh * e, sp)

    # --- pipeline point-to-point ----------------------------------------------------
    p2p = 0.0
    if p > 1:
        alpha, beta = mesh.link("pipe")
        send_bytes = sbh * e / t if t > 1 else sbh * e
        one_send = alpha + beta * send_bytes
        if t > 1 and not sp:
            one_send += all_gather_cost(mesh, "model", sbh * e, NO_TIE_BREAKERS)
        p2p = 2 * v * one_send  # forward activation + backward gradient per chunk

    # per micro-batch time of the first and the last stage; the slowest sets the pace
    layers_part = {
        "compute_gemm": layers_per_device * gemm,
        "compute_elementwise": layers_per_device * elementwise,
        "tp_comm": layers_per_device * tp_comm,
        "pp_p2p": p2p,
    }
    if flash:  # softmax's breakdown keeps its keys (and its sums) as they were
        layers_part["compute_attention"] = layers_per_device * kernel
    layers_part["compute_elementwise"] += accumulation_s(layer_params)
    middle_time = sum(layers_part.values())
    first = dict(layers_part)
    first["compute_elementwise"] += first_ew + accumulation_s(embed_params + s * h)
    first["tp_comm"] += first_tp
    last = dict(layers_part)
    last["compute_gemm"] += last_gemm
    last["compute_elementwise"] += last_ew
    last["tp_comm"] += last_tp
    last["compute_elementwise"] += accumulation_s((embed_params if p > 1 else 0) + 2 * h)
    if p == 1:
        last["compute_elementwise"] += first_ew + accumulation_s(embed_params + s * h)
        last["tp_comm"] += first_tp
    slowest, other_end = sorted((first, last), key=lambda d: sum(d.values()), reverse=True)

    breakdown = {k: m * val for k, val in slowest.items()}
    # 1F1B's critical path: the first micro-batch's forward through the other p - 1 stages,
    # the slowest stage's m micro-batches back to back, the last backward through the
    # other stages again -- so the bubble is the other stages' time, not p - 1 times the
    # slowest's (the last stage's logits make it the slowest); / v when interleaved
    others = (p - 2) * middle_time + sum(other_end.values()) if p > 1 else 0.0
    breakdown["pipeline_bubble"] = others / v

    # --- after the flush: gradient all-reduce and optimizer -----------------------------
    first_params = layer_params + embed_params + s * h
    last_params = layer_params + (embed_params if p > 1 else 0) + 2 * h
    stage_params = max(first_params, last_params) if p > 1 else first_params + 2 * h
    breakdown["dp_allreduce"] = all_reduce_cost(
        mesh, "data", stage_params * GRAD_ALLREDUCE_BYTES_PER_PARAM, NO_TIE_BREAKERS
    )
    breakdown["embedding_allreduce"] = 0.0
    if p > 1:
        alpha, beta = mesh.link("pipe")
        ends = DeviceMesh(Mesh(("pipe_ends",), (2,)), (alpha,), (beta,))
        breakdown["embedding_allreduce"] = all_reduce_cost(
            ends, "pipe_ends", embed_params * GRAD_ALLREDUCE_BYTES_PER_PARAM, NO_TIE_BREAKERS
        )
    breakdown["optimizer"] = memory_bound_time(stage_params * OPTIMIZER_BYTES_PER_PARAM, hbm)
    # a per-step cost of tensor parallelism the table's software pays beyond its collectives
    # (0 except on a table calibrated for it: v100-megatron2019, docs/validation.md); every
    # run it was fitted on has one micro-batch and one stage, so per step and per
    # micro-batch are not told apart there -- it is charged once per step
    breakdown["tp_step_overhead"] = gemm_table.tp_step_overhead_s * (1 - 1 / t)
    step = sum(breakdown.values())
    recompute_s = m * layers_per_device * recomputed
    parts = {
        "compute": breakdown["compute_gemm"]
        + breakdown["compute_elementwise"]
        + breakdown.get("compute_attention", 0.0)
        - recompute_s,
        "recompute": recompute_s,
        "comm_model": breakdown["tp_comm"] + breakdown["tp_step_overhead"],
        "comm_data": breakdown["dp_allreduce"],
        "comm_pipe": breakdown["pp_p2p"] + breakdown["embedding_allreduce"],
        "pipeline_bubble": breakdown["pipeline_bubble"],
        "optimizer": breakdown["optimizer"],
    }

    # --- memory of the fullest stage ------------------------------------------------
    # flash keeps no s x s scores: a layer stashes what selective recompute stashes
    kept = "selective" if flash and cfg.recompute == "none" else cfg.recompute
    act_layer = formulas.activation_bytes_per_layer(s, b, h, a, t, sp, kept)
    stash = act_layer * _inflight_layers(model, cfg)
    working = 0.0
    if cfg.recompute == "full":
        working = formulas.activation_bytes_per_layer(
            s, b, h, a, t, sp, "selective" if flash else "none"
        )
    logits_bytes = (e + 4) * b * s * v_size / t
    first_mem = formulas.model_state_bytes(first_params) + stash + working
    last_mem = formulas.model_state_bytes(last_params) + act_layer * layers_per_device + working
    memory = (
        max(first_mem, last_mem + logits_bytes)
        if p > 1
        else formulas.model_state_bytes(stage_params) + stash + working + logits_bytes
    )

    tokens = cfg.global_batch * s
    model_flops = formulas.model_flops_per_step(cfg.global_batch, s, n_layers, h, v_size)
    hw_flops = formulas.hardware_flops_per_step(
        cfg.global_batch, s, n_layers, h, v_size, cfg.recompute
    )
    return SimResult(
        step_time_s=step,
        tokens_per_s=tokens / step,
        tflops_per_device=hw_flops / step / cfg.num_gpus / 1e12,
        mfu=formulas.flops_utilization(model_flops, step, cfg.num_gpus, peak),
        hfu=formulas.flops_utilization(hw_flops, step, cfg.num_gpus, peak),
        memory_bytes_per_device=memory,
        oom=memory > device.hbm_bytes,
        breakdown=MappingProxyType(breakdown),
        step_breakdown=step_breakdown(step, parts),
    )


def bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The 1F1B bubble relative to the ideal time: (p - 1) / (v m)."""
    return (pp - 1) / (virtual_stages * num_microbatches)
