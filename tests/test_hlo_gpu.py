"""XLA:GPU's HLO spellings read as XLA:CPU's: async collectives, combiners, reduce-scatter forms.

No GPU needed. Two kinds of evidence:

* hand-written fixtures in XLA:GPU's printed syntax (tests/fixtures/xla_gpu/, README there
  says where the syntax comes from; not captured from our own GPU), each with a sync twin
  in XLA:CPU's forms: both must read the same collectives, kinds, axes and bytes;
* programs compiled here by XLA:CPU, rewritten into XLA:GPU's asynchronous forms
  (:func:`to_gpu_async`): the rewritten text must read exactly as the original, the
  all-reduce + dynamic-slice normalisation included.

One real XLA:GPU module (a one-GPU step from an H100, jax 0.11) checks that the reader
takes in every instruction of GPU-printed text.
"""

import gzip
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.ir.spec import Mesh
from autoshard.verify.collectives import analyze_collectives
from autoshard.verify.compare import summarize
from autoshard.verify.hlo import _leaves, _parse_module

try:  # the suite's conftest normally does this before any backend starts
    jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
    pass

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "xla_gpu"
MESH = Mesh(("data", "model"), (2, 4))


def _read(text: str, mesh: Mesh = MESH):
    found = analyze_collectives(text, mesh, range(mesh.num_devices))
    collectives = sorted(
        (c.collective.kind, c.collective.axes, c.collective.bytes, c.dtype, c.in_loop)
        for c in found.collectives
    )
    permutes = sorted((p.axes, p.bytes, p.dtype, p.pairs, p.in_loop) for p in found.permutes)
    return collectives, permutes, found


# --------------------------------------------------------------------------- fixtures


def test_gpu_fixture_reads_its_collectives_kinds_axes_and_bytes():
    collectives, permutes, found = _read((FIXTURES / "step_2x4.hlo").read_text())
    assert collectives == [
        ("all-gather", ("data",), 128 * 512 * 2, "bfloat16", True),  # in the 24-step loop
        ("all-gather", ("model",), 2048 * 2, "bfloat16", False),  # combined, gathered bytes
        ("all-gather", ("model",), 1024 * 512 * 2, "bfloat16", False),
        ("all-reduce", ("data",), 2048 * 4, "float32", False),  # combined all-reduce-start
        ("all-reduce", ("data",), 512 * 512 * 4, "float32", False),
        ("all-to-all", ("model",), 8 * 256 * 512 * 2, "bfloat16", False),  # async-start
        ("reduce-scatter", ("data",), 2048 * 2, "bfloat16", False),  # sugared, combined
        ("reduce-scatter", ("data",), 512 * 512 * 2, "bfloat16", False),
        ("reduce-scatter", ("model",), 512 * 512 * 2, "bfloat16", False),  # async-start
    ]
    assert permutes == [
        (("data",), 64 * 512 * 2, "bfloat16", ((0, 4), (4, 0), (1, 5), (5, 1), (2, 6), (6, 2), (3, 7), (7, 3)), False)
    ]  # fmt: skip
    by_name = {c.hlo_name: c for c in found.collectives}
    assert "runs 24 times" in by_name["all-gather-start.9"].note
    assert by_name["reduce-scatter-start.1"].hlo_opcode == "reduce-scatter-start"
    assert "combined reduce-scatter" in by_name["reduce-scatter-start.1"].note
    assert by_name["reduce-scatter.3"].hlo_opcode == "reduce-scatter"  # inside the wrapper


def test_gpu_fixture_reads_as_its_sync_twin():
    gpu = _read((FIXTURES / "step_2x4.hlo").read_text())
    cpu = _read((FIXTURES / "step_2x4.sync.hlo").read_text())
    assert gpu[:2] == cpu[:2]
    assert summarize(gpu[2].collectives) == summarize(cpu[2].collectives)


