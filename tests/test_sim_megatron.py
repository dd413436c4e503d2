"""GEMM tables and the Megatron step-time simulator, including the published validation."""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import load_benchmark
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.hardware.clusters import load_cluster
from autoshard.hardware.gemm import GemmTable, available_gemm_tables, memory_bound_time
from autoshard.sim.megatron import GPTShape, MegatronConfig, bubble_fraction, simulate_megatron

GPT_18B = GPTShape(hidden=6144, layers=40, heads=48)
GPT_39B_ALPA = GPTShape(hidden=8192, layers=48, heads=64, vocab=51200, seq_len=1024)


# ---------------------------------------------------------------------------- GEMM tables


@pytest.mark.parametrize(
    "name, origin", [("v100", "Modelled, not measured"), ("a100", "Modelled, not measured"),
                     ("h100", "Measured, not modelled")],
)  # fmt: skip
def test_gemm_table_exact_at_table_points(name, origin):
    table = GemmTable.load(name)
    assert name in available_gemm_tables()
    assert table.source.startswith(origin)  # honest about where the numbers come from
    for dtype in table.dtypes:
        rows = table.rows[dtype]
        for m, n, k, tflops in rows[:: max(1, len(rows) // 97)]:
            assert math.isclose(table.tflops(m, n, k, dtype), tflops, rel_tol=1e-12)


def test_gemm_table_clamps_outside_its_range():
    table = GemmTable.load("h100")
    sizes = sorted({row[0] for row in table.rows["bf16"]})
    lo, hi = sizes[0], sizes[-1]
    assert table.efficiency(2**24, 2**20, 2**18, "bf16") == table.efficiency(hi, hi, hi, "bf16")
    assert table.efficiency(1, 2, 3, "bf16") == table.efficiency(lo, lo, lo, "bf16")
    assert table.efficiency(1, 2**20, 3, "bf16") == table.efficiency(lo, hi, lo, "bf16")


def test_gemm_efficiency_grows_with_square_size():
    table = GemmTable.load("a100")
    effs = [table.efficiency(2**i, 2**i, 2**i, "fp16") for i in range(5, 17)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(effs))
    assert effs[0] < 0.05 < 0.5 < effs[-1] <= 1.0


@settings(max_examples=50, deadline=None)
@given(st.floats(5, 16), st.floats(5, 16), st.floats(5, 16))
def test_gemm_interpolation_stays_between_grid_neighbours(lm, ln, lk):
    table = GemmTable.load("h100")
    m, n, k = 2**lm, 2**ln, 2**lk
    corners = [
        table.efficiency(2 ** f(lm), 2 ** g(ln), 2 ** q(lk), "bf16")
        for f in (math.floor, math.ceil)
        for g in (math.floor, math.ceil)
        for q in (math.floor, math.ceil)
    ]
    eff = table.efficiency(m, n, k, "bf16")
    assert min(corners) - 1e-12 <= eff <= max(corners) + 1e-12


def test_scattered_table_uses_inverse_distance_and_is_exact_at_rows():
    rows = [[64, 64, 64, 10.0], [4096, 4096, 4096, 80.0], [64, 4096, 256, 30.0]]
    table = GemmTable.from_json(
        {"device": "toy", "source": "test", "peak_tflops": {"bf16": 100.0}, "rows": {"bf16": rows}}
    )
    for m, n, k, tflops in rows:
        assert table.tflops(m, n, k, "bf16") == tflops
    mid = table.efficiency(512, 512, 512, "bf16")
    assert 0.10 < mid < 0.80


def test_gemm_time_and_errors():
    table = GemmTable.load("a100")
    t = table.gemm_time(4096, 4096, 4096, "bf16", device_peak=300e12)
    assert math.isclose(t, 2 * 4096**3 / (300e12 * table.efficiency(4096, 4096, 4096, "bf16")))
    batched = table.gemm_time(128, 256, 64, "bf16", batch=32)
    assert math.isclose(batched, table.gemm_time(32 * 128, 256, 64, "bf16"))
    with pytest.raises(ValueError, match="no rows for dtype"):
        table.efficiency(64, 64, 64, "int8")
    with pytest.raises(ValueError, match="available"):
        GemmTable.load("tpu-v5e")
    assert memory_bound_time(2e12, 2e12) == 1.0


# ---------------------------------------------------------------------------- simulator


def _sim(model, cluster_name="dgx-a100", **kw):
    cfg = MegatronConfig(**kw)
    return simulate_megatron(model, cfg, load_cluster(cluster_name, num_gpus=cfg.num_gpus))


def test_breakdown_sums_to_step_time_and_flops_are_consistent():
    r = _sim(GPT_18B, tp=8, pp=2, dp=2, micro_batch=2, global_batch=64, virtual_stages=2)
    assert math.isclose(sum(r.breakdown.values()), r.step_time_s, rel_tol=1e-12)
    assert math.isclose(r.tflops_per_device * 1e12, r.hfu * 312e12, rel_tol=1e-9)
    assert r.mfu < r.hfu  # full recompute by default
    assert math.isclose(r.tokens_per_s, 64 * 2048 / r.step_time_s)
    none = _sim(GPT_18B, tp=8, pp=1, dp=1, micro_batch=1, global_batch=4, recompute="none")
    assert math.isclose(none.mfu, none.hfu, rel_tol=1e-12)


def test_more_tensor_parallel_less_memory_per_device():
    mems = [
        _sim(GPT_18B, tp=t, pp=1, dp=1, micro_batch=1, global_batch=8).memory_bytes_per_device
        for t in (1, 2, 4, 8)
    ]
    assert all(b < a for a, b in itertools.pairwise(mems))


def test_sequence_parallel_and_recompute_save_memory():
    kw = dict(tp=8, pp=1, dp=1, micro_batch=4, global_batch=8)
    sp = _sim(GPT_18B, sequence_parallel=True, recompute="selective", **kw)
    no_sp = _sim(GPT_18B, sequence_parallel=False, recompute="selective", **kw)
    none = _sim(GPT_18B, recompute="none", **kw)
    assert sp.memory_bytes_per_device < no_sp.memory_bytes_per_device
    assert no_sp.memory_bytes_per_device < none.memory_bytes_per_device
    assert none.step_time_s < no_sp.step_time_s  # recompute costs time


def test_bubble_shrinks_with_more_microbatches_and_interleaving():
    def bubble_share(gbs, v=1):
        r = _sim(GPT_18B, tp=8, pp=4, dp=1, micro_batch=1, global_batch=gbs, virtual_stages=v)
        return r.breakdown["pipeline_bubble"] / r.step_time_s, r

    shares = [bubble_share(g)[0] for g in (4, 8, 16, 64)]
    assert all(b < a for a, b in itertools.pairwise(shares))
    assert bubble_share(16, v=2)[0] < bubble_share(16, v=1)[0]


def _busy_and_bubble(model, **kw):
    r = _sim(model, **kw)
    busy = sum(
        val
        for k, val in r.breakdown.items()
        if k in ("compute_gemm", "compute_elementwise", "tp_comm", "pp_p2p")
    )
    return busy, r.breakdown["pipeline_bubble"]


@pytest.mark.parametrize("v", [1, 2])
def test_bubble_is_the_other_stages_time(v):
    """1F1B's bubble is the time of the p - 1 stages other than the slowest, / v: with
    (nearly) equal stages it is (p-1)/(v m) of the busy time; a heavy last stage (the
    logits of a large vocabulary) sets the busy time but not the bubble."""
    kw = dict(tp=8, pp=4, dp=1, micro_batch=1, global_batch=16, virtual_stages=v)
    tiny_vocab = GPTShape(hidden=6144, layers=40, heads=48, vocab=64)
    busy, bubble = _busy_and_bubble(tiny_vocab, **kw)
    assert bubble / busy == pytest.approx(bubble_fraction(4, 16, v), rel=0.01)
    big_vocab = GPTShape(hidden=6144, layers=40, heads=48, vocab=8 * 51200)
    busy_big, bubble_big = _busy_and_bubble(big_vocab, **kw)
    # the logit GEMM lengthens the last stage by about 8% here: the bubble stays put
    assert busy_big > 1.05 * busy
    assert bubble_big == pytest.approx(bubble, rel=0.01)
    assert bubble_big / busy_big < 0.96 * bubble_fraction(4, 16, v)


def test_unfused_gradient_accumulation_is_one_pass_per_microbatch():
    """2021's ``main_grad.add_(grad)``: per micro-batch, the 16-bit gradient read and the
    16-bit buffer read and written (fp16: 6 bytes; bf16, whose buffer Megatron-LM keeps in
    fp32: 10), over every parameter of the (one) stage."""
    h, layers, vocab, s = GPT_18B.hidden, GPT_18B.layers, GPT_18B.vocab, GPT_18B.seq_len
    params = (12 * h * h + 13 * h) * layers / 8 + vocab * h / 8 + s * h + 2 * h
    hbm = load_cluster("dgx-a100").device.hbm_bandwidth
    for dtype, bytes_per_param in (("fp16", 6), ("bf16", 10)):
        kw = dict(tp=8, pp=1, dp=1, micro_batch=2, global_batch=8, dtype=dtype)
        fused = _sim(GPT_18B, **kw)
        unfused = _sim(GPT_18B, grad_accumulation="unfused", **kw)
        want = 4 * memory_bound_time(bytes_per_param * params, hbm)  # 4 micro-batches
        assert unfused.step_time_s - fused.step_time_s == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="grad_accumulation must be one of"):
        _sim(GPT_18B, grad_accumulation="lazy", **kw)


def test_sequence_parallel_overlaps_the_backward_reduce_scatter():
    """With sequence parallelism the column-parallel linears' backward reduce-scatter runs
    under the weight-gradient GEMM (Megatron-LM's code always does): the exposed TP time
    drops by two reduce-scatters per layer and micro-batch (each shorter than its GEMM
    here), and forcing it off gives the blocking step back."""
    from autoshard.hardware.mesh import to_device_mesh
    from autoshard.intra.cost.resharding import CostOptions, reduce_scatter_cost

    kw = dict(tp=8, pp=1, dp=1, micro_batch=1, global_batch=4, sequence_parallel=True)
    default = _sim(GPT_18B, recompute="selective", **kw)
    blocking = _sim(GPT_18B, recompute="selective", tp_comm_overlap=False, **kw)
    cluster = load_cluster("dgx-a100", num_gpus=8)
    mesh = to_device_mesh(cluster, (1, 1, 8), ("pipe", "data", "model"), "fp16")
    sbh = GPT_18B.seq_len * GPT_18B.hidden
    rs = reduce_scatter_cost(mesh, "model", sbh * 2, CostOptions(tie_breakers=False))
    hidden = 4 * GPT_18B.layers * 2 * rs  # 4 micro-batches, 2 per layer
    saved = blocking.breakdown["tp_comm"] - default.breakdown["tp_comm"]
    assert saved == pytest.approx(hidden, rel=1e-9)
    assert blocking.step_time_s - default.step_time_s == pytest.approx(hidden, rel=1e-9)


def test_gpt_39b_does_not_fit_one_v100_but_350m_does():
    big = _sim(GPT_39B_ALPA, "alpa-v100", tp=1, pp=1, dp=1, micro_batch=1, global_batch=1)
    assert big.oom and big.memory_bytes_per_device > 16 * 2**30
    small_model = GPTShape(hidden=1024, layers=24, heads=16, seq_len=1024)
    small = _sim(small_model, "alpa-v100", tp=1, pp=1, dp=1, micro_batch=1, global_batch=8)
    assert not small.oom


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a multiple of micro_batch x dp"):
        _sim(GPT_18B, tp=8, pp=1, dp=2, micro_batch=3, global_batch=8)
    with pytest.raises(ValueError, match="num_gpus=16"):
        simulate_megatron(
            GPT_18B,
            MegatronConfig(tp=8, pp=1, dp=2, micro_batch=1, global_batch=8),
            load_cluster("dgx-a100"),
        )
    with pytest.raises(ValueError, match="equal chunks"):
        _sim(GPT_18B, tp=8, pp=3, dp=1, micro_batch=1, global_batch=8)


def test_megatron_table_1_within_15_percent():
    rows = [
        r for r in load_benchmark("validate_megatron").validate() if r["source"] == "sc21-table1"
    ]
    assert len(rows) == 10
    for row in rows:
        assert not row["oom"], row["model"]
        assert abs(row["error_percent"]) <= 15.0, row


def test_a100_and_h100_hold_on_rows_they_were_not_calibrated_on():
    """Validation rows (never used to fit): on A100 (Korthikanti et al. 2022: sequence
    parallel + selective recompute, pipelines up to 64 deep) the mean |error| is at most 8%
    and no row is above 12% (issue #32); on H100 (the step measured here) at most 10% and
    15%."""
    rows = load_benchmark("validate_megatron").validate()
    for device, mean_limit, max_limit in (("a100", 8.0, 12.0), ("h100", 10.0, 15.0)):
        errors = [
            abs(r["error_percent"])
            for r in rows
            if r["device"] == device and r["role"] == "validation"
        ]
        assert len(errors) >= 3, device
        assert max(errors) <= max_limit, (device, errors)
        assert sum(errors) / len(errors) <= mean_limit, (device, errors)
    deep = [r for r in rows if r["source"] == "korthikanti22" and r["pp"] >= 35]
    assert len(deep) == 2 and all(abs(r["error_percent"]) <= 12.0 for r in deep), deep


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_calibration_and_validation_rows_are_apart_and_the_fit_is_reproduced():
    """Each modelled table's 16-bit efficiency, and the 2019 software's per-step
    tensor-parallel cost, are what calibration on the calibration rows finds (and nothing
    else is fitted); no row is in both sets."""
    bench = load_benchmark("validate_megatron")
    runs = load_benchmark("published_runs").ALL_RUNS
    assert {r.role for r in runs} == {"calibration", "validation"}
    assert len({(r.source, r.name) for r in runs}) == len(runs)
    tables = load_benchmark("make_gemm_tables")
    for device, shipped in tables.CALIBRATED.items():
        fit = bench.calibrate(device)
        assert fit["efficiency"] == shipped, fit
        assert GemmTable.load(device).efficiency(8192, 8192, 8192, "fp16") == pytest.approx(
            shipped, rel=0.02
        )
        overhead = tables.CALIBRATED_TP_STEP_OVERHEAD_S.get(device)
        assert fit.get("tp_step_overhead_s") == overhead, fit
        assert GemmTable.load(device).tp_step_overhead_s == (overhead or 0.0)
    # the cost is fitted on the three model-parallel weak-scaling runs only
    fit = bench.calibrate("v100-megatron2019")
    assert (fit["efficiency_rows"], fit["tp_step_overhead_rows"]) == (1, 3)


def test_tensor_parallel_step_overhead_is_charged_as_fitted():
    """A table's ``tp_step_overhead_s`` c adds c (1 - 1/t) seconds per step to the model
    axis's communication and nothing at t = 1; the shipped tables other than Megatron-LM
    2019's carry none; a bad value in a table file is refused."""
    tables = load_benchmark("make_gemm_tables")
    model = GPTShape(hidden=1536, layers=40, heads=16, seq_len=1024)
    eff = tables.CALIBRATED["v100-megatron2019"]
    without = GemmTable.from_json(tables.make_table("v100-megatron2019", eff, 0.0))
    with_c = GemmTable.from_json(tables.make_table("v100-megatron2019", eff, 0.5))
    assert with_c.tp_step_overhead_s == 0.5 and "0.5 s x (1 - 1/t)" in with_c.source
    for t in (1, 2, 8):
        cfg = MegatronConfig(tp=t, pp=1, dp=1, micro_batch=8, global_batch=8)
        cluster = load_cluster("dgx2h-v100", num_gpus=t)
        a = simulate_megatron(model, cfg, cluster, without)
        b = simulate_megatron(model, cfg, cluster, with_c)
        extra = 0.5 * (1 - 1 / t)
        assert b.step_time_s == pytest.approx(a.step_time_s + extra, rel=1e-12)
        assert b.step_breakdown["comm_model"] == pytest.approx(
            a.step_breakdown["comm_model"] + extra, rel=1e-12, abs=1e-15
        )
        assert b.step_breakdown["compute"] == a.step_breakdown["compute"]
        assert math.isclose(sum(b.step_breakdown.values()), b.step_time_s, rel_tol=1e-9)
    for name in ("a100", "v100", "h100"):
        assert GemmTable.load(name).tp_step_overhead_s == 0.0
    for bad in (-0.1, float("nan"), "0.3"):
        obj = dict(with_c.to_json(), tp_step_overhead_s=bad)
        with pytest.raises(ValueError, match="tp_step_overhead_s must be a finite number"):
            GemmTable.from_json(obj)


def test_v100_holds_on_rows_it_was_not_calibrated_on():
    """Megatron-LM 2019 on DGX-2H (level from its 1-GPU row, tensor-parallel step cost from
    its three model-parallel weak-scaling rows: the calibration): the nine validation rows
    -- 64-way data parallelism alone and with model parallel 2/4/8 across nodes, the
    strong scaling of the 1.2B model on 2/4/8 GPUs, and the 8-way 8.3B model with 16 and 24
    heads -- stay within 15% (mean 10%); the strong-scaling rows, which no model-parallel
    run of another model calibrates, are among them. The data-parallel rows hold only with
    node-aware all-reduces (a flat ring at one GPU's NIC share is 11-23% too slow)."""
    rows = [
        r
        for r in load_benchmark("validate_megatron").validate()
        if r["source"] == "shoeybi19" and r["role"] == "validation"
    ]
    assert len(rows) == 9 and {r["gemm_table"] for r in rows} == {"v100-megatron2019"}
    assert sum("strong" in r["model"] for r in rows) == 3
    errors = [abs(r["error_percent"]) for r in rows]
    assert max(errors) <= 15.0 and sum(errors) / len(errors) <= 10.0, errors
    # and every V100 validation row (both V100 tables), the acceptance's grouping
    summary = load_benchmark("validate_megatron").summary(
        load_benchmark("validate_megatron").validate()
    )
    (v100,) = [s for s in summary if (s["device"], s["role"]) == ("v100", "validation")]
    assert v100["max_abs_error_percent"] <= 15.0 and v100["mean_abs_error_percent"] <= 10.0


@pytest.mark.parametrize("name", ["v100", "v100-megatron2019"])
def test_v100_table_shapes_against_deepbench(name):
    """The V100 tables' skinny-GEMM factor is fitted to a published V100 GEMM benchmark
    (DeepBench, fp16, CUDA 10.1; benchmarks/make_gemm_tables.py): relative to each side's
    large-GEMM rate, every group of DeepBench rows by smallest dimension now agrees with the
    table within 5% (median; in-sample: these rows set the factor). Before the fit the
    groups <= 64 and 65-256 ran at 0.28 and 0.50 of the modelled rate."""
    result = load_benchmark("compare_gemm_deepbench").compare(name)
    groups = {g["smallest_dim"]: g for g in result["groups"]}
    assert sum(g["rows"] for g in groups.values()) == 159  # one transcribed row has no time
    assert set(groups) == {"<= 64", "65-256", "257-1023", ">= 1024"}
    for label, group in groups.items():
        assert abs(group["median_measured_over_modelled"] - 1) <= 0.05, (label, group)
    # skinny GEMMs are slow relative to large ones on both sides (not a flat table)
    assert groups["<= 64"]["median_modelled_relative"] < 0.2
    assert groups["65-256"]["median_modelled_relative"] < 0.5


def test_small_shape_factor_keeps_the_calibrated_level():
    """The DeepBench factor is a ratio of rates: 1 from a smallest dimension of 1024 up (the
    calibrated large-GEMM level is untouched), below 1 under it and rising from 32 through
    128 to 512 (DeepBench's medians, not forced monotone: at 8 and 16 they are within 1%)."""
    tables = load_benchmark("make_gemm_tables")
    spec = tables.DEVICES["v100-megatron2019"]
    peak, eff, itemsize = spec["dtypes"]["fp16"]
    anchors = tables.small_shape_anchors(peak, eff, itemsize, spec)
    assert set(anchors) <= set(tables.DEEPBENCH_ANCHORS) and len(anchors) >= 5
    factors = [tables.small_shape_factor(d, anchors) for d in (4, 8, 16, 32, 64, 96, 128, 192, 512)]
    assert all(0 < f < 1 for f in factors)
    by_dim = dict(zip((4, 8, 16, 32, 64, 96, 128, 192, 512), factors, strict=True))
    assert by_dim[32] < by_dim[128] < by_dim[512] and by_dim[4] == by_dim[8]
    assert tables.small_shape_factor(1024, anchors) == 1.0
    assert tables.small_shape_factor(8192, anchors) == 1.0
    table = GemmTable.load("v100-megatron2019")
    roofline = tables.roofline_gemm_tflops(8192, 8192, 8192, peak, eff, itemsize, spec)
    assert table.tflops(8192, 8192, 8192, "fp16") == pytest.approx(roofline, rel=1e-4)
    skinny = tables.roofline_gemm_tflops(8192, 64, 8192, peak, eff, itemsize, spec)
    assert table.tflops(8192, 64, 8192, "fp16") == pytest.approx(skinny * anchors[64], rel=1e-4)


def test_host_overhead_what_if_on_the_2019_rows():
    """benchmarks/studies/host_overhead_v100.py (docs/validation.md): Megatron-LM 2019's kernels per
    step as counted from its code, and PyTorch's published per-op host time (280k ops/s):
    with the host running ahead of the GPU the term never binds on these rows (26 ms
    against a step of 0.42 s or more), so the shipped model is what the principled
    variant predicts."""
    bench = load_benchmark("studies/host_overhead_v100")
    runs = {r.name: r for r in bench.SHOEYBI_19}
    baseline, strong8 = runs["1.2B 1 GPU (baseline)"], runs["1.2B MP 8 (strong)"]
    assert bench.kernels_per_step(baseline) == 40 * 120 + 30 + 5 * (12 * 40 + 4)
    assert bench.kernels_per_step(strong8) == bench.kernels_per_step(baseline)
    assert bench.step_with_host(0.5, 1000, 1e-4, "async") == 0.5
    assert bench.step_with_host(0.05, 1000, 1e-4, "async") == pytest.approx(0.1)
    assert bench.step_with_host(0.5, 1000, 1e-4, "additive") == pytest.approx(0.6)
    table = GemmTable.load(bench.TABLE)
    priced = bench.price(strong8, table, bench.HOST_SECONDS_PER_OP, "async")
    plain = load_benchmark("validate_megatron").price(strong8, table)
    assert priced["step_s"] == plain["result"].step_time_s
    assert bench.kernels_per_step(strong8) * bench.HOST_SECONDS_PER_OP < 0.1 * priced["step_s"]


def test_elementwise_structures_fused_default_and_2019_unfused():
    """``MegatronConfig.elementwise``: "fused" (the default, Megatron's fused kernels, backward
    streams twice the forward bytes) or "megatron-lm-2019" (the unfused passes counted from
    the 2019 code), which streams more at every tensor class; a bad name is a clear error."""
    from autoshard.sim.megatron import ELEMENTWISE_PASSES

    fused, unfused = ELEMENTWISE_PASSES["fused"](2), ELEMENTWISE_PASSES["megatron-lm-2019"](2)
    assert set(fused) == set(unfused) == {"sbh", "sbh_t", "mlp_t", "att_t"}
    assert all(bwd == 2 * fwd for fwd, bwd in fused.values())
    assert unfused["sbh"] == (38, 46) and unfused["att_t"] == (21, 19)
    for key in fused:
        assert unfused[key][0] + unfused[key][1] > fused[key][0] + fused[key][1], key
    model = GPTShape(hidden=1536, layers=40, heads=16, seq_len=1024)
    kw = dict(tp=8, pp=1, dp=1, micro_batch=8, global_batch=8)
    default = _sim(model, "dgx2h-v100", **kw)
    assert _sim(model, "dgx2h-v100", elementwise="fused", **kw) == default
    old = _sim(model, "dgx2h-v100", elementwise="megatron-lm-2019", **kw)
    assert old.breakdown["compute_elementwise"] > 1.5 * default.breakdown["compute_elementwise"]
    assert old.breakdown["compute_gemm"] == default.breakdown["compute_gemm"]
    with pytest.raises(ValueError, match="elementwise must be one of"):
        _sim(model, "dgx2h-v100", elementwise="xla", **kw)


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_megatron_2019_strong_scaling_is_not_a_replicated_elementwise_part():
    """benchmarks/studies/megatron2019_elementwise.py (docs/validation.md): the time missing on the
    1.2B strong-scaling rows fits c (1 - 1/t) with c about 0.36 s, but the part of the 1-GPU
    step that does not shrink with t -- the passes over [s, b, h] tensors every TP rank
    repeats -- is 0.05 s fused and 0.07 s with the unfused 2019 kernels. The 2019 structure,
    refitted on the 1-GPU row, leaves the strong rows where they were and pushes weak-scaling
    rows past 15%; making the replicated part as large as c fixes the strong rows but makes
    the 8.3B rows, whose [s, b, h] work is 3.6x the 1.2B model's, over 15% too slow."""
    result = load_benchmark("studies/megatron2019_elementwise").analyse()
    by = {s["elementwise"]: s for s in result["structures"]}
    fused, unfused = by["fused"], by["megatron-lm-2019"]
    (hypothesis,) = [s for k, s in by.items() if k.startswith("hypothesis")]
    tables = load_benchmark("make_gemm_tables")
    assert fused["efficiency"] == tables.CALIBRATED["v100-megatron2019"]  # the shipped model
    assert unfused["efficiency"] > fused["efficiency"]
    for s in (fused, unfused):
        assert 0.3 < s["fit"]["c_s"] < 0.42
        assert max(abs(r) for r in s["fit"]["residuals_s"]) < 0.025
        assert s["one_gpu_non_shrinking_s"] < s["fit"]["c_s"] / 4
    assert unfused["one_gpu_elementwise_share"] > 1.5 * fused["one_gpu_elementwise_share"]
    rows = {s["elementwise"]: {r["model"]: r for r in s["rows"]} for s in by.values()}
    strong8 = "1.2B MP 8 (strong)"
    assert rows["megatron-lm-2019"][strong8]["error_percent"] > 60
    weak = [r for r in unfused["rows"] if r["role"] == "validation" and "strong" not in r["model"]]
    assert max(r["error_percent"] for r in weak) > 15
    assert abs(rows[hypothesis["elementwise"]][strong8]["error_percent"]) < 15
    assert rows[hypothesis["elementwise"]]["8.3B MP 8 x DP 64"]["error_percent"] < -15


def test_tensor_parallel_step_cost_form_what_if():
    """benchmarks/studies/tp_overhead_forms.py (docs/validation.md): fitted the same way on the three
    model-parallel weak-scaling runs, the shipped form c (1 - 1/t) and log2 t both keep every
    V100 validation row within 15%, while a constant per-step cost for any t > 1 misses the
    1.2B model's 8-way strong-scaling row by more than 15% -- the validation rows can tell
    the shapes apart, and the shipped one is not the only one that holds."""
    forms = {f["form"]: f for f in load_benchmark("studies/tp_overhead_forms").analyse()["forms"]}
    assert set(forms) == {"1 - 1/t", "log2 t", "t - 1", "1 (t > 1)"}
    for name in ("1 - 1/t", "log2 t"):
        assert forms[name]["validation_max_abs_error_percent"] <= 15.0, forms[name]
    constant = {r["model"]: r["error_percent"] for r in forms["1 (t > 1)"]["rows"]}
    assert constant["1.2B MP 8 (strong)"] > 15.0
    shipped_c = load_benchmark("make_gemm_tables").CALIBRATED_TP_STEP_OVERHEAD_S
    assert abs(forms["1 - 1/t"]["c_s"] - shipped_c["v100-megatron2019"]) <= 0.01
