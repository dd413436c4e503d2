"""Intra-operator planning: Alpa's canonical outcomes, plans that run correctly, and
predictions that match what XLA compiled."""

import jax
import numpy as np
import pytest
from conftest import shared_plan

from autoshard.api import trace_workload, xla_cpu_memory_layout
from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.baselines.tables import baseline_inputs, baseline_options
from autoshard.intra.cost.resharding import CostOptions
from autoshard.intra.problem.build import auto_shard_graph, build_problem
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.primitives import ATTENTION
from autoshard.ir.spec import ShardingSpec
from autoshard.models import make_optimizer
from autoshard.runtime.reference_check import check_against_single_device
from autoshard.runtime.sharded import make_mesh
from autoshard.verify.check import verify_plan
from autoshard.verify.compare import summarize

HIGHS = IntraOptions(solver="highs")
# all-to-alls priced as when the tests below that use it were written: (n-1)/n^2 of the
# per-device buffer, i.e. today's (n-1)/n with a penalty of 1/n (n = 8, one mesh axis)
A2A_AS_WRITTEN_8 = HIGHS.replace(cost=CostOptions(all_to_all_penalty=1 / 8))


def _mlp(batch, hidden, layers=2):
    return trace_workload(
        "mlp", optimizer="sgd", batch_size=batch, hidden=hidden, num_layers=layers
    )


def _spec(traced, plan, name):
    g = traced.graph
    for tid, spec in zip(g.inputs, plan.input_specs):
        if g.tensors[tid].path == name:
            return spec
    raise KeyError(name)


def _compiled(traced, plan):
    devices = jax.devices()[: plan.mesh.num_devices]
    report = verify_plan(traced.program, plan, devices=devices)
    return report, summarize(report.compiled_collectives)


def test_large_batch_small_hidden_is_data_parallel():
    traced = _mlp(1024, 16)
    plan = auto_shard_graph(traced.graph, alpa_test_mesh((4,), ("x",)))
    for layer in ("dense_0", "dense_1"):
        assert _spec(traced, plan, f"[0]['{layer}']['kernel']").is_replicated
    first_dot = next(n for n in traced.graph.nodes if n.primitive == "dot_general")
    assert plan.tensor_specs[first_dot.outputs[0]] == ShardingSpec((("x",), ()))  # batch split
    report, compiled = _compiled(traced, plan)
    assert set(compiled) == {("all-reduce", ("x",))}  # gradient all-reduces only
    assert report.collectives_agree


def test_small_batch_large_hidden_is_megatron():
    traced = _mlp(16, 1024)
    plan = auto_shard_graph(traced.graph, alpa_test_mesh((4,), ("x",)))
    assert _spec(traced, plan, "[0]['dense_0']['kernel']") == ShardingSpec(((), ("x",)))  # column
    assert _spec(traced, plan, "[0]['dense_1']['kernel']") == ShardingSpec((("x",), ()))  # row
    report, compiled = _compiled(traced, plan)
    # one activation all-reduce (the row-split output); the backward needs none
    assert [c.kind for c in report.compiled_collectives] == ["all-reduce"]
    assert report.compiled_collectives[0].bytes == 16 * 1024 * 4
    assert report.collectives_agree


def test_2d_mesh_combines_data_and_tensor_parallel():
    """Under per-demand pricing the 2x2 optimum of this MLP is data parallel over one
    axis and tensor parallel over the other; exact_search="auto" solves the exact
    per-value program from it (10% cheaper, its second kernel read replicated by two dots
    through one route) and XLA compiles the collectives it predicts."""
    traced = _mlp(4096, 128)
    mesh = alpa_test_mesh((2, 2), ("data", "model"))
    plan = auto_shard_graph(traced.graph, mesh, IntraOptions(exact_values=False))
    exact = auto_shard_graph(traced.graph, mesh, IntraOptions(exact_search="auto"))
    assert exact.solver["exact_stopped"] is None  # solved, not only priced
    assert exact.objective <= plan.objective * (1 + 1e-9)
    assert _compiled(traced, exact)[0].collectives_agree
    first_dot = next(n for n in traced.graph.nodes if n.primitive == "dot_general")
    # activations: batch over "data", features over "model"
    assert plan.tensor_specs[first_dot.outputs[0]] == ShardingSpec((("data",), ("model",)))
    k0 = _spec(traced, plan, "[0]['dense_0']['kernel']")
    k1 = _spec(traced, plan, "[0]['dense_1']['kernel']")
    assert k0 == ShardingSpec(((), ("model",)))  # column split on the fast axis
    assert "data" not in k1.used_axes  # weights are never split over the data axis
    report, compiled = _compiled(traced, plan)
    assert ("all-reduce", ("data",)) in compiled  # gradients reduced over the data axis
    assert report.collectives_agree


def test_problem_size_does_not_grow_with_depth():
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    sizes = []
    for layers in (2, 4):
        traced = trace_workload("gpt-tiny", optimizer="sgd", num_layers=layers)
        ip = build_problem(traced.graph, mesh)
        from autoshard.intra.ilp import resolve_ties

        sizes.append(len(set(resolve_ties(ip.problem)[0])))
    assert sizes[0] == sizes[1]


