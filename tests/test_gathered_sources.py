"""What XLA:CPU keeps of a forward value whose backward readers read a copy of it: the
copy, not the value (``freed_gathered_sources``, autoshard/intra/memory/gathered_sources.py), and
of a fused attention's operands: ``q, k, v``, not the GEMM output they are sliced from
(``ATTENTION`` in ``UNFUSED_CONSUMERS``, autoshard/intra/memory/materialized.py); docs/truth.md."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import autoshard.intra.memory.materialized as materialized
from autoshard.intra.memory.model import (
    _gathered_tails,
    mesh_intervals,
    predicted_live_bytes,
    program_positions,
    tensor_buffers,
)
from autoshard.ir.primitives import ATTENTION, ATTENTION_FWD


@pytest.fixture(scope="module")
def fused_zero3_4x2():
    """gpt-tiny with the fused attention, the ZeRO-3 baseline on 4x2 (SGD), as
    bench_truth plans it, and its compiled report."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.verify.check import verify_plan

    traced = trace_workload("gpt-tiny", optimizer="sgd", attention="fused")
    g = traced.graph
    mesh = device_mesh_for((4, 2), ("data", "model"))
    options = baseline_options(IntraOptions(solver="highs", time_limit_s=60), mesh.mesh, "zero3")
    pinned = baseline_inputs(g, mesh.mesh, "zero3")
    plan = auto_shard_graph(g, mesh, options, pinned_inputs=pinned, name="zero3")
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8], live_peak="never")
    return g, mesh, plan, report


