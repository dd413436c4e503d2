"""``autoshard explain`` and ``autoshard export``: a saved plan read for people and taken to
Megatron-LM, DeepSpeed and MaxText."""

import base64
import json
import re

import pytest
from conftest import save_plan

from autoshard.cli.main import main
from autoshard.ir.planfile import PlanFile, load_plan
from autoshard.ir.spec import ShardingSpec
from autoshard.report.digest import digest, short_path
from autoshard.report.export import export, layout_specs

MLP = dict(batch_size=64, hidden=32)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    return {b: save_plan(tmp, "mlp", "2x4", b, **MLP) for b in ("dp", "zero2", "zero3", "megatron")}


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    return save_plan(tmp, "gpt-tiny", "2x4", "megatron", seq_len=16, vocab_size=64)


def _exported(path, target):
    return export(digest(load_plan(path)), target)


@pytest.mark.parametrize(
    "mesh, tp, dp", [("2x4", 4, 2), ("4x2", 2, 4), ("1x8", 8, 1), ("8", 8, 1), ("8x1", 1, 8)]
)
def test_megatron_baseline_exports_exactly_its_grid(tmp_path, mesh, tp, dp):
    out = _exported(save_plan(tmp_path, "mlp", mesh, "megatron", **MLP), "megatron")
    assert out.exact, out.differences
    assert out.config["tensor-model-parallel-size"] == tp
    assert out.config["pipeline-model-parallel-size"] == 1
    assert out.config["micro-batch-size"] == 64 // dp
    assert out.config["global-batch-size"] == 64
    args = out.text.split()
    assert args[args.index("--tensor-model-parallel-size") + 1] == str(tp)
    assert "--use-distributed-optimizer" not in args and "--sequence-parallel" not in args


@pytest.mark.parametrize(
    "baseline, stage, distributed",
    [("dp", 0, False), ("zero2", 2, True), ("zero3", 3, True)],
)
def test_data_parallel_baselines_export_their_zero_stage(plans, baseline, stage, distributed):
    ds = _exported(plans[baseline], "deepspeed")
    assert ds.exact, ds.differences
    doc = json.loads(ds.text)
    assert doc["zero_optimization"] == {"stage": stage}
    assert doc["train_batch_size"] == 64 and doc["train_micro_batch_size_per_gpu"] == 8
    assert doc["gradient_accumulation_steps"] == 1
    meg = _exported(plans[baseline], "megatron")
    assert ("--use-distributed-optimizer" in meg.text.split()) == distributed
    assert meg.config["tensor-model-parallel-size"] == 1
    # Megatron-LM has no ZeRO-3: the nearest keeps the weights whole, and says so per tensor
    assert meg.exact == (baseline != "zero3")
    if baseline == "zero3":
        assert {d.kind for d in meg.differences} == {"param"}
        assert all("@" in d.plan_spec and "@" not in d.export_spec for d in meg.differences)


@pytest.mark.parametrize(
    "baseline, data, fsdp, tensor, exact",
    [("dp", 8, 1, 1, True), ("zero3", 1, 8, 1, True), ("megatron", 2, 1, 4, True),
     ("zero2", 8, 1, 1, False)],
)  # fmt: skip
def test_maxtext_settings(plans, baseline, data, fsdp, tensor, exact):
    out = _exported(plans[baseline], "maxtext")
    lines = dict(line.split("=") for line in out.text.splitlines())
    assert lines["ici_data_parallelism"] == str(data)
    assert lines["ici_fsdp_parallelism"] == str(fsdp)
    assert lines["ici_tensor_parallelism"] == str(tensor)
    assert lines["per_device_batch_size"] == "8"
    assert all(lines[f"dcn_{k}_parallelism"] == "1" for k in ("data", "fsdp", "tensor"))
    assert out.exact == exact
    if not exact:  # ZeRO-2's split optimizer state has no MaxText equivalent
        assert {d.kind for d in out.differences} == {"opt_state"}


def test_an_edited_plan_names_exactly_the_tensor_that_differs(plans, tmp_path):
    pf = load_plan(plans["megatron"])
    k = next(i for i, t in enumerate(pf.inputs) if t.kind == "param" and len(t.shape) == 2)
    specs = list(pf.plan.input_specs)
    assert not specs[k].is_replicated  # Megatron splits every MLP kernel
    specs[k] = ShardingSpec.replicated(2)
    import dataclasses

    edited = PlanFile(
        dataclasses.replace(pf.plan, input_specs=tuple(specs)), pf.fingerprint, inputs=pf.inputs
    )
    out = export(digest(edited), "megatron")
    assert out.config["tensor-model-parallel-size"] == 4  # still the nearest grid
    assert [d.path for d in out.differences] == [short_path(pf.inputs[k].path)]
    assert "@model" in out.differences[0].export_spec and "@" not in out.differences[0].plan_spec