def test_a_computation_closed_with_its_execution_thread_ends_there():
    # XLA prints a computation of another thread as "}, execution_thread=..."
    text = """HloModule m, num_partitions=8

%wrapped (p.1: f32[16]) -> f32[16] {
  %p.1 = f32[16]{0} parameter(0)
  ROOT %a2a = f32[16]{0} all-to-all(%p.1), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
}, execution_thread="parallel_thread"

ENTRY %main (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %start = ((f32[16]{0}), f32[16]{0}, s32[]) async-start(%p), async_execution_thread="parallel_thread", calls=%wrapped
  ROOT %done = f32[16]{0} async-done(%start), async_execution_thread="parallel_thread", calls=%wrapped
}
"""
    mod = _parse_module(text)
    assert mod.instrs["start"].computation == "main"
    assert mod.instrs["a2a"].computation == "wrapped"
    assert mod.roots == {"wrapped": "a2a", "main": "done"}
    collectives, _, _ = _read(text)
    assert collectives == [("all-to-all", ("model",), 64, "float32", False)]


# --------------------------------------------------------------------------- XLA:CPU programs
# rewritten into XLA:GPU's asynchronous forms


def to_gpu_async(text: str, sugar: bool = False) -> str:
    """XLA:CPU's sync collectives in XLA:GPU's async forms: all-reduce, all-gather and
    collective-permute as their own -start/-done opcodes; reduce-scatter and all-to-all in
    a generic async-start/async-done wrapping a new computation (``sugar``: printed as
    reduce-scatter-start/-done and all-to-all-start/-done instead)."""
    mod = _parse_module(text)
    wrappers, lines = [], []
    for line in text.splitlines():
        m = re.match(r"^(\s*)(ROOT )?%([\w.\-]+) = (.*)$", line)
        ins = mod.instrs.get(m.group(3)) if m else None
        if ins is None or ins.opcode not in (
            "all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all",
        ):  # fmt: skip
            lines.append(line)
            continue
        indent, root, name = m.group(1), m.group(2) or "", ins.name
        shapes = [mod.instrs[o].shape for o in ins.operands]
        operands = "(" + ", ".join(shapes) + ")" if len(shapes) > 1 else shapes[0]
        call = f"({', '.join('%' + o for o in ins.operands)}){ins.attrs}"
        if ins.opcode == "all-reduce":
            start = f"{ins.shape} all-reduce-start{call}"
        elif ins.opcode in ("all-gather", "collective-permute"):
            start = f"({operands}, {ins.shape}) {ins.opcode}-start{call}"
        elif sugar:
            start = f"(({operands}), {ins.shape}) {ins.opcode}-start{call}"
        else:
            wrapped = f"wrapped_{ins.opcode}_{name}"
            params = [f"%param.{k} = {s} parameter({k})" for k, s in enumerate(shapes)]
            args = ", ".join(f"param.{k}: {s}" for k, s in enumerate(shapes))
            inner = f"ROOT %{name}.inner = {ins.shape} {ins.opcode}("
            inner += ", ".join(f"%param.{k}" for k in range(len(shapes))) + f"){ins.attrs}"
            wrappers.append(
                f"%{wrapped} ({args}) -> {ins.shape} {{\n  "
                + "\n  ".join([*params, inner])
                + "\n}\n"
            )
            start = f"(({operands}), {ins.shape}) async-start({', '.join('%' + o for o in ins.operands)}), calls=%{wrapped}"
        done_op = (
            "async-done"
            if ins.opcode in ("reduce-scatter", "all-to-all") and not sugar
            else f"{ins.opcode}-done"
        )
        lines.append(f"{indent}%{name}.start = {start}")
        lines.append(f"{indent}{root}%{name} = {ins.shape} {done_op}(%{name}.start)")
    out = "\n".join(lines)
    entry = out.index("\nENTRY")
    return out[:entry] + "\n" + "\n".join(wrappers) + out[entry:]


@pytest.fixture(scope="module")
def jmesh():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return jax.sharding.Mesh(devices, ("data", "model"))


def _compiled(jmesh, fn, in_specs, out_spec, shapes, dtype=jnp.float32) -> str:
    shard = lambda s: NamedSharding(jmesh, s)  # noqa: E731
    out = jax.tree.map(shard, out_spec, is_leaf=lambda s: isinstance(s, P))
    jitted = jax.jit(fn, in_shardings=tuple(map(shard, in_specs)), out_shardings=out)
    return jitted.lower(*(jax.ShapeDtypeStruct(s, dtype) for s in shapes)).compile().as_text()


