"""Every export is something its target can launch (docs/explain.md#export).

The plans: the one-mesh baselines and ILP plans the report tests save (mlp and gpt-tiny,
meshes 2x4, 4x2, 1x8, 8), the pipeline grids they write, a 3-stage plan with a stage on
another view, a full-recompute plan, and the stage search's 5-stage plan of gpt-tiny
(4 layers) on 8 devices, whose stages hold 4, 1, 1, 1 and 1 devices. Each export is
checked here by the target's own rules, read off the text a user pastes (not off the
exporter's config); a refused export must name a nearest configuration that passes the
same rules.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import save_plan

from autoshard.inter.plan import InterPlan, Stage, StagePlan
from autoshard.ir.planfile import PipelinePlanFile, load_plan
from autoshard.report.digest import digest
from autoshard.report.export import export
from autoshard.report.launchable import JobFacts, launch_problems
from autoshard.report.pipeline import export_pipeline, pipeline_digest

TARGETS = ("megatron", "deepspeed", "maxtext")


def _pipeline(devices_views, layers, microbatches=4, batch=32, recompute="none", gpus=None):
    """A pipeline plan file: stage i holds ``layers[i]`` on ``devices_views[i]`` =
    (devices, (dp, tp)), as the stage search writes it."""
    stages, first, start = [], 0, 0
    for i, ((n, view), names) in enumerate(zip(devices_views, layers, strict=True)):
        stages.append(
            Stage(
                start,
                start + len(names),
                (1, n),
                view,
                1e-3,
                1e6,
                len(layers) - i,
                recompute,
                tuple(names),
                tuple(range(first, first + n)),
            )  # fmt: skip
        )
        first, start = first + n, start + len(names)
    stages = tuple(stages)
    inter = InterPlan("gpt-tiny", stages, 4e-3, 1.0, {}, 0, 0, microbatches, "1f1b", "auto",
                      "layer", StagePlan(stages, 4e-3, 1.0, 0, microbatches, "1f1b"))  # fmt: skip
    fp = {"model": "gpt-tiny", "devices": {"hosts": 1, "per_host": gpus or first}}
    return pipeline_digest(PipelinePlanFile(inter.to_json(), fp, {"global_batch": batch}))


def _grid(tp, pp, dp, **kw):
    blocks = [[f"block_{i}"] for i in range(pp)]
    blocks[0] = ["embedding", *blocks[0]]
    blocks[-1] = [*blocks[-1], "head"]
    return _pipeline([(tp * dp, (dp, tp))] * pp, blocks, **kw)


PIPELINES = {
    "4x2x1": lambda: _grid(4, 2, 1),
    "2x2x2": lambda: _grid(2, 2, 2),
    "1x4x2": lambda: _grid(1, 4, 2),
    "2x4x1": lambda: _grid(2, 4, 1),
    "1x2x4": lambda: _grid(1, 2, 4),
    "full recompute": lambda: _grid(2, 2, 2, recompute="full"),
    "selective recompute": lambda: _grid(2, 2, 2, recompute="selective"),
    "3 stages, one on another view": lambda: _pipeline(
        [(4, (2, 2)), (4, (2, 2)), (4, (1, 4))], [["block_0"], ["block_1"], ["block_2"]], batch=48
    ),
    "5 stages on 8 devices": lambda: _pipeline(
        [(4, (1, 4)), (1, (1, 1)), (1, (1, 1)), (1, (1, 1)), (1, (1, 1))],
        [["embedding"], ["block_0"], ["block_1"], ["block_2"], ["block_3", "head"]],
        batch=8,
        gpus=8,
    ),
}


# ------------------------------------------------------------ the rules, read off the text


def _megatron_text_problems(text: str, gpus: int, layers: int | None) -> list[str]:
    args = text.split()

    def flag(name, default=None):
        return args[args.index(name) + 1] if name in args else default

    tp = int(flag("--tensor-model-parallel-size"))
    pp = int(flag("--pipeline-model-parallel-size"))
    micro, batch = int(flag("--micro-batch-size")), int(flag("--global-batch-size"))
    out = []
    if gpus % (tp * pp):
        out.append("world size")
    elif batch % (micro * (gpus // (tp * pp))):
        out.append("batch")
    if layers and layers % pp:
        out.append("layers")
    if flag("--recompute-granularity") == "full" and (
        flag("--recompute-method") not in ("uniform", "block") or not flag("--recompute-num-layers")
    ):
        out.append("recompute companions")
    return out


def _deepspeed_text_problems(text: str, gpus: int, stages: int) -> list[str]:
    cfg = json.loads(text)
    if gpus % stages:
        return ["stages"]
    dp = gpus // stages
    want = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    return [] if cfg["train_batch_size"] == want else ["batch"]


def _maxtext_text_problems(pairs: dict, gpus: int, layers: int | None) -> list[str]:
    out = []
    ici = [int(v) for k, v in pairs.items() if k.startswith("ici_")]
    prod = 1
    for v in ici:
        prod *= v
    if prod != gpus:
        out.append("devices")
    pp = int(pairs["ici_pipeline_parallelism"])
    if layers and layers % pp:
        out.append("layers")
    if pp > 1 and int(pairs.get("num_pipeline_microbatches", pp)) % pp:
        out.append("microbatches")
    if pairs["remat_policy"] not in ("minimal", "minimal_with_context", "full"):
        out.append("remat")
    return out


def _check(target, text, facts: JobFacts, stages: int):
    if target == "megatron":
        return _megatron_text_problems(text, facts.gpus, facts.layers)
    if target == "deepspeed":
        return _deepspeed_text_problems(text, facts.gpus, stages)
    pairs = dict(p.split("=") for p in text.split())
    return _maxtext_text_problems(pairs, facts.gpus, facts.layers)


def _nearest_from_error(target: str, message: str) -> tuple[str, int]:
    """The settings and stages a refusal names as the nearest launchable configuration."""
    m = re.search(r"nearest launchable configuration is TP \d+ x PP (\d+) x DP \d+ = \d+ GPUs: "
                  r"(.*) \(or re-plan", message)  # fmt: skip
    assert m, message
    text = m.group(2)
    if target == "deepspeed":
        text = text.split(" with PipelineModule")[0]
    return text, int(m.group(1))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(PIPELINES))
def test_every_pipeline_export_launches_or_names_one_that_does(name, target):
    from autoshard.report.pipeline import job_facts

    d = PIPELINES[name]()
    facts = job_facts(d)
    try:
        out = export_pipeline(d, target)
    except ValueError as err:
        text, stages = _nearest_from_error(target, str(err))
        assert _check(target, text, facts, stages) == [], str(err)
        # the only ones that cannot launch: 5 stages on 8 GPUs; 4 microbatches on 3 stages
        assert name == "5 stages on 8 devices" or (
            target == "maxtext" and "4 pipeline microbatches are not divisible by 3" in str(err)
        ), str(err)
        return
    assert _check(target, out.text, facts, len(d.stages)) == []


def test_the_five_stage_plan_is_refused_with_the_reasons():
    d = PIPELINES["5 stages on 8 devices"]()
    with pytest.raises(ValueError) as err:
        export_pipeline(d, "megatron")
    msg = str(err.value)
    assert "megatron cannot launch this plan as it is (TP 1 x PP 5 x DP 1 = 5 GPUs, of 8)" in msg
    assert "TP 1 x PP 5 does not divide the 8 GPUs" in msg
    assert "4 layers do not split into 5 pipeline stages" in msg
    assert "nearest launchable configuration is TP 1 x PP 4 x DP 2 = 8 GPUs" in msg
    with pytest.raises(ValueError, match="5 pipeline stages do not divide the 8 GPUs"):
        export_pipeline(d, "deepspeed")
    with pytest.raises(ValueError, match="the ici_\\* parallelisms multiply to 5, not the 8"):
        export_pipeline(d, "maxtext")


def test_full_recompute_exports_megatrons_companion_flags_and_maxtext_remat():
    d = PIPELINES["full recompute"]()
    args = export_pipeline(d, "megatron").text.split()
    i = args.index("--recompute-granularity")
    assert args[i : i + 6] == [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ]  # fmt: skip
    assert export_pipeline(d, "maxtext").config["remat_policy"] == "full"
    sel = export_pipeline(PIPELINES["selective recompute"](), "megatron").text
    assert "--recompute-granularity selective" in sel and "--recompute-method" not in sel
    assert export_pipeline(_grid(2, 2, 2), "maxtext").config["remat_policy"] == (
        "minimal_with_context"  # keeps the attention context: nothing recomputed is nearest
    )


def test_the_rule_check_catches_what_megatron_refuses():
    facts = JobFacts(gpus=8, layers=4, global_batch=8, microbatches=4)
    ok = {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2,
          "micro-batch-size": 1, "global-batch-size": 8}  # fmt: skip
    assert launch_problems("megatron", ok, facts) == []
    bare_full = {**ok, "recompute-granularity": "full"}
    assert launch_problems("megatron", bare_full, facts) == [
        "--recompute-granularity full needs --recompute-method uniform|block",
        "--recompute-granularity full needs --recompute-num-layers",
    ]
    three = {**ok, "pipeline-model-parallel-size": 3}
    assert "4 layers do not split into 3 pipeline stages" in launch_problems(
        "megatron", three, facts
    )


# ----------------------------------------------------------------------- one-mesh plans


@pytest.fixture(scope="module")
def one_mesh_plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    mlp = dict(batch_size=64, hidden=32)
    plans = [
        save_plan(tmp, "mlp", mesh, b, **mlp)
        for mesh in ("2x4", "4x2", "1x8", "8")
        for b in ("dp", "zero2", "zero3", "megatron")
    ]
    # the ILP's own plan at batch 128: 0.3 s of CPU (batch 64 with hidden 32 is a slow case
    # of the exact program, 6 s)
    plans.append(save_plan(tmp, "mlp", "2x4", None, batch_size=128, hidden=32))
    plans.append(save_plan(tmp, "gpt-tiny", "2x4", "megatron", seq_len=16, vocab_size=64))
    return plans


@pytest.mark.parametrize("target", TARGETS)
def test_every_one_mesh_export_launches(one_mesh_plans, target):
    from autoshard.report.export import one_mesh_facts

    for path in one_mesh_plans:
        d = digest(load_plan(path))
        out = export(d, target)
        assert _check(target, out.text, one_mesh_facts(d), 1) == [], path.name


def test_an_own_models_plan_exports_to_megatron(tmp_path):
    """No weight of your own model is in the Megatron rule table: the export keeps the
    plan's split over the TP axis (it used to refuse with a message about a baseline
    'megatron' nobody asked for)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import autoshard

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(nn.relu(nn.Dense(64)(x)))

    model, opt = Net(), optax.sgd(1e-2)
    batch = (jnp.ones((16, 16)), jnp.zeros((16, 16)))
    params = model.init(jax.random.key(0), batch[0])

    def step(p, s, b):
        loss, g = jax.value_and_grad(lambda q: jnp.mean((model.apply(q, b[0]) - b[1]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    bound = autoshard.auto_shard(step, params, opt.init(params), batch, mesh="2x4")
    bound.save(tmp_path / "own.json")
    d = digest(load_plan(tmp_path / "own.json"))
    for target in TARGETS:
        out = export(d, target)
        assert _check(target, out.text, JobFacts(8, None, 16), 1) == []