def test_unknown_primitive_gets_replicated_fallback_and_one_warning():
    import jax.numpy as jnp

    from autoshard.ir.graph import build_graph
    from autoshard.trace.jaxpr import trace

    def step(x):  # cumsum has a rule now (intra/rules/moe.py); a Cholesky factor has none
        return jax.lax.linalg.cholesky(x) * 2.0 + jax.lax.linalg.cholesky(x.T)

    program = trace(step, jax.ShapeDtypeStruct((8, 8), jnp.float32))
    graph = build_graph(program.records)
    with pytest.warns(UserWarning, match="cholesky") as record:
        plan = auto_shard_graph(graph, alpa_test_mesh((4,), ("x",)))
    assert sum("cholesky" in str(w.message) for w in record) == 1
    for node in graph.nodes:
        if node.primitive == "cholesky":
            assert plan.tensor_specs[node.outputs[0]].is_replicated


MESHES = [(8,), (2, 4), (4, 2), (1, 8)]


@pytest.fixture(scope="module")
def tiny():
    return trace_workload("gpt-tiny", optimizer="sgd")


@pytest.fixture(scope="module")
def tiny8():
    """gpt-tiny with 8 heads: Megatron-LM (and the strict ``megatron`` baseline) splits
    heads over the model axis, so an 8-way model axis needs them (4 heads are refused,
    tests/test_megatron_strict.py)."""
    return trace_workload("gpt-tiny", optimizer="sgd", num_heads=8)


def _for(tiny, tiny8, shape, which):
    return tiny8 if which == "megatron" and shape[-1] == 8 else tiny


def _plan(traced, shape, which=None):
    """The ILP's plan, or baseline ``which`` (inputs pinned), on Alpa's test mesh."""
    mesh = alpa_test_mesh(shape, ("data", "model")[: len(shape)])
    pinned = baseline_inputs(traced.graph, mesh.mesh, which) if which else None
    options = baseline_options(HIGHS, mesh.mesh, which) if which else HIGHS
    # solved once per worker: several tests check the same plan (train, XLA, JSON)
    return shared_plan(traced, mesh, options, pinned_inputs=pinned, name=which or "auto")


def _assert_trains_like_one_device(traced, plan, optimizer="sgd", num_steps=1):
    jmesh = make_mesh(plan.mesh, jax.devices()[: plan.mesh.num_devices])
    args = traced.workload.init_train_args(make_optimizer(optimizer))
    report = check_against_single_device(
        traced.program, plan, jmesh, args, num_steps=num_steps, rtol=1e-5
    )
    assert report.ok, report


def _mesh_id(shape):
    return "x".join(map(str, shape))


# megatron on 2x4 and 1x8: heavy (CI's heavy step). The same plans (gpt-tiny, 4 heads on
# 2x4, 8 on 1x8, the strict megatron baseline on Alpa's test mesh) train like one device
# over 2 steps by default in tests/test_megatron_strict.py::test_megatron_plan_trains_like_one_device
BASELINE_CASES = [
    pytest.param(
        shape,
        which,
        id=f"{which}-{_mesh_id(shape)}",
        marks=[pytest.mark.heavy] if which == "megatron" and shape in ((2, 4), (1, 8)) else [],
    )
    for which in ("dp", "zero3", "megatron")
    for shape in MESHES
]


@pytest.mark.parametrize("shape, which", BASELINE_CASES)
def test_baselines_train_like_one_device(tiny, tiny8, shape, which):
    traced = _for(tiny, tiny8, shape, which)
    _assert_trains_like_one_device(traced, _plan(traced, shape, which))


# 2x4: heavy (CI's heavy step); the ILP's own plan for gpt-tiny on a 2x4 mesh (the CLI's, SGD,
# 2 steps, rtol 1e-5) trains like one device by default in
# tests/test_cli.py::test_demo_runs_plans_and_reports_its_checks
@pytest.mark.parametrize(
    "shape",
    [pytest.param(s, marks=[pytest.mark.heavy] if s == (2, 4) else []) for s in MESHES],
    ids=_mesh_id,
)
def test_auto_plan_trains_like_one_device(tiny, shape):
    _assert_trains_like_one_device(tiny, _plan(tiny, shape))


@pytest.mark.parametrize("shape, which", [((8,), "dp"), ((8,), "megatron"), ((2, 4), "dp")])
def test_baseline_collectives_match_xla(tiny, tiny8, shape, which):
    traced = _for(tiny, tiny8, shape, which)
    plan = _plan(traced, shape, which)
    report = verify_plan(traced.program, plan, devices=jax.devices()[: plan.mesh.num_devices])
    assert report.collectives_agree, report.comparison.format()


def test_plan_json_round_trip(tiny):
    from autoshard.ir.plan import ParallelPlan

    plan = _plan(tiny, (8,), "dp")
    again = ParallelPlan.loads(plan.dumps())
    assert again.input_specs == plan.input_specs
    assert dict(again.tensor_specs) == dict(plan.tensor_specs)
    assert again.predicted_collectives == plan.predicted_collectives
    assert np.isclose(again.objective, plan.objective)


