"""The auto path's compute model is the Megatron grid model's (GEMM tables + HBM bytes)."""

from __future__ import annotations

import math

import pytest

from autoshard.api_pipeline import auto_stage_plan, trace_microbatch
from autoshard.hardware.clusters import load_cluster
from autoshard.hardware.gemm import GemmTable
from autoshard.hardware.mesh import uniform_mesh
from autoshard.inter.options import StageSearchOptions
from autoshard.inter.stage_cost import _NO_TIES, IntraStageCost
from autoshard.inter.stages import pipeline_objective
from autoshard.inter.subgraph import range_subgraph
from autoshard.inter.submesh import cluster_for, logical_mesh_costs
from autoshard.intra.ilp import solve
from autoshard.intra.memory.model import materialized_tensors
from autoshard.intra.problem.build import build_problem
from autoshard.intra.problem.options import IntraOptions
from autoshard.sim.megatron import GPTShape, MegatronConfig, simulate_megatron
from autoshard.sim.simulate import gpt_shape

V100 = load_cluster("alpa-v100", 8)


@pytest.fixture(scope="module")
def one_block():
    """gpt-350m's dimensions with one block, micro-batch 2: (graph of block_0, its layer).
    Unfused attention: these tests check the GEMM table on every dot of the block, the
    attention's batched dots included, and their sum against Megatron's grid model
    (the fused operator's own costs: tests/test_fused_attention.py)."""
    traced = trace_microbatch(
        "gpt-350m", 1, batch_size=2, num_layers=1, dtype="bfloat16", attention="unfused"
    )
    return range_subgraph(traced.graph, 1, 2).graph


def _mesh(logical):
    return logical_mesh_costs(cluster_for(V100, 1, 8))(logical)


def _local_gemm(graph, node, strategy, mesh):
    """(batch, M, N, K) of a dot's per-device shard, derived from the operand specs."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    local = []
    for tid, spec in zip(node.inputs, strategy.input_specs, strict=True):
        shape = graph.tensors[tid].shape
        local.append([d // mesh.mesh.size(a) for d, a in zip(shape, spec.dims, strict=True)])
    lhs, rhs = local
    batch = math.prod(lhs[d] for d in lb)
    m = math.prod(x for d, x in enumerate(lhs) if d not in (*lc, *lb))
    n = math.prod(x for d, x in enumerate(rhs) if d not in (*rc, *rb))
    k = math.prod(lhs[d] for d in lc)
    return batch, m, n, k


@pytest.mark.parametrize("logical", [(1, 1), (2, 4), (1, 8)])
def test_dot_costs_come_from_the_gemm_table_at_the_shard_shape(one_block, logical):
    mesh = _mesh(logical)
    table = GemmTable.load("v100")
    peak = V100.device.peak_flops_for("fp16")
    ip = build_problem(one_block, mesh, IntraOptions(cost=_NO_TIES))
    dots = [n for n in one_block.nodes if n.primitive == "dot_general"]
    assert len(dots) == 18  # forward: QKV, scores, values, projection, 2 MLP; 2 each backward
    checked = 0
    for node in dots:
        for s in ip.strategies[ip.node_of(node.index)]:
            batch, m, n, k = _local_gemm(one_block, node, s, mesh)
            assert 2 * batch * m * n * k == pytest.approx(node.flops / s.parallel_factor)
            want = table.gemm_time(m, n, k, "fp16", peak, batch)
            assert s.compute_cost == pytest.approx(want, rel=1e-12)
            assert s.compute_cost > node.flops / s.parallel_factor / peak  # never at peak
            checked += 1
    assert checked >= len(dots)


def test_memory_bound_ops_pay_bytes_over_hbm_bandwidth(one_block):
    mesh = _mesh((1, 1))
    ip = build_problem(one_block, mesh, IntraOptions(cost=_NO_TIES))
    kept = materialized_tensors(one_block)
    charged = 0
    for node in one_block.nodes:
        if node.primitive not in ("add", "mul", "exp", "convert_element_type"):
            continue
        nbytes = sum(
            one_block.tensors[t].nbytes for t in (*node.inputs, *node.outputs) if t in kept
        )
        (s,) = [s for s in ip.strategies[ip.node_of(node.index)] if s.parallel_factor == 1][:1]
        want = max(nbytes / V100.device.hbm_bandwidth, node.flops / mesh.peak_flops)
        assert s.compute_cost == pytest.approx(want, rel=1e-12)
        charged += nbytes > 0
    assert charged > 5  # the fusion model leaves some ops streaming buffers


def test_abstract_meshes_keep_flops_at_peak(one_block):
    """Alpa's test meshes (no GEMM table, no HBM figure): the classic FLOPs / (split x peak)."""
    mesh = uniform_mesh((2, 4), ("data", "model"), 1.0, (1.0, 0.1), peak_flops=1e12)
    ip = build_problem(one_block, mesh, IntraOptions(cost=_NO_TIES))
    for node in one_block.nodes:
        for s in ip.strategies[ip.node_of(node.index)]:
            assert s.compute_cost == pytest.approx(node.flops / s.parallel_factor / 1e12)


