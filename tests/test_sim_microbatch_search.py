"""``simulate(plan="auto")`` searching its micro-batch count (issue #15): the candidates,
the choice (fastest that fits; none fits: least memory), the record, bad input, the CLI."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest

from autoshard.sim.auto import microbatch_candidates, search_microbatches
from autoshard.sim.report import SimulationReport
from autoshard.sim.simulate import simulate

# a 2-block GPT-125m on 2 V100s, 16 sequences a step: each search takes a few seconds
SMALL = dict(global_batch=16, num_layers=2, recompute="none")


def _tried(report) -> dict[int, dict]:
    return {c["num_microbatches"]: c for c in report.plan["microbatch_search"]}


def test_search_picks_the_fastest_candidate_as_each_alone_prices_it():
    """Each candidate's recorded step time is what a fixed-count run gives; the report is
    the fastest that fits, and its search time counts every candidate's."""
    searched = simulate("gpt-125m", "alpa-v100", 2, "auto", num_microbatches=(4, 16), **SMALL)
    alone = {
        m: simulate("gpt-125m", "alpa-v100", 2, "auto", num_microbatches=m, **SMALL)
        for m in (4, 16)
    }
    tried = _tried(searched)
    assert sorted(tried) == [4, 16]
    for m, r in alone.items():
        assert tried[m]["step_time_s"] == pytest.approx(r.step_time_s, rel=1e-9)
        assert tried[m]["peak_bytes_per_device"] == pytest.approx(r.peak_bytes_per_device)
        assert tried[m]["fits"] == (not r.oom)
        assert tried[m]["microbatch_size"] == 16 // m
    fits = [m for m, r in alone.items() if not r.oom]
    assert fits, "both fit a V100: the test needs a fitting candidate"
    best = min(fits, key=lambda m: alone[m].step_time_s)
    assert len({round(alone[m].step_time_s, 9) for m in alone}) == 2  # a real choice
    assert searched.plan["num_microbatches"] == best
    assert [m for m, c in tried.items() if c["chosen"]] == [best]
    assert searched.step_time_s == pytest.approx(alone[best].step_time_s, rel=1e-9)
    assert searched.mfu == pytest.approx(alone[best].mfu, rel=1e-9)
    assert searched.search_seconds == pytest.approx(
        sum(c["search_seconds"] for c in tried.values())
    )
    data = searched.to_json()
    json.dumps(data)  # plain JSON
    assert len(data["plan"]["microbatch_search"]) == 2


def test_search_default_candidates_and_an_extra_count():
    """``"search"``: the default count (16 for 16 sequences), a quarter and half of it, and
    twice and four times it where they divide the batch (they don't here); ``("search", 2)``
    adds 2."""
    searched = simulate("gpt-125m", "alpa-v100", 2, "auto", num_microbatches="search", **SMALL)
    assert sorted(_tried(searched)) == [4, 8, 16]
    fixed = simulate("gpt-125m", "alpa-v100", 2, "auto", **SMALL)  # the default alone
    assert fixed.plan["num_microbatches"] == 16 and "microbatch_search" not in fixed.plan
    assert _tried(searched)[16]["step_time_s"] == pytest.approx(fixed.step_time_s, rel=1e-9)
    more = simulate("gpt-125m", "alpa-v100", 2, "auto", num_microbatches=["search", 2], **SMALL)
    assert sorted(_tried(more)) == [2, 4, 8, 16]


def test_candidates_around_the_default():
    assert microbatch_candidates(1024, 64) == (16, 32, 64, 128, 256)
    assert microbatch_candidates(1024, 64, extra=(512,)) == (16, 32, 64, 128, 256, 512)
    assert microbatch_candidates(1024, 512, extra=(1024,)) == (128, 256, 512, 1024)  # <= batch
    assert microbatch_candidates(12, 3) == (3, 6, 12)  # odd: no half, no quarter
    assert microbatch_candidates(24, 6) == (3, 6, 12, 24)  # 6 / 4 is not whole
    assert microbatch_candidates(16, None, extra=(4, 2, 4)) == (2, 4)
    assert microbatch_candidates(64, 8, valid=lambda c: c <= 16) == (2, 4, 8, 16)
    assert microbatch_candidates(64, 8, valid=lambda c: c % 4 == 0) == (4, 8, 16, 32)


