"""The Megatron-LM 2019 rows (V100): where the strong-scaling rows lose time, and the unfused
2019 elementwise kernels as a structure of their own (docs/validation.md).

Two parts, both on the ``shoeybi19`` rows of ``benchmarks/published_runs.py``:

1. **The observation** (the integrator's): the time the simulator misses on the strong-scaling
   rows of the 1.2B model (published minus predicted step, t = 2, 4, 8) looks like
   c (1 - 1/t), what a part c of the 1-GPU step that does *not* shrink with tensor
   parallelism would give, while the 1-GPU calibration folds all of its time into a GEMM
   level that does shrink. Printed: each row's predicted step split into GEMM, elementwise
   (and of it the passes over [s, b, h] tensors, which every tensor-parallel rank repeats),
   tensor-parallel collectives, data-parallel all-reduce and optimizer; the published step;
   the missing time; the least-squares c; and the model's own non-shrinking time at t = 1.
2. **The 2019 structure**: every row priced with the unfused eager-PyTorch passes of
   Megatron-LM's 2019 transformer layer (``autoshard.sim.megatron.ELEMENTWISE_PASSES
   ["megatron-lm-2019"]``, counted from NVIDIA/Megatron-LM commit a0368ddf
   ``mpu/transformer.py``, ``mpu/layers.py``, ``mpu/cross_entropy.py``), the
   ``v100-megatron2019`` level refitted on the 1-GPU calibration row with it (the same 0.01
   grid as ``validate_megatron.py --calibrate``), next to the Megatron 2021 fused structure
   at its own refit level.

Assumptions, fixed before any validation error was looked at: the passes run at the
preset's nominal HBM bandwidth (900 GB/s), as every elementwise byte of the model does; the
optimizer (32 bytes per parameter) is unchanged; only the calibration row fits anything.

Usage: python benchmarks/studies/megatron2019_elementwise.py [--json]
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

from autoshard.hardware.clusters import load_cluster  # noqa: E402
from autoshard.hardware.gemm import GemmTable  # noqa: E402
from autoshard.sim.megatron import ELEMENTWISE_PASSES  # noqa: E402

TABLE = "v100-megatron2019"


def role_of(run: PublishedRun) -> str:
    """This what-if studies the model *without* the 2019 software's per-step tensor-parallel
    cost (fitted since 2026-11-26; every table here is built with it at 0): its one
    calibration row is the 1-GPU run, every other row is validation, as when it was
    written."""
    return "calibration" if run.gpus == 1 else "validation"


STRUCTURES = ("fused", "megatron-lm-2019")
STRONG = ("1.2B MP 2 (strong)", "1.2B MP 4 (strong)", "1.2B MP 8 (strong)")


def replicated_elementwise_s(run: PublishedRun, structure: str) -> float:
    """Seconds per step of the layers' passes over [s, b, h] tensors (forward, backward and
    the forward again under full recompute): the elementwise work every tensor-parallel rank
    repeats, so it does not shrink with t (no sequence parallelism in these rows)."""
    cluster = load_cluster(run.cluster, num_gpus=run.gpus)
    e = 2
    fwd, bwd = ELEMENTWISE_PASSES[structure](e)["sbh"]
    per_layer = (2 * fwd + bwd) if run.recompute == "full" else (fwd + bwd)
    sbh = run.seq_len * run.micro_batch * run.hidden
    microbatches = run.global_batch // (run.micro_batch * run.dp)
    return microbatches * run.layers * per_layer * sbh / cluster.device.hbm_bandwidth


def row(run: PublishedRun, table: GemmTable, structure: str) -> dict:
    """One row's predicted step, its parts (s), the published step and the error."""
    priced = validate_megatron.price(run, table, structure)
    result = priced["result"]
    b = result.breakdown
    published_step = result.step_time_s * (1 + priced["error"])  # tflops: rate ratio
    return {
        "model": run.name,
        "role": role_of(run),
        "tp": run.tp,
        "dp": run.dp,
        "gemm_s": round(b["compute_gemm"], 4),
        "elementwise_s": round(b["compute_elementwise"], 4),
        "replicated_elementwise_s": round(replicated_elementwise_s(run, structure), 4),
        "tp_comm_s": round(b["tp_comm"], 4),
        "dp_allreduce_s": round(b["dp_allreduce"], 4),
        "optimizer_s": round(b["optimizer"], 4),
        "predicted_step_s": round(result.step_time_s, 4),
        "published_step_s": round(published_step, 4),
        "missing_s": round(published_step - result.step_time_s, 4),
        "error_percent": round(100 * priced["error"], 2),
    }


