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
    schedule_buffers,
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
    """gpt-tiny's two captured modules against XLA:GPU's own temporaries (the run's JSON).
    The live peak is what any placement of these buffers must hold, so XLA's heap is at or
    above it, by the gaps it leaves between buffers: 0.5% on auto (2026-11-28: 3,060,068
    vs 3,076,128 B), 1.2% on ZeRO-3 (2,150,856 vs 2,176,288 B), where a best-fit placement
    of the reader's own buffers leaves 0.2% to 3.0% (benchmarks/studies/gpu_tuple_reads.py
    --pack)."""
    run = json.loads((ROOT / "benchmarks/results/gpu_truth_h100_2026-11-27.json").read_text())
    temp = {r["name"]: r["verification"]["compiled_memory"]["temp_bytes"] for r in run["rows"]}
    for name in ("gpt-tiny-L2-zero3-2x4", "gpt-tiny-L2-auto-2x4"):
        peak = hlo_live_peak(_text(name))
        assert 0.985 * temp[name] <= peak.temp_bytes <= temp[name], name
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


# A two-output fusion: a 4 KiB element read at once and a 64 B element read last, through
# a get-tuple-element XLA printed late (it runs nothing); 8 KiB made between the two reads.
_TWO_OUTPUTS = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %two = (f32[1024]{0}, f32[16]{0}) fusion(%x), kind=kLoop, calls=%fused_two
  %big = f32[1024]{0} get-tuple-element(%two), index=0
  %sum = f32[16]{0} fusion(%big), kind=kInput, calls=%fused_sum
  %wide = f32[2048]{0} fusion(%sum), kind=kLoop, calls=%fused_wide
  %small = f32[16]{0} get-tuple-element(%two), index=1
  ROOT %out = f32[16]{0} fusion(%wide, %small), kind=kLoop, calls=%fused_out
}
"""


def test_a_get_tuple_element_reads_only_the_element_it_names():
    """Each element of a tuple is its own buffer, live to the readers of its own view: the
    4 KiB element dies at ``sum``, before ``wide`` is made, however late the view of the
    other element is printed (reading the whole tuple there held it beside ``wide``:
    12,416 B)."""
    peak = hlo_live_peak(_TWO_OUTPUTS)
    # at wide: wide, sum, and the small element
    assert (peak.temp_bytes, peak.instruction) == (8192 + 64 + 64, "wide")
    moved = _TWO_OUTPUTS.replace(
        "  %small = f32[16]{0} get-tuple-element(%two), index=1\n", ""
    ).replace("index=0\n", "index=0\n  %small = f32[16]{0} get-tuple-element(%two), index=1\n")
    assert moved != _TWO_OUTPUTS
    assert hlo_live_peak(moved).temp_bytes == peak.temp_bytes


def test_a_while_loops_state_elements_live_to_their_own_readers():
    """A loop's state lives in its operand's buffers (XLA colocates them), one buffer an
    element, so the 4 KiB element is live from its maker to ``sum`` and the 64 B one to
    the root."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %a = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %b = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused_b
  %init = (f32[1024]{0}, f32[16]{0}) tuple(%a, %b)
  %loop = (f32[1024]{0}, f32[16]{0}) while(%init), condition=%cond, body=%body
  %big = f32[1024]{0} get-tuple-element(%loop), index=0
  %sum = f32[16]{0} fusion(%big), kind=kInput, calls=%fused_sum
  %wide = f32[2048]{0} fusion(%sum), kind=kLoop, calls=%fused_wide
  %small = f32[16]{0} get-tuple-element(%loop), index=1
  ROOT %out = f32[16]{0} fusion(%wide, %small), kind=kLoop, calls=%fused_out
}
"""
    _, bufs = schedule_buffers(text)
    made = {b.made_by[0]: b for b in bufs}
    assert "loop" not in made  # no buffer of its own
    assert (made["a"].first, made["a"].last) == (1, 6)  # to sum
    assert (made["b"].first, made["b"].last) == (2, 10)  # the root's, to the end
    assert hlo_live_peak(text).temp_bytes == 8192 + 64 + 64


def test_each_tuple_elements_live_range_is_xlas_own(tmp_path):
    """A max pool's gradient on XLA:CPU: the expanded pooling's reduce-window fusion makes
    five elements, the pooled values unread (the forward pools again) and four index planes
    read through views printed after it. Every element's live range read from the text is
    the one XLA's own live-range dump gives: the unread element dies where it is made, not at
    the tuple's last view."""
    import glob
    import re

    from jax import lax

    from autoshard.verify.check import _past_the_persistent_cache
    from autoshard.verify.memory import LIVE_RANGE_DUMP_OPTIONS

    def loss(x, w):
        h = jnp.tanh(x * w)
        pooled = lax.reduce_window(h, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        return jnp.sum(pooled**2)

    x = jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32)
    options = {"xla_dump_to": str(tmp_path), **LIVE_RANGE_DUMP_OPTIONS}
    # under a persistent cache (JAX_COMPILATION_CACHE_DIR) a hit would dump nothing
    with _past_the_persistent_cache(options, str(tmp_path)):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, x).compile(options)
    (dump,) = glob.glob(str(tmp_path / "*after_optimizations-live-range.txt"))
    xla = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^\s+(\S+\{[\d,]+\}):(\d+)-(\d+)\s*$", open(dump).read(), re.M)
    }
    instrs, bufs = schedule_buffers(compiled.as_text())
    views = {}  # tuple -> position of its last view
    for k, ins in enumerate(instrs):
        if ins.opcode == "get-tuple-element":
            views[ins.operands[0]] = k
    elements = {
        f"{b.made_by[0]}{{{','.join(map(str, b.made_by[1]))}}}": (b.first, b.last, b.made_by[0])
        for b in bufs
        if b.made_by[1] and len(b.values) == 1 and not b.parameter
    }
    assert elements and elements.keys() <= xla.keys()
    assert {name: e[:2] for name, e in elements.items()} == {name: xla[name] for name in elements}
    # an element that dies before its tuple's last view: what reading the whole tuple missed
    assert any(last < views.get(tuple_, -1) for _, last, tuple_ in elements.values())


def test_temporaries_live_in_a_donated_parameter_after_its_last_reader():
    """XLA's buffer assignment offers a donated parameter's buffer to the temporaries made
    after its last reader and dead before the output written there (``hlo_live_peak``'s
    ``in_dead_donated_parameters``): here ``w`` is read by the first dot only and the new
    ``w`` is made last, so ``h1`` lives in ``w``'s buffer, from its tanh to the fusion that
    writes the new ``w`` over it in place. XLA:CPU allocates 3 MiB of temporaries
    (2026-11-28, jax 0.10.2); counting all four activations in the heap read 4 MiB."""

    def step(w, x):
        h1 = jnp.tanh(x @ w)
        h2 = jnp.tanh(h1 @ x)
        h3 = jnp.tanh(h2 @ x)
        h4 = jnp.tanh(h3 @ x)
        return jnp.sin(h1 + h2 + h3 + h4)

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    compiled = jax.jit(step, donate_argnums=0).lower(w, w).compile()
    peak = hlo_live_peak(compiled.as_text())
    assert peak.temp_bytes == compiled.memory_analysis().temp_size_in_bytes == 3 * 2**20