def _stub(m: int, step: float, peak: float, oom: bool) -> SimulationReport:
    plan = {"kind": "auto", "num_microbatches": m, "microbatch_size": 64 // m}
    return SimulationReport(
        model="stub", cluster="stub", gpus=1, step_time_s=step, tokens_per_s=1.0,
        tflops_per_device=1.0, mfu=0.1, hfu=0.1, peak_bytes_per_device=peak, oom=oom,
        plan=MappingProxyType(plan), breakdown=MappingProxyType({"x": step}),
        search_seconds=2.0,
    )  # fmt: skip


def test_an_out_of_memory_candidate_never_beats_one_that_fits():
    reports = {
        4: _stub(4, 1.0, 9e9, True),
        8: _stub(8, 3.0, 5e9, False),
        16: _stub(16, 2.0, 4e9, False),
    }
    best = search_microbatches(reports.__getitem__, (4, 8, 16))
    assert best.plan["num_microbatches"] == 16 and best.step_time_s == 2.0
    assert [c["fits"] for c in best.plan["microbatch_search"]] == [False, True, True]
    assert best.search_seconds == 6.0


def test_none_fits_the_least_memory_wins_flagged_oom():
    reports = {
        4: _stub(4, 1.0, 9e9, True),
        8: _stub(8, 3.0, 5e9, True),
        16: _stub(16, 2.0, 6e9, True),
    }
    best = search_microbatches(reports.__getitem__, (4, 8, 16))
    assert best.plan["num_microbatches"] == 8 and best.oom
    assert [c["chosen"] for c in best.plan["microbatch_search"]] == [False, True, False]


@pytest.mark.parametrize(
    ("value", "plan", "match"),
    [
        ("serch", "auto", "positive int, 'search'"),
        ((4, 0), "auto", "got 0"),
        ((4, True), "auto", "got True"),
        ((4, 2.5), "auto", "got 2.5"),
        ((), "auto", "at least one"),
        ((3,), "auto", "3 to search does not divide the global batch 16"),
        ("search", "megatron", "is for plan='auto'"),
        (("search", 4), "dp", "is for plan='auto'"),
    ],
)
def test_bad_search_requests_are_refused(value, plan, match):
    with pytest.raises(ValueError, match=match):
        simulate("gpt-125m", "alpa-v100", 2, plan, num_microbatches=value, **SMALL)


def test_search_with_a_microbatch_size_is_refused():
    with pytest.raises(ValueError, match="not both"):
        simulate("gpt-125m", "alpa-v100", 2, "auto", microbatch_size=2, num_microbatches="search")


def test_moe_search_counts_hold_whole_expert_groups():
    """moe-380m: 1024 tokens a sequence, groups of 2048: 8 micro-batches of 1 sequence are
    refused by name, as a fixed count is."""
    with pytest.raises(ValueError, match=r"whole expert groups of 2048 tokens.*\[1, 2, 4\]"):
        simulate("moe-380m", "alpa-v100", 1, "auto", num_microbatches=("search", 8))


def _cli(capsys, *extra):
    from autoshard.cli.main import main

    argv = ["simulate", "--model", "gpt-125m", "--cluster", "alpa-v100", "--gpus", "2",
            "--global-batch", "16", "--layers", "2", "--recompute", "none", *extra]  # fmt: skip
    code = main(argv)
    return code, capsys.readouterr()


def test_cli_microbatches_search(capsys):
    code, out = _cli(capsys, "--plan", "auto", "--microbatches", "search,4", "--json")
    assert code == 0
    data = json.loads(out.out)  # exactly one JSON document; progress went to stderr
    tried = {c["num_microbatches"]: c for c in data["plan"]["microbatch_search"]}
    assert sorted(tried) == [4, 8, 16]
    assert "micro-batch search 3/3: m=16" in out.err
    chosen = [m for m, c in tried.items() if c["chosen"]]
    assert chosen == [data["plan"]["num_microbatches"]]
    code, out = _cli(capsys, "--plan", "auto", "--microbatches", "4,8")
    assert code == 0 and "micro-batches searched" in out.out and "(chosen)" in out.out
    code, out = _cli(capsys, "--plan", "auto", "--microbatches", "4", "--json")
    assert code == 0 and "microbatch_search" not in json.loads(out.out)["plan"]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--plan", "auto", "--microbatches", "sometimes"], "give a positive int, 'search'"),
        (["--plan", "auto", "--microbatches", "search,0"], "give a positive int, 'search'"),
        (["--plan", "megatron", "--microbatches", "search"], "is for plan='auto'"),
    ],
)
def test_cli_bad_microbatches_exit_2(capsys, flags, match):
    """argparse refuses a malformed value, simulate a search on a grid plan: exit 2 both."""
    try:
        code, out = _cli(capsys, *flags)
        err = out.err
    except SystemExit as exit_:
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2
    assert match in err and "Traceback" not in err


