"""What-if: a per-kernel host overhead for Megatron-LM's 2019 eager PyTorch code (V100 rows).

Megatron-LM 2019 launches every operation from Python. Would the host's time per launched
kernel explain why its small strongly-scaled runs are slower than the simulator says
(docs/validation.md)? This script prices the Megatron-LM 2019 rows of
``benchmarks/published_runs.py`` with a per-kernel host time added, recalibrates the
``v100-megatron2019`` table's level on the 1-GPU calibration row *with the term in*, and
prints every row's error next to the shipped model's (without the per-step tensor-parallel
cost fitted since 2026-11-26: this what-if came first). It changes no shipped number.

Inputs, all stated before looking at any validation error:

* ``HOST_SECONDS_PER_OP`` = 1 / 280,000 s (3.6 us): PyTorch eager's throughput on tiny
  tensors, "we can only get 280 thousand operations per second" (Horace He, *Making Deep
  Learning Go Brrrr From First Principles*, 2022, horace.io/brrr_intro.html). Python,
  dispatcher and launch together; a 2019 PyTorch on a 2019 host may be slower, so the
  script also prints the term at 3x that figure.
* Kernels per transformer layer and micro-batch, counted from Megatron-LM's 2019
  ``mpu/transformer.py`` (NVIDIA/Megatron-LM, commit a0368ddf): forward 30 (layernorm 1;
  QKV GEMM + bias 2; two copies making Q and K contiguous for the batched GEMM + the GEMM
  3; scale 1; causal mask 4; softmax 1; dropout 1; V copy + GEMM 2; permute copy 1;
  projection GEMM + all-reduce + bias 3; dropout 1; residual add 1; layernorm 1; MLP up
  GEMM + bias 2; GeLU (TorchScript-fused) 1; MLP down GEMM + all-reduce + bias 3; dropout
  1; residual add 1); backward taken as twice the forward (two GEMMs per GEMM, a gradient
  kernel per elementwise op, the autograd accumulations); recompute (activation
  checkpointing) repeats the forward: 120 in all. Embedding, logits and loss: 30 per
  micro-batch. Optimizer: 5 kernels per parameter tensor (16-bit gradient to fp32, unscale,
  norm, Adam, fp32 weight to 16-bit), 12 tensors per layer plus 4.

Two ways to combine host and GPU time:

* ``async``: the host runs ahead of the GPU (PyTorch's launches are asynchronous), so
  the step is max(GPU time, kernels x host time per op);
* ``additive``: no overlap at all, step = GPU time + kernels x host time per op (a
  pessimistic bound: the host never runs ahead).

Usage: python benchmarks/studies/host_overhead_v100.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE))  # the sibling scripts below, also when loaded by path

import make_gemm_tables  # noqa: E402
import validate_megatron  # noqa: E402
from published_runs import SHOEYBI_19, PublishedRun  # noqa: E402

from autoshard.hardware.gemm import GemmTable  # noqa: E402

TABLE = "v100-megatron2019"


def role_of(run: PublishedRun) -> str:
    """This what-if studies the model *without* the 2019 software's per-step tensor-parallel
    cost (fitted since 2026-11-26; every table here is built with it at 0): its one
    calibration row is the 1-GPU run, every other row is validation, as when it was
    written."""
    return "calibration" if run.gpus == 1 else "validation"


HOST_SECONDS_PER_OP = 1 / 280_000
KERNELS_PER_LAYER_FORWARD = 30
KERNELS_PER_LAYER = 4 * KERNELS_PER_LAYER_FORWARD  # forward, backward (2x), recompute
KERNELS_EMBEDDING_AND_LOSS = 30
OPTIMIZER_KERNELS_PER_TENSOR = 5
TENSORS_PER_LAYER = 12
MODES = ("async", "additive")


def kernels_per_step(run: PublishedRun) -> int:
    """Kernels one GPU launches in one step of ``run`` (the count in the docstring)."""
    microbatches = run.global_batch // (run.micro_batch * run.dp)
    layers = run.layers // run.pp
    per_microbatch = layers * KERNELS_PER_LAYER + KERNELS_EMBEDDING_AND_LOSS
    optimizer = OPTIMIZER_KERNELS_PER_TENSOR * (TENSORS_PER_LAYER * layers + 4)
    return microbatches * per_microbatch + optimizer


def step_with_host(gpu_step_s: float, kernels: int, host_s: float, mode: str) -> float:
    """Step time once each of ``kernels`` launches costs the host ``host_s``."""
    host = kernels * host_s
    return max(gpu_step_s, host) if mode == "async" else gpu_step_s + host


def price(run: PublishedRun, table: GemmTable, host_s: float, mode: str) -> dict:
    """``run``'s predicted TFLOP/s per GPU with the host term and its throughput error."""
    base = validate_megatron.price(run, table)
    gpu_step = base["result"].step_time_s
    step = step_with_host(gpu_step, kernels_per_step(run), host_s, mode)
    predicted = base["predicted"] * gpu_step / step  # tflops_per_gpu scales as 1 / step
    return {"predicted": predicted, "error": predicted / run.published - 1, "step_s": step}


