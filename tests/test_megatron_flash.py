"""Megatron-LM's program with flash attention (``MegatronConfig.attention="flash"``,
``program="megatron-lm-flash"``) against the 2021 softmax kernels it replaces."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from autoshard.hardware.attention import BWD_FLOPS_RATIO, AttentionTiming, load_attention_table
from autoshard.hardware.clusters import load_cluster
from autoshard.hardware.gemm import GemmTable, memory_bound_time
from autoshard.sim import formulas
from autoshard.sim.megatron import GPTShape, MegatronConfig, simulate_megatron

GPT_1_3B = GPTShape(hidden=2048, layers=24, heads=32, seq_len=1024)  # the gpt-1.3b preset


def _pair(cluster="dgx-h100", **kw):
    """(softmax, flash) results of one grid point on ``cluster``."""
    cfg = MegatronConfig(**kw)
    the_cluster = load_cluster(cluster, cfg.num_gpus)
    return tuple(
        simulate_megatron(GPT_1_3B, dataclasses.replace(cfg, attention=a), the_cluster)
        for a in ("softmax", "flash")
    )


def _attention_terms(cfg: MegatronConfig):
    """Per layer and micro-batch on one H100: the softmax program's two batched attention
    GEMMs (forward, backward), its softmax + dropout bytes (forward, backward), and the
    flash kernel (forward, backward)."""
    table, h100 = GemmTable.load("h100"), load_cluster("dgx-h100", 1).device
    peak = h100.peak_flops_for("bf16")
    b, t, a, s, h = cfg.micro_batch, cfg.tp, GPT_1_3B.heads, GPT_1_3B.seq_len, GPT_1_3B.hidden
    heads, d = b * a // t, h // a
    gemms = [(heads, s, s, d), (heads, s, d, s)]
    gemm_fwd = sum(table.gemm_time(m, n, k, "bf16", peak, bt) for bt, m, n, k in gemms)
    gemm_bwd = sum(
        table.gemm_time(m, k, n, "bf16", peak, bt) + table.gemm_time(k, n, m, "bf16", peak, bt)
        for bt, m, n, k in gemms
    )
    att_bytes = (4 * 2 + 1) * heads * s * s  # fused softmax + dropout, e = 2
    timing = AttentionTiming.for_device(load_attention_table("h100"), h100.peak_flops)
    flops = 4 * heads * s * s * d
    kernel = (
        timing.seconds(flops, heads, s, d, backward=False),
        timing.seconds(BWD_FLOPS_RATIO * flops, heads, s, d, backward=True),
    )
    return (gemm_fwd, gemm_bwd), (att_bytes, 2 * att_bytes), kernel


@pytest.mark.parametrize("tp", [1, 2])
def test_flash_is_faster_smaller_and_keeps_the_dense_gemms(tp):
    """gpt-1.3b on dgx-h100: flash drops the two batched attention GEMMs and the
    softmax/dropout bytes for one kernel timed from the H100 attention table, keeps every
    dense GEMM to the bit, stashes no s x s scores, and counts the same model FLOPs."""
    cfg = MegatronConfig(tp, 1, 1, micro_batch=8, global_batch=8, recompute="none")
    softmax, flash = _pair(tp=tp, pp=1, dp=1, micro_batch=8, global_batch=8, recompute="none")
    (gemm_fwd, gemm_bwd), (bytes_fwd, bytes_bwd), kernel = _attention_terms(cfg)
    layers, hbm = GPT_1_3B.layers, load_cluster("dgx-h100", 1).device.hbm_bandwidth
    assert flash.step_time_s < 0.8 * softmax.step_time_s
    assert flash.memory_bytes_per_device < softmax.memory_bytes_per_device
    assert "compute_attention" not in softmax.breakdown  # softmax's keys as they were
    assert math.isclose(
        flash.breakdown["compute_gemm"],
        softmax.breakdown["compute_gemm"] - layers * (gemm_fwd + gemm_bwd),
        rel_tol=1e-12,
    )
    assert math.isclose(
        flash.breakdown["compute_elementwise"],
        softmax.breakdown["compute_elementwise"]
        - layers * memory_bound_time(bytes_fwd + bytes_bwd, hbm),
        rel_tol=1e-9,
    )
    assert math.isclose(flash.breakdown["compute_attention"], layers * sum(kernel), rel_tol=1e-12)
    assert sum(kernel) < gemm_fwd + gemm_bwd  # the kernel beats even the GEMMs alone
    s, b, h, a = GPT_1_3B.seq_len, 8, GPT_1_3B.hidden, GPT_1_3B.heads
    scores = 5 * a * s / (h * tp) * s * b * h  # Korthikanti's attention term per layer
    assert math.isclose(
        softmax.memory_bytes_per_device - flash.memory_bytes_per_device,
        layers * scores,
        rel_tol=1e-12,
    )
    assert math.isclose(sum(flash.breakdown.values()), flash.step_time_s, rel_tol=1e-12)
    assert math.isclose(sum(flash.step_breakdown.values()), flash.step_time_s, rel_tol=1e-9)
    # MFU counts the same full-square model FLOPs on both programs
    assert math.isclose(
        flash.mfu * flash.step_time_s, softmax.mfu * softmax.step_time_s, rel_tol=1e-12
    )


def test_flash_recompute_selective_is_free_and_full_repeats_the_forward_kernel():
    kw = dict(tp=1, pp=1, dp=1, micro_batch=8, global_batch=8)
    none, selective, full = (_pair(recompute=mode, **kw)[1] for mode in formulas.RECOMPUTE_MODES)
    assert selective.step_time_s == none.step_time_s
    assert selective.memory_bytes_per_device == none.memory_bytes_per_device
    assert selective.step_breakdown["recompute"] == 0.0
    cfg = MegatronConfig(recompute="full", **kw)
    _, _, (kernel_fwd, _) = _attention_terms(cfg)
    assert math.isclose(
        full.breakdown["compute_attention"] - none.breakdown["compute_attention"],
        GPT_1_3B.layers * kernel_fwd,
        rel_tol=1e-12,
    )
    assert full.step_time_s > none.step_time_s and full.step_breakdown["recompute"] > 0
    assert full.memory_bytes_per_device < none.memory_bytes_per_device
    # the HFU convention is unchanged: selective still counts 4 B s^2 L h as recomputed
    assert selective.hfu > selective.mfu


def test_softmax_is_the_default_and_bad_flash_requests_say_why():
    kw = dict(tp=1, pp=1, dp=1, micro_batch=8, global_batch=8, recompute="none")
    h100 = load_cluster("dgx-h100", 1)
    assert simulate_megatron(GPT_1_3B, MegatronConfig(**kw), h100) == simulate_megatron(
        GPT_1_3B, MegatronConfig(attention="softmax", **kw), h100
    )
    for v100 in ("alpa-v100", "dgx2h-v100"):
        with pytest.raises(ValueError, match="presets with one: dgx-a100, dgx-h100"):
            simulate_megatron(
                GPT_1_3B, MegatronConfig(attention="flash", **kw), load_cluster(v100, 1)
            )
    with pytest.raises(ValueError, match="16-bit"):
        simulate_megatron(GPT_1_3B, MegatronConfig(attention="flash", dtype="fp32", **kw), h100)
    with pytest.raises(ValueError, match="2019's code had no flash attention"):
        simulate_megatron(
            GPT_1_3B,
            MegatronConfig(attention="flash", elementwise="megatron-lm-2019", **kw),
            h100,
        )
    with pytest.raises(ValueError, match="attention must be one of"):
        simulate_megatron(GPT_1_3B, MegatronConfig(attention="fused", **kw), h100)


def test_flash_on_a100_uses_its_own_table():
    """dgx-a100 names the FlashAttention-2 table: flash is faster there too."""
    softmax, flash = _pair(
        "dgx-a100", tp=1, pp=1, dp=1, micro_batch=8, global_batch=8, recompute="none"
    )
    assert flash.step_time_s < softmax.step_time_s and flash.breakdown["compute_attention"] > 0


# ------------------------------------------------------- simulate(), the grid, the CLI


def test_program_megatron_lm_flash_through_simulate():
    """``simulate(program="megatron-lm-flash")``: the grid point is the flash config's, the
    searched grid and the ZeRO points run flash too, and the plan names the program."""
    from autoshard.sim.simulate import PROGRAMS, simulate

    assert "megatron-lm-flash" in PROGRAMS
    kw = dict(plan="megatron:1x1x1", microbatch_size=8, global_batch=8, recompute="none")
    softmax = simulate("gpt-1.3b", "dgx-h100", 1, **kw)
    flash = simulate("gpt-1.3b", "dgx-h100", 1, program="megatron-lm-flash", **kw)
    direct = simulate_megatron(
        GPT_1_3B,
        MegatronConfig(1, 1, 1, 8, 8, "none", attention="flash"),
        load_cluster("dgx-h100", 1),
    )
    assert flash.step_time_s == direct.step_time_s
    assert flash.peak_bytes_per_device == direct.memory_bytes_per_device
    assert flash.plan["program"] == "megatron-lm-flash" and softmax.plan["program"] == "megatron-lm"
    assert flash.step_time_s < softmax.step_time_s and flash.mfu > softmax.mfu
    for plan in ("megatron", "zero2", "zero3", "dp"):
        s = simulate("gpt-1.3b", "dgx-h100", 8, plan, global_batch=64, recompute="none")
        f = simulate(
            "gpt-1.3b", "dgx-h100", 8, plan, global_batch=64, recompute="none",
            program="megatron-lm-flash",
        )  # fmt: skip
        assert "compute_attention" in f.breakdown and "compute_attention" not in s.breakdown
        assert f.step_time_s < s.step_time_s, plan
    sp = simulate(
        "gpt-1.3b", "dgx-h100", 8, "megatron:8x1x1", global_batch=8, microbatch_size=8,
        recompute="none", sequence_parallel=True, program="megatron-lm-flash",
    )  # fmt: skip
    assert sp.plan["sequence_parallel"]


def test_megatron_lm_programs_refuse_the_traced_attention_and_v100_refuses_flash():
    from autoshard.sim.simulate import simulate

    for program in ("megatron-lm", "megatron-lm-flash"):
        with pytest.raises(ValueError, match="chooses the traced step's attention"):
            simulate("gpt-125m", "dgx-h100", 1, "megatron", program=program, attention="fused")
    with pytest.raises(ValueError, match="presets with one: dgx-a100, dgx-h100"):
        simulate("gpt-125m", "alpa-v100", 1, "megatron", program="megatron-lm-flash")


def test_cli_simulate_program_megatron_lm_flash(capsys):
    import json

    from autoshard.cli.main import main

    args = ["simulate", "--model", "gpt-1.3b", "--cluster", "dgx-h100", "--gpus", "1",
            "--plan", "megatron:1x1x1", "--microbatch-size", "8", "--global-batch", "8",
            "--recompute", "none"]  # fmt: skip
    assert main([*args, "--program", "megatron-lm-flash", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["program"] == "megatron-lm-flash"
    assert main([*args, "--program", "megatron-lm-flash"]) == 0
    assert "flash attention" in capsys.readouterr().out
    bad = ["simulate", "--model", "gpt-125m", "--cluster", "alpa-v100", "--gpus", "1"]
    try:
        code = main([*bad, "--program", "megatron-lm-flash"])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and "dgx-a100, dgx-h100" in capsys.readouterr().err


# ------------------------------------------------------------------ weak scaling


def _weak_scaling():
    from conftest import load_experiment

    return load_experiment("weak_scaling")


def test_weak_scaling_megatron_flash_only_where_an_attention_table_is():
    ws = _weak_scaling()
    assert ws.megatron_methods("alpa-v100") == ("megatron",)
    assert (
        ws.megatron_methods("dgx-a100")
        == ws.megatron_methods("dgx-h100")
        == (
            "megatron",
            "megatron-flash",
        )
    )
    row, report = ws.megatron_row("dgx-h100", "gpt", "gpt-350m", 1, 64, "megatron-flash")
    assert row["method"] == "megatron-flash" and report.plan["program"] == "megatron-lm-flash"
    softmax, _ = ws.megatron_row("dgx-h100", "gpt", "gpt-350m", 1, 64, "megatron")
    assert row["pflops"] > softmax["pflops"]


def _chunk(cluster: str) -> dict:
    rows = [
        dict(cluster=cluster, family="gpt", model=model, gpus=gpus, method=method, pflops=1.0,
             oom=False, plan={}, step_time_s=1.0, optimizer="adamw")
        for model, gpus in (("gpt-350m", 1), ("gpt-760m", 2))
        for method in ("megatron", "auto", "intra-only")
    ]  # fmt: skip
    config = {"global_batch": {"gpt": 64}, "optimizer": {"gpt": "adamw"}}
    return dict(config=config, rows=rows, chunk_wall_s=1.0, chunk_cpu_s=1.0, chunk_commit="x")


def test_add_methods_puts_megatron_flash_into_finished_chunks(tmp_path):
    """``weak_scaling_chunks.py --add-methods megatron-flash DIR``: a row beside each
    megatron row of the GPT chunks of clusters with an attention table (none on alpa-v100),
    the other rows untouched, recorded in the chunk; run again, nothing more; --assemble
    carries the record and the figure draws the method as its own series."""
    import json
    import subprocess
    import sys

    from conftest import load_benchmark

    chunks = load_benchmark("weak_scaling_chunks")
    part = _chunk("dgx-h100")
    before = [dict(r) for r in part["rows"]]
    assert chunks.add_methods(part, "dgx-h100", "gpt", ("megatron-flash",)) == ["megatron-flash"]
    assert [r for r in part["rows"] if r["method"] != "megatron-flash"] == before
    assert [(r["model"], r["method"]) for r in part["rows"][:2]] == [
        ("gpt-350m", "megatron"),
        ("gpt-350m", "megatron-flash"),
    ]
    flash = [r for r in part["rows"] if r["method"] == "megatron-flash"]
    assert [(r["model"], r["gpus"]) for r in flash] == [("gpt-350m", 1), ("gpt-760m", 2)]
    assert all(r["plan"]["program"] == "megatron-lm-flash" for r in flash)
    assert all(r["plan"]["global_batch"] == 64 for r in flash)
    (added,) = part["added_methods"]
    assert added["method"] == "megatron-flash" and "not rerun" in added["note"]
    assert chunks.add_methods(part, "dgx-h100", "gpt", ("megatron-flash",)) == []
    v100 = _chunk("alpa-v100")
    assert chunks.add_methods(v100, "alpa-v100", "gpt", ("megatron-flash",)) == []
    assert "added_methods" not in v100

    for c in ("alpa-v100", "dgx-a100", "dgx-h100"):
        for f in ("gpt", "moe", "wresnet"):
            part = _chunk(c)
            for r in part["rows"]:
                r["family"] = f
            (tmp_path / f"chunk-{c}-{f}.json").write_text(json.dumps(part))
    script = str(Path(chunks.__file__))
    subprocess.run(
        [sys.executable, script, "--add-methods", "megatron-flash", str(tmp_path)], check=True
    )
    have = {
        c: {r["method"] for r in json.loads((tmp_path / f"chunk-{c}-gpt.json").read_text())["rows"]}
        for c in ("alpa-v100", "dgx-a100", "dgx-h100")
    }
    assert "megatron-flash" not in have["alpa-v100"]
    assert "megatron-flash" in have["dgx-a100"] and "megatron-flash" in have["dgx-h100"]
    moe = json.loads((tmp_path / "chunk-dgx-h100-moe.json").read_text())
    assert "added_methods" not in moe
    out = tmp_path / "out"
    subprocess.run([sys.executable, script, str(tmp_path), "--assemble", str(out)], check=True)
    doc = json.loads((out / "weak-scaling.json").read_text())
    record = {(k["cluster"], k["family"]): k["added_methods"] for k in doc["data"]["chunks"]}
    assert [a["method"] for a in record[("dgx-h100", "gpt")]] == ["megatron-flash"]
    assert record[("alpa-v100", "gpt")] == []
    assert "megatron_flash" in doc["data"]["config"]

    ws = _weak_scaling()
    _, methods, by, _ = ws.panel_data(doc, "dgx-h100", "gpt")
    assert methods.index("megatron-flash") == methods.index("megatron") + 1
    assert "megatron-flash" not in ws.panel_data(doc, "alpa-v100", "gpt")[1]
    fig = ws.plot(doc)
    import figure

    drawn = figure.drawn(fig)
    title = ws.panel_title(doc, "dgx-h100", "gpt")
    assert f"{title}::bar|megatron-flash|1" in drawn
    ax = next(a for a in fig.axes if a.get_title() == title)
    assert ws.LABELS["megatron-flash"] in [t.get_text() for t in ax.get_legend().get_texts()]
    figure.plt.close(fig)
