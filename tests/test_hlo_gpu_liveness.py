"""The live peak read from scheduled HLO text (autoshard/verify/hlo_liveness.py), on XLA:CPU
compiled here and on HLO captured from XLA:GPU (tests/fixtures/xla_gpu/README.md), and the
optimizer updates XLA:GPU holds from their gradient to the backward's end
(``held_update_gathers`` in the memory model)."""

from __future__ import annotations

import gzip
import json
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.verify.hlo_liveness import (
    HloParseError,
    held_updates,
    hlo_live_peak,
    most_live_square_blocks,
)

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = ROOT / "tests" / "fixtures" / "xla_gpu" / "h100_2026-11-27"


def _text(name: str) -> str:
    return gzip.open(CAPTURED / f"{name}.hlo.txt.gz", "rt").read()


def test_the_live_peak_is_xla_cpus_allocation_on_a_donated_sharded_step():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

    w = jax.ShapeDtypeStruct(
        (256, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(step, donate_argnums=0).lower([w] * 4, x).compile()
    memory = compiled.memory_analysis()
    peak = hlo_live_peak(compiled.as_text())
    assert peak.parameter_bytes == memory.argument_size_in_bytes
    # XLA's temporaries, to a few scalars (2026-11-27, jax 0.10.2: 524,320 B and 524,288 B)
    assert abs(peak.temp_bytes - memory.temp_size_in_bytes) <= 64
    assert peak.temp_bytes > 0.9 * memory.temp_size_in_bytes


def test_the_live_peak_of_captured_xla_gpu_modules_is_near_xlas_allocation():
    """gpt-tiny's two captured modules against XLA:GPU's own temporaries (the run's JSON):
    ZeRO-3's to 1%; auto's 6.5% over (2026-11-27: 3,277,220 vs 3,076,128 B), where XLA:GPU
    shares a buffer the reader does not find."""
    run = json.loads((ROOT / "benchmarks/results/gpu_truth_h100_2026-11-27.json").read_text())
    temp = {r["name"]: r["verification"]["compiled_memory"]["temp_bytes"] for r in run["rows"]}
    zero3 = hlo_live_peak(_text("gpt-tiny-L2-zero3-2x4"))
    assert zero3.temp_bytes == pytest.approx(temp["gpt-tiny-L2-zero3-2x4"], rel=0.01)
    auto = hlo_live_peak(_text("gpt-tiny-L2-auto-2x4"))
    assert temp["gpt-tiny-L2-auto-2x4"] <= auto.temp_bytes <= 1.1 * temp["gpt-tiny-L2-auto-2x4"]
    assert not held_updates(_text("gpt-tiny-L2-auto-2x4"))  # its updates are not gathered


def test_xla_gpu_holds_gpt_39b_gathered_updates_until_the_backward_ends():
    """The gathered updates of gpt-39b's auto step on 8x8 H100s (the fixture: each
    all-gather of an update and the add that reads it, in XLA:GPU's schedule, cut out of the
    compiled module by benchmarks/studies/gpu_held_updates.py --slice): 4 weights x 48
    layers, each gathered right after its all-gather starts and added into its donated
    parameter only after the other layers' gathers, so at the peak 190 of the 192 are live
    together, 19.19 of their 19.33 GB per device."""
    text = _text("gpt-39b-L48-auto-8x8.held-updates")
    held = held_updates(text)
    assert len(held) == 4 * 48
    sizes = sorted({h.bytes for h in held})
    # the out projection, qkv, and the MLP's two kernels, split 8 ways over model
    assert sizes == [8192 * 8192 * 4 // 8, 8192 * 24576 * 4 // 8, 8192 * 32768 * 4 // 8]
    assert (
        sum(h.bytes for h in held) == 48 * 4 * (8192 * 8192 + 8192 * 24576 + 2 * 8192 * 32768) // 8
    )
    first_add = min(h.added_at for h in held)
    assert sum(h.gathered_at > first_add for h in held) <= 2  # gathered early, added late
    peak = hlo_live_peak(text)
    live = [h for h in held if h.gathered_at <= peak.position <= h.added_at]
    assert len(live) == 190
    assert sum(h.bytes for h in live) == peak.temp_bytes == 19_193_135_104


def _scale_module(name: str, run: str = "2026-11-27c") -> str:
    """One module of a scale run's committed --hlo-tar (benchmarks/results)."""
    path = ROOT / f"benchmarks/results/gpu_truth_scale_hlo_h100_{run}.tar.gz"
    with tarfile.open(path) as tar:
        return tar.extractfile(f"{name}.hlo.txt").read().decode()


@pytest.mark.parametrize(
    "name, layers, per_layer",
    [
        ("gpt-6.7b-L32-heuristic-2x8", 32, 2),
        ("moe-1.3b-L16-megatron-2x4", 16, 2),
        # XLA fused the subtraction into the backward's dS: the scores alone are kept
        ("gpt-6.7b-L32-zero2-2x8-B16", 32, 1),
        ("moe-1.3b-L16-zero2-2x4", 16, 1),
    ],
)
def test_xla_gpu_keeps_float32_attention_score_blocks_to_the_backward(name, layers, per_layer):
    """The float32 scale rows run the attention's XLA body on XLA:GPU (cuDNN takes no
    float32) and keep ``per_layer`` S x S float32 blocks (S = 1024) of every layer from its
    forward to its backward, with at most one more of the operator's own live beside them
    (benchmarks/studies/gpu_attention_blocks.py: 2 a layer on 11 of the 14 float32 GPT / MoE
    modules of the H100 scale runs, 1 on 3). The memory model's XLA:GPU layout counts the
    2 (``wide_attention_held_blocks``)."""
    from autoshard.hardware.mesh import XLA_GPU_MEMORY

    most, _ = most_live_square_blocks(_scale_module(name), 1024)
    assert per_layer * layers <= most <= per_layer * layers + 1
    assert most_live_square_blocks(_scale_module(name), 2048)[0] == 0  # no other side
    if per_layer == 2:
        assert XLA_GPU_MEMORY.wide_attention_held_blocks == per_layer


def test_text_that_is_not_hlo_is_refused_with_what_was_wrong():
    with pytest.raises(HloParseError, match="no ENTRY computation"):
        hlo_live_peak("HloModule m\n\n%f (p: f32[2]) -> f32[2] {\n}\n")
