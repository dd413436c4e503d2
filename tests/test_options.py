"""IntraOptions: one frozen object for an intra-op planning run; every field honoured."""

import json
import math
import subprocess
import sys

import pytest
from conftest import cli_in_process, shared_plan

from autoshard.api import trace_workload
from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem import build, exact_values
from autoshard.intra.problem.build import auto_shard_graph, solve_time_limit
from autoshard.intra.problem.options import PER_DEMAND_MAX_NODES, SAFETY_NET_FACTOR, IntraOptions

HIGHS = IntraOptions(solver="highs")


@pytest.fixture(scope="module")
def tiny():
    return trace_workload("gpt-tiny", optimizer="adamw")


# an MLP whose free 2x4 plan neither puts every batch on "model" nor splits each dim over
# one axis at most: the options bind on it as on gpt-tiny, its three plans in about a second
# (gpt-tiny's forced plan is the exact program's slow LP: heavy, CI's heavy step)
SMALL_MLP = "mlp --batch 32 --hidden 64 --layers 2"


@pytest.fixture(scope="module")
def small_mlp():
    return trace_workload("mlp", optimizer="adamw", batch_size=32, hidden=64, num_layers=2)


MODELS = pytest.mark.parametrize(
    "model", ["small_mlp", pytest.param("tiny", marks=pytest.mark.heavy)]
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(solver="gurobi"), "unknown solver"),
        (dict(time_limit_s=-5), "time_limit_s=-5"),
        (dict(time_limit_s=0), "time_limit_s=0"),
        (dict(time_limit_s=math.nan), "time_limit_s=nan"),
        (dict(mip_gap=1.5), "relative gap"),
        (dict(memory_budget_bytes=0), "memory_budget_bytes=0"),
        (dict(seed=-1), "seed=-1"),
        (dict(max_nodes=0), "max_nodes=0"),
        (dict(max_nodes=True), "max_nodes=True"),
        (dict(max_nodes=2.5), "max_nodes=2.5"),
        (dict(force_batch_dim_to_mesh_axis=""), "mesh axis name"),
    ],
)
def test_bad_options_are_refused_with_what_would_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IntraOptions(**kwargs)


def test_options_are_frozen_and_replace_validates():
    opts = IntraOptions()
    with pytest.raises(AttributeError):
        opts.solver = "highs"
    assert opts.replace(solver="highs").solver == "highs"
    with pytest.raises(ValueError, match="time_limit_s"):
        opts.replace(time_limit_s=-1)


def test_the_time_limit_is_a_safety_net_where_the_node_budget_ends_the_solve():
    """Without a memory budget the per-demand solve stops at its node budget, and the
    user's time limit, times SAFETY_NET_FACTOR, only catches a solve that runs away: the
    plan then does not depend on the load. Under a budget (its root node can take
    minutes) or with no node budget, the limit is the user's."""
    opts = IntraOptions(time_limit_s=7.0)
    assert opts.max_nodes == PER_DEMAND_MAX_NODES
    assert solve_time_limit(opts) == SAFETY_NET_FACTOR * 7.0 > 7.0
    assert solve_time_limit(opts.replace(memory_budget_bytes=1e9)) == 7.0
    assert solve_time_limit(opts.replace(max_nodes=None)) == 7.0
    assert solve_time_limit(opts.replace(time_limit_s=None)) is None


def test_the_per_demand_solve_gets_the_node_budget_and_the_net(monkeypatch, small_mlp):
    """What the planner hands the per-demand solve: the node budget and the safety net,
    and a plan whose solver record says no clock decided it."""
    seen = []

    def spy(real):
        def solve(problem, **kwargs):
            seen.append(kwargs)
            return real(problem, **kwargs)

        return solve

    monkeypatch.setattr(build, "solve", spy(build.solve))
    monkeypatch.setattr(exact_values, "solve", spy(exact_values.solve))
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    plan = auto_shard_graph(small_mlp.graph, mesh, HIGHS.replace(time_limit_s=9.0, max_nodes=50))
    first = seen[0]
    assert first["max_nodes"] == 50 and first["time_limit_s"] == SAFETY_NET_FACTOR * 9.0
    assert plan.solver["load_dependent"] is False


