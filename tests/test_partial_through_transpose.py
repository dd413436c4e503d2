"""A partial sum reduced for a transpose whose one reader splits it over the reduced axis
(issue #36; moe-1.3b megatron 2x4: the backward's gradient of the experts' input,
``EGCM,EMH->EGCH`` partial over model, transposed, then read by a dot split on the expert
dim over model). XLA moves the reader's slice ahead of the transpose, so the all-reduce's
one use is a dynamic-slice: a reduce-scatter (XLA:GPU's ReduceScatterCreator; the verifier
reads it as one on XLA:CPU), which the plan now predicts. Read by two readers through the
transpose, sliced on different dims, the reduced buffer is needed whole: an all-reduce,
predicted as such. The ILP prices what is predicted: its objective for the plan is the
plan's compute plus the predicted collectives' cost.

The strategies are chosen by hand (the ILP would not pick this plan for so small a
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

E, G, C, M, H, S = 8, 4, 16, 32, 64, 8
D, MP = ("data",), ("model",)
F32 = 4
REDUCED = E * (G // 2) * C * M * F32  # the partial sum's bytes per device (G over data)
OUT = (G // 2) * S * M * F32  # the final dot's output, partial over model


def _step(two_readers: bool):
    def f(dh, w, disp):
        p = jnp.einsum("egch,emh->egcm", dh, w)  # H split over model: partial over model
        t = jnp.transpose(p, (1, 3, 0, 2))  # [G, M, E, C]
        out = jnp.tanh(jnp.einsum("gmec,gsec->gsm", t, disp))  # reads E split over model
        return (out, jnp.tanh(t)) if two_readers else out

    sd = jax.ShapeDtypeStruct
    args = (sd((E, G, C, H), jnp.float32), sd((E, M, H), jnp.float32))
    return f, args + (sd((G, S, E, C), jnp.float32),)


def _spec(*dims, partial=()):
    return ShardingSpec(tuple(dims), partial=partial)


def _plan(two_readers: bool, options: IntraOptions | None = None):
    """The program, its ILP, the chosen strategies and the plan: the first dot partial over model (data splits G), the
    transpose replicated over model, the second dot reading E split over model; with
    ``two_readers`` the transpose's output is also read by a tanh split on C over model."""
    f, args = _step(two_readers)
    program = trace(f, *args)
    graph = build_graph(program.records)
    mesh = device_mesh_for((2, 4), ("data", "model"))
    ip = build_problem(graph, mesh, options or IntraOptions(), followers=False)
    wanted = [
        lambda s: s.output_specs[0] == _spec((), D, (), MP),  # dh: G over data, H over model
        lambda s: s.output_specs[0] == _spec((), (), MP),  # w: H over model
        lambda s: s.output_specs[0] == _spec(D, (), (), ()),  # disp: G over data
    ]
    for node in graph.nodes:
        ins = [graph.tensors[t].shape for t in node.inputs]
        if node.primitive == "dot_general" and len(ins[0]) == 4 and ins[0][0] == E:
            wanted.append(lambda s: s.output_specs[0] == _spec((), D, (), (), partial=MP))
        elif node.primitive == "transpose":
            wanted.append(lambda s: s.input_specs[0] == _spec((), D, (), ()))
        elif node.primitive == "dot_general":  # E split over model on both operands
            wanted.append(lambda s: s.input_specs[:2] == (_spec(D, (), MP, ()),) * 2)
        elif len(ins[0]) == 3:  # the tanh of the dot's output, reduced
            wanted.append(lambda s: s.input_specs[0] == _spec(D, (), ()))
        else:  # the tanh of the transpose's output, split on C over model
            wanted.append(lambda s: s.input_specs[0] == _spec(D, (), (), MP))
    choice = []
    for i, ok in enumerate(wanted):
        found = [k for k, s in enumerate(ip.strategies[i]) if ok(s)]
        assert found, f"no strategy of ILP node {i} is the one this test wants"
        choice.append(found[0])
    solution = Solution(tuple(choice), 0.0, "optimal", None, "by hand", 0.0, 0.0, 0, 0, 0)
    forbidden = (options or IntraOptions()).forbidden_collectives()
    return program, ip, tuple(choice), plan_from_solution(ip, solution, forbidden=forbidden)


def _ilp_price(ip, choice) -> float:
    """The ILP's objective of ``choice`` (its extra nodes completed as XLA's behaviour
    implies) less the compute: what it charges for moving data."""
    full = ip.values.complete(ip.strategies, choice, ip.mesh)
    compute = math.fsum(ip.problem.node_costs[v][full[v]] for v in range(len(choice)))
    return objective_of(ip.problem, full) - compute


def _cost(ip, collectives) -> float:
    options = IntraOptions().cost_options(relative_units=math.isinf(ip.mesh.peak_flops))
    return math.fsum(collective_cost(ip.mesh, c, options) for c in collectives)


def _rows(report):
    return sorted(
        (r.kind, tuple(r.axes), r.predicted_count, r.predicted_bytes, r.compiled_bytes)
        for r in report.comparison.rows
    )


@pytest.mark.parametrize("two_readers", [False, True], ids=["one reader", "two readers"])
def test_a_partial_sum_sliced_after_a_transpose_is_predicted_as_xla_compiles_it(two_readers):
    program, _, _, plan = _plan(two_readers)
    report = verify_plan(program, plan, live_peak="never")
    assert report.collectives_agree, report.comparison.format()
    # the partial sum: a reduce-scatter where its one reader chain slices it over model,
    # an all-reduce where two readers keep different dims of it
    kind = "all-reduce" if two_readers else "reduce-scatter"
    expected = {("all-reduce", MP, OUT), (kind, MP, REDUCED)}
    assert set(plan.predicted_collectives) == {Collective(*e) for e in expected}
    if two_readers:
        assert _rows(report) == [("all-reduce", MP, 2, OUT + REDUCED, OUT + REDUCED)]
    else:
        assert _rows(report) == [
            ("all-reduce", MP, 1, OUT, OUT),
            ("reduce-scatter", MP, 1, REDUCED, REDUCED),
        ]


@pytest.mark.parametrize("two_readers", [False, True], ids=["one reader", "two readers"])
def test_the_ilp_prices_the_collectives_predicted(two_readers):
    """The ILP's objective of the plan (its extra nodes completed as XLA's behaviour
    implies) less the compute is the predicted collectives' cost: the reduce-scatter's
    where one reader slices the transposed partial sum, the all-reduce's where two do."""
    _, ip, choice, plan = _plan(two_readers)
    assert _ilp_price(ip, choice) == pytest.approx(_cost(ip, plan.predicted_collectives), rel=1e-9)


def test_with_reduce_scatters_forbidden_the_ilp_prices_the_all_reduce():
    """Under ``all_reduce_only`` (the strict megatron's rule) the plan is priced with
    all-reduces only: the one XLA makes a reduce-scatter of is charged as the all-reduce
    and is not counted as a forbidden kind held."""
    _, ip, choice, plan = _plan(False, IntraOptions(all_reduce_only=True))
    assert "reduce-scatter" in {c.kind for c in plan.predicted_collectives}
    assert plan.solver["forbidden_held"] == []
    as_priced = [Collective("all-reduce", c.axes, c.bytes) for c in plan.predicted_collectives]
    assert _ilp_price(ip, choice) == pytest.approx(_cost(ip, as_priced), rel=1e-9)