def _peak(g, mesh, plan) -> float:
    spec_of = dict(zip(g.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)
    return max(predicted_live_bytes(g, spec_of, mesh, plan.operand_specs))


def test_the_attention_reads_q_k_v_from_memory_not_the_gemm_output(fused_zero3_4x2):
    """q, k and v (the split of the q/k/v GEMM's output) are buffers of their own, kept
    to the backward; the GEMM's output is not kept past the forward pass."""
    g, mesh, _, _ = fused_zero3_4x2
    intervals = mesh_intervals(g, mesh)
    fwd = [n for n in g.nodes if n.primitive in ATTENTION_FWD]
    bwd_at = min(n.index for n in g.nodes if n.primitive in ATTENTION and n.phase == "backward")
    for node in fwd:
        for tid in node.inputs[:3]:  # q, k, v
            assert tid in intervals
            assert intervals[tid][1] >= bwd_at  # read again by the attention's backward
        split = g.nodes[g.tensors[node.inputs[0]].producer]
        assert split.primitive == "split"
        # the GEMM output the split is made from (through the bias add and a reshape)
        gemm = [
            t for t in intervals if g.tensors[t].producer is not None
            and g.nodes[g.tensors[t].producer].primitive == "dot_general"
            and g.nodes[g.tensors[t].producer].phase == "forward"
            and intervals[t][0] < split.index <= intervals[t][1] + 3
            and g.tensors[t].shape[-1] == 3 * g.tensors[node.inputs[0]].shape[-2]
            * g.tensors[node.inputs[0]].shape[-1]
        ]  # fmt: skip
        assert gemm and all(intervals[t][1] < bwd_at for t in gemm)


def test_the_fused_zero3_4x2_prediction_needs_both_rules(fused_zero3_4x2, monkeypatch):
    """With both rules the model is within 10% of XLA's allocation (+3.5% on 2026-11-27,
    jax 0.10.2: 1,039,748 B against 1,004,812 B); each rule moves it closer; with neither
    it is more than 10% over (+17.3%: the GELU output and LayerNorm outputs kept beside
    their gathered copies, the q/k/v GEMM's 48 KiB outputs kept for the attention's
    backward)."""
    g, mesh, plan, report = fused_zero3_4x2
    xla = report.compiled_peak_bytes
    both = plan.predicted_peak_bytes
    assert both == _peak(g, mesh, plan)
    assert abs(both - xla) <= 0.10 * xla, (both, xla)
    kept = dataclasses.replace(
        mesh, memory_layout=dataclasses.replace(mesh.memory_layout, freed_gathered_sources=False)
    )
    no_tails = _peak(g, kept, plan)
    monkeypatch.setattr(
        materialized, "UNFUSED_CONSUMERS", materialized.UNFUSED_CONSUMERS - ATTENTION
    )
    no_qkv = _peak(g, mesh, plan)
    neither = _peak(g, kept, plan)
    assert abs(both - xla) < abs(no_tails - xla) and abs(both - xla) < abs(no_qkv - xla)
    assert neither > 1.10 * xla, (neither, xla)


def test_a_gathered_source_lives_to_its_last_reader_in_its_own_layout(fused_zero3_4x2):
    """The plan gathers forward values for their weight gradients' dots only: their own
    buffers end at their forward readers; a backward dot that reads the value as it is
    keeps it to that dot."""
    from autoshard.intra.memory.gathered_sources import own_buffer_end

    g, mesh, plan, _ = fused_zero3_4x2
    spec_of = dict(zip(g.inputs, plan.input_specs))
    spec_of.update(plan.tensor_specs)
    pos = program_positions(g, mesh.memory_layout.late_updates)
    own = tensor_buffers(g, mesh)
    tails = _gathered_tails(g, mesh, own, pos)
    last = {tid: b for tid, _, b, _ in own}
    shortened = [
        t for t, tail in tails.items()
        if own_buffer_end(tail, spec_of[t], plan.operand_specs) < last[t]
    ]  # fmt: skip
    assert len(shortened) >= 5  # two GELU outputs, three LayerNorm outputs
    for t in shortened:
        tail = tails[t]
        assert own_buffer_end(tail, spec_of[t], plan.operand_specs) == tail.fixed < last[t]
        # read as it is by its last dot, the value is kept to it
        at, node, slot = tail.readers[-1]
        as_is = {node: {s: v for s, v in plan.operand_specs.get(node, {}).items() if s != slot}}
        assert own_buffer_end(tail, spec_of[t], as_is) == at == last[t]
    off = dataclasses.replace(
        mesh, memory_layout=dataclasses.replace(mesh.memory_layout, freed_gathered_sources=False)
    )
    assert _gathered_tails(g, off, own, pos) == {}


def test_the_ilp_memory_rows_count_the_freed_sources_as_the_prediction_does():
    """For random assignments of the fused gpt-tiny on 4x2 (XLA:CPU's layout) the ILP's
    own peak equals the prediction, the freed sources' buffers included, and some of
    those assignments free a source early (else the rows' tail groups go untested)."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.ilp import peak_memory, resolve_ties
    from autoshard.intra.memory.gathered_sources import own_buffer_end
    from autoshard.intra.problem.build import build_problem

    g = trace_workload("gpt-tiny", optimizer="sgd", attention="fused").graph
    mesh = device_mesh_for((4, 2), ("data", "model"))
    ip = build_problem(g, mesh, copy_buffers=True)
    pb = ip.problem
    pos = program_positions(g, mesh.memory_layout.late_updates)
    own = tensor_buffers(g, mesh)
    tails = _gathered_tails(g, mesh, own, pos)
    assert tails
    last = {tid: b for tid, _, b, _ in own}
    roots, maps = resolve_ties(pb)
    allowed: dict[int, np.ndarray] = {}
    for v, r in enumerate(roots):
        ok = allowed.setdefault(r, np.ones(pb.num_strategies[r], bool))
        m = np.asarray(maps[v])
        ok &= m >= 0
        ok[m >= 0] &= np.isfinite(np.asarray(pb.node_costs[v])[m[m >= 0]])
    rng = np.random.default_rng(0)
    rows, predicted, freed = [], [], 0
    for _ in range(60):
        pick = {r: int(rng.choice(np.flatnonzero(ok))) for r, ok in allowed.items()}
        s = tuple(int(maps[v][pick[r]]) for v, r in enumerate(roots))
        spec_of, operand_specs = _layouts(ip, s)
        freed += any(
            own_buffer_end(tail, spec_of[t], operand_specs) < last[t] for t, tail in tails.items()
        )
        rows.append(peak_memory(pb, s))
        predicted.append(max(predicted_live_bytes(g, spec_of, mesh, operand_specs)))
    assert freed >= 5
    assert rows == pytest.approx(predicted, rel=1e-12)


def _layouts(ip, s):
    """(tensor -> layout, node -> slot -> resharded layout) of the assignment ``s``."""
    g = ip.graph
    chosen = [ip.strategies[i][s[i]] for i in range(len(ip.strategies))]
    spec_of = {t: chosen[i].output_specs[0] for i, t in enumerate(g.inputs)}
    for node in g.nodes:
        spec_of.update(zip(node.outputs, chosen[ip.node_of(node.index)].output_specs))
    operand_specs: dict = {}
    for op in ip.operands:
        if op.slot >= 0 and op.dst >= ip.num_inputs:
            want = chosen[op.dst].input_specs[op.slot]
            if want is not None and want != spec_of.get(op.tensor):
                operand_specs.setdefault(op.dst - ip.num_inputs, {})[op.slot] = want
    return spec_of, operand_specs