def test_layout_of_a_baseline_is_the_baseline(plans):
    for name in ("dp", "zero2", "megatron"):
        d = digest(load_plan(plans[name]))
        layout = {
            "dp": ((), ("data", "model"), False, False),
            "zero2": ((), ("data", "model"), True, False),
            "megatron": (("model",), ("data",), False, False),
        }[name]
        from autoshard.report.export import Layout

        assert layout_specs(d, Layout(*layout)) == list(d.plan.input_specs)


def test_digest_reads_roles_and_folds_identical_layers(gpt_plan):
    d = digest(load_plan(gpt_plan))
    assert d.parallelism.summary() == "1 stage x (DP 2 over data, TP 4 over model), no recompute"
    labels = [g.label for g in d.layers]
    assert labels[0] == "block_0..1 (2 identical)" and "embedding" in labels
    qkv = next(p for p in d.layers[0].params if p.name == "attn/qkv/kernel")
    assert qkv.spec == "f32[64, 192@model]" and qkv.bytes_per_device == 64 * 192 * 4 / 4
    mem = d.memory_bytes
    assert mem["weights"] == pytest.approx(sum(p.bytes_per_device for g in d.layers
                                               for p in g.params * len(g.layers)))  # fmt: skip
    assert sum(mem.values()) == pytest.approx(d.plan.predicted_peak_bytes)


