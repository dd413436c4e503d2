"""Stage DP against brute force, sub-mesh shapes and placement, manual stage baselines."""

import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.inter.plan import StagePlan
from autoshard.inter.stages import (
    SCHEDULES,
    StageCost,
    cost_stage_choices,
    equal_flops_stages,
    equal_layer_stages,
    logical_mesh_shapes,
    microbatches_in_flight,
    optimal_stage_plan,
    pipeline_objective,
    place_submeshes,
    submesh_shapes,
)
from autoshard.inter.uniform_stages import uniform_stage_plan

CLUSTERS = [(1, 2), (1, 4), (2, 2), (2, 4)]


def random_cost_table(seed: int, num_layers: int, additive: bool):
    """A memoised random ``stage_cost``: additive per-layer costs or arbitrary per key."""
    rng = random.Random(seed)
    layer_time = [rng.uniform(0.5, 4.0) for _ in range(num_layers)]
    layer_params = [rng.uniform(0.5, 3.0) for _ in range(num_layers)]
    table: dict = {}

    def stage_cost(start, end, submesh, logical, recompute="none"):
        key = (start, end, submesh, logical, recompute)
        if recompute != "none" and key not in table:
            # recompute: slower, leaner; "full" keeps a working set besides
            base = stage_cost(start, end, submesh, logical)
            slower, kept = {"selective": (1.1, 0.5), "full": (1.35, 0.1)}[recompute]
            working = base.activation_bytes if recompute == "full" else 0.0
            table[key] = StageCost(
                base.latency_s * slower, base.param_bytes, base.activation_bytes * kept, working
            )
        if key not in table:
            if additive:
                dp, tp = logical
                devices = dp * tp
                work = sum(layer_time[start:end])
                comm = 0.3 * (tp - 1) + 0.1 * (dp - 1) * (end - start)
                table[key] = StageCost(
                    work / devices + comm,
                    sum(layer_params[start:end]) / tp,
                    0.5 * (end - start) / devices,
                )
            else:
                latency = rng.choice([rng.uniform(0.1, 10.0), float(rng.randint(1, 4)), math.inf])
                table[key] = StageCost(latency, rng.uniform(0.0, 5.0), rng.uniform(0.0, 2.0))
        return table[key]

    return stage_cost


def brute_force(
    num_layers, hosts, per_host, stage_cost, microbatches, budget, schedule, stages=None,
    modes=None,
):  # fmt: skip
    """(best objective, smallest max stage memory over all plans) by full enumeration;
    ``modes``: recompute modes each stage may take (None: the 4-argument callback)."""
    shapes = submesh_shapes(hosts, per_host)
    best, least_memory = math.inf, math.inf
    counts = range(1, num_layers + 1) if stages is None else [stages]
    for count in counts:
        for cuts in itertools.combinations(range(1, num_layers), count - 1):
            bounds = (0, *cuts, num_layers)
            for subs in itertools.product(shapes, repeat=count):
                if sum(r * c for r, c in subs) != hosts * per_host:
                    continue
                options = [
                    [(g, m) for g in logical_mesh_shapes(sub) for m in (modes or [None])]
                    for sub in subs
                ]
                for variants in itertools.product(*options):
                    costs = [
                        stage_cost(bounds[s], bounds[s + 1], subs[s], *variants[s])
                        if modes
                        else stage_cost(bounds[s], bounds[s + 1], subs[s], variants[s][0])
                        for s in range(count)
                    ]
                    if not all(math.isfinite(c.latency_s) for c in costs):
                        continue
                    memory = [
                        c.memory_bytes(microbatches_in_flight(s, count, microbatches, schedule))
                        for s, c in enumerate(costs)
                    ]
                    least_memory = min(least_memory, max(memory))
                    if max(memory) <= budget:
                        objective = pipeline_objective([c.latency_s for c in costs], microbatches)
                        best = min(best, objective)
    return best, least_memory