@pytest.fixture(scope="module")
def gpt350m_1l():
    """:func:`gpt350m_2l` with one layer: the budget sweep's default case."""
    return trace_workload(
        "gpt-350m", optimizer="adamw", batch_size=8, num_layers=1, attention="unfused"
    )


@pytest.fixture(scope="module")
def gpt350m_2l():
    # XLA's S x S attention (attention="unfused"): the budgets and peaks below are that
    # program's (the fused program's free plan is 0.86 GB, and its model misses the
    # custom-VJP cross-entropy's recomputed probabilities at XLA's peak)
    return trace_workload(
        "gpt-350m", optimizer="adamw", batch_size=8, num_layers=2, attention="unfused"
    )


# (layers, budgets, refused): gpt-350m's 2 layers are heavy (CI's heavy step: its tightest
# budget is the slowest solve of this file); its 1 layer runs the same sweep by default in
# about half the time (peaks 2.85, 1.35 and 1.04 GB, 0.91 GB the least any plan peaks)
@pytest.mark.parametrize(
    "layers, budgets, refused",
    [
        # at 1.15e9 the plan pays in communication, not in state (as much state as at 1.9e9
        # on jax 0.12.0.1), so the state order needs the tighter 1.05e9 (jax 0.10.2 and 0.12)
        (1, (1.9e9, 1.05e9), 0.9e9),
        # 1.52 and 1.20 GB predicted when written; 1.11 GiB the least any plan peaks
        pytest.param(2, (2.0e9, 1.2e9), 1.0e9, marks=pytest.mark.heavy),
    ],
    ids=["1-layer", "2-layers"],
)
def test_memory_budget_sweep_trades_communication_for_memory(request, layers, budgets, refused):
    """As the budget shrinks the plan is predicted within it, its peak falls, it costs more
    and shards more of the training state; below the smallest peak any plan reaches, the error states a
    proven figure no plan peaks under. The ILP's memory rows count the resharded copies (all-gathered weights
    included), so each plan's prediction is exactly the peak the rows saw."""
    from autoshard.intra.ilp import InfeasibleBudgetError

    g = request.getfixturevalue(f"gpt350m_{layers}l").graph
    mesh = alpa_test_mesh((8,), ("data",))

    def state(plan):
        pairs = [(t, s) for t, s in zip(g.inputs, plan.input_specs) if g.tensors[t].kind != "data"]
        return sum(g.tensors[t].nbytes * s.shard_fraction(mesh.mesh) for t, s in pairs)

    options = A2A_AS_WRITTEN_8
    free = auto_shard_graph(g, mesh, options)
    assert free.predicted_peak_bytes > budgets[0]
    plans = [free]
    for budget in budgets:
        plans.append(auto_shard_graph(g, mesh, options.replace(memory_budget_bytes=budget)))
        assert plans[-1].predicted_peak_bytes <= budget
        assert not plans[-1].notes  # planned in one solve
    assert plans[0].objective < plans[1].objective < plans[2].objective
    peaks = [p.predicted_peak_bytes for p in plans]
    assert peaks[0] > peaks[1] > peaks[2]
    # the tightest budget shards more of the state than the looser one (the free plan's
    # state is not ordered with them: priced once per value, its cheapest plan already
    # shards some of the state)
    assert state(plans[1]) > state(plans[2])
    # (``refused`` is under the bound every plan peaks over: refused without a solve, the
    # bound stated; between the bound and the least peak the solver proves it)
    with pytest.raises(InfeasibleBudgetError, match="smallest peak|or more") as err:
        auto_shard_graph(g, mesh, options.replace(memory_budget_bytes=refused))
    assert err.value.proven
    assert refused < err.value.min_feasible_bytes <= plans[2].predicted_peak_bytes


@pytest.fixture(scope="module")
def tiny_fused():
    return trace_workload("gpt-tiny", optimizer="sgd", attention="fused")


@pytest.fixture(scope="module")
def tiny_unfused():
    return trace_workload("gpt-tiny", optimizer="sgd", attention="unfused")


