"""autoshard.verify's HLO readers: collectives and memory read back from what XLA compiled (8 fake CPU devices)."""

import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.ir.spec import Collective, Mesh
from autoshard.verify.collectives import analyze_collectives, parse_collectives
from autoshard.verify.compare import compare_collectives, summarize
from autoshard.verify.memory import (
    LIVE_RANGE_DUMP_OPTIONS,
    buffer_slices,
    dump_live_peak,
    live_range_peak,
    memory_stats,
    stated_live_peak_bytes,
)
from autoshard.verify.replica_groups import UNKNOWN_AXES, parse_replica_groups, replica_group_axes

try:  # the suite's conftest normally does this before any backend starts
    jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
    pass

M, K, N = 16, 32, 8  # x: [M, K] @ w: [K, N]


@pytest.fixture(scope="module")
def meshes():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    jmesh = jax.sharding.Mesh(devices, ("data", "model"))
    return jmesh, Mesh(("data", "model"), (2, 4)), [d.id for d in devices.flat]


def _compile(jmesh, fn, in_specs, out_specs, shapes, dtype=jnp.float32):
    shard = lambda s: NamedSharding(jmesh, s)  # noqa: E731
    in_shardings = tuple(map(shard, in_specs))
    out_shardings = jax.tree.map(shard, out_specs, is_leaf=lambda s: isinstance(s, P))
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    return jitted.lower(*(jax.ShapeDtypeStruct(s, dtype) for s in shapes)).compile()


def _kinds(found):
    return [(c.collective.kind, c.collective.axes, c.collective.bytes) for c in found]


def _matmul(jmesh, out_spec, dtype=jnp.float32, contract=("model",)):
    lhs, rhs = P(None, contract), P(contract, None)
    return _compile(jmesh, jnp.matmul, (lhs, rhs), out_spec, [(M, K), (K, N)], dtype)


# --------------------------------------------------------------------------- compiled programs


def test_contracting_dim_on_model_all_reduces_over_model(meshes):
    jmesh, mesh, ids = meshes
    found = parse_collectives(_matmul(jmesh, P()).as_text(), mesh, ids)
    assert _kinds(found) == [("all-reduce", ("model",), M * N * 4)]
    assert found[0].dtype == "float32" and not found[0].in_loop


def test_batch_sharded_on_data_all_gathers_over_data(meshes):
    jmesh, mesh, ids = meshes
    compiled = _compile(jmesh, lambda x: 2 * x, (P("data", None),), P(), [(M, N)])
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert _kinds(found) == [("all-gather", ("data",), M * N * 4)]  # bytes = gathered output


def test_cpu_all_reduce_plus_dynamic_slice_is_normalised_to_reduce_scatter(meshes):
    jmesh, mesh, ids = meshes
    text = _matmul(jmesh, P(None, "model")).as_text()
    assert "reduce-scatter(" not in text  # XLA:CPU's GSPMD lowering: all-reduce + slice
    raw = parse_collectives(text, mesh, ids, normalize=False)
    found = parse_collectives(text, mesh, ids)
    assert _kinds(raw) == [("all-reduce", ("model",), M * N * 4)]
    assert _kinds(found) == [("reduce-scatter", ("model",), M * N * 4)]  # bytes = input
    assert "reduce-scatter" in found[0].note and "offsets checked" in found[0].note


@pytest.mark.parametrize(("cols", "out_spec"), [(None, P(("data", "model"))), (16, None)])
def test_reduce_scatter_into_a_data_sharded_view_is_normalised(meshes, cols, out_spec):
    # a's rows are split over data, its contracting dim over model: the local product is a
    # [32(, 16)] view of the rows, partial over model; splitting the rows over
    # (data, model) keeps 8 of them at 8 * partition_id - table[partition_id]
    jmesh, mesh, ids = meshes
    rows, k = 64, 32
    b_shape, b_spec = ((k,), P("model")) if cols is None else ((k, cols), P("model", None))
    out = out_spec if cols is None else P(("data", "model"), None)
    compiled = _compile(jmesh, jnp.matmul, (P("data", "model"), b_spec), out, [(rows, k), b_shape])
    text = compiled.as_text()
    local = (rows // 2) * (cols or 1) * 4
    assert re.search(r"s32\[8\]\{0\} constant\(\{0, 0, 0, 0, 32, 32, 32, 32\}\)", text), (
        "XLA no longer emits the offset table this test is about"
    )
    raw = parse_collectives(text, mesh, ids, normalize=False)
    found = parse_collectives(text, mesh, ids)
    assert _kinds(raw) == [("all-reduce", ("model",), local)]
    assert _kinds(found) == [("reduce-scatter", ("model",), local)]
    assert "offsets checked on all 8 devices" in found[0].note


def test_slices_of_a_window_of_the_reduced_buffer_stay_an_all_reduce(meshes):
    # a's rows are not split over data, so XLA reduces all 64 rows over model and each
    # device keeps 8: a group of 4 uses only half of what it reduced
    jmesh, mesh, ids = meshes
    compiled = _compile(
        jmesh, jnp.matmul, (P(None, "model"), P("model")), P(("data", "model")), [(64, 32), (32,)]
    )
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert _kinds(found) == [("all-reduce", ("model",), 64 * 4)]
    assert "keeps 8 of 64 along dim 0, not 1/4" in found[0].note
    assert "bases [0, 32]" in found[0].note


def test_psum_scatter_under_shard_map_is_a_real_reduce_scatter(meshes):
    jmesh, mesh, ids = meshes
    body = partial(jax.lax.psum_scatter, axis_name="model", scatter_dimension=0, tiled=True)
    fn = jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=P(), out_specs=P("model")))
    text = fn.lower(jax.ShapeDtypeStruct((M, N), jnp.float32)).compile().as_text()
    found = parse_collectives(text, mesh, ids)
    assert _kinds(found) == [("reduce-scatter", ("model",), M * N * 4)]
    assert found[0].hlo_opcode == "reduce-scatter" and found[0].note == ""