def calibrate(host_s: float, mode: str) -> float:
    """The table's efficiency (0.01 grid) that fits the calibration row with the term in."""
    calibration = [r for r in SHOEYBI_19 if role_of(r) == "calibration"]
    best = None
    for eff in validate_megatron.CALIBRATION_GRID:
        table = GemmTable.from_json(make_gemm_tables.make_table(TABLE, eff, 0.0), f"{TABLE}@{eff}")
        worst = max(abs(price(r, table, host_s, mode)["error"]) for r in calibration)
        if best is None or worst < best[1] - 1e-12:
            best = (eff, worst, table)
    return best


def what_if() -> dict:
    """Every Megatron-LM 2019 row: the shipped model without its tensor-parallel step cost
    (``shipped``: the shipped level, the cost at 0), and each mode at 1x and 3x the host
    time."""
    eff = make_gemm_tables.CALIBRATED[TABLE]
    shipped = GemmTable.from_json(make_gemm_tables.make_table(TABLE, eff, 0.0), f"{TABLE}@{eff}")
    variants = [("shipped", 0.0, "async", eff, shipped)]
    for factor in (1, 3):
        for mode in MODES:
            eff, _, table = calibrate(factor * HOST_SECONDS_PER_OP, mode)
            variants.append((f"{mode} {factor}x", factor * HOST_SECONDS_PER_OP, mode, eff, table))
    out = {"host_seconds_per_op": HOST_SECONDS_PER_OP, "variants": []}
    for name, host_s, mode, eff, table in variants:
        rows = []
        for run in SHOEYBI_19:
            priced = price(run, table, host_s, mode)
            rows.append(
                {
                    "model": run.name,
                    "role": role_of(run),
                    "kernels_per_step": kernels_per_step(run),
                    "host_s": round(kernels_per_step(run) * host_s, 4),
                    "step_s": round(priced["step_s"], 4),
                    "error_percent": round(100 * priced["error"], 2),
                }
            )
        errors = [abs(r["error_percent"]) for r in rows if r["role"] == "validation"]
        out["variants"].append(
            {
                "variant": name,
                "efficiency": eff,
                "rows": rows,
                "validation_mean_abs_error_percent": round(sum(errors) / len(errors), 2),
                "validation_max_abs_error_percent": round(max(errors), 2),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    result = what_if()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    variants = result["variants"]
    print("| row | kernels | " + " | ".join(v["variant"] for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    print("| eff_large | | " + " | ".join(f"{v['efficiency']:.2f}" for v in variants) + " |")
    for i, run in enumerate(SHOEYBI_19):
        cells = [f"{v['rows'][i]['error_percent']:+.1f}%" for v in variants]
        print(
            f"| {run.name} | {variants[0]['rows'][i]['kernels_per_step']} | "
            + " | ".join(cells)
            + " |"
        )
    print(
        "| validation mean / worst | | "
        + " | ".join(
            f"{v['validation_mean_abs_error_percent']:.1f}% / "
            f"{v['validation_max_abs_error_percent']:.1f}%"
            for v in variants
        )
        + " |"
    )


if __name__ == "__main__":
    main()