@pytest.mark.parametrize(
    "shape, which, cpu, fused",
    [
        ((8,), "zero3", True, False),
        # heavy (CI's heavy step): the free 2x4 ILP with copy rows is the slowest solve of
        # this file; the same rows-equal-prediction path runs by default on the pinned
        # cases here (1-D and 2-D meshes, both programs)
        pytest.param((2, 4), "auto", True, False, marks=pytest.mark.heavy),
        ((4, 2), "dp", False, False),
        # the fused program's q/k/v kernel slices are read by a forward dot in one layout
        # and gathered for the backward's: XLA:CPU makes that copy right after the slice
        ((8,), "zero3", True, True),
    ],
)
def test_the_ilp_memory_rows_count_what_the_prediction_counts(request, shape, which, cpu, fused):
    """With its copies, the ILP's own peak for the chosen plan is the plan's predicted peak
    (resharded copies and XLA:CPU's early all-gathers included), so a budget on the rows is
    a budget on the prediction."""
    from autoshard.api import device_mesh_for
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.problem.build import plan_from_solution

    tiny = request.getfixturevalue("tiny_fused" if fused else "tiny_unfused")
    axes = ("data", "model")[: len(shape)]
    mesh = device_mesh_for(shape, axes) if cpu else alpa_test_mesh(shape, axes)
    pinned = None if which == "auto" else baseline_inputs(tiny.graph, mesh.mesh, which)
    ip = build_problem(tiny.graph, mesh, pinned_inputs=pinned, copy_buffers=True)
    solution = solve(ip.problem, solver="highs")
    plan = plan_from_solution(ip, solution)
    assert plan.operand_specs  # the plan reshards something, so copies are in play
    assert peak_memory(ip.problem, solution.strategy) == pytest.approx(
        plan.predicted_peak_bytes, rel=1e-12
    )
    no_copies = build_problem(tiny.graph, mesh, pinned_inputs=pinned)
    # without copy buffers only the fused attention's XLA:CPU workspaces remain, and on
    # XLA:CPU the LayerNorm broadcasts held where the forward multiply's layout is the
    # backward op's (their source: that forward multiply)
    from autoshard.intra.memory.broadcast_buffers import held_broadcasts

    n_in = no_copies.num_inputs
    sources = {c.source - n_in for c in no_copies.problem.copies}
    forward = {h.forward for h in held_broadcasts(tiny.graph, mesh, set())} - {None}
    held = {tiny.graph.nodes[i].primitive for i in sources - forward}
    assert held <= ATTENTION and bool(held) == fused
    assert peak_memory(no_copies.problem, solution.strategy) < plan.predicted_peak_bytes


# gpt-tiny's 1 block by default, its 2 (the shared fixture) in CI's heavy step
@pytest.mark.parametrize(
    "layers", [1, pytest.param(2, marks=pytest.mark.heavy)], ids=["1-layer", "2-layer"]
)
def test_the_ilp_memory_rows_count_xla_gpus_float32_attention_blocks(request, layers):
    """On XLA:GPU a float32 attention runs XLA's body, whose S x S blocks XLA:GPU keeps
    from the forward to the backward: the ILP's rows count them as the prediction does,
    and a budget under them is a budget on them."""
    import dataclasses

    if layers == 2:
        tiny_fused = request.getfixturevalue("tiny_fused")
    else:
        tiny_fused = trace_workload("gpt-tiny", optimizer="sgd", attention="fused", num_layers=1)

    from autoshard.hardware.mesh import XLA_GPU_MEMORY, relative_mesh
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.problem.build import plan_from_solution

    gpu = relative_mesh((2, 4), ("data", "model"), XLA_GPU_MEMORY)
    cudnn = dataclasses.replace(
        gpu, memory_layout=dataclasses.replace(XLA_GPU_MEMORY, wide_attention_held_blocks=0.0)
    )
    peaks = {}
    for name, mesh in (("gpu", gpu), ("cudnn", cudnn)):
        ip = build_problem(tiny_fused.graph, mesh, copy_buffers=True)
        solution = solve(ip.problem, solver="highs")
        plan = plan_from_solution(ip, solution)
        peaks[name] = peak_memory(ip.problem, solution.strategy)
        assert peaks[name] == pytest.approx(plan.predicted_peak_bytes, rel=1e-12)
        # without copy buffers only the attention's blocks remain (none on cuDNN)
        bare = build_problem(tiny_fused.graph, mesh)
        sources = {c.source - bare.num_inputs for c in bare.problem.copies}
        held = {tiny_fused.graph.nodes[i].primitive for i in sources}
        assert held <= ATTENTION and bool(held) == (name == "gpu")
    assert peaks["gpu"] > peaks["cudnn"]


def test_xla_gpu_holds_a_forward_convs_gather_to_the_filter_gradient():
    """wresnet-tiny's heuristic plan on 2x4 gathers activations for forward convs whose
    weight gradients read them split: XLA:GPU reads the gathered copy there instead and
    holds it to the backward conv (``reused_conv_gathers``; wresnet-1b heuristic 2x4 on an
    H100: -22.9% -> +8.3%). The prediction counts it (more than without the rule) and the
    ILP's rows count it as the prediction does."""
    import dataclasses

    from autoshard.hardware.mesh import XLA_GPU_MEMORY, relative_mesh
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.intra.memory.reshard_copies import reused_gather_end
    from autoshard.intra.problem.build import plan_from_solution

    g = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8).graph
    gpu = relative_mesh((2, 4), ("data", "model"), XLA_GPU_MEMORY)
    options = baseline_options(IntraOptions(solver="highs"), gpu.mesh, "heuristic")
    pinned = baseline_inputs(g, gpu.mesh, "heuristic")
    ip = build_problem(g, gpu, options, pinned_inputs=pinned, copy_buffers=True)
    solution = solve(ip.problem, solver="highs")
    plan = plan_from_solution(ip, solution)
    assert peak_memory(ip.problem, solution.strategy) == pytest.approx(
        plan.predicted_peak_bytes, rel=1e-12
    )
    layout = dataclasses.replace(XLA_GPU_MEMORY, reused_conv_gathers=False)
    without = predicted_peak_bytes(
        g,
        plan.specs_by_tensor(g.inputs),
        dataclasses.replace(gpu, memory_layout=layout),
        plan.operand_specs,
    )
    assert plan.predicted_peak_bytes > without
    # the rule's values: read by a forward conv and, later, by a backward one
    pos = list(range(len(g.nodes)))
    held = [t for t in range(len(g.tensors)) if reused_gather_end(g, t, pos) is not None]
    assert held
    for t in held:
        convs = [g.nodes[c] for c in g.tensors[t].consumers]
        assert {"forward", "backward"} <= {n.phase for n in convs if n.primitive.startswith("conv")}


