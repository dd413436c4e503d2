"""Published (and here-measured) GPT training runs the simulator is checked against.

Data only: each :class:`PublishedRun` is one row of a public table -- the model, the
parallel layout, the batch, the cluster preset it ran on and the figure it reported --
with its role: ``calibration`` rows fix the one free number of a modelled GEMM table (its
large-GEMM efficiency, ``benchmarks/make_gemm_tables.py``), ``validation``
rows were never used to fit anything. Read by ``benchmarks/validate_megatron.py``.

Sources (figures, not code; docs/validation.md says how each was read):

* ``sc21-table1``: Narayanan et al., *Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM*, SC21, Table 1 (A100; hardware TFLOP/s per GPU with full
  recompute); micro-batch and interleaving from Megatron-LM's examples/sc21/run_table_1.sh.
  The A100 calibration.
* ``korthikanti22``: Korthikanti et al., *Reducing Activation Recomputation in Large
  Transformer Models* (MLSys 2023, arXiv 2205.05198): configurations from its Table 3
  (sequence parallel + selective recompute, micro-batch 1, data parallel 1), model-FLOP
  utilisation as published in the Megatron-LM README ("22B 41.5%, 175B 51.4%, 530B 56.0%,
  1T 56.3%"). Interleaving is not listed there; v = 1 is assumed. A100 validation.
* ``shoeybi19``: Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism* (arXiv 1909.08053), DGX-2H V100 cluster, sequence 1024,
  vocabulary 51200, batch 8 per model-parallel group, activation checkpointing, fp16:
  the single-GPU baseline (1.2B: 39 TFLOP/s, "30% of peak"), the weak-scaling
  efficiencies of its Figure 5 (Table 1's models), the strong scaling of the 1.2B model
  (Table 8: speed-ups 1.64, 2.34, 2.98 on 2, 4, 8 GPUs) and the 8.3B model with 16 and 24
  heads (Table 7: 82%, 80%), as TFLOP/s per GPU = 39 x
  efficiency (its FLOP count is taken to be the hardware count with recompute, the SC21
  paper's formula). The single-GPU row is the calibration of the preset's GEMM table
  (``v100-megatron2019``: the same V100 under 2019 software); the scaling rows are V100
  validation, both as published and relative to the baseline row (the scaling alone).
* ``alpa-readme``: Alpa's benchmark README, the one end-to-end V100 figure published for
  the alpa-v100 cluster itself (below). The calibration of the ``v100`` table (2022
  software).
* ``gpu-single-h100``: autoshard's own GPT step measured on one H100 here (docs/
  validation.md, benchmarks/results/gpu_single.json); the H100 GEMM table was measured
  separately (GEMMs alone), so these rows are validation.
* ``gpu-peer-h100``: the PyTorch peer step (benchmarks/gpu_peer_torch.py: nanoGPT-style
  blocks, ``scaled_dot_product_attention``, bf16 autocast, fused AdamW, ``torch.compile``)
  measured on one H100 here (benchmarks/results/gpu_fused_2026-11-27.json), priced as
  Megatron-LM's flash-attention program: the nearest measured stand-in for it, and the
  validation of the H100 attention table (benchmarks/gpu_attention.py measured the kernel
  alone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    """One published training run and what it reported (``metric``: ``tflops_per_gpu``
    hardware FLOPs with recompute, ``mfu`` model-FLOP utilisation, or ``step_time_s``)."""

    source: str
    role: str  # calibration | validation
    name: str
    cluster: str
    gpus: int
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    published: float
    metric: str = "tflops_per_gpu"
    seq_len: int = 2048
    vocab: int = 51200
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "full"
    dtype: str = "fp16"
    relative_to: str | None = None  # a row of the same source: also compare the ratio
    attention: str = "softmax"  # MegatronConfig.attention: "flash" prices the fused kernel
    # the software that ran (MegatronConfig): SC21's 2021 code adds each micro-batch's
    # gradients to the buffer in a separate pass ("unfused"); the fused accumulation (Feb
    # 2022) is in Korthikanti et al.'s code, whose sequence parallelism also overlaps the
    # backward reduce-scatter with the weight-gradient GEMM (tp_comm_overlap None: as
    # sequence parallelism does)
    grad_accumulation: str = "fused"
    tp_comm_overlap: bool | None = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _sc21(name, a, h, layers, t, p, gpus, gbs, mbs, v, tflops):
    return PublishedRun(
        "sc21-table1", "calibration", name, "dgx-a100", gpus, a, h, layers, t, p, gbs, mbs,
        tflops, virtual_stages=v, grad_accumulation="unfused",
    )  # fmt: skip


SC21_TABLE_1 = [
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    _sc21("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    _sc21("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    _sc21("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    _sc21("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    _sc21("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    _sc21("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    _sc21("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    _sc21("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    _sc21("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]


def _k22(name, a, h, layers, p, gpus, gbs, mfu):
    return PublishedRun(
        "korthikanti22", "validation", name, "dgx-a100", gpus, a, h, layers, 8, p, gbs, 1,
        mfu, metric="mfu", sequence_parallel=True, recompute="selective",
    )  # fmt: skip


KORTHIKANTI_22 = [
    _k22("22B", 64, 6144, 48, 1, 8, 4, 0.415),
    _k22("175B", 96, 12288, 96, 8, 64, 64, 0.514),
    _k22("530B", 128, 20480, 105, 35, 280, 280, 0.560),
    _k22("1T", 160, 25600, 128, 64, 512, 512, 0.563),
]

SHOEYBI_BASELINE_TFLOPS = 39.0
# Table 1 of the 2019 paper: (name, heads, hidden, layers, model-parallel degree)
_SHOEYBI_MODELS = {
    "1.2B": (16, 1536, 40, 1),
    "2.5B": (20, 1920, 54, 2),
    "4.2B": (24, 2304, 64, 4),
    "8.3B": (32, 3072, 72, 8),
}


SHOEYBI_BASELINE = "1.2B 1 GPU (baseline)"


def _s19(role, name, gpus, tp, efficiency, label, heads=None):
    a, h, layers, _ = _SHOEYBI_MODELS[name]
    a = heads or a
    return PublishedRun(
        "shoeybi19", role, f"{name} {label}", "dgx2h-v100", gpus, a, h, layers, tp, 1,
        8 * gpus // tp, 8, SHOEYBI_BASELINE_TFLOPS * efficiency, seq_len=1024,
        relative_to=None if gpus == 1 else SHOEYBI_BASELINE,
    )  # fmt: skip


# Alpa's benchmark README ("Sanity Check", expected output on AWS p3.16xlarge, 2022-04-24):
# gpt-2.6b (hidden 2560, 32 layers, 32 heads, seq 1024), batch 32 in 4 micro-batches, data 2 x
# operator 2 x pipeline 2 on 8 V100s, remat on: mean step 2.425 s. The V100 calibration: the
# one public end-to-end figure on the cluster the alpa-v100 preset describes.
ALPA_README = [
    PublishedRun(
        "alpa-readme",
        "calibration",
        "gpt-2.6b 2x2x2",
        "alpa-v100",
        8,
        32,
        2560,
        32,
        2,
        2,
        32,
        4,
        2.425,
        metric="step_time_s",
        seq_len=1024,
    ),  # fmt: skip
]

SHOEYBI_19 = [
    # the paper's single-GPU figure calibrates the 2019 software level (v100-megatron2019)
    _s19("calibration", "1.2B", 1, 1, 1.00, "1 GPU (baseline)"),
    # Figure 5, weak scaling: model parallel (batch 8), model + data parallel (batch 512).
    # The three model-parallel runs calibrate the 2019 software's per-step cost of tensor
    # parallelism (since 2026-11-26; validation rows before, docs/validation.md)
    _s19("calibration", "2.5B", 2, 2, 0.95, "MP 2"),
    _s19("calibration", "4.2B", 4, 4, 0.82, "MP 4"),
    _s19("calibration", "8.3B", 8, 8, 0.77, "MP 8"),
    _s19("validation", "1.2B", 64, 1, 0.96, "DP 64"),
    _s19("validation", "2.5B", 128, 2, 0.83, "MP 2 x DP 64"),
    _s19("validation", "4.2B", 256, 4, 0.79, "MP 4 x DP 64"),
    _s19("validation", "8.3B", 512, 8, 0.74, "MP 8 x DP 64"),
    # Table 8, strong scaling of the 1.2B model: speed-up over the same model on 1 GPU, / GPUs.
    # Appendix D.2: "We use a fixed batch size of 8 samples per iteration and increase the
    # number of GPUs using model parallelism. The results are listed in Table 8."
    _s19("validation", "1.2B", 2, 2, 1.64 / 2, "MP 2 (strong)"),
    _s19("validation", "1.2B", 4, 4, 2.34 / 4, "MP 4 (strong)"),
    _s19("validation", "1.2B", 8, 8, 2.98 / 8, "MP 8 (strong)"),
    # Table 7 (Appendix D.1), the 8.3B model on 8-way model parallelism with 16 and 24
    # heads (head dimension 192, 128) instead of 32 (96, the MP 8 row above, also 77%):
    # scaling efficiency 82%, 80% against the same single-GPU baseline. Added 2026-11-25 as
    # a check of the skinny-K GEMM assumption (docs/validation.md), whatever they show.
    _s19("validation", "8.3B", 8, 8, 0.82, "MP 8, 16 heads", heads=16),
    _s19("validation", "8.3B", 8, 8, 0.80, "MP 8, 24 heads", heads=24),
]


def _h100(name, layers, hidden, heads, batch, step_s):
    return PublishedRun(
        "gpu-single-h100", "validation", name, "dgx-h100", 1, heads, hidden, layers, 1, 1,
        batch, batch, step_s, metric="step_time_s", seq_len=1024, recompute="none",
        dtype="bf16",
    )  # fmt: skip


# measured here: benchmarks/results/gpu_single.json (median step, 10 steps after warm-up)
GPU_SINGLE_H100 = [
    _h100("gpt-350m L24 B8", 24, 1024, 16, 8, 0.0815897),
    _h100("gpt-1.3b L24 B4", 24, 2048, 32, 4, 0.1185644),
    _h100("gpt-1.3b L8 B8", 8, 2048, 32, 8, 0.0724661),
]


def _h100_peer(name, layers, hidden, heads, batch, step_s):
    return dataclasses.replace(
        _h100(name, layers, hidden, heads, batch, step_s), source="gpu-peer-h100", attention="flash"
    )


# measured here: benchmarks/results/gpu_fused_2026-11-27.json, "peer" (median of 10 steps)
GPU_PEER_H100 = [
    _h100_peer("gpt-350m L24 B8", 24, 1024, 16, 8, 0.0511120),
    _h100_peer("gpt-1.3b L24 B8", 24, 2048, 32, 8, 0.1447582),
]

ALL_RUNS = [
    *SC21_TABLE_1, *KORTHIKANTI_22, *ALPA_README, *SHOEYBI_19, *GPU_SINGLE_H100, *GPU_PEER_H100,
]  # fmt: skip


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        description="List the published (and here-measured) runs the simulator is checked "
        "against (data only; benchmarks/validate_megatron.py compares them with the simulator)."
    )
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    args = parser.parse_args()
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in ALL_RUNS], indent=1))
        return
    for r in ALL_RUNS:
        print(
            f"{r.source:14s} {r.role:11s} {r.name:32s} {r.cluster:10s} {r.gpus:5d} GPUs "
            f"tp {r.tp} pp {r.pp} dp {r.dp}  {r.metric} {r.published:g}"
        )


if __name__ == "__main__":
    main()
