"""A partial sum reduce-scattered into a spec whose one reader, through a reshape, slices
it again (wresnet-tiny zero3 on 2x4, a BatchNorm scale's gradient: ``[16]`` partial over
data and model, read as ``[16@data]`` by a reshape whose ``[1, 1, 1, 16@data]`` is read as
``[..., 16@data+model]``). XLA makes the two slices one, of 1/8 of the buffer, so the
reduction over data is an all-reduce whose one use keeps a window of it (the verifier reads
it as an all-reduce, :mod:`autoshard.verify.xla_cpu`): predicted as such.

The ILP prices what is predicted: a surcharge node adds the all-reduce's price over the\nreduce-scatter's where the layout op's reader slices again.\n\nThe strategies are chosen by hand (the ILP would not pick this plan for so small a
program), then the plan is compiled on the 8 fake CPU devices and compared."""

import math

import jax
import jax.numpy as jnp
import pytest

from autoshard.api import device_mesh_for
from autoshard.intra.cost.collectives import collective_cost
from autoshard.intra.ilp.problem import objective_of
from autoshard.intra.ilp.solve import Solution
from autoshard.intra.problem.build import build_problem, plan_from_solution
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.graph import build_graph
from autoshard.ir.spec import Collective, ShardingSpec
from autoshard.trace.jaxpr import trace
from autoshard.verify.check import verify_plan

D, MP, DM = ("data",), ("model",), ("data", "model")
C = 16  # channels: the reduced value's length
F32 = 4


def _step(x):
    g = x.sum((0, 1, 2))  # [C], partial over data and model
    return jnp.tanh(g.reshape(1, 1, 1, C))


def _spec(*dims, partial=()):
    return ShardingSpec(tuple(dims), partial=partial)


def _plan(last_read):
    """x split on its batch over data and its rows over model; the sum partial over both;
    the reshape reading ``[C@data]``; the tanh reading ``last_read``."""
    program = trace(_step, jax.ShapeDtypeStruct((8, 8, 8, C), jnp.float32))
    graph = build_graph(program.records)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    ip = build_problem(graph, mesh, IntraOptions(), followers=False)
    wanted = [
        lambda s: s.output_specs[0] == _spec(D, MP, (), ()),
        lambda s: (
            s.input_specs[0] == _spec(D, MP, (), ()) and s.output_specs[0] == _spec((), partial=DM)
        ),
        lambda s: s.input_specs[0] == _spec(D),
        lambda s: s.input_specs[0] == last_read,
    ]
    choice = []
    for i, ok in enumerate(wanted):
        found = [k for k, s in enumerate(ip.strategies[i]) if ok(s)]
        assert found, f"no strategy of ILP node {i} is the one this test wants"
        choice.append(found[0])
    solution = Solution(tuple(choice), 0.0, "optimal", None, "by hand", 0.0, 0.0, 0, 0, 0)
    return program, ip, tuple(choice), plan_from_solution(ip, solution)


def test_a_scatter_sliced_again_is_predicted_as_the_all_reduce_xla_compiles():
    program, _, _, plan = _plan(_spec((), (), (), DM))
    report = verify_plan(program, plan, live_peak="never")
    assert report.collectives_agree, report.comparison.format()
    assert set(plan.predicted_collectives) == {
        Collective("all-reduce", MP, C * F32),
        Collective("all-reduce", D, C * F32),
    }


def test_a_scatter_read_as_made_stays_a_reduce_scatter():
    """The same sum read by the tanh as the reshape made it: XLA's reduce-scatter."""
    program, _, _, plan = _plan(_spec((), (), (), D))
    report = verify_plan(program, plan, live_peak="never")
    assert report.collectives_agree, report.comparison.format()
    assert Collective("reduce-scatter", D, C * F32) in plan.predicted_collectives


@pytest.mark.parametrize("again", [True, False], ids=["sliced again", "read as made"])
def test_the_ilp_prices_the_collectives_predicted(again):
    """The ILP's objective of the plan (its extra nodes completed as XLA's behaviour
    implies) less the compute is the predicted collectives' cost."""
    _, ip, choice, plan = _plan(_spec((), (), (), DM if again else D))
    full = ip.values.complete(ip.strategies, choice, ip.mesh)
    compute = math.fsum(ip.problem.node_costs[v][full[v]] for v in range(len(choice)))
    options = IntraOptions().cost_options(relative_units=math.isinf(ip.mesh.peak_flops))
    predicted = math.fsum(collective_cost(ip.mesh, c, options) for c in plan.predicted_collectives)
    assert objective_of(ip.problem, full) - compute == pytest.approx(predicted, rel=1e-9)


def _step_through_a_unit_sum(x):
    g = x.sum((0, 1, 2))  # [C], partial over data and model
    return jnp.tanh(g.reshape(1, 1, 1, C).sum((0, 1, 2)))  # a sum over dims of 1: a bitcast


def test_a_sum_over_unit_dims_passes_the_slice_to_the_all_reduce():
    """The reshape's result summed over its dims of size 1 (XLA: a bitcast) and read as
    ``[C@model]`` from ``[C@data]`` (a slice then a permute): XLA again slices the
    all-reduced buffer once (the ILP's surcharge covers one layout op only)."""
    program = trace(_step_through_a_unit_sum, jax.ShapeDtypeStruct((8, 8, 8, C), jnp.float32))
    graph = build_graph(program.records)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    ip = build_problem(graph, mesh, IntraOptions(), followers=False)
    wanted = [
        lambda s: s.output_specs[0] == _spec(D, MP, (), ()),
        lambda s: (
            s.input_specs[0] == _spec(D, MP, (), ()) and s.output_specs[0] == _spec((), partial=DM)
        ),
        lambda s: s.input_specs[0] == _spec(D),
        lambda s: s.input_specs[0] == _spec((), (), (), D) and s.output_specs[0] == _spec(D),
        lambda s: s.input_specs[0] == _spec(MP),
    ]
    choice = []
    for i, ok in enumerate(wanted):
        found = [k for k, s in enumerate(ip.strategies[i]) if ok(s)]
        assert found, f"no strategy of ILP node {i} is the one this test wants"
        choice.append(found[0])
    solution = Solution(tuple(choice), 0.0, "optimal", None, "by hand", 0.0, 0.0, 0, 0, 0)
    plan = plan_from_solution(ip, solution)
    report = verify_plan(program, plan, live_peak="never")
    assert report.collectives_agree, report.comparison.format()
    assert Collective("all-reduce", D, C * F32) in plan.predicted_collectives