def test_xla_gpu_holds_each_kernels_cudnn_copy_to_its_backward():
    """XLA:GPU copies each conv kernel into cuDNN's ``[out, spatial, in]`` filter layout at
    its forward conv and reads the copy again in the backward-input conv (a 3x3 kernel, a
    strided 1x1) and, where the filter gradient is all-reduced whole (data parallelism),
    in the update (``cudnn_filter_copies``; wresnet-1b dp 2x4 on an H100: -14.3% ->
    +1.4%). On wresnet-tiny's dp plan on 2x4 every kernel's copy is live at the end of the
    forward pass: the GPU layout's prediction there is the kernels' bytes over the
    prediction without the rule, and the ILP's rows count what the prediction does. The
    CPU layout copies none."""
    import dataclasses

    from autoshard.hardware.mesh import XLA_CPU_MEMORY, XLA_GPU_MEMORY, relative_mesh
    from autoshard.intra.ilp import peak_memory, solve
    from autoshard.intra.memory.filter_copies import filter_copies
    from autoshard.intra.memory.model import predicted_live_bytes
    from autoshard.intra.problem.build import plan_from_solution

    g = trace_workload("wresnet-tiny", optimizer="sgd", num_layers=8).graph
    gpu = relative_mesh((2, 4), ("data", "model"), XLA_GPU_MEMORY)
    copies = filter_copies(g, gpu)
    convs = [n for n in g.nodes if n.primitive == "conv_general_dilated" and n.phase == "forward"]
    assert sorted(c.kernel for c in copies) == sorted({n.inputs[1] for n in convs})
    for c in copies:  # read back by the input gradient: wider than 1x1, or strided
        node = g.nodes[c.forward[0]]
        wide = g.tensors[c.kernel].shape[:2] != (1, 1)
        strided = node.params["window_strides"] != (1, 1)
        stem = node.inputs[0] in g.inputs  # the images: no input gradient
        assert (c.backward_input is not None) == ((wide or strided) and not stem)
        assert c.gradient_readers and c.update_end is not None
    assert filter_copies(g, relative_mesh((2, 4), ("data", "model"), XLA_CPU_MEMORY)) == []

    options = baseline_options(IntraOptions(solver="highs"), gpu.mesh, "dp")
    pinned = baseline_inputs(g, gpu.mesh, "dp")
    ip = build_problem(g, gpu, options, pinned_inputs=pinned, copy_buffers=True)
    solution = solve(ip.problem, solver="highs")
    plan = plan_from_solution(ip, solution)
    assert peak_memory(ip.problem, solution.strategy) == pytest.approx(
        plan.predicted_peak_bytes, rel=1e-12
    )
    spec_of = plan.specs_by_tensor(g.inputs)
    without = dataclasses.replace(
        gpu, memory_layout=dataclasses.replace(XLA_GPU_MEMORY, cudnn_filter_copies=False)
    )
    live = predicted_live_bytes(g, spec_of, gpu, plan.operand_specs)
    base = predicted_live_bytes(g, spec_of, without, plan.operand_specs)
    end = max(n.index for n in convs) + 1  # the last forward conv's position, from -1
    kernels = sum(g.tensors[c.kernel].nbytes * spec_of[c.kernel].shard_fraction(gpu.mesh)
                  for c in copies)  # fmt: skip
    assert kernels > 0
    assert live[end] - base[end] == pytest.approx(kernels, rel=1e-12)
    assert plan.predicted_peak_bytes > max(base)


def test_the_ilp_rows_hold_filter_copies_as_the_prediction_does():
    """The cuDNN filter copies in the ILP's rows (per layout a kernel may be given, the
    forward convs' and the updates' strategies that read it so) peak where the prediction
    of the same assignment does, for random assignments of wresnet-tiny on 2x4 with the
    GPU layout (AdamW)."""
    from autoshard.hardware.mesh import XLA_GPU_MEMORY, relative_mesh
    from autoshard.intra.ilp import peak_memory, resolve_ties

    g = trace_workload("wresnet-tiny", optimizer="adamw", num_layers=8).graph
    gpu = relative_mesh((2, 4), ("data", "model"), XLA_GPU_MEMORY)
    ip = build_problem(g, gpu, copy_buffers=True)
    pb = ip.problem
    roots, maps = resolve_ties(pb)
    allowed: dict[int, np.ndarray] = {}
    for v, r in enumerate(roots):
        ok = allowed.setdefault(r, np.ones(pb.num_strategies[r], bool))
        m = np.asarray(maps[v])
        ok &= m >= 0
        ok[m >= 0] &= np.isfinite(np.asarray(pb.node_costs[v])[m[m >= 0]])
    rng = np.random.default_rng(0)
    rows, predicted = [], []
    for _ in range(30):
        pick = {r: int(rng.choice(np.flatnonzero(ok))) for r, ok in allowed.items()}
        s = tuple(int(maps[v][pick[r]]) for v, r in enumerate(roots))
        rows.append(peak_memory(pb, s))
        predicted.append(_predicted_peak_of(ip, s))
    assert len(set(predicted)) > 10
    assert rows == pytest.approx(predicted, rel=1e-12)