def _grad_step(x, w1, w2):
    def loss(w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    return jax.grad(loss, argnums=(0, 1))(w1, w2)


PROGRAMS = {
    # all-reduce over model, reduce-scatter (XLA:CPU: all-reduce + dynamic-slice), gathers
    "matmul_partial_to_sharded": (
        jnp.matmul,
        (P(None, "model"), P("model", None)),
        P(None, "model"),
        [(16, 32), (32, 8)],
    ),
    # the offsets come from a per-device table (data-sharded rows scattered over model)
    "matmul_into_data_sharded_view": (
        jnp.matmul,
        (P("data", "model"), P("model")),
        P(("data", "model")),
        [(64, 32), (32,)],
    ),
    "matmul_gather": (jnp.matmul, (P("data", None), P(None, "model")), P(), [(16, 32), (32, 8)]),
    # a real reduce-scatter on XLA:CPU too
    "psum_scatter": (
        lambda jmesh: jax.shard_map(
            lambda x: jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True),
            mesh=jmesh,
            in_specs=P(),
            out_specs=P("model"),
        ),
        (P(),),
        P("model"),
        [(16, 8)],
    ),
    "transpose_all_to_all": (lambda x: x.T, (P("model", None),), P("model", None), [(16, 32)]),
    "zero_grads": (
        _grad_step,
        (P("data", None), P(None, "model"), P("model", None)),
        (P(("data", "model"), None), P(("data", "model"), None)),
        [(16, 32), (32, 64), (64, 32)],
    ),
}


MESH_PROGRAMS = {"psum_scatter"}  # made for the mesh