def test_block_gemm_time_matches_the_megatron_grid_model(one_block):
    """One transformer block's GEMMs (forward + backward) cost the same in the ILP as in the
    grid model, at the same micro-batch (2) on one V100. Not bit-equal (1.5% apart when
    written): some backward attention GEMMs of the traced program come out transposed
    (``[h/a, s]`` results where Megatron's model has ``[s, h/a]``), which the table, not
    symmetric in M and N, prices a little differently; hence 5%."""
    mesh = _mesh((1, 1))
    ip = build_problem(one_block, mesh, IntraOptions(cost=_NO_TIES))
    solution = solve(ip.problem, solver="highs", time_limit_s=30)
    traced = sum(
        ip.strategies[ip.node_of(n.index)][solution.strategy[ip.node_of(n.index)]].compute_cost
        for n in one_block.nodes
        if n.primitive == "dot_general"
    )
    cluster = load_cluster("alpa-v100", 1)
    cfg = MegatronConfig(1, 1, 1, 2, 2, "none")
    per_model = [
        simulate_megatron(GPTShape(1024, layers, 16, 51200, 1024), cfg, cluster)
        for layers in (1, 2)
    ]
    megatron = per_model[1].breakdown["compute_gemm"] - per_model[0].breakdown["compute_gemm"]
    assert traced == pytest.approx(megatron, rel=0.05)


def _grid_search_costs(model: str, batch: int, microbatches: int):
    """Per Megatron grid (tp, pp, dp) on 8 V100s: (simulate_megatron step, the search's
    objective of the same stages: Megatron's layer split on (1, 8/pp) sub-meshes viewed as
    (dp, tp)); and the auto plan's objective, all at ``microbatches`` micro-batches."""
    shape, _ = gpt_shape(model)
    traced = trace_microbatch(model, microbatches, batch_size=batch, dtype="bfloat16")
    cost = IntraStageCost(
        traced.graph,
        logical_mesh_costs(cluster_for(V100, 1, 8)),
        num_microbatches=microbatches,
        time_limit_s=20,
    )
    layers, per_microbatch = shape.layers, batch // microbatches
    rows = {}
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            dp = 8 // (tp * pp)
            if tp * pp * dp != 8 or per_microbatch % dp:
                continue
            cfg = MegatronConfig(tp, pp, dp, per_microbatch // dp, batch, "none")
            grid_step = simulate_megatron(shape, cfg, V100).step_time_s
            latencies = []
            for i in range(pp):  # layer 0 is the embedding, the last the head
                start = 0 if i == 0 else 1 + i * layers // pp
                end = layers + 2 if i == pp - 1 else 1 + (i + 1) * layers // pp
                latencies.append(cost(start, end, (1, 8 // pp), (dp, tp)).latency_s)
            rows[tp, pp, dp] = (grid_step, pipeline_objective(latencies, microbatches))
    auto = auto_stage_plan(
        traced, 1, 8, StageSearchOptions(microbatches, time_limit_s=20), cluster=V100
    )
    return rows, auto


@pytest.fixture(scope="module")
def gpt_2_6b_grid():
    return _grid_search_costs("gpt-2.6b", 128, 16)


@pytest.mark.slow
def test_auto_plan_beats_every_grid_point_under_the_search_cost(gpt_2_6b_grid):
    """Every Megatron grid point is in the search space (Megatron's stages, sub-meshes and
    (dp, tp) view); the stage DP's plan is at least as fast as each of them."""
    rows, auto = gpt_2_6b_grid
    assert len(rows) == 10
    best_grid = min(search for _, search in rows.values())
    assert auto.objective_s <= best_grid * (1 + 1e-9)


@pytest.mark.slow
def test_simulator_times_the_grid_on_the_traced_step_like_the_search(gpt_2_6b_grid):
    """The issue's self-consistency check, on one program and one cost model: the
    simulator's ``program="traced"`` grid (its own stage split, sub-meshes and pipeline
    formula, through the search's stage costs) ranks the 10 grids of gpt-2.6b on 8 V100s
    as the search's objective does, at the same figures, and the auto plan is at least as
    fast as the best of them."""
    from autoshard.sim.simulate import simulate

    rows, auto = gpt_2_6b_grid
    simulated = {}
    for tp, pp, dp in rows:
        report = simulate(
            "gpt-2.6b", "alpa-v100", 8, plan=f"megatron:{tp}x{pp}x{dp}", global_batch=128,
            microbatch_size=8 // dp, program="traced", ilp_time_limit_s=20,
        )  # fmt: skip
        assert report.plan["num_microbatches"] == 16
        simulated[tp, pp, dp] = report.step_time_s
    for grid, (_, search) in rows.items():
        assert simulated[grid] == pytest.approx(search, rel=1e-9)
    assert sorted(rows, key=simulated.get) == sorted(rows, key=lambda g: rows[g][1])
    assert auto.objective_s <= min(simulated.values()) * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="Megatron-LM's program is not the traced one (the test above holds on the traced "
    "step): the search prices the traced JAX program, the grid model Megatron's fused kernels: "
    "the traced step streams its attention softmax in fp32 through several materialised "
    "buffers (XLA fusion model) where Megatron runs one fused scale-mask-softmax, so a block's "
    "memory-bound time is higher than the grid model's, and a logical (dp, tp) mesh is costed "
    "by the ILP's best layout, not Megatron's (the (8,1,1) and (1,1,8) grids cost the same to the "
    "search). The GEMM time agrees (test_block_gemm_time_matches_the_megatron_grid_model).",
)
def test_megatron_lm_program_ranks_the_grid_like_the_search(gpt_2_6b_grid):
    rows, auto = gpt_2_6b_grid
    by_grid = sorted(rows, key=lambda g: rows[g][0])
    by_search = sorted(rows, key=lambda g: rows[g][1])
    assert by_grid == by_search
    assert auto.objective_s <= min(grid for grid, _ in rows.values())