def _data_specs(traced, plan):
    g = traced.graph
    return [s for t, s in zip(g.inputs, plan.input_specs) if g.tensors[t].kind == "data"]


@MODELS
def test_force_batch_dim_puts_every_batch_on_the_axis(request, model):
    traced = request.getfixturevalue(model)
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    # no time limit: the objectives are compared, so both plans must be optimal (on a
    # loaded machine 60 s can pass before HiGHS proves the free plan)
    exact = HIGHS.replace(time_limit_s=None)
    free = shared_plan(traced, mesh, exact)
    forced = auto_shard_graph(
        traced.graph, mesh, exact.replace(force_batch_dim_to_mesh_axis="model")
    )
    assert not all("model" in s.dims[0] for s in _data_specs(traced, free))  # it does bind
    assert all("model" in s.dims[0] for s in _data_specs(traced, forced))
    assert forced.objective >= free.objective - 1e-6 * abs(free.objective)


def test_force_batch_dim_refuses_an_unknown_axis_or_an_undivided_batch(tiny):
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"not an axis of the mesh.*\['data', 'model'\]"):
        auto_shard_graph(tiny.graph, mesh, HIGHS.replace(force_batch_dim_to_mesh_axis="batch"))
    odd = trace_workload("gpt-tiny", optimizer="sgd", batch_size=6)
    with pytest.raises(ValueError, match="not divisible by the 4 devices of axis 'model'"):
        auto_shard_graph(odd.graph, mesh, HIGHS.replace(force_batch_dim_to_mesh_axis="model"))


@MODELS
def test_no_mixed_mesh_shape_splits_each_dim_over_one_axis_at_most(request, model):
    traced = request.getfixturevalue(model)
    mesh = alpa_test_mesh((2, 4), ("data", "model"))

    def mixed(plan):
        specs = [*plan.input_specs, *plan.tensor_specs.values()]
        return [s for s in specs if any(len(d) > 1 for d in s.dims)]

    # the free plan of the test above (solved once; no time limit: the optimum)
    free = shared_plan(traced, mesh, HIGHS.replace(time_limit_s=None))
    plain = auto_shard_graph(traced.graph, mesh, HIGHS.replace(allow_mixed_mesh_shape=False))
    assert mixed(free)  # the option has something to forbid
    assert not mixed(plain)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "model", [SMALL_MLP, pytest.param("gpt-tiny", marks=pytest.mark.heavy)], ids=["mlp", "gpt-tiny"]
)
def test_cli_flags_build_the_options(model):
    argv = f"plan --model {model} --mesh 2x4 --solver highs --no-mixed-mesh-shape --json"
    proc = _cli(*argv.split())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    specs = out["specs"].values()
    assert specs and not any("+" in s for s in specs)  # "d0@data+model": two axes


@pytest.mark.parametrize(
    "argv, message",
    [
        ("plan --model gpt-tiny --mesh 2x4 --force-batch-axis batch", "not an axis of the mesh"),
        (
            "plan --model gpt-tiny --mesh 2x4 --time-limit -5",
            "--time-limit: expected a positive number, got -5",
        ),
        (
            "plan --model gpt-tiny --layers 2 --devices 8 --pipeline auto --no-mixed-mesh-shape",
            "--no-mixed-mesh-shape",
        ),
    ],
)
def test_cli_refuses_options_it_cannot_honour(capsys, argv, message):
    rc, out, err = cli_in_process(capsys, *argv.split())  # refused before planning
    assert rc == 2, out + err
    assert message in err
    assert "Traceback" not in err