def test_moving_the_sharded_dim_is_an_all_to_all(meshes):
    jmesh, mesh, ids = meshes
    compiled = _compile(jmesh, lambda x: 2 * x, (P("model", None),), P(None, "model"), [(M, M)])
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert _kinds(found) == [("all-to-all", ("model",), M * M * 4 // 4)]  # the local block


def test_contracting_dim_on_both_axes_all_reduces_over_both(meshes):
    jmesh, mesh, ids = meshes
    compiled = _matmul(jmesh, P(), contract=("data", "model"))
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert _kinds(found) == [("all-reduce", ("data", "model"), M * N * 4)]


def test_gather_over_both_axes_model_major_notes_the_group_order(meshes):
    jmesh, mesh, ids = meshes
    compiled = _compile(jmesh, lambda x: 2 * x, (P(("model", "data"), None),), P(), [(M, N)])
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert _kinds(found) == [("all-gather", ("data", "model"), M * N * 4)]
    assert "model-major" in found[0].note


def test_bf16_all_reduce_upcast_on_cpu_is_reported_in_bf16(meshes):
    jmesh, mesh, ids = meshes
    text = _matmul(jmesh, P(), jnp.bfloat16).as_text()
    raw = parse_collectives(text, mesh, ids, normalize=False)
    found = parse_collectives(text, mesh, ids)
    assert _kinds(raw) == [("all-reduce", ("model",), M * N * 4)] and raw[0].dtype == "float32"
    assert _kinds(found) == [("all-reduce", ("model",), M * N * 2)]
    assert found[0].dtype == "bfloat16" and "bf16 upcast" in found[0].note


@pytest.mark.parametrize(
    "fn, narrow",
    [
        (lambda x: x * 2, True),  # bf16 in, bf16 out: XLA:CPU moves the parts as f32
        (jnp.tanh, True),
        # the program's own f32 value: it really moves f32 bytes
        (lambda x: (x.astype(jnp.float32) * 2).astype(jnp.bfloat16), False),
    ],
)
def test_bf16_all_to_all_parts_converted_back_are_counted_in_bf16(meshes, fn, narrow):
    # The all-to-all returns a tuple of parts; each part is converted back to bf16
    # (after a concatenate, in one fusion). Normalising must follow every part.
    jmesh, mesh, ids = meshes
    text = _compile(jmesh, fn, (P("model", None),), P(None, "model"), [(M, M)], jnp.bfloat16)
    text = text.as_text()
    raw = parse_collectives(text, mesh, ids, normalize=False)
    found = parse_collectives(text, mesh, ids)
    assert _kinds(raw) == [("all-to-all", ("model",), M * M * 4 // 4)]
    assert raw[0].dtype == "float32"
    expect = M * M * (2 if narrow else 4) // 4
    assert _kinds(found) == [("all-to-all", ("model",), expect)]
    assert found[0].dtype == ("bfloat16" if narrow else "float32")


def test_bf16_reduce_scatter_gets_both_normalisations(meshes):
    jmesh, mesh, ids = meshes
    found = parse_collectives(_matmul(jmesh, P(None, "model"), jnp.bfloat16).as_text(), mesh, ids)
    assert _kinds(found) == [("reduce-scatter", ("model",), M * N * 2)]


def test_combined_tuple_all_reduce_counts_every_operand(meshes):
    jmesh, mesh, ids = meshes
    n2 = 4
    lhs, rhs = P(None, "model"), P("model", None)
    fn = lambda x, w1, w2: (x @ w1, x @ w2)  # noqa: E731
    compiled = _compile(jmesh, fn, (lhs, rhs, rhs), (P(), P()), [(M, K), (K, N), (K, n2)])
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert len({c.hlo_name for c in found}) == 1  # XLA's combiner made one instruction
    assert sorted(_kinds(found)) == sorted(
        [("all-reduce", ("model",), M * N * 4), ("all-reduce", ("model",), M * n2 * 4)]
    )
    assert summarize(found) == {("all-reduce", ("model",)): M * (N + n2) * 4}


def test_collective_in_while_body_is_counted_once_and_flagged(meshes):
    jmesh, mesh, ids = meshes
    trips = 3

    def fn(x, w):
        return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

    compiled = _compile(
        jmesh, fn, (P(None, "model"), P("model", None)), P(None, "model"), [(M, K), (K, K)]
    )
    found = parse_collectives(compiled.as_text(), mesh, ids)
    assert len(found) == 1 and found[0].in_loop
    assert found[0].collective.axes == ("model",) and f"runs {trips} times" in found[0].note
    # the slice offset reaches the body through the loop tuple; it is still traced and checked
    assert found[0].collective.kind == "reduce-scatter" and "offsets checked" in found[0].note


def test_collective_permute_is_reported_separately(meshes):
    jmesh, mesh, ids = meshes
    ring = [(i, (i + 1) % 4) for i in range(4)]
    body = partial(jax.lax.ppermute, axis_name="model", perm=ring)
    fn = jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=P("model"), out_specs=P("model")))
    text = fn.lower(jax.ShapeDtypeStruct((M, N), jnp.float32)).compile().as_text()
    found = analyze_collectives(text, mesh, ids)
    assert found.collectives == () and len(found.permutes) == 1
    permute = found.permutes[0]
    assert permute.axes == ("model",) and permute.bytes == M * N * 4 // 4
    assert len(permute.pairs) == 8


def test_logical_ids_follow_mesh_order_not_device_ids():
    order = [7, 3, 5, 1, 6, 2, 4, 0]
    devices = np.array(jax.devices()[:8])[order].reshape(2, 4)
    jmesh = jax.sharding.Mesh(devices, ("data", "model"))
    ids = [d.id for d in devices.flat]
    found = parse_collectives(_matmul(jmesh, P()).as_text(), Mesh(("data", "model"), (2, 4)), ids)
    assert _kinds(found) == [("all-reduce", ("model",), M * N * 4)]


def test_wrong_mesh_size_or_device_ids_raise(meshes):
    jmesh, _, ids = meshes
    text = _matmul(jmesh, P()).as_text()
    with pytest.raises(ValueError, match="runs on 8 devices"):
        parse_collectives(text, Mesh(("x",), (4,)), ids[:4])
    with pytest.raises(ValueError, match="distinct device ids"):
        parse_collectives(text, Mesh(("data", "model"), (2, 4)), [0] * 8)


def test_data_parallel_train_step_all_reduces_exactly_the_gradients(meshes):
    jmesh, mesh, ids = meshes
    params = {"w1": (N, 4 * N), "b1": (4 * N,), "w2": (4 * N, N)}
    batch = 8 * M

    def step(params, x):
        loss = lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)  # noqa: E731
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    rep, rows = NamedSharding(jmesh, P()), NamedSharding(jmesh, P(("data", "model")))
    jitted = jax.jit(step, in_shardings=(rep, rows), out_shardings=rep)
    abstract = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in params.items()}
    compiled = jitted.lower(abstract, jax.ShapeDtypeStruct((batch, N), jnp.float32)).compile()
    found = parse_collectives(compiled.as_text(), mesh, ids)
    predicted = [
        Collective("all-reduce", ("data", "model"), 4 * math.prod(s)) for s in params.values()
    ]
    comparison = compare_collectives(predicted, found)
    assert comparison.agree, comparison.format()
    assert summarize(found) == summarize(predicted)