instance = st.fixed_dictionaries(
    {
        "num_layers": st.integers(1, 5),
        "cluster": st.sampled_from(CLUSTERS),
        "microbatches": st.integers(1, 8),
        "seed": st.integers(0, 2**32 - 1),
        "additive": st.booleans(),
        "budget": st.one_of(st.none(), st.floats(0.5, 12.0)),
        "schedule": st.sampled_from(SCHEDULES),
        "search": st.sampled_from(["frontier", "alpa"]),
    }
)


@settings(max_examples=80, deadline=None)
@given(case=instance)
def test_stage_dp_matches_brute_force(case):
    layers, (hosts, per_host) = case["num_layers"], case["cluster"]
    stage_cost = random_cost_table(case["seed"], layers, case["additive"])
    budget = case["budget"]
    expected, least_memory = brute_force(
        layers,
        hosts,
        per_host,
        stage_cost,
        case["microbatches"],
        math.inf if budget is None else budget,
        case["schedule"],
    )
    kwargs = dict(
        memory_budget_bytes=budget, schedule=case["schedule"], t_max_search=case["search"]
    )
    if math.isinf(expected):
        with pytest.raises(ValueError, match="no plan") as err:
            optimal_stage_plan(layers, hosts, per_host, stage_cost, case["microbatches"], **kwargs)
        if math.isfinite(least_memory):
            # the error's smallest budget is the brute-force one, and it admits a plan
            assert f"{least_memory:.4g}" in str(err.value)
            kwargs["memory_budget_bytes"] = least_memory
            optimal_stage_plan(layers, hosts, per_host, stage_cost, case["microbatches"], **kwargs)
        return
    plan = optimal_stage_plan(layers, hosts, per_host, stage_cost, case["microbatches"], **kwargs)
    assert plan.objective_s == pytest.approx(expected, rel=1e-9)
    assert plan.stages[0].start_layer == 0 and plan.stages[-1].end_layer == layers
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        assert a.end_layer == b.start_layer
    assert sum(s.num_devices for s in plan.stages) == hosts * per_host
    if budget is not None:
        assert all(s.peak_bytes <= budget for s in plan.stages)
    # re-costing the chosen stages by hand gives the same objective
    manual = cost_stage_choices(
        [((s.start_layer, s.end_layer), s.submesh) for s in plan.stages],
        layers,
        hosts,
        per_host,
        stage_cost,
        case["microbatches"],
        budget,
        case["schedule"],
    )
    assert manual.objective_s == pytest.approx(plan.objective_s, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(case=instance, stages=st.integers(1, 5))
def test_fixed_stage_count_matches_brute_force(case, stages):
    layers, (hosts, per_host) = case["num_layers"], case["cluster"]
    stages = min(stages, layers, hosts * per_host)
    stage_cost = random_cost_table(case["seed"], layers, additive=True)
    expected, _ = brute_force(
        layers, hosts, per_host, stage_cost, case["microbatches"], math.inf, "1f1b", stages
    )
    if math.isinf(expected):
        with pytest.raises(ValueError, match="no plan"):
            optimal_stage_plan(
                layers, hosts, per_host, stage_cost, case["microbatches"], num_stages=stages
            )
        return
    plan = optimal_stage_plan(
        layers, hosts, per_host, stage_cost, case["microbatches"], num_stages=stages
    )
    assert len(plan.stages) == stages
    assert plan.objective_s == pytest.approx(expected, rel=1e-9)


def test_each_candidate_is_costed_exactly_once():
    calls: list = []
    inner = random_cost_table(0, 6, additive=True)

    def counting(*args):
        calls.append(args)
        return inner(*args)

    plan = optimal_stage_plan(6, 2, 4, counting, num_microbatches=4, memory_budget_bytes=6.0)
    assert len(calls) == len(set(calls)) == plan.num_cost_calls
    ranges = 6 * 7 // 2
    per_range = sum(len(logical_mesh_shapes(s)) for s in submesh_shapes(2, 4))
    assert plan.num_cost_calls == ranges * per_range


def test_submesh_shapes_and_logical_meshes():
    assert submesh_shapes(2, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert logical_mesh_shapes((1, 8)) == ((1, 8), (2, 4), (4, 2), (8, 1))
    for hosts, per_host in [(1, 1), (3, 8), (4, 6)]:
        sizes = [r * c for r, c in submesh_shapes(hosts, per_host)]
        single = [
            s
            for (rows, _), s in zip(submesh_shapes(hosts, per_host), sizes, strict=True)
            if rows == 1
        ]
        # single-host sizes divide each other and the host; multi-host ones are whole hosts
        assert all(big % small == 0 for small, big in zip(single, single[1:], strict=False))
        assert single[-1] == per_host and all(s % per_host == 0 for s in sizes[len(single) :])
        assert sizes[-1] == hosts * per_host
    assert all(dp * tp == 12 for dp, tp in logical_mesh_shapes((2, 6)))


@settings(max_examples=40, deadline=None)
@given(cluster=st.sampled_from([(1, 8), (2, 4), (3, 8), (4, 4)]), data=st.data())
def test_any_multiset_of_submeshes_filling_the_cluster_tiles_it(cluster, data):
    hosts, per_host = cluster
    shapes, left = [], hosts * per_host
    while left:
        options = [s for s in submesh_shapes(hosts, per_host) if s[0] * s[1] <= left]
        shapes.append(data.draw(st.sampled_from(options)))
        left -= shapes[-1][0] * shapes[-1][1]
    placed = place_submeshes(shapes, hosts, per_host)
    assert sorted(d for ids in placed for d in ids) == list(range(hosts * per_host))
    for (rows, cols), ids in zip(shapes, placed, strict=True):
        assert len(ids) == rows * cols
        if rows == 1:
            assert len({d // per_host for d in ids}) == 1
        else:
            assert {d // per_host for d in ids} == set(
                range(ids[0] // per_host, ids[0] // per_host + rows)
            )


def test_place_submeshes_rejects_wrong_totals():
    with pytest.raises(ValueError, match="all must be used"):
        place_submeshes([(1, 4)], 2, 4)


@pytest.mark.parametrize("layers,stages", [(8, 3), (12, 4), (5, 5), (7, 1)])
def test_equal_layer_stages(layers, stages):
    ranges = equal_layer_stages(layers, stages)
    sizes = [b - a for a, b in ranges]
    assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == layers
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="non-empty"):
        equal_layer_stages(stages - 1, stages) if stages > 1 else equal_layer_stages(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    flops=st.lists(st.integers(0, 50).map(float), min_size=1, max_size=8), stages=st.integers(1, 8)
)
def test_equal_flops_stages_minimises_the_largest_stage(flops, stages):
    stages = min(stages, len(flops))
    ranges = equal_flops_stages(flops, stages)
    assert len(ranges) == stages and all(a < b for a, b in ranges)
    got = max(sum(flops[a:b]) for a, b in ranges)
    best = min(
        max(sum(flops[a:b]) for a, b in zip((0, *cuts), (*cuts, len(flops)), strict=True))
        for cuts in itertools.combinations(range(1, len(flops)), stages - 1)
    )
    assert got == best


def test_stage_dp_beats_or_ties_manual_baselines_and_round_trips():
    stage_cost = random_cost_table(7, 8, additive=True)
    plan = optimal_stage_plan(8, 2, 4, stage_cost, num_microbatches=8)
    for count, width in [(2, 4), (4, 2), (8, 1)]:
        manual = cost_stage_choices(
            [(r, (1, width)) for r in equal_layer_stages(8, count)], 8, 2, 4, stage_cost, 8
        )
        assert plan.objective_s <= manual.objective_s + 1e-12
    assert StagePlan.from_json(plan.to_json()) == plan


def test_errors_say_what_is_wrong():
    stage_cost = random_cost_table(1, 4, additive=True)
    with pytest.raises(ValueError, match="num_stages=5"):
        optimal_stage_plan(4, 1, 8, stage_cost, 2, num_stages=5)
    with pytest.raises(ValueError, match="smallest budget"):
        optimal_stage_plan(4, 1, 4, stage_cost, 2, memory_budget_bytes=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cost_stage_choices([((0, 2), (1, 2)), ((3, 4), (1, 2))], 4, 1, 4, stage_cost, 2)
    with pytest.raises(ValueError, match="all must be used"):
        cost_stage_choices([((0, 2), (1, 2)), ((2, 4), (1, 1))], 4, 1, 4, stage_cost, 2)
    with pytest.raises(ValueError, match="leanest"):
        cost_stage_choices([((0, 4), (1, 4))], 4, 1, 4, stage_cost, 2, memory_budget_bytes=1e-6)
    with pytest.raises(ValueError, match="at most one per layer"):
        cost_stage_choices([((0, 1), (1, 1))] * 3, 2, 1, 4, stage_cost, 2)


@settings(max_examples=60, deadline=None)
@given(
    case=instance,
    modes=st.sampled_from([("none", "selective", "full"), ("full",), ("selective", "none")]),
)
def test_stage_dp_with_recompute_choice_matches_brute_force(case, modes):
    """Each stage also picks its recompute mode: the DP still equals full enumeration, and
    the chosen modes are the ones whose costs the plan reports."""
    layers, (hosts, per_host) = case["num_layers"], case["cluster"]
    stage_cost = random_cost_table(case["seed"], layers, case["additive"])
    budget = case["budget"]
    mb, schedule = case["microbatches"], case["schedule"]
    cap = math.inf if budget is None else budget
    expected, least = brute_force(
        layers, hosts, per_host, stage_cost, mb, cap, schedule, modes=modes
    )  # fmt: skip
    kwargs = dict(memory_budget_bytes=budget, schedule=schedule, recompute_modes=modes)
    if math.isinf(expected):
        with pytest.raises(ValueError):
            optimal_stage_plan(layers, hosts, per_host, stage_cost, mb, **kwargs)
        return
    plan = optimal_stage_plan(layers, hosts, per_host, stage_cost, mb, **kwargs)
    assert plan.objective_s == pytest.approx(expected, rel=1e-9)
    for st_ in plan.stages:
        assert st_.recompute in modes and st_.peak_bytes <= cap
        cost = stage_cost(
            st_.start_layer, st_.end_layer, st_.submesh, st_.logical_mesh, st_.recompute
        )
        assert cost.latency_s == st_.latency_s
        assert cost.memory_bytes(st_.microbatches_in_flight) == st_.peak_bytes
    assert StagePlan.from_json(plan.to_json()) == plan
    # with every mode on offer, a budget too tight for no recompute is met by recomputing
    if modes == ("none", "selective", "full") and budget is not None:
        plain, _ = brute_force(layers, hosts, per_host, stage_cost, mb, cap, schedule)
        assert expected <= plain


@pytest.mark.parametrize("seed", range(6))
def test_uniform_search_is_the_best_plan_of_equal_submeshes(seed):
    """uniform_stage_plan = brute force over plans whose stages all take one sub-mesh
    shape; never better than Alpa's DP over every mix (a restriction of it)."""
    from autoshard.inter.uniform_stages import uniform_stage_plan

    layers, hosts, per_host, micro = 5, 2, 4, 4
    cost = random_cost_table(seed, layers, additive=seed % 2 == 0)
    budget = None if seed < 3 else 6.0
    expected = math.inf
    for shape in submesh_shapes(hosts, per_host):
        n = shape[0] * shape[1]
        if (hosts * per_host) % n or (hosts * per_host) // n > layers:
            continue
        count = (hosts * per_host) // n
        best = math.inf
        for cuts in itertools.combinations(range(1, layers), count - 1):
            bounds = (0, *cuts, layers)
            per_stage = []
            for s in range(count):
                fits = []
                for g in logical_mesh_shapes(shape):
                    c = cost(bounds[s], bounds[s + 1], shape, g)
                    mem = c.memory_bytes(microbatches_in_flight(s, count, micro, "1f1b"))
                    if math.isfinite(c.latency_s) and (budget is None or mem <= budget):
                        fits.append(c.latency_s)
                if not fits:
                    break
                per_stage.append(min(fits))
            else:
                best = min(best, pipeline_objective(per_stage, micro))
        expected = min(expected, best)
    if not math.isfinite(expected):
        with pytest.raises(ValueError, match="no plan of equal sub-meshes"):
            uniform_stage_plan(layers, hosts, per_host, cost, micro, budget)
        return
    plan = uniform_stage_plan(layers, hosts, per_host, cost, micro, budget)
    assert len({s.submesh for s in plan.stages}) == 1
    assert plan.objective_s == pytest.approx(expected, rel=1e-12)
    alpa = optimal_stage_plan(layers, hosts, per_host, cost, micro, budget)
    assert alpa.objective_s <= plan.objective_s * (1 + 1e-12)


def _placement_cost(start, end, submesh, logical, recompute="none", placement="none"):
    """Per layer: offloading the state (``opt``) costs 20% latency and frees 6 of its 10
    bytes of state; every layer keeps 3 bytes per microbatch in flight."""
    layers = end - start
    slow, state = (1.2, 4.0) if placement == "opt" else (1.0, 10.0)
    return StageCost(slow * layers, state * layers, 3.0 * layers)


@pytest.mark.parametrize("dp", ["alpa", "manual"])
def test_dp_offloads_only_the_stages_whose_memory_binds(dp):
    # 4 one-layer stages, 4 microbatches, 1F1B: stage i holds 4 - i microbatches
    # (22, 19, 16, 13 bytes without offload); a budget of 20 fits all but the first
    def plan(placements):
        if dp == "alpa":
            return optimal_stage_plan(
                4, 1, 4, _placement_cost, 4, memory_budget_bytes=20, num_stages=4,
                placements=placements,
            )  # fmt: skip
        return cost_stage_choices(
            [((i, i + 1), (1, 1)) for i in range(4)], 4, 1, 4, _placement_cost, 4,
            memory_budget_bytes=20, placements=placements,
        )  # fmt: skip

    mixed = plan(("none", "opt"))
    assert [s.offload for s in mixed.stages] == ["opt", "none", "none", "none"]
    uniform = plan(("opt",))  # every stage takes the one placement given
    assert [s.offload for s in uniform.stages] == ["opt"] * 4
    # 1.2 + 3 x 1.0 + 3 x 1.2 against 4 x 1.2 + 3 x 1.2
    assert mixed.objective_s == pytest.approx(7.8) and uniform.objective_s == pytest.approx(8.4)
    assert mixed.stages[0].peak_bytes == 4 + 12 and mixed.stages[1].peak_bytes == 19
    with pytest.raises(ValueError, match="bytes per device"):
        plan(("none",))  # the first stage fits no placement but offload
    restored = StagePlan.from_json(json.loads(json.dumps(mixed.to_json())))
    assert [s.offload for s in restored.stages] == ["opt", "none", "none", "none"]
    if dp == "alpa":  # the frontier-scale DP (one sub-mesh shape) chooses the same way
        uniform_dp = uniform_stage_plan(
            4, 1, 4, _placement_cost, 4, memory_budget_bytes=20, num_stages=4,
            placements=("none", "opt"),
        )  # fmt: skip
        assert [s.offload for s in uniform_dp.stages] == ["opt", "none", "none", "none"]


@pytest.mark.parametrize("offload_s, want", [(1.2, ("none", "opt")), (1.4, ("selective", "none"))])
def test_dp_chooses_recompute_or_offload_whichever_is_faster(offload_s, want):
    # the first stage fits with selective recompute (+0.3, half its activations) or with
    # its state offloaded (+0.2 or +0.4): the DP takes the faster, the others neither
    def cost(start, end, submesh, logical, recompute="none", placement="none"):
        layers = end - start
        slow = (offload_s if placement == "opt" else 1.0) + (0.3 if recompute != "none" else 0)
        state = 4.0 if placement == "opt" else 10.0
        act = 1.5 if recompute != "none" else 3.0
        return StageCost(slow * layers, state * layers, act * layers)

    plan = optimal_stage_plan(
        4, 1, 4, cost, 4, memory_budget_bytes=20, num_stages=4,
        recompute_modes=("none", "selective"), placements=("none", "opt"),
    )  # fmt: skip
    assert (plan.stages[0].recompute, plan.stages[0].offload) == want
    assert all((s.recompute, s.offload) == ("none", "none") for s in plan.stages[1:])