def test_explain_json_html_and_pictures(gpt_plan, tmp_path, capsys):
    html_path, pics = tmp_path / "r.html", tmp_path / "pics"
    argv = ["explain", str(gpt_plan), "--json", "--html", str(html_path), "--pictures", str(pics)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one document on stdout
    assert out["roles"]["tp"] == 4 and out["roles"]["dp"] == 2
    assert "weights" in out["memory_bytes_per_device"]
    page = html_path.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3
    for b64 in images:
        assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("mesh", "memory", "tensor"):
        data = (pics / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # one stage: no timeline (fixed-width forward/backward/update bars said nothing)
    assert not (pics / "timeline.png").exists() and 'alt="timeline"' not in page
    assert "--tensor-model-parallel-size 4" in page


def test_explain_text_and_simulated_step(gpt_plan, capsys):
    assert main(["explain", str(gpt_plan), "--cluster", "dgx-a100"]) == 0
    text = capsys.readouterr().out
    assert "DP 2 over data, TP 4 over model" in text
    assert re.search(r"step time [\d.]+ ms, MFU [\d.]+%", text)
    assert "megatron:4x1x2" in text


def test_export_cli_prints_flags_and_one_json(plans, capsys):
    assert main(["export", str(plans["megatron"]), "--to", "megatron"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip().startswith("--tensor-model-parallel-size 4")
    assert "lays out every tensor as the plan does" in cap.err
    assert main(["export", str(plans["zero3"]), "--to", "megatron", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exact"] is False and doc["differences"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "/nonexistent/plan.json"], "cannot read plan file"),
        (["export", "/nonexistent/plan.json", "--to", "deepspeed"], "cannot read plan file"),
    ],
)
def test_bad_plan_paths_are_clear(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_old_plan_file_without_inputs_says_to_save_again(plans, tmp_path, capsys):
    doc = json.loads(plans["dp"].read_text())
    del doc["inputs"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert main(["export", str(path), "--to", "megatron"]) == 2
    assert "save it again" in capsys.readouterr().err


def test_tensor_regex_that_matches_nothing(gpt_plan, tmp_path, capsys):
    argv = ["explain", str(gpt_plan), "--pictures", str(tmp_path), "--tensor", "nope"]
    assert main(argv) == 2
    assert "--tensor 'nope' matches no input" in capsys.readouterr().err


# ----------------------------------------------------------------------------- pipelines


def _pipeline_file(grid, microbatches=4, batch=32, recompute="none", views=None):
    """A pipeline plan file of ``pp`` stages, each (dp, tp), as the stage search writes."""
    from autoshard.inter.plan import InterPlan, Stage, StagePlan
    from autoshard.ir.planfile import PipelinePlanFile

    tp, pp, dp = grid
    views = views or [(dp, tp)] * pp
    per = dp * tp
    stages = tuple(
        Stage(
            i,
            i + 1,
            (1, per),
            views[i],
            1e-3,
            1e6,
            pp - i,
            recompute,
            (f"block_{i}",),
            tuple(range(i * per, (i + 1) * per)),
        )  # fmt: skip
        for i in range(pp)
    )
    inter = InterPlan("gpt-tiny", stages, 4e-3, 1.0, {}, 0, 0, microbatches, "1f1b",
                      "auto", "layer", StagePlan(stages, 4e-3, 1.0, 0, microbatches, "1f1b"))  # fmt: skip
    fp = {"model": "gpt-tiny", "devices": {"hosts": 1, "per_host": tp * pp * dp}}
    return PipelinePlanFile(inter.to_json(), fp, {"global_batch": batch})


@pytest.mark.parametrize("grid", [(4, 2, 1), (2, 2, 2), (1, 4, 2), (2, 4, 1), (1, 2, 4)])
def test_pipeline_grid_exports_exactly_tp_pp_dp(grid, tmp_path):
    from autoshard.report.pipeline import export_pipeline, pipeline_digest

    path = tmp_path / "pipe.json"
    _pipeline_file(grid).save(path)
    d = pipeline_digest(load_plan(path))  # through the file
    tp, pp, dp = grid
    out = export_pipeline(d, "megatron")
    assert out.exact
    assert out.text.split() == [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", str(32 // (dp * 4)), "--global-batch-size", "32",
    ]  # fmt: skip
    mt = dict(line.split("=") for line in export_pipeline(d, "maxtext").text.splitlines())
    assert (mt["ici_tensor_parallelism"], mt["ici_pipeline_parallelism"]) == (str(tp), str(pp))
    assert mt["ici_data_parallelism"] == str(dp) and mt["num_pipeline_microbatches"] == "4"
    ds = json.loads(export_pipeline(d, "deepspeed").text)
    assert ds["gradient_accumulation_steps"] == 4
    assert d.summary() == f"{pp} stages x (DP {dp}, TP {tp}), no recompute"


def test_pipeline_with_uneven_stages_lists_the_stage_that_differs():
    from autoshard.ir.planfile import plan_file_from_json
    from autoshard.report.pipeline import export_pipeline, pipeline_digest

    pf = _pipeline_file((2, 3, 2), recompute="full", views=[(2, 2), (2, 2), (1, 4)])
    d = pipeline_digest(plan_file_from_json(json.loads(json.dumps(pf.to_json()))))
    out = export_pipeline(d, "megatron")
    assert out.config["tensor-model-parallel-size"] == 2  # the view most stages use
    assert out.config["recompute-granularity"] == "full"
    assert [(x.path, x.plan_spec, x.export_spec) for x in out.differences] == [
        ("stage 2 (block_2)", "DP 1, TP 4", "DP 2, TP 2")
    ]


def test_pipeline_plan_file_from_the_cli(tmp_path, capsys):
    path, page = tmp_path / "pipe.json", tmp_path / "pipe.html"
    argv = "plan --model gpt-tiny --layers 2 --devices 8 --pipeline equal-layer --stages 2 "
    argv += f"--microbatches 2 --solver highs --out {path}"
    assert main(argv.split()) == 0
    capsys.readouterr()
    assert main(["export", str(path), "--to", "megatron"]) == 0
    args = capsys.readouterr().out.split()
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "2"
    assert main(["explain", str(path), "--html", str(page)]) == 0
    assert "2 stages x" in capsys.readouterr().out
    assert page.read_text().count("data:image/png;base64,") == 2
    assert main(["run", "--plan", str(path)]) == 2  # run takes one-mesh plans only
    assert "is a pipeline plan" in capsys.readouterr().err


def test_export_and_explain_load_no_jax(plans, tmp_path):
    """They read the file alone: no jax, no tracing (fast, and usable where jax is not)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom autoshard.cli.main import main\n"
        f"assert main(['export', {str(plans['megatron'])!r}, '--to', 'megatron']) == 0\n"
        f"assert main(['explain', {str(plans['zero2'])!r}, '--pictures', {str(tmp_path)!r}]) == 0\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_an_ilp_plan_export_names_its_differences(tmp_path, capsys):
    """The ILP's own plan for the MLP is not a Megatron grid: its export lists each tensor
    that differs, with the spec the plan file itself records for it."""
    path = tmp_path / "auto.json"
    # batch 128: its 2x4 plan in 0.3 s of CPU (batch 64 is a slow case of the exact program)
    flags = "--model mlp --batch 128 --hidden 32"
    assert main(f"plan {flags} --mesh 2x4 --solver highs --out {path}".split()) == 0
    capsys.readouterr()
    assert main(["export", str(path), "--to", "megatron", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    recorded = json.loads(path.read_text())["specs"]  # path -> spec, written by plan --out
    params = {short_path(p): s for p, s in recorded.items() if p.startswith("[0]")}
    assert out["exact"] is False and out["differences"]
    for diff in out["differences"]:
        assert diff["plan"] != diff["export"]
        if diff["kind"] == "param":
            assert params[diff["path"]] == diff["plan"]
    assert any(d["kind"] == "param" for d in out["differences"])


def test_memory_by_layer_adds_up_to_the_predicted_peak(plans):
    """The memory picture's bars: each layer's state and a whole-step bar for what no
    layer holds (activations and temporaries, data), together the predicted peak (the
    dp plan: no ZeRO, gradients laid out like the weights)."""
    from autoshard.report.pictures import memory_by_layer

    d = digest(load_plan(plans["dp"]))
    rows = memory_by_layer(d)
    assert rows["(whole step)"]["activations and temporaries"] > 0
    total = sum(sum(r.values()) for r in rows.values())
    assert total == pytest.approx(d.plan.predicted_peak_bytes, rel=1e-3)