def _predicted_peak_of(ip, s) -> float:
    """The predicted peak (bytes per device) of the assignment ``s`` of ``ip``: the
    layouts it gives each value and reads each operand in, as plan_from_solution's."""
    from autoshard.intra.memory.model import predicted_peak_bytes

    g = ip.graph
    chosen = [ip.strategies[i][s[i]] for i in range(len(ip.strategies))]
    spec_of = {t: chosen[i].output_specs[0] for i, t in enumerate(g.inputs)}
    for node in g.nodes:
        spec_of.update(zip(node.outputs, chosen[ip.node_of(node.index)].output_specs))
    operand_specs: dict[int, dict[int, ShardingSpec]] = {}
    for op in ip.operands:
        if op.slot >= 0 and op.dst >= ip.num_inputs:
            want = chosen[op.dst].input_specs[op.slot]
            if want is not None and want != spec_of.get(op.tensor):
                operand_specs.setdefault(op.dst - ip.num_inputs, {})[op.slot] = want
    peak = predicted_peak_bytes(g, spec_of, ip.mesh, operand_specs, ip.host_tensors)
    return peak + ip.staging_bytes


def test_the_ilp_memory_rows_keep_a_gradient_for_any_layout_it_is_reduced_to():
    """On XLA:CPU a weight gradient copied at the combined all-reduce is kept from its own
    buffer's end to there, whichever layout its reader reads it in: the rows' peak equals
    the prediction for random assignments of an MLP on 2x4 (AdamW). (Before the fix the
    kept gradient counted only for the first layout its transpose may read, so 59 of
    these 200 assignments peaked lower in the rows than predicted, and
    ``autoshard plan --model mlp --batch 16 --hidden 16 --mesh 2x4 --memory-budget
    0.0000023395`` stopped on an internal error.)"""
    from autoshard.api import device_mesh_for
    from autoshard.intra.ilp import peak_memory, resolve_ties

    mlp = trace_workload("mlp", optimizer="adamw", batch_size=16, hidden=16)
    mesh = device_mesh_for((2, 4))
    assert mesh.memory_layout.late_updates
    ip = build_problem(mlp.graph, mesh, copy_buffers=True)
    pb = ip.problem
    roots, maps = resolve_ties(pb)
    allowed: dict[int, np.ndarray] = {}  # root -> its strategies every tied node allows
    for v, r in enumerate(roots):
        ok = allowed.setdefault(r, np.ones(pb.num_strategies[r], bool))
        m = np.asarray(maps[v])
        ok &= m >= 0
        ok[m >= 0] &= np.isfinite(np.asarray(pb.node_costs[v])[m[m >= 0]])
    rng = np.random.default_rng(0)
    rows, predicted = [], []
    for _ in range(200):
        pick = {r: int(rng.choice(np.flatnonzero(ok))) for r, ok in allowed.items()}
        s = tuple(int(maps[v][pick[r]]) for v, r in enumerate(roots))
        rows.append(peak_memory(pb, s))
        predicted.append(_predicted_peak_of(ip, s))
    assert len(set(predicted)) > 10  # the assignments differ in what they hold
    assert rows == pytest.approx(predicted, rel=1e-12)


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_open_loop_memory_model_keeps_compiled_within_budget(gpt350m_2l):
    """Without the compile loop: the plan auto_shard_graph makes for a 1.6 GB budget, its
    memory predicted as XLA:CPU lays it out, compiles within it (predicted 1,597.6 MB,
    compiled 1,597.9 MB). The least-cost plan sits 0.2% under the budget: the model must
    count what XLA:CPU keeps -- the scatter's zeros made at the start, the LayerNorms'
    broadcasts its reductions read -- or the plan does not fit (planned with no layout:
    predicted 1,589 MB, compiled 1,649 MB)."""
    mesh = alpa_test_mesh((8,), ("data",), memory_layout=xla_cpu_memory_layout())
    plan = auto_shard_graph(gpt350m_2l.graph, mesh, HIGHS.replace(memory_budget_bytes=1.6e9))
    report = verify_plan(gpt350m_2l.program, plan, devices=jax.devices()[:8])
    assert plan.predicted_peak_bytes <= 1.6e9
    assert report.compiled_peak_bytes <= 1.6e9
    assert abs(report.compiled_peak_bytes - plan.predicted_peak_bytes) < 0.1 * 1.6e9


GPT350M_2L = dict(optimizer="adamw", batch_size=8, num_layers=2)


# one budget a test: two shorter tests share out better over the xdist workers
@pytest.mark.parametrize(
    "budget", [pytest.param(2.0e9, marks=pytest.mark.heavy), 1.6e9]
)  # the looser budget: heavy (CI's heavy step)
def test_closed_loop_budget_holds_for_the_compiled_step(budget):
    from autoshard.api import plan_workload

    bound = plan_workload(
        "gpt-350m", "8", options=HIGHS.replace(memory_budget_bytes=budget), **GPT350M_2L
    )
    assert bound.verify().compiled_peak_bytes <= budget
    assert any("compiled" in note for note in bound.plan.notes)


