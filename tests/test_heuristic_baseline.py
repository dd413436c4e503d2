"""The "shard the largest dimension" baseline (Alpa's intra-op ablation heuristic): every
input and every operator that chooses its layout splits the largest dim of its output over
the mesh, whatever the resharding costs; the ILP only prices what is left."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from autoshard.api import plan_workload
from autoshard.intra.baselines.tables import baseline_inputs
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.problem.ties import largest_dim_spec
from autoshard.ir.spec import Mesh, ShardingSpec

HIGHS = IntraOptions(solver="highs", time_limit_s=60.0)
MESH_8 = Mesh(("data",), (8,))
MESH_2x4 = Mesh(("data", "model"), (2, 4))


@pytest.mark.parametrize(
    "shape, mesh, dims",
    [
        ((8, 32, 192), MESH_8, ((), (), ("data",))),  # the largest dim, over the one axis
        ((8, 32, 192), MESH_2x4, ((), (), ("data", "model"))),  # over both axes together
        ((64, 64), MESH_8, (("data",), ())),  # a tie: the lower index
        ((6, 3), MESH_2x4, (("data",), ())),  # 8 does not divide 6, 4 neither: axis 'data'
        ((12, 5), MESH_2x4, (("model",), ())),  # 4 divides 12: the larger single axis
        ((5, 3), MESH_8, ((), ())),  # nothing divides: replicated
        ((), MESH_8, ()),  # a scalar
    ],
)
def test_largest_dim_spec(shape, mesh, dims):
    assert largest_dim_spec(shape, mesh) == ShardingSpec(dims)


@pytest.fixture(scope="module", params=[("gpt-tiny", "8"), ("gpt-tiny", "2x4"),
                                        ("mlp", "8"), ("mlp", "2x4")])  # fmt: skip
def heuristic(request):
    model, mesh = request.param
    return plan_workload(model, mesh, baseline="heuristic", options=HIGHS)


def test_heuristic_is_feasible_and_named(heuristic):
    plan = heuristic.plan
    assert plan.name == "heuristic"
    assert plan.solver.get("status") == "optimal"
    assert plan.objective > 0 and plan.predicted_peak_bytes > 0
    assert any(n.startswith("heuristic: ") for n in plan.notes)


def test_heuristic_shards_every_dot_output_on_its_largest_dim(heuristic):
    graph, plan = heuristic.graph, heuristic.plan
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    assert len(dots) >= 5  # forward, backward and weight-gradient dots
    for node in dots:
        shape = graph.tensors[node.outputs[0]].shape
        want = largest_dim_spec(shape, plan.mesh)
        assert not want.is_replicated, shape
        assert plan.tensor_specs[node.outputs[0]] == want, (node.index, shape)


def test_heuristic_pins_every_input_on_its_largest_dim(heuristic):
    graph, plan = heuristic.graph, heuristic.plan
    for tid, spec in zip(graph.inputs, plan.input_specs, strict=True):
        assert spec == largest_dim_spec(graph.tensors[tid].shape, plan.mesh)
    pinned = baseline_inputs(graph, plan.mesh, "heuristic")
    assert [pinned[i] for i in range(len(graph.inputs))] == list(plan.input_specs)


def test_heuristic_costs_more_than_the_ilp_on_gpt_tiny():
    """The ILP may pick the heuristic's plan, so it can only be as cheap or cheaper; on
    gpt-tiny the heuristic's resharding makes it strictly dearer."""
    auto = plan_workload("gpt-tiny", "8", options=HIGHS).plan
    heur = plan_workload("gpt-tiny", "8", baseline="heuristic", options=HIGHS).plan
    assert auto.objective < heur.objective


def test_heuristic_plan_compiles_with_the_predicted_memory_order():
    bound = plan_workload("mlp", "8", baseline="heuristic", options=HIGHS)
    report = bound.verify(jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()
    pred, comp = report.predicted_peak_bytes, report.compiled_peak_bytes
    assert abs(pred - comp) <= 0.10 * comp, (pred, comp)


def test_cli_plan_takes_baseline_heuristic():
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "plan", "--model", "mlp", "--mesh", "8",
         "--baseline", "heuristic", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "heuristic" in json.dumps(doc)
