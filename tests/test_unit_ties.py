"""The junctions between a stage's layers (autoshard.inter.unit_ties, IntraStageCost.junction):
what a tensor crossing from one layer's plan to the next costs, and identical layers
planned knowing it."""

import pytest

from autoshard.api import trace_workload
from autoshard.inter.stage_cost import _NO_TIES, IntraStageCost
from autoshard.inter.submesh import cluster_for, logical_mesh_costs
from autoshard.inter.unit_cost import crossing_seconds, read_specs
from autoshard.intra.cost.consumers import reshard_to_consumers
from autoshard.intra.cost.resharding import reshard
from autoshard.ir.spec import ShardingSpec

SHAPE, ITEM = (8, 16, 32), 4


@pytest.fixture(scope="module")
def tiny4():
    return trace_workload("gpt-tiny", num_layers=4, batch_size=8)


def _cost(graph, hosts, per_host):
    mesh_for = logical_mesh_costs(cluster_for(None, hosts, per_host))
    return IntraStageCost(graph, mesh_for, solver="highs")


def _mesh():
    return logical_mesh_costs(cluster_for(None, 2, 4))((2, 4))


def test_crossing_reshards_straight_to_the_reads():
    """A tensor read in the spec it was made in costs nothing, whatever spec the reading
    plan nominally holds it in (a free replicated input): the stage never materialises
    that spec. A read in another spec costs the direct reshard."""
    mesh = _mesh()
    made = ShardingSpec((("data",), (), ("model",)))
    replicated = ShardingSpec(((), (), ()))
    via_held = reshard(made, replicated, SHAPE, ITEM, mesh, _NO_TIES).cost
    assert via_held > 0  # what the junction cost before: made -> held
    assert crossing_seconds(made, replicated, [made], SHAPE, ITEM, mesh, _NO_TIES) == 0.0
    other = ShardingSpec((("data",), ("model",), ()))
    direct = reshard_to_consumers(made, [other], SHAPE, ITEM, mesh, _NO_TIES).cost
    got = crossing_seconds(made, replicated, [other], SHAPE, ITEM, mesh, _NO_TIES)
    assert direct > 0 and got == pytest.approx(direct)  # held -> other is a free slice
    # what the reading plan charged for its own reads is taken back
    charged = reshard_to_consumers(other, [made], SHAPE, ITEM, mesh, _NO_TIES).cost
    assert crossing_seconds(made, other, [made], SHAPE, ITEM, mesh, _NO_TIES) == pytest.approx(
        -charged
    )


@pytest.mark.parametrize("hosts, per_host, logical", [(2, 4, (2, 4)), (1, 8, (8, 1))])
def test_junction_is_the_route_the_stage_runs(tiny4, hosts, per_host, logical):
    """Every junction: from the spec the producing plan makes each crossing tensor in,
    straight to the specs the reading plan's equations read it in, less what the reading
    plan charged for those reads."""
    cost = _cost(tiny4.graph, hosts, per_host)
    mesh = cost.mesh_for(logical)
    for a, b in cost._crossings:
        ua, ub = cost.unit(a, a + 1, logical), cost.unit(b, b + 1, logical)
        ga, gb = cost._shallow_subgraph(a).graph, cost._shallow_subgraph(b)
        made = {cost._shallow_subgraph(a).tensor_ids[t]: j for j, t in enumerate(ga.outputs)}
        want = 0.0
        for k, tid in enumerate(gb.graph.inputs):
            if gb.tensor_ids[tid] not in made:
                continue
            t = gb.graph.tensors[tid]
            src = ua.plan.output_specs[made[gb.tensor_ids[tid]]]
            reads = read_specs(gb.graph, ub.plan, k)
            direct = reshard_to_consumers(src, reads, t.shape, 4, mesh, _NO_TIES).cost
            held = ub.plan.input_specs[k]
            want += direct - reshard_to_consumers(held, reads, t.shape, 4, mesh, _NO_TIES).cost
        assert cost.junction(a, b, logical) == pytest.approx(want, abs=1e-15)


def test_identical_blocks_plan_what_they_pass_each_other(tiny4):
    """A block's ILP sees the activation and the cotangent it exchanges with its identical
    neighbours as its own outputs: on two hosts of four the blocks then pass both in the
    spec they are made in (before, the cotangent was held replicated -- a free input --
    and each junction all-gathered it, 14.6 us per block per micro-batch), and the
    seconds the ILP paid on those ties are the junction's, not the unit's communication."""
    cost = _cost(tiny4.graph, 2, 4)
    logical = (2, 4)
    mesh = cost.mesh_for(logical)
    blocks = [i for i in range(cost.num_layers) if cost.signatures[i] == cost.signatures[1]]
    assert len(blocks) == 4
    pairs = cost._tie_pairs(cost.subgraph(1, 2))
    assert len(pairs) == 2  # the activation forward, the cotangent backward
    for a, b in cost._crossings:
        if a in blocks and b in blocks:
            assert cost.junction(a, b, logical) == 0.0
    u = cost.unit(1, 2, logical)
    g = cost.subgraph(1, 2).graph
    tied = sum(
        reshard(
            u.plan.output_specs[j], u.plan.input_specs[k], g.tensors[g.inputs[k]].shape, 4,
            mesh, _NO_TIES,
        ).cost
        for k, j in pairs
    )  # fmt: skip
    assert u.plan.objective == pytest.approx(u.compute_s + u.communication_s + tied)