def test_closed_loop_refuses_with_the_smallest_peak_or_the_compiled_estimate():
    """Both refusals of the closed loop, on a small MLP: below the smallest peak any plan
    reaches, the model's own error (proven); above it, but where XLA compiles even the
    smallest plan over the budget, "no plan compiles within" with the estimate."""
    from autoshard.api import plan_workload
    from autoshard.intra.ilp import InfeasibleBudgetError

    sizes = dict(batch_size=16, hidden=16)  # 817 B of state per device; least peak 2,484 B
    with pytest.raises(
        InfeasibleBudgetError, match=r"proven by the solver\): the least peak"
    ) as err:
        plan_workload("mlp", "2x4", options=HIGHS.replace(memory_budget_bytes=2000.0), **sizes)
    least = err.value.min_feasible_bytes
    assert err.value.proven and least > 2000.0
    # 2,800 B: above the least peak, but XLA compiled the least plan at 1.37x its
    # prediction when written
    budget = 2800.0
    assert least < budget
    with pytest.raises(InfeasibleBudgetError, match="no plan compiles within") as err:
        plan_workload("mlp", "2x4", options=HIGHS.replace(memory_budget_bytes=budget), **sizes)
    assert err.value.min_feasible_bytes > budget  # the estimate of what would compile


# slow: the time-limited search for the smallest peak runs its whole 60 s; the same
# refusal through plan_workload is checked fast on an MLP (the test above)
@pytest.mark.slow
def test_closed_loop_refuses_a_budget_below_gpt350m_smallest_peak():
    from autoshard.api import plan_workload
    from autoshard.intra.ilp import InfeasibleBudgetError

    # 1.0 GB: the model already finds no plan (its error states the least peak found; the
    # sweep above proves 1.0 GB out of reach); budgets the model accepts but XLA does not
    # get "no plan compiles within". With 1.2 GB, used until the LayerNorm broadcasts were
    # counted as XLA:CPU holds them (2026-11-27), HiGHS now neither finds a plan nor proves
    # none within the 60 s (SolverTimeLimitError; load 5-7)
    with pytest.raises(InfeasibleBudgetError, match="no plan compiles within|least peak"):
        plan_workload(
            "gpt-350m", "8", options=HIGHS.replace(memory_budget_bytes=1.0e9), **GPT350M_2L
        )


def test_bad_inputs_get_clear_errors(tiny):
    from autoshard.api import device_mesh_for, parse_mesh_shape
    from autoshard.intra.ilp import solve

    with pytest.raises(ValueError, match="2x4"):
        parse_mesh_shape("2by4")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(alpa_test_mesh((4, 4), ("data", "model")).mesh)
    with pytest.raises(ValueError, match="does not exist"):
        ShardingSpec((("nope",), ())).validate(device_mesh_for((2, 4)).mesh, (8, 8))
    ip = build_problem(tiny.graph, alpa_test_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="cbc"):
        solve(ip.problem, solver="gurobi")


# by default on a 3-layer MLP (1.8 CPU-s); gpt-tiny (8.6 s) in CI's heavy step
@pytest.mark.parametrize(
    "model, sizes",
    [
        ("mlp", dict(batch_size=256, hidden=64, num_layers=3)),
        pytest.param("gpt-tiny", {}, marks=pytest.mark.heavy),
    ],
    ids=["mlp", "gpt-tiny"],
)
def test_zero2_with_optimizer_state_trains_like_one_device(model, sizes):
    """ZeRO-2 only differs from DP when the optimizer has state: SGD with momentum."""
    import optax

    from autoshard.ir.graph import build_graph
    from autoshard.models import get_workload, make_train_step
    from autoshard.trace.jaxpr import trace_train_step

    w = get_workload(model, **sizes)
    opt = optax.sgd(1e-2, momentum=0.9)
    program = trace_train_step(make_train_step(w.loss_fn, opt), *w.abstract_train_args(opt))
    graph = build_graph(program.records)
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    plan = auto_shard_graph(
        graph,
        mesh,
        HIGHS,
        pinned_inputs=baseline_inputs(graph, mesh.mesh, "zero2"),
        name="zero2",
    )
    momenta = [
        s for t, s in zip(graph.inputs, plan.input_specs) if graph.tensors[t].kind == "opt_state"
    ]
    assert momenta and all(not s.is_replicated for s in momenta if s.rank)
    args = w.init_train_args(opt)
    report = check_against_single_device(
        program, plan, make_mesh(plan.mesh, jax.devices()[:8]), args, num_steps=2, rtol=1e-5
    )
    assert report.ok, report


@pytest.fixture(scope="module")
def tiny4():
    return trace_workload("gpt-tiny", optimizer="sgd", num_layers=4)


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_deeper_gpt_auto_plan_trains_like_one_device(tiny4):
    _assert_trains_like_one_device(tiny4, _plan(tiny4, (2, 4)))