def test_weak_scaling_candidates_take_every_megatron_methods_count():
    """The full search's extra micro-batch counts: one per Megatron-LM method's best point
    (the 2021 program's and the flash program's), each once, ascending; none without."""
    from types import SimpleNamespace

    from conftest import load_experiment

    module = load_experiment("weak_scaling")
    mega, flash = (SimpleNamespace(plan={"num_microbatches": m}) for m in (64, 16))
    assert module.auto_microbatches(mega, flash) == ("search", 16, 64)
    assert module.auto_microbatches(mega, mega) == ("search", 64)
    assert module.auto_microbatches() == ("search",)


def test_weak_scaling_gpt_search_tries_megatrons_count(monkeypatch):
    """The weak-scaling GPT point: the full search tries the default candidates and the
    count of Megatron-LM's best grid point, intra-op only and inter-op only take the count
    it chose; ``--quick`` keeps the one default count and its config says so."""
    from conftest import load_experiment

    module = load_experiment("weak_scaling")
    monkeypatch.setattr(module, "SUITES", {"gpt": [("gpt-tiny", 2)]})
    monkeypatch.setattr(module, "CLUSTERS", ("dgx-h100",))
    monkeypatch.setattr(module, "GLOBAL_BATCH", {"gpt": 64})
    data = module.run(False, lambda *a: None)
    rows = {r["method"]: r for r in data["rows"]}
    mega_m = rows["megatron"]["plan"]["num_microbatches"]
    # dgx-h100 has an attention table: Megatron-LM's flash program is a method of its own
    assert rows["megatron-flash"]["plan"]["program"] == "megatron-lm-flash"
    tried = {c["num_microbatches"]: c for c in rows["auto"]["plan"]["microbatch_search"]}
    flash_m = rows["megatron-flash"]["plan"]["num_microbatches"]
    assert {mega_m, flash_m, 16, 32, 64} <= set(tried)  # default 64, quarter, half, Megatron's
    chosen = rows["auto"]["plan"]["num_microbatches"]
    assert [m for m, c in tried.items() if c["chosen"]] == [chosen]
    fits = [m for m, c in tried.items() if c["fits"]]
    assert chosen == min(fits, key=lambda m: tried[m]["step_time_s"])
    assert rows["intra-only"]["plan"]["num_microbatches"] == chosen
    assert rows["inter-only"]["plan"]["num_microbatches"] == chosen
    assert data["config"]["auto_microbatches"]["gpt"].startswith("searched")
    quick = module.run(True, lambda *a: None)
    auto = next(r for r in quick["rows"] if r["method"] == "auto")
    assert "microbatch_search" not in auto["plan"] and auto["plan"]["num_microbatches"] == 64
    assert "--quick" in quick["config"]["auto_microbatches"]["gpt"]


def test_weak_scaling_gpt_searches_reduce_gradients_as_told(monkeypatch):
    """``--grad-reduce`` reaches the GPT point's searches: under ``step`` every stage of
    the full search and of the restricted searches priced from its costs (intra-op only,
    inter-op only) runs data-parallel replicas that reduce once a step; the config records
    it per family (the others reduce every micro-batch), and the flag parses."""
    import argparse

    from conftest import load_experiment

    module = load_experiment("weak_scaling")
    monkeypatch.setattr(module, "SUITES", {"gpt": [("gpt-tiny", 2)]})
    monkeypatch.setattr(module, "CLUSTERS", ("dgx-h100",))
    # 128 sequences: the default 64 micro-batches of 2, which 2 replicas split
    monkeypatch.setattr(module, "GLOBAL_BATCH", {"gpt": 128})
    data = module.run(True, lambda *a: None, grad_reduce="step")
    assert data["config"]["grad_reduce"] == {"gpt": "step"}
    rows = {r["method"]: r for r in data["rows"]}
    for method in ("auto", "intra-only", "inter-only"):
        stages = rows[method]["plan"]["stages"]
        assert [s["grad_reduce"] for s in stages] == ["step"] * len(stages), method
        assert all(s["logical_mesh_dp_tp"][0] > 1 for s in stages), method
    assert module.family_grad_reduce("moe", "step") == "microbatch"
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        module.family_grad_reduce("gpt", "sometimes")
    ap = argparse.ArgumentParser()
    names = module.add_arguments(ap)
    assert {n: getattr(ap.parse_args([]), n) for n in names} == {"grad_reduce": "microbatch"}
    assert ap.parse_args(["--grad-reduce", "auto"]).grad_reduce == "auto"
