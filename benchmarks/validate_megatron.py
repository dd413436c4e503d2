"""Megatron-LM weak scaling on A100 (Narayanan et al., SC21, Table 1): predicted vs published.

Configurations: Table 1 of the paper (heads, hidden, layers, TP, PP, GPUs, global batch,
achieved teraFLOP/s per GPU); micro-batch sizes and interleaving from the paper's run script
(Megatron-LM examples/sc21/run_table_1.sh). All runs: seq 2048, vocab 51200, fp16, full
activation recompute, DGX A100 80GB nodes. Megatron reports *hardware* FLOPs,
96 B s L h^2 (1 + s/6h + V/16Lh), which is what ``SimResult.tflops_per_device`` counts.

Writes benchmarks/results/megatron_validation.json and prints a markdown table.
Usage: python benchmarks/validate_megatron.py
"""

from __future__ import annotations

import json
from pathlib import Path

from autoshard.hardware.clusters import load_cluster
from autoshard.sim.megatron import GPTShape, MegatronConfig, simulate_megatron

OUT = Path(__file__).resolve().parent / "results" / "megatron_validation.json"

# name, heads, hidden, layers, tp, pp, gpus, global batch, micro batch, virtual stages,
# published TFLOP/s per GPU, published % of peak
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, 44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, 44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, 46),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, 43),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, 44),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, 45),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, 47),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, 50),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, 52),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, 52),
]


def validate() -> list[dict]:
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, gbs, mbs, v, tflops, pct in TABLE_1:
        model = GPTShape(hidden=hidden, layers=layers, heads=heads, vocab=51200, seq_len=2048)
        cfg = MegatronConfig(
            tp=tp,
            pp=pp,
            dp=gpus // (tp * pp),
            micro_batch=mbs,
            global_batch=gbs,
            recompute="full",
            virtual_stages=v,
            dtype="fp16",
        )
        result = simulate_megatron(model, cfg, load_cluster("dgx-a100", num_gpus=gpus))
        rows.append(
            {
                "model": name,
                "heads": heads,
                "hidden": hidden,
                "layers": layers,
                "tp": tp,
                "pp": pp,
                "dp": cfg.dp,
                "gpus": gpus,
                "global_batch": gbs,
                "micro_batch": mbs,
                "virtual_stages": v,
                "published_tflops_per_gpu": tflops,
                "published_percent_of_peak": pct,
                "predicted_tflops_per_gpu": round(result.tflops_per_device, 2),
                "predicted_hfu": round(result.hfu, 4),
                "predicted_mfu": round(result.mfu, 4),
                "error_percent": round(100 * (result.tflops_per_device / tflops - 1), 2),
                "step_time_s": round(result.step_time_s, 4),
                "memory_gib": round(result.memory_bytes_per_device / 2**30, 2),
                "oom": result.oom,
                "breakdown_s": {k: round(val, 5) for k, val in result.breakdown.items()},
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| model | t | p | d | GPUs | B | b | v | published TFLOP/s | predicted TFLOP/s | error |"
        " predicted MFU | memory GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | "
            f"{r['global_batch']} | {r['micro_batch']} | {r['virtual_stages']} | "
            f"{r['published_tflops_per_gpu']} | {r['predicted_tflops_per_gpu']:.1f} | "
            f"{r['error_percent']:+.1f}% | {r['predicted_mfu']:.1%} | {r['memory_gib']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    rows = validate()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"cluster": "dgx-a100", "rows": rows}, indent=1) + "\n")
    print(markdown_table(rows))
    worst = max(abs(r["error_percent"]) for r in rows)
    print(f"\nworst |error| = {worst:.1f}%  (written to {OUT})")


if __name__ == "__main__":
    main()