# Plans on 2-D meshes whose predicted collectives equal the compiled ones (kind, mesh
# axes, bytes within 2%): locked in so that a cost-model change cannot lose them.
# zero3 on 2x4 still disagrees (see docs/truth.md).
# megatron on 2x4: heavy (CI's heavy step); the same plan's collectives are XLA's (all
# all-reduces) by default in tests/test_megatron_strict.py
AGREE_2D = [
    pytest.param((2, 4), "megatron", marks=pytest.mark.heavy),
    ((4, 2), None),
    ((4, 2), "megatron"),
    ((4, 2), "zero3"),
]
AGREE_2D_SLOW = [((2, 4), None), ((2, 4), "zero2"), ((4, 2), "dp")]


def _assert_collectives_agree(tiny, shape, which):
    plan = _plan(tiny, shape, which)
    report = verify_plan(tiny.program, plan, devices=jax.devices()[: plan.mesh.num_devices])
    assert report.collectives_agree, report.comparison.format()


@pytest.mark.parametrize("shape, which", AGREE_2D, ids=str)
def test_2d_mesh_collectives_match_xla(tiny, shape, which):
    _assert_collectives_agree(tiny, shape, which)


@pytest.mark.slow
@pytest.mark.parametrize("shape, which", AGREE_2D_SLOW, ids=str)
def test_2d_mesh_collectives_match_xla_slow(tiny, shape, which):
    _assert_collectives_agree(tiny, shape, which)


@pytest.mark.slow
def test_zero2_on_4x2_once_disagreed_by_one_all_to_all_over_model(tiny):
    # Was a known, named disagreement: XLA added one 24,576-byte all-to-all over `model`
    # that the plan did not predict. Found agreeing on 2026-11-28 (this slow test, which
    # still asserted the disagreement, failed; bench_truth's zero2 4x2 row agrees too).
    plan = _plan(tiny, (4, 2), "zero2")
    report = verify_plan(tiny.program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_deeper_zero3_on_4x2_collectives_match_xla(tiny4):
    """Reductions and scatter-adds (the bias and embedding gradients) leave partial sums
    that XLA reduces where they are made, before slicing: all-reduce + dynamic-slice, a
    reduce-scatter only when the slice is exactly the reduced axes'."""
    _assert_collectives_agree(tiny4, (4, 2), "zero3")


@pytest.mark.slow
def test_zero3_on_2x4_once_disagreed_where_xla_exchanges_over_part_of_an_axis(tiny):
    # Was a known, named disagreement: XLA splits the 4-device model axis and runs an
    # all-to-all over pairs of it, which the verifier read as axes "?". Found agreeing on
    # 2026-11-28, no such all-to-all left (this slow test, which still asserted the
    # disagreement, failed); whether the plan or its prediction moved was not bisected
    # (the planner has since priced XLA's own routes, all-to-alls over part of an axis too).
    plan = _plan(tiny, (2, 4), "zero3")
    report = verify_plan(tiny.program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()
    assert not any(c.axes == ("?",) for c in report.compiled_collectives)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["megatron", None], ids=["megatron", "auto"])
def test_deeper_megatron_on_4x2_collectives_match_xla(tiny4, which):
    # Was a known disagreement (docs/truth.md): a LayerNorm-backward value the plan moved
    # with a 256-byte all-gather over `model`, which XLA moved with an 8 KiB all-to-all.
    # Megatron now keeps activations split over `data` (baseline_options), and the auto
    # plan ties the 4 blocks two at a time; neither plan moves that value any more.
    plan = _plan(tiny4, (4, 2), which)
    report = verify_plan(tiny4.program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()


# gpt-tiny's 1 block by default (6.0 CPU-s), its default 2 in CI's heavy step (8.8 s)
@pytest.mark.parametrize(
    "layers", [1, pytest.param(2, marks=pytest.mark.heavy)], ids=["1-layer", "2-layer"]
)
def test_bf16_plan_collectives_match_xla_after_upcast_normalisation(layers):
    """XLA:CPU moves some bf16 tensors through all-gathers and all-to-alls as f32 (the
    convert hoisted above the data movement, for its f32 dots); the verifier counts them in
    bf16, and an f32 value the program made itself keeps its f32 bytes."""
    traced = trace_workload("gpt-tiny", optimizer="adamw", dtype="bfloat16", num_layers=layers)
    mesh = alpa_test_mesh((8,), ("data",))
    # dp's pinned inputs without its data-parallel rule (baseline_options), all-to-alls
    # priced as when written: the ILP then moves bf16 activations and the logits gradient
    # through all-gathers and all-to-alls, which this test needs
    pinned = baseline_inputs(traced.graph, mesh.mesh, "dp")
    plan = auto_shard_graph(
        traced.graph, mesh, A2A_AS_WRITTEN_8, pinned_inputs=pinned, name="dp-pins"
    )
    report = verify_plan(traced.program, plan, devices=jax.devices()[:8])
    assert report.collectives_agree, report.comparison.format()
    assert any("bf16 upcast to f32 normalised" in note for note in report.compiled_notes)
    kinds = {c.kind for c in report.compiled_collectives}
    assert {"all-gather", "all-to-all"} <= kinds