@pytest.mark.parametrize("sugar", [False, True], ids=["async-wrapper", "sugared"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_compiled_program_in_gpu_forms_reads_as_compiled(jmesh, program, sugar):
    fn, in_specs, out_spec, shapes = PROGRAMS[program]
    fn = fn(jmesh) if program in MESH_PROGRAMS else fn
    text = _compiled(jmesh, fn, in_specs, out_spec, shapes)
    gpu_text = to_gpu_async(text, sugar=sugar)
    assert "-start" in gpu_text and gpu_text != text
    original, rewritten = _read(text), _read(gpu_text)
    assert original[0], f"{program} compiles to no collectives; it tests nothing"
    assert rewritten[:2] == original[:2]
    notes = lambda found: sorted(c.note for c in found.collectives)  # noqa: E731
    assert notes(rewritten[2]) == notes(original[2])  # the same normalisations, noted


def test_partial_to_sharded_stays_a_reduce_scatter_through_an_async_done(jmesh):
    fn, in_specs, out_spec, shapes = PROGRAMS["matmul_partial_to_sharded"]
    text = to_gpu_async(_compiled(jmesh, fn, in_specs, out_spec, shapes))
    found = analyze_collectives(text, MESH, range(8))
    assert [(c.collective.kind, c.collective.axes) for c in found.raw] == [
        ("all-reduce", ("model",))
    ]
    assert [(c.collective.kind, c.collective.axes) for c in found.collectives] == [
        ("reduce-scatter", ("model",))
    ]


# --------------------------------------------------------------------------- real XLA:GPU text


def test_a_real_xla_gpu_module_is_read_whole():
    path = ROOT / "benchmarks/results/gpu_fused_hlo/gpt-1.3b_L24_B8_fused.hlo.txt.gz"
    text = gzip.open(path, "rt").read()
    mod = _parse_module(text)
    instructions = re.findall(r"^\s+(?:ROOT )?%(\S+) = ", text, re.M)
    headers = re.findall(r"^(?:ENTRY )?%(\S+) \(.*\) -> .*\{$", text, re.M)
    assert len(instructions) > 20_000 and set(mod.instrs) == set(instructions)
    assert list(mod.computations) == headers
    assert all(_leaves(i.shape) or i.shape == "()" for i in mod.instrs.values())
    found = analyze_collectives(text, Mesh(("data",), (1,)), [0])
    assert found.collectives == () and found.permutes == ()  # one GPU: nothing to exchange


# --------------------------------------------------------------------------- combined by concatenation

CONCATENATED = """HloModule m, num_partitions=8

%wrapped_concatenate_computation (p0: f32[8], p1: f32[8]) -> f32[16] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  ROOT %concatenate.1 = f32[16]{0} concatenate(%p0, %p1), dimensions={0}
}

%wrapped_slice_computation (q0: f32[16]) -> f32[8] {
  %q0 = f32[16]{0} parameter(0)
  ROOT %slice.1 = f32[8]{0} slice(%q0), slice={[0:8]}
}

%wrapped_slice_computation.1 (q1: f32[16]) -> f32[8] {
  %q1 = f32[16]{0} parameter(0)
  ROOT %slice.2 = f32[8]{0} slice(%q1), slice={[8:16]}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (a: f32[2,4], b: bf16[8]) -> (f32[2,4], f32[2]) {
  %a = f32[2,4]{1,0} parameter(0)
  %b = bf16[8]{0} parameter(1)
  %a.flat = f32[8]{0} bitcast(%a)
  %b.up = f32[8]{0} convert(%b)
  %wrapped_concatenate = f32[16]{0} fusion(%a.flat, %b.up), kind=kLoop, calls=%wrapped_concatenate_computation
  %ars = ((f32[16]{0}), f32[16]{0}) all-reduce-start(%wrapped_concatenate), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %wrapped_slice = f32[8]{0} fusion(%ard), kind=kLoop, calls=%wrapped_slice_computation
  %wrapped_slice.1 = f32[8]{0} fusion(%ard), kind=kLoop, calls=%wrapped_slice_computation.1
  %whole = f32[2,4]{1,0} bitcast(%wrapped_slice)
  %pid = u32[] partition-id()
  %table = s32[8]{0} constant({0, 2, 4, 6, 0, 2, 4, 6})
  %entry = s32[1]{0} dynamic-slice(%table, %pid), dynamic_slice_sizes={1}
  %offset = s32[] bitcast(%entry)
  %mine = f32[2]{0} dynamic-slice(%wrapped_slice.1, %offset), dynamic_slice_sizes={2}
  ROOT %out = (f32[2,4]{1,0}, f32[2]{0}) tuple(%whole, %mine)
}
"""


def test_an_all_reduce_combined_by_concatenation_is_read_piece_by_piece():
    # XLA:GPU's combiner: the flat operands concatenated, one all-reduce, each piece sliced
    # back (the captured gpt-1.3b megatron module: the cross-entropy's reduce-scatter
    # over model hides in such a piece)
    found = analyze_collectives(CONCATENATED, MESH, range(8))
    assert [(c.collective.kind, c.collective.axes, c.collective.bytes) for c in found.raw] == [
        ("all-reduce", ("model",), 32),
        ("all-reduce", ("model",), 32),
    ]
    whole, mine = found.collectives
    assert (whole.collective.kind, whole.collective.bytes, whole.dtype) == (
        "all-reduce",
        32,
        "float32",
    )
    assert "part 0 of 2 of an all-reduce combined by concatenation" in whole.note
    # the second piece: each device keeps its rank's 1/4 (a reduce-scatter) of a bf16
    # value that XLA reduces in f32
    assert (mine.collective.kind, mine.collective.bytes, mine.dtype) == (
        "reduce-scatter",
        16,
        "bfloat16",
    )
    assert "normalised to reduce-scatter (offsets checked on all 8 devices)" in mine.note


def test_a_concatenation_piece_sliced_at_the_wrong_offsets_stays_an_all_reduce():
    text = CONCATENATED.replace("{0, 2, 4, 6, 0, 2, 4, 6}", "{6, 4, 2, 0, 6, 4, 2, 0}")
    found = analyze_collectives(text, MESH, range(8))
    assert [c.collective.kind for c in found.collectives] == ["all-reduce", "all-reduce"]
    assert "slice offsets are not the device's group rank" in found.collectives[1].note


def test_a_concatenation_read_whole_is_one_value():
    # the program's own concatenation (some use reads the whole reduced buffer): not the
    # combiner's, so one all-reduce of all of it
    text = CONCATENATED.replace(
        "ROOT %out = (f32[2,4]{1,0}, f32[2]{0}) tuple(%whole, %mine)",
        "ROOT %out = (f32[2,4]{1,0}, f32[2]{0}, f32[16]{0}) tuple(%whole, %mine, %ard)",
    ).replace("-> (f32[2,4], f32[2])", "-> (f32[2,4], f32[2], f32[16])")
    found = analyze_collectives(text, MESH, range(8))
    assert [(c.collective.kind, c.collective.bytes, c.note) for c in found.collectives] == [
        ("all-reduce", 64, "")
    ]
