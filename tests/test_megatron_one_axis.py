"""The strict ``megatron`` on a one-axis mesh, where tensor and data parallelism share the
axis: what XLA compiles of the cross-entropy's target logit, and of the embedding's f32
lookup in a bf16 model (issue #14, the 1-D ``bench_truth`` rows)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.api import device_mesh_for, trace_workload
from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.spec import Mesh
from autoshard.verify.check import verify_plan
from autoshard.verify.collectives import parse_collectives

try:  # the suite's conftest normally does this before any backend starts
    jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
    pass


@pytest.mark.parametrize(
    "shape, axes, tp",
    [((8,), ("data",), ("data",)), ((2, 4), ("data", "model"), ("model",))],
)
def test_target_logit_all_reduced_then_split_by_the_loss_is_a_reduce_scatter(shape, axes, tp):
    # gpt-350m's width, one block, 128 tokens: the loss splits the batch over the axis
    # the vocabulary is split over (on 8: the one axis; on 2x4: `model`, after `data`);
    # the target logit [8, 128, 1] is all-reduced over it, squeezed, and each device keeps
    # its rows. XLA compiles the all-reduce and that slice as one reduce-scatter of the
    # all-reduce's bytes (the local buffer: the batch over `data` already split).
    # optax's cross-entropy (attention="unfused"): the fused program's custom-VJP loss
    # takes the target logit from the logits as its own op, with no such all-reduce.
    # Keeping the per-token loss split is the optimum only where its elementwise ops cost
    # something: on Alpa's relative mesh they are free, and replicating them after the
    # all-reduce saves the loss's own 4-byte all-reduce (8.01 units). With memory traffic
    # priced (HBM 100x a link's bandwidth; the split plan wins from 1x to 1,000x, not at
    # 10,000x) the replicated tail costs more than that all-reduce: all-reduce-then-slice
    # is the optimum.
    batch, seq = 8, 128
    traced = trace_workload(
        "gpt-350m",
        optimizer="adamw",
        num_layers=1,
        batch_size=batch,
        seq_len=seq,
        attention="unfused",
    )
    mesh = dataclasses.replace(device_mesh_for(shape, axes), hbm_bandwidth=100.0)
    options = baseline_options(IntraOptions(solver="highs"), mesh.mesh, "megatron")
    pinned = baseline_inputs(traced.graph, mesh.mesh, "megatron")
    plan = auto_shard_graph(traced.graph, mesh, options, pinned_inputs=pinned, name="megatron")
    scatters = [c for c in plan.predicted_collectives if c.kind == "reduce-scatter"]
    local = batch * seq * 4 // (8 // mesh.mesh.size(tp))
    assert [(c.axes, c.bytes) for c in scatters] == [(tp, local)]
    assert {c.kind for c in plan.predicted_collectives} == {"all-reduce", "reduce-scatter"}
    # priced as the all-reduce it is: all_reduce_only holds, no forbidden-kind warning
    assert plan.solver["forbidden_held"] == [] and not plan.notes
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    assert report.collectives_agree, report.comparison.format()


def _all_reduces(fn, dtype):
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    jmesh = jax.sharding.Mesh(devices, ("data", "model"))
    shard = lambda s: NamedSharding(jmesh, s)  # noqa: E731
    jitted = jax.jit(
        fn,
        in_shardings=(shard(P(None, "model")), shard(P("model", None))),
        out_shardings=shard(P()),
    )
    shapes = [jax.ShapeDtypeStruct((16, 32), dtype), jax.ShapeDtypeStruct((32, 8), dtype)]
    text = jitted.lower(*shapes).compile().as_text()
    found = parse_collectives(text, Mesh(("data", "model"), (2, 4)), [d.id for d in devices.flat])
    return [(c.collective.kind, c.collective.bytes, c.dtype) for c in found]


def test_bf16_dot_all_reduced_in_f32_is_counted_in_bf16():
    assert _all_reduces(jnp.matmul, jnp.bfloat16) == [("all-reduce", 16 * 8 * 2, "bfloat16")]


def test_f32_values_cast_to_bf16_after_their_all_reduce_keep_f32_bytes():
    # the program's own f32 values (an f32 dot; rows gathered from an f32 table, as the
    # embedding of a bf16 GPT): XLA all-reduces f32 and casts after, and so does the plan
    def dot(x, w):
        return (x @ w).astype(jnp.bfloat16)

    def lookup(x, table):
        rows = jnp.take(table, jnp.arange(16) % 32, axis=0)
        return rows.astype(jnp.bfloat16)

    assert _all_reduces(dot, jnp.float32) == [("all-reduce", 16 * 8 * 4, "float32")]
    assert _all_reduces(lookup, jnp.float32) == [("all-reduce", 16 * 8 * 4, "float32")]