def test_breakdown_names_the_junctions_and_splits_each_units_communication(tiny4):
    """The traced program's step breakdown: ``comm_reshard`` is the stage's junctions,
    ``comm_<axis>`` its units' communication by axis (the update's collectives counted
    once per step), once per micro-batch each."""
    from autoshard.inter.stages import pipeline_objective
    from autoshard.sim.breakdown import pipeline_step_breakdown

    mesh_for = logical_mesh_costs(cluster_for(None, 2, 4))
    m, logical = 4, (2, 4)
    cost = IntraStageCost(tiny4.graph, mesh_for, solver="highs", num_microbatches=m)
    n = cost.num_layers
    latency = cost.range_cost(0, n, logical).latency_s
    parts = pipeline_step_breakdown(
        cost, [(0, n, logical, "none", latency)], m, pipeline_objective([latency], m)
    )
    units = [cost.unit(i, i + 1, logical) for i in range(n)]
    for u in units:
        assert sum(u.communication_by_axis.values()) == pytest.approx(u.communication_s)
    junctions = cost.junctions_s(0, n, logical)
    assert junctions > 0  # the embedding and head read their inputs in other specs
    assert parts["comm_reshard"] == pytest.approx(m * junctions)
    for axis in ("data", "model"):
        want = m * sum(u.communication_by_axis.get(axis, 0.0) for u in units)
        assert want > 0 and parts[f"comm_{axis}"] == pytest.approx(want)


def test_a_unit_prices_its_junctions_with_other_layers_planned_before_it(tiny4):
    """The head's unit is planned after the block that feeds it its activation, and its
    ILP prices receiving it in the spec the block makes it in; the embedding's after the
    block and head that send it cotangents, and it prices sending the block its
    activation in the spec the block reads it in. What the ILPs paid there is left out of
    each unit's communication (the junction holds it)."""
    cost = _cost(tiny4.graph, 2, 4)
    logical = (2, 4)
    mesh = cost.mesh_for(logical)
    block, head = cost.signatures[1], cost.signatures[5]
    cost.unit(0, 1, logical)  # the embedding: its feeders are planned first
    assert {((block,), mesh), ((head,), mesh)} <= set(cost._units)
    for layer in (0, 5):
        rg = cost.subgraph(layer, layer + 1)
        fed, drained = cost._fed_specs(rg, mesh), cost._drain_reads(rg, mesh)
        assert fed  # both receive a tensor from a block
        u, g = cost.unit(layer, layer + 1, logical), rg.graph
        paid = 0.0
        for k, src in fed:
            t = g.tensors[g.inputs[k]]
            paid += reshard(src, u.plan.input_specs[k], t.shape, 4, mesh, _NO_TIES).cost
        for j, reads in drained:
            t = g.tensors[g.outputs[j]]
            made = u.plan.output_specs[j]
            paid += reshard_to_consumers(made, reads, t.shape, 4, mesh, _NO_TIES).cost
        assert u.plan.objective == pytest.approx(u.compute_s + u.communication_s + paid)
    assert cost._drain_reads(cost.subgraph(0, 1), mesh)  # the embedding's activation


def test_a_units_communication_is_its_plans_collectives_once_per_value():
    """The stage ILPs solve the per-demand program, which pays a spec that two readers of
    a value want twice (gpt-tiny's block on a DGX A100 (2, 4): a cotangent both backward
    ``mul``s read replicated, all-gathered once by XLA). The unit prices what its plan
    compiles to: each predicted collective once (one micro-batch: nothing amortised),
    below what the ILP's objective charged beyond compute."""
    from autoshard.intra.cost.collectives import collective_cost

    g = trace_workload("gpt-tiny", num_layers=2, batch_size=8).graph
    mesh_for = logical_mesh_costs(cluster_for("dgx-a100", 1, 8))
    cost = IntraStageCost(g, mesh_for, solver="highs", num_microbatches=1)
    logical = (2, 4)
    mesh = mesh_for(logical)
    u = cost.unit(1, 2, logical)
    want = sum(collective_cost(mesh, c, _NO_TIES) for c in u.plan.predicted_collectives)
    assert want > 0 and u.communication_s == pytest.approx(want, rel=1e-12)
    assert sum(u.communication_by_axis.values()) == pytest.approx(want, rel=1e-12)
    # what the ILP charged for the values, beyond compute and the junctions it priced
    # (its ties with the next block, its feed from the embedding, its drains): more
    charged = u.plan.objective - u.compute_s - _junctions_paid(cost, 1, logical, itemsize=4)
    assert charged > 1.1 * u.communication_s


def _junctions_paid(cost, layer, logical, itemsize):
    """Seconds ``layer``'s unit's ILP paid on its junctions: its ties with a layer of its
    own signature, the inputs fed by layers planned before, the outputs they read."""
    mesh = cost.mesh_for(logical)
    u, rg = cost.unit(layer, layer + 1, logical), cost.subgraph(layer, layer + 1)
    g = rg.graph
    paid = sum(
        reshard(u.plan.output_specs[j], u.plan.input_specs[k], g.tensors[g.inputs[k]].shape,
                itemsize, mesh, _NO_TIES).cost
        for k, j in cost._tie_pairs(rg)
    )  # fmt: skip
    for k, src in cost._fed_specs(rg, mesh):
        t = g.tensors[g.inputs[k]]
        paid += reshard(src, u.plan.input_specs[k], t.shape, itemsize, mesh, _NO_TIES).cost
    for j, reads in cost._drain_reads(rg, mesh):
        t = g.tensors[g.outputs[j]]
        made = u.plan.output_specs[j]
        paid += reshard_to_consumers(made, reads, t.shape, itemsize, mesh, _NO_TIES).cost
    return paid