# --------------------------------------------------------------------------- HLO text by hand

_HEADER = "HloModule m, num_partitions=8\n\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"


def _module(body: str, params: str = "%p = f32[16,8]{1,0} parameter(0)") -> str:
    lines = "\n".join("  " + line for line in [params, *body.strip().splitlines()])
    return _HEADER + f"ENTRY %main (p: f32[16,8]) -> f32[16,8] {{\n{lines}\n}}\n"


def test_async_start_done_pairs_are_counted_once():
    text = _module("""
%ars = f32[16,8]{1,0} all-reduce-start(%p), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
%ard = f32[16,8]{1,0} all-reduce-done(%ars)
%ags = (f32[16,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
ROOT %agd = f32[32,8]{1,0} all-gather-done(%ags)""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert _kinds(found) == [("all-reduce", ("model",), 512), ("all-gather", ("data",), 1024)]


def test_collective_inside_a_called_computation_is_counted_once():
    text = (
        _HEADER
        + """%inner (q: f32[16,8]) -> f32[16,8] {
  %q = f32[16,8]{1,0} parameter(0)
  ROOT %ar = f32[16,8]{1,0} all-reduce(%q), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
}

ENTRY %main (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %c = f32[16,8]{1,0} call(%p), to_apply=%inner
}
"""
    )
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert _kinds(found) == [("all-reduce", ("data", "model"), 512)]


@pytest.mark.parametrize(
    ("table", "normalised"),
    [  # slices of 2 columns: device i must start at 2 * (its rank in {0..3} or {4..7})
        ("0,2,4,6,0,2,4,6", True),
        ("0,1,2,3,0,1,2,3", False),  # the rank, not the rank's block: the slices overlap
        ("0,0,2,2,4,4,6,6", False),
    ],
)
def test_reduce_scatter_needs_offsets_that_are_the_group_rank(table, normalised):
    text = _module(f"""
%pid = u32[] partition-id()
%table = u32[8]{{0}} constant({{{table}}})
%off = u32[1]{{0}} dynamic-slice(%table, %pid), dynamic_slice_sizes={{1}}
%o = s32[] bitcast(%off)
%z = s32[] constant(0)
%ar = f32[16,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
ROOT %ds = f32[16,2]{{1,0}} dynamic-slice(%ar, %z, %o), dynamic_slice_sizes={{16,2}}""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.kind == ("reduce-scatter" if normalised else "all-reduce")
    assert found[0].collective.bytes == 512


_FUSED_SLICE = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_computation.172 (param_1.415: f32[32], param_2.373: u32[], param_3.340: s32[8]) -> f32[8] {
  %param_1.415 = f32[32]{0} parameter(0)
  %param_2.373 = u32[] parameter(1)
  %convert.42 = s32[] convert(%param_2.373)
  %constant.1378 = s32[] constant(8)
  %multiply.260 = s32[] multiply(%convert.42, %constant.1378)
  %param_3.340 = s32[8]{0} parameter(2)
  %dynamic-slice.594 = s32[1]{0} dynamic-slice(%param_3.340, %param_2.373), dynamic_slice_sizes={1}
  %bitcast.401 = s32[] bitcast(%dynamic-slice.594)
  %subtract.71 = s32[] subtract(%multiply.260, %bitcast.401)
  ROOT %dynamic-slice.593 = f32[8]{0} dynamic-slice(%param_1.415, %subtract.71), dynamic_slice_sizes={8}
}

ENTRY %main (p: f32[32]) -> f32[8] {
  %p = f32[32]{0} parameter(0)
  %partition-id = u32[] partition-id()
  %table = s32[8]{0} constant({TABLE})
  %ar = f32[32]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %fusion = f32[8]{0} fusion(%ar, %partition-id, %table), kind=kLoop, calls=%fused_computation.172
}
"""


@pytest.mark.parametrize(
    ("table", "normalised"),
    [
        ("0, 0, 0, 0, 32, 32, 32, 32", True),  # 8 * pid - table = 8 * (rank in the model group)
        ("0, 0, 0, 0, 0, 0, 0, 0", False),  # data 1 would start past the buffer (clamped to 24)
        ("0, 8, 16, 24, 32, 40, 48, 56", False),  # everyone keeps block 0
    ],
)
def test_offset_computed_from_the_partition_id_inside_a_fusion(table, normalised):
    text = _FUSED_SLICE.replace("TABLE", table)
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.axes == ("model",) and found[0].collective.bytes == 32 * 4
    assert found[0].collective.kind == ("reduce-scatter" if normalised else "all-reduce")
    assert ("offsets checked" in found[0].note) == normalised


# Offset expressions that each give 2 * (rank of the partition in {0..3} or {4..7}).
_RANK_TIMES_2 = {
    "remainder": """
%four = u32[] constant(4)
%rem = u32[] remainder(%pid, %four)
%two = u32[] constant(2)
%off = u32[] multiply(%rem, %two)""",
    "select-compare": """
%four = u32[] constant(4)
%ge = pred[] compare(%pid, %four), direction=GE
%low = u32[] subtract(%pid, %four)
%r = u32[] select(%ge, %low, %pid)
%off = u32[] add(%r, %r)""",
    "divide-min-max": """
%four = s32[] constant(4)
%two = s32[] constant(2)
%zero = s32[] constant(0)
%spid = s32[] convert(%pid)
%q = s32[] divide(%spid, %four)
%base = s32[] multiply(%q, %four)
%r = s32[] subtract(%spid, %base)
%lo = s32[] maximum(%r, %zero)
%seven = s32[] constant(7)
%hi = s32[] minimum(%lo, %seven)
%off = s32[] multiply(%hi, %two)""",
    "broadcast-slice-reshape": """
%bpid = u32[3]{0} broadcast(%pid), dimensions={}
%one = u32[1]{0} slice(%bpid), slice={[1:2]}
%s = u32[] reshape(%one)
%iota = u32[8]{0} iota(), iota_dimension=0
%four = u32[8]{0} constant({4, 4, 4, 4, 4, 4, 4, 4})
%ranks = u32[8]{0} remainder(%iota, %four)
%lo = u32[] constant(0)
%hi = u32[] constant(3)
%pick = u32[1]{0} dynamic-slice(%ranks, %s), dynamic_slice_sizes={1}
%r = u32[1]{0} clamp(%lo, %pick, %hi)
%rr = u32[] bitcast(%r)
%off = u32[] add(%rr, %rr)""",
}


@pytest.mark.parametrize("form", sorted(_RANK_TIMES_2))
def test_offset_expressions_are_evaluated_per_partition(form):
    text = _module(
        "%pid = u32[] partition-id()\n"
        + _RANK_TIMES_2[form].strip()
        + """
%z = u32[] constant(0)
%ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
ROOT %ds = f32[16,2]{1,0} dynamic-slice(%ar, %z, %off), dynamic_slice_sizes={16,2}"""
    )
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.kind == "reduce-scatter", found[0].note
    assert "offsets checked on all 8 devices" in found[0].note


@pytest.mark.parametrize(
    ("table", "kind"), [("0,2,4,6,0,2,4,6", "reduce-scatter"), ("0,0,2,2,4,4,6,6", "all-reduce")]
)
def test_an_op_the_evaluator_does_not_know_falls_back_to_the_rank_table(table, kind):
    text = _module(f"""
%pid = u32[] partition-id()
%table = u32[8]{{0}} constant({{{table}}})
%t = u32[1]{{0}} dynamic-slice(%table, %pid), dynamic_slice_sizes={{1}}
%one = u32[1]{{0}} constant({{1}})
%half = u32[1]{{0}} shift-right-logical(%t, %one)
%two = u32[1]{{0}} shift-left(%half, %one)
%off = u32[] bitcast(%two)
%z = u32[] constant(0)
%ar = f32[16,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
ROOT %ds = f32[16,2]{{1,0}} dynamic-slice(%ar, %z, %off), dynamic_slice_sizes={{16,2}}""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.kind == kind
    assert "offset evaluation stopped at %two (shift-left)" in found[0].note


_LOOP = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (state: (s32[], f32[16,8])) -> (s32[], f32[16,8]) {
  %state = (s32[], f32[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[16,8]{1,0} get-tuple-element(%state), index=1
  %ar = f32[16,8]{1,0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %z = s32[] constant(0)
  %ds = f32[16,2]{1,0} dynamic-slice(%ar, %z, %i), dynamic_slice_sizes={16,2}
  %tanh = f32[16,2]{1,0} tanh(%ds)
  %pad = f32[] constant(0)
  %wide = f32[16,8]{1,0} pad(%tanh, %pad), padding=0_0x0_6
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  ROOT %out = (s32[], f32[16,8]{1,0}) tuple(CARRIED, %wide)
}

%cond (state.1: (s32[], f32[16,8])) -> pred[] {
  %state.1 = (s32[], f32[16,8]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (p: f32[16,8]) -> (s32[], f32[16,8]) {
  %p = f32[16,8]{1,0} parameter(0)
  %pid = u32[] partition-id()
  %four = u32[] constant(4)
  %rank = u32[] remainder(%pid, %four)
  %r = s32[] convert(%rank)
  %i0 = s32[] add(%r, %r)
  %init = (s32[], f32[16,8]{1,0}) tuple(%i0, %p)
  ROOT %loop = (s32[], f32[16,8]{1,0}) while(%init), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("carried", ["%i", "%next"])
def test_a_loop_carried_offset_is_evaluated_only_when_the_loop_leaves_it_alone(carried):
    text = _LOOP.replace("CARRIED", carried)  # %i: passed on unchanged; %next: i + 2
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].in_loop
    if carried == "%i":
        assert "offsets checked on all 8 devices" in found[0].note
    else:
        assert "offset evaluation stopped at %state" in found[0].note
        assert "changes in loop %loop" in found[0].note


_SECOND_USES = {  # the all-reduce's second use: a block of other rows, or the same columns
    "rows": "f32[4,8]{1,0} dynamic-slice(%ar, %r, %z), dynamic_slice_sizes={4,8}",
    "columns": "f32[16,2]{1,0} dynamic-slice(%ar, %z, %c), dynamic_slice_sizes={16,2}",
}


@pytest.mark.parametrize("second", ["rows", "columns"])
def test_uses_that_keep_different_blocks_leave_an_all_reduce(second):
    # moe-1.3b megatron 2x4 on XLA:GPU and XLA:CPU: an expert output reduced over model is
    # read split on one dim by the forward and on another by the backward; each use keeps
    # 1/4, not the same 1/4, so the whole reduced buffer is read. Two uses of one block
    # are a reduce-scatter.
    use = _SECOND_USES[second]
    text = _module(f"""
%pid = u32[] partition-id()
%cols = u32[8]{{0}} constant({{0,2,4,6,0,2,4,6}})
%coff = u32[1]{{0}} dynamic-slice(%cols, %pid), dynamic_slice_sizes={{1}}
%c = s32[] bitcast(%coff)
%rows = u32[8]{{0}} constant({{0,4,8,12,0,4,8,12}})
%roff = u32[1]{{0}} dynamic-slice(%rows, %pid), dynamic_slice_sizes={{1}}
%r = s32[] bitcast(%roff)
%z = s32[] constant(0)
%ar = f32[16,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
%first = f32[16,2]{{1,0}} dynamic-slice(%ar, %z, %c), dynamic_slice_sizes={{16,2}}
%second = {use}
ROOT %t = (f32[16,2]{{1,0}}, {use.split()[0]}) tuple(%first, %second)""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    (ar,) = [f for f in found if f.hlo_name == "ar"]
    if second == "rows":
        assert ar.collective == Collective("all-reduce", ("model",), 512)
        assert "its uses keep 1/n of different dims (0, 1)" in ar.note
    else:
        assert ar.collective == Collective("reduce-scatter", ("model",), 512)
        assert "offsets checked on all 8 devices" in ar.note


def test_slice_that_is_not_one_nth_of_the_group_stays_an_all_reduce():
    text = _module("""
%z = s32[] constant(0)
%ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
ROOT %ds = f32[16,4]{1,0} dynamic-slice(%ar, %z, %z), dynamic_slice_sizes={16,4}""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.kind == "all-reduce"


def test_slice_at_a_device_independent_offset_stays_an_all_reduce():
    text = _module("""
%z = s32[] constant(0)
%ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
ROOT %ds = f32[16,2]{1,0} dynamic-slice(%ar, %z, %z), dynamic_slice_sizes={16,2}""")
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.kind == "all-reduce" and "do not depend" in found[0].note


def test_groups_matching_no_mesh_axes_are_marked_unknown_not_guessed():
    text = _module(
        "ROOT %ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,5},{1,4},{2,7},{3,6}}, use_global_device_ids=true, to_apply=%add"
    )
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.axes == UNKNOWN_AXES and "match no set of mesh axes" in found[0].note


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model:(2)2",)),  # pairs of model, its minor part
        ("{{0,2},{1,3},{4,6},{5,7}}", ("model:(1)2",)),  # its major part
        ("{{0,2,4,6},{1,3,5,7}}", ("data", "model:(1)2")),
    ],
)
def test_groups_over_part_of_an_axis_are_named_as_sub_axes(groups, axes):
    text = _module(
        f"ROOT %ar = f32[16,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add"
    )
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert found[0].collective.axes == axes


@pytest.mark.parametrize(
    ("header", "attrs", "axes"),
    [  # XLA's group modes: which id space the replica groups are written in
        ("replica_count=8", "replica_groups={{0,1,2,3},{4,5,6,7}}", ("model",)),
        ("replica_count=8", "replica_groups={}", ("data", "model")),
        ("num_partitions=8", "channel_id=1, replica_groups={{0}}", ("data", "model")),
        (
            "num_partitions=8",
            "channel_id=1, replica_groups={}, use_global_device_ids=true",
            ("data", "model"),
        ),
        ("replica_count=2, num_partitions=4", "channel_id=1, replica_groups={{0},{1}}", ("model",)),
        ("replica_count=2, num_partitions=4", "replica_groups={{0,1}}", ("data",)),
    ],
)
def test_group_modes_map_to_the_right_devices(header, attrs, axes):
    text = _module(f"ROOT %ar = f32[16,8]{{1,0}} all-reduce(%p), {attrs}, to_apply=%add")
    text = text.replace("num_partitions=8", header)
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), range(8))
    assert _kinds(found) == [("all-reduce", axes, 512)]


def test_all_to_all_with_a_channel_uses_partition_ids():
    text = _module(
        "ROOT %a2a = f32[16,8]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,2},{1,3}}, dimensions={0}"
    ).replace("num_partitions=8", "replica_count=2, num_partitions=4")
    found = parse_collectives(text, Mesh(("r", "p1", "p2"), (2, 2, 2)), range(8))
    assert _kinds(found) == [("all-to-all", ("p1",), 512)]


# --------------------------------------------------------------------------- replica groups


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("{}", ((0, 1, 2, 3),)),
        ("[2,2]<=[4]", ((0, 1), (2, 3))),
        ("[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
        ("[1,4]<=[4]", ((0, 1, 2, 3),)),
        ("mesh['a'=2,'b'=2] {'a'}", ((0, 2), (1, 3))),
        ("mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}", ((0, 2), (1, 3))),
        ("mesh['x'=4] {'x':(1)2}", ((0, 2), (1, 3))),  # major half of x
        ("mesh['x'=4] {'x':(2)2}", ((0, 1), (2, 3))),  # minor half of x
    ],
)
def test_replica_group_forms(text, groups):
    assert parse_replica_groups(text, 4) == groups


def test_transposed_iota_groups_match_a_numpy_transpose():
    parsed = parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8)
    expected = np.arange(8).reshape(2, 4).T.reshape(4, 2)
    assert parsed == tuple(map(tuple, expected.tolist()))
    assert replica_group_axes(parsed, Mesh(("data", "model"), (2, 4)), range(8)) == ("data",)


def test_unreadable_replica_groups_raise():
    with pytest.raises(ValueError, match="unrecognised replica_groups"):
        parse_replica_groups("<0,1>", 2)


@pytest.mark.parametrize(
    ("shape", "text", "axes"),
    [
        ((1, 8), "[1,8]<=[8]", ("y",)),
        ((1, 8), "[8,1]<=[8]", ()),
        ((8,), "{}", ("x",)),
        ((8,), "[4,2]<=[8]", ("x:(4)2",)),  # pairs of x: its minor part
        ((4, 2), "[4,2]<=[8]", ("y",)),
        ((4, 2), "[2,4]<=[4,2]T(1,0)", ("x",)),
        ((4, 2), "{{0,1,2,3,4,5,6,7}}", ("x", "y")),
        ((2, 4), "{{0,1},{2,3},{4,5},{6,7}}", ("y:(2)2",)),
        ((2, 4), "{{0,5},{1,4},{2,7},{3,6}}", None),
    ],
)
def test_replica_group_axes_on_several_meshes(shape, text, axes):
    mesh = Mesh(("x", "y")[: len(shape)], shape)
    groups = parse_replica_groups(text, 8)
    assert replica_group_axes(groups, mesh, range(8)) == axes


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
def test_iota_groups_over_any_axis_subset_map_back_to_that_subset(sizes, data):
    names = ("a", "b", "c")[: len(sizes)]
    mesh = Mesh(names, tuple(sizes))
    subset = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True))
    grouped = sorted(subset)
    rest = [a for a in range(len(sizes)) if a not in grouped]
    group_size = math.prod(sizes[a] for a in grouped)
    perm = ",".join(map(str, rest + grouped))
    text = (
        f"[{mesh.num_devices // group_size},{group_size}]<=[{','.join(map(str, sizes))}]T({perm})"
    )
    device_ids = data.draw(st.permutations(range(mesh.num_devices)))
    groups = parse_replica_groups(text, mesh.num_devices)
    axes = replica_group_axes(groups, mesh, device_ids)
    assert axes == tuple(names[a] for a in grouped if sizes[a] > 1)


# --------------------------------------------------------------------------- memory, comparison


def test_memory_stats_are_consistent(meshes):
    jmesh, *_ = meshes
    stats = memory_stats(_matmul(jmesh, P()))
    per_device_args = (M * K + K * N) * 4 // 4  # both operands split 4 ways over model
    assert stats.argument_bytes == per_device_args and stats.output_bytes == M * N * 4
    assert stats.peak_bytes >= stats.argument_bytes and stats.temp_bytes >= 0


def test_memory_stats_fall_back_to_the_sum_without_an_xla_peak():
    class Analysis:
        argument_size_in_bytes, output_size_in_bytes = 100, 40
        temp_size_in_bytes, alias_size_in_bytes, generated_code_size_in_bytes = 30, 20, 0

    class Compiled:
        def memory_analysis(self):
            return Analysis()

    stats = memory_stats(Compiled())
    assert stats.peak_bytes == 100 + 40 + 30 - 20 and not stats.peak_from_xla


def _live_range_dump(fn, shapes, folder):
    from autoshard.verify.check import _past_the_persistent_cache

    options = {"xla_dump_to": str(folder), **LIVE_RANGE_DUMP_OPTIONS}
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    # under a persistent cache (JAX_COMPILATION_CACHE_DIR) a hit would dump nothing
    with _past_the_persistent_cache(options, str(folder)):
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
    (live_range,) = folder.glob("*after_optimizations-live-range.txt")
    (assignment,) = folder.glob("*after_optimizations-buffer-assignment.txt")
    return compiled, live_range.read_text(), assignment.read_text()


def _allocated(compiled) -> int:
    m = memory_stats(compiled)
    return m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes


def test_live_peak_of_an_elementwise_op_is_its_input_and_output(tmp_path):
    """XLA's live peak, read from its own dumps: an elementwise op holds its input and its
    output at once, nothing else."""
    compiled, live_range, assignment = _live_range_dump(jnp.sin, [(512, 256)], tmp_path)
    peak = live_range_peak(live_range, assignment)
    assert peak.bytes == 2 * 512 * 256 * 4 == _allocated(compiled)
    assert dump_live_peak(str(tmp_path)) == peak
    assert sorted(b for _, b in peak.values) == [512 * 256 * 4] * 2


def test_the_live_peak_holds_an_instructions_operands_and_result_together(tmp_path):
    """At ``tanh(x @ w) @ w.T`` XLA's schedule holds x, w, the first dot's result and the
    tanh at the tanh (operand and result), or x, w, the tanh and the output at the last
    dot: either way at least x, w and two [256, 512] buffers, and never more than XLA
    allocated."""

    def fn(x, w):
        return jnp.tanh(x @ w) @ w.T

    compiled, live_range, assignment = _live_range_dump(fn, [(256, 512), (512, 512)], tmp_path)
    peak = live_range_peak(live_range, assignment)
    act, weight = 256 * 512 * 4, 512 * 512 * 4
    assert 3 * act + weight <= peak.bytes <= _allocated(compiled)
    assert peak.instruction and sum(b for _, b in peak.values) == peak.bytes


def test_values_sharing_a_buffer_count_once(tmp_path):
    """A scatter-add into zeros updates them in place: XLA's dump lists both values, live
    together at the scatter, in one buffer slice.  The live peak counts the slice once
    (``shared_once=False`` counts both, as XLA's printed figure can)."""

    def fn(updates, idx):
        return jnp.zeros((256, 1024), jnp.float32).at[idx.astype(jnp.int32)].add(updates)

    compiled, live_range, assignment = _live_range_dump(fn, [(16, 1024), (16,)], tmp_path)
    slices = buffer_slices(assignment)
    shared = [n for n, pieces in slices.items() if [p[2] for p in pieces] == [256 * 1024 * 4]]
    assert len({tuple(slices[n]) for n in shared}) < len(shared)  # the premise: one slice
    once = live_range_peak(live_range, assignment)
    each = live_range_peak(live_range, assignment, shared_once=False)
    assert once.bytes <= _allocated(compiled) < each.bytes
    assert each.bytes - once.bytes >= 256 * 1024 * 4


def test_the_printed_peak_is_read_but_is_not_the_live_peak(tmp_path):
    """The live-range dump prints a peak block (and a breakdown line with the same total);
    both are read, alike.  It is the set of values at the moment XLA's running sum picks,
    which follows the true peak: never above it where no values share a buffer."""

    def fn(x, w):
        return jnp.sum(jnp.exp(jnp.tanh(x @ w)) @ w.T)

    compiled, live_range, assignment = _live_range_dump(
        jax.grad(fn, argnums=1), [(256, 512), (512, 512)], tmp_path
    )
    stated = stated_live_peak_bytes(live_range)
    peak = live_range_peak(live_range, assignment, shared_once=False)
    assert stated is not None and stated <= peak.bytes
    block_only = re.sub(r"Stack trace breakdown for peak usage: [\d ]+ bytes", "", live_range)
    assert block_only != live_range and stated_live_peak_bytes(block_only) == stated
    peak_block = r" *Live ranges at \d+ \(peak\):\n( +.*\(cumulative: \d+ bytes\)\n)+"
    breakdown_only = re.sub(peak_block, "", live_range)
    assert "(peak)" not in breakdown_only and "Stack trace" in breakdown_only
    assert stated_live_peak_bytes(breakdown_only) == stated
    grouped = f"{stated + 1:,}".replace(",", " ")
    mismatched = re.sub(r"peak usage: [\d ]+ bytes", f"peak usage: {grouped} bytes", live_range)
    assert stated_live_peak_bytes(mismatched) is None


def test_unreadable_dumps_are_an_unknown_peak(tmp_path):
    assert dump_live_peak(str(tmp_path)) is None
    compiled, live_range, assignment = _live_range_dump(jnp.sin, [(64, 64)], tmp_path)
    assert live_range_peak("HloLiveRange (max 0):\n", assignment) is None
    assert live_range_peak(live_range, "BufferAssignment:\n") is None
    first = re.search(r"^allocation \d+: .*\n( value: .*\n)", assignment, re.M)
    missing = assignment.replace(first.group(1), "")  # a live value without a slice
    assert live_range_peak(live_range, missing) is None


def test_compare_agrees_on_a_matching_prediction_and_flags_differences(meshes):
    jmesh, mesh, ids = meshes
    found = parse_collectives(_matmul(jmesh, P(None, "model")).as_text(), mesh, ids)
    good = compare_collectives([Collective("reduce-scatter", ("model",), M * N * 4)], found)
    assert good.agree and good.rows[0].compiled_count == 1
    off = compare_collectives([Collective("reduce-scatter", ("model",), M * N * 4 * 2)], found)
    assert not off.agree
    wrong_kind = compare_collectives([Collective("all-reduce", ("model",), M * N * 4)], found)
    assert [r.agree for r in wrong_kind.rows] == [False, False]
    assert "DISAGREE" in wrong_kind.format() and "reduce-scatter" in wrong_kind.format()


def test_compare_treats_axes_as_sets_and_respects_rel_tol():
    pred = [Collective("all-reduce", ("model", "data"), 1000)]
    assert compare_collectives(pred, [Collective("all-reduce", ("data", "model"), 1015)]).agree
    assert not compare_collectives(pred, [Collective("all-reduce", ("data", "model"), 1030)]).agree
    with pytest.raises(ValueError, match="rel_tol"):
        compare_collectives(pred, pred, rel_tol=-1)