def calibrate(structure: str) -> tuple[float, GemmTable]:
    """The table's 16-bit efficiency (0.01 grid) that fits the calibration row(s) priced with
    ``structure``, and that table."""
    calibration = [r for r in SHOEYBI_19 if role_of(r) == "calibration"]
    best = None
    for eff in validate_megatron.CALIBRATION_GRID:
        table = GemmTable.from_json(make_gemm_tables.make_table(TABLE, eff, 0.0), f"{TABLE}@{eff}")
        worst = max(abs(validate_megatron.price(r, table, structure)["error"]) for r in calibration)
        if best is None or worst < best[1] - 1e-12:
            best = (eff, worst, table)
    return best[0], best[2]


def fit_c(rows: list[dict]) -> dict:
    """Least-squares c of missing = c (1 - 1/t) over the strong-scaling rows, and residuals."""
    strong = [r for r in rows if r["model"] in STRONG]
    x = [1 - 1 / r["tp"] for r in strong]
    y = [r["missing_s"] for r in strong]
    c = sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    return {
        "c_s": round(c, 4),
        "residuals_s": [round(b - c * a, 4) for a, b in zip(x, y, strict=True)],
    }


def register_hypothesis(c_s: float) -> str:
    """A diagnostic structure, never shipped: the 2019 passes with the [s, b, h] bytes scaled
    so that the 1-GPU row's non-shrinking time is ``c_s`` -- what the strong-scaling rows
    would need if their missing time were replicated elementwise work -- to see what that
    does to the weak-scaling rows (whose [s, b, h] work grows with the model). Fitted to
    validation rows, so it only tests the observation."""
    base = next(r for r in SHOEYBI_19 if role_of(r) == "calibration")
    scale = c_s / replicated_elementwise_s(base, "megatron-lm-2019")

    def passes(e: int) -> dict[str, tuple[float, float]]:
        out = dict(ELEMENTWISE_PASSES["megatron-lm-2019"](e))
        out["sbh"] = tuple(scale * x for x in out["sbh"])
        return out

    ELEMENTWISE_PASSES[HYPOTHESIS] = passes
    return HYPOTHESIS


HYPOTHESIS = "hypothesis: non-shrinking c as [s,b,h] passes"


def analyse() -> dict:
    out = {"table": TABLE, "structures": []}
    structures = list(STRUCTURES)
    for structure in structures:
        eff, table = calibrate(structure)
        rows = [row(run, table, structure) for run in SHOEYBI_19]
        errors = [abs(r["error_percent"]) for r in rows if r["role"] == "validation"]
        one_gpu = next(r for r in rows if r["role"] == "calibration")
        out["structures"].append(
            {
                "elementwise": structure,
                "efficiency": eff,
                "rows": rows,
                "fit": fit_c(rows),
                "one_gpu_non_shrinking_s": one_gpu["replicated_elementwise_s"],
                "one_gpu_elementwise_share": round(
                    one_gpu["elementwise_s"] / one_gpu["predicted_step_s"], 4
                ),
                "validation_mean_abs_error_percent": round(sum(errors) / len(errors), 2),
                "validation_max_abs_error_percent": round(max(errors), 2),
            }
        )
        if structure == "megatron-lm-2019":
            structures.append(register_hypothesis(out["structures"][-1]["fit"]["c_s"]))
    ELEMENTWISE_PASSES.pop(HYPOTHESIS, None)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    result = analyse()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    cols = [
        "gemm_s", "elementwise_s", "replicated_elementwise_s", "tp_comm_s", "dp_allreduce_s",
        "optimizer_s", "predicted_step_s", "published_step_s", "missing_s", "error_percent",
    ]  # fmt: skip
    for s in result["structures"]:
        print(
            f"\n{s['elementwise']} (eff_large {s['efficiency']:.2f}; 1-GPU elementwise share "
            f"{s['one_gpu_elementwise_share']:.1%}, of which non-shrinking "
            f"{s['one_gpu_non_shrinking_s']:.3f} s; strong-scaling fit c = "
            f"{s['fit']['c_s']:.3f} s, residuals {s['fit']['residuals_s']}; validation mean "
            f"{s['validation_mean_abs_error_percent']:.1f}%, worst "
            f"{s['validation_max_abs_error_percent']:.1f}%)\n"
        )
        print("| row | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for r in s["rows"]:
            print(f"| {r['model']} | " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
