"""Issue #34 on the pipeline path: ``plan --pipeline ... --offload``, the plan file and
``explain`` per stage, and the pipeline runtime keeping the optimizer state in
``pinned_host`` memory while it trains like one device."""

import json

import numpy as np
import pytest
from conftest import cli_in_process

from autoshard.hardware.clusters import load_cluster
from autoshard.inter.plan import InterPlan

PLAN = (
    "plan --model gpt-tiny --pipeline equal-layer --devices 2 --stages 2 --microbatches 2 "
    "--cluster alpa-v100"
)


def test_pipeline_plan_file_with_offload_round_trips_and_explains(capsys, tmp_path):
    out = tmp_path / "pipe.json"
    rc, text, err = cli_in_process(capsys, *PLAN.split(), "--offload", "optimizer", "--out", out)
    assert rc == 0, text + err
    assert "offload optimizer: optimizer in host memory, update on device" in text
    assert "stage 1:" in text and "per device in host memory" in text
    saved = json.loads(out.read_text())
    record = saved["inter_plan"]["offload"]
    plan = InterPlan.from_json(saved["inter_plan"])
    assert plan.offload == record and InterPlan.loads(plan.dumps()).offload == record
    assert record["where"] == {
        "optimizer": "host", "master": "device", "gradients": "device",
        "activations": "device", "update": "device",
    }  # fmt: skip
    # every stage holds Adam's moments of its own parameters on the host: both stages some,
    # and together two f32 copies of the model's parameters (gpt-tiny: all of them f32)
    assert len(record["host_bytes_per_stage"]) == 2 and min(record["host_bytes_per_stage"]) > 0
    assert all(s > 0 for s in record["exposed_s_per_stage"])
    rc, explained, err = cli_in_process(capsys, "explain", out, "--json")
    assert rc == 0, err
    assert json.loads(explained)["offload"] == record
    rc, explained, err = cli_in_process(capsys, "explain", out)
    assert rc == 0, err
    assert "in host memory on every stage" in explained and "exposed offload" in explained


def test_pipeline_offload_takes_the_state_out_of_the_stage_peak(capsys):
    peaks = {}
    for placement in ("none", "optimizer"):
        rc, text, err = cli_in_process(capsys, *PLAN.split(), "--offload", placement, "--json")
        assert rc == 0, err
        plan = json.loads(text)
        peaks[placement] = [s["peak_bytes"] for s in plan["stages"]]
        assert ("offload" in plan) == (placement != "none")
    # Adam's two moments leave HBM; a staging buffer for the largest shard comes in
    assert all(o < p for o, p in zip(peaks["optimizer"], peaks["none"], strict=True))


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--offload optimizer", "pass --cluster"),  # no host figures without a preset
        ("--cluster alpa-v100 --offload optimizer,master", "master"),  # f32 compute
        ("--cluster alpa-v100 --offload gradients", "update runs on the host"),
    ],
)
def test_bad_pipeline_offload_exits_2(capsys, flags, message):
    argv = "plan --model gpt-tiny --pipeline equal-layer --devices 2 --stages 2 " + flags
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 2, out + err
    assert message in err and "Traceback" not in err


def test_pipeline_host_memory_too_small_is_refused(tmp_path):
    from importlib import resources

    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.hardware.clusters import cluster_from_json
    from autoshard.inter.options import StageSearchOptions

    text = (resources.files("autoshard.hardware") / "presets" / "alpa-v100.json").read_text()
    preset = json.loads(text)
    preset["name"] = "no-ram"
    preset["host"]["memory_bytes"] = 1024
    cluster = cluster_from_json(preset)
    with pytest.raises(ValueError, match="of host memory per node"):
        auto_stage_plan(
            "gpt-tiny", 1, 2, StageSearchOptions(2, stages="equal-layer", num_stages=2),
            cluster=cluster, offload="optimizer",
        )  # fmt: skip


def _train(offload, steps=2, microbatches=2, **overrides):
    import jax

    from autoshard.api_pipeline import auto_pipeline
    from autoshard.models import get_workload, make_optimizer

    workload = get_workload("gpt-tiny", num_layers=1, **overrides)
    opt = make_optimizer("adamw")
    params, _, batch = workload.init_train_args(opt, seed=0)
    trainer = auto_pipeline(
        workload.loss_fn, opt, params, batch, devices=jax.devices()[:2], num_microbatches=microbatches,
        stages="equal-layer", num_stages=2, cluster="alpa-v100", offload=offload,
    )  # fmt: skip
    losses = [float(trainer.step(batch)) for _ in range(steps)]
    return trainer, losses


@pytest.fixture(scope="module")
def plain_f32():
    """The f32 AdamW pipeline without offload, two steps: (trainer, losses)."""
    return _train(None)  # gpt-tiny with one block: 3 layers, 2 stages


def test_pipeline_runtime_keeps_adam_state_in_pinned_host_and_trains_like_one_device(plain_f32):
    import jax
    import jax.numpy as jnp

    from autoshard.models import get_workload, make_optimizer, make_train_step

    off, losses_off = _train("optimizer")
    plain, losses = plain_f32
    assert off.inter_plan.offload["classes"] == ["optimizer"] and plain.inter_plan.offload is None
    for st_off, st in zip(off.stage_executables, plain.stage_executables, strict=True):
        moments = [
            x for x in jax.tree.leaves(st_off.opt_state) if jnp.issubdtype(x.dtype, jnp.inexact)
        ]
        assert moments and {x.sharding.memory_kind for x in moments} == {"pinned_host"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(st.opt_state)} == {"device"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(st_off.params)} == {"device"}
    # one device, f32 AdamW: the same losses within 1e-5
    workload = get_workload("gpt-tiny", num_layers=1)
    opt = make_optimizer("adamw")
    p, s, batch = workload.init_train_args(opt, seed=0)
    step = jax.jit(make_train_step(workload.loss_fn, opt))
    want = []
    for _ in range(2):
        p, s, loss = step(p, s, batch)
        want.append(float(loss))
    assert losses_off == pytest.approx(want, rel=1e-5)
    # and the same training as the pipeline without offload: losses and parameters
    assert losses_off == pytest.approx(losses, rel=1e-5)
    for a, b in zip(jax.tree.leaves(off.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_cli_run_pipeline_offload_needs_a_cluster(capsys):
    argv = "run --model gpt-tiny --pipeline equal-layer --devices 2 --stages 2 --offload optimizer"
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 2 and "--cluster" in err and "Traceback" not in err  # no host figures


def _residual_layouts(compiled) -> list[str]:
    """The layouts of a compiled forward's results: ``S(5)`` marks host memory."""
    import re

    entry = re.search(r"entry_computation_layout=\{\((.*)\)->\((.*)\)\}", compiled.as_text())
    return re.findall(r"\w+\[[^\]]*\](?:\{[^{}]*\})?", entry.group(2))  # f32[4,8]{1,0:S(5)}


def test_pipeline_runtime_keeps_saved_activations_in_pinned_host_and_trains_the_same(plain_f32):
    """offload activations: every stage's forward returns its residuals in pinned_host
    (the compiled forward's results carry host memory space S(5)), the backward takes them
    back, and two f32 AdamW steps give the losses and weights of the pipeline without
    offload within 1e-5."""
    import jax
    import jax.numpy as jnp

    off, losses_off = _train("activations")
    plain, losses = plain_f32
    assert off.inter_plan.offload["classes"] == ["activations"]
    assert losses_off == pytest.approx(losses, rel=1e-5)
    for a, b in zip(jax.tree.leaves(off.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for i, (st_off, st) in enumerate(zip(off.stage_executables, plain.stage_executables,
                                         strict=True)):  # fmt: skip
        assert st_off.activations_on_host and not st.activations_on_host
        compiled_off, compiled = off.compiled_forward(i), plain.compiled_forward(i)
        kinds = [s.memory_kind for s in jax.tree.leaves(compiled_off.output_shardings[1])]
        assert kinds and set(kinds) == {"pinned_host"}, kinds
        assert {s.memory_kind for s in jax.tree.leaves(compiled.output_shardings[1])} == {"device"}
        sent = len(st.output_shardings)  # the results before the residuals
        layouts = _residual_layouts(compiled_off)
        assert len(layouts) == sent + len(kinds)
        assert all("S(5)" not in x for x in layouts[:sent])  # what is sent stays on device
        assert all("S(5)" in x for x in layouts[sent:])  # every residual in host memory
        assert not any("S(5)" in x for x in _residual_layouts(compiled))
        # a real forward: its residuals arrive in pinned_host, the state stays put
        params, received, data = st_off.abstract_args()
        zeros = [jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding) for a in received + data]
        _, residuals = st_off.forward(st_off.live_params(), zeros[: len(received)],
                                      zeros[len(received):])  # fmt: skip
        assert {r.sharding.memory_kind for r in residuals} == {"pinned_host"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(st_off.opt_state)} == {"device"}


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_pipeline_runtime_keeps_bf16_masters_in_pinned_host_and_trains_the_same():
    """optimizer,master on a bf16 model: the f32 weights read through a convert to bf16
    rest in pinned_host (those read in f32 -- layer-norm scales, the tied embedding --
    stay on the device); during a step the device holds their bf16 copies (what the stage
    search prices), the gradients accumulate in f32; two steps give the losses and
    weights of the pipeline without offload, bit for bit."""
    import jax

    from autoshard.api_pipeline import microbatch_graph
    from autoshard.intra.offload.placement import tensor_classes

    off, losses_off = _train("optimizer,master", dtype="bfloat16")
    plain, losses = _train(None, dtype="bfloat16")
    assert losses_off == losses
    for a, b in zip(jax.tree.leaves(off.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, graph = microbatch_graph("gpt-tiny", 2, "adamw", dtype="bfloat16", num_layers=1)
    masters = tensor_classes(graph)["master"] & set(graph.inputs)
    kinds = {}
    assert any(st.masters_on_host for st in off.stage_executables)
    for st in off.stage_executables:
        for t, leaf in zip(st.param_ids, jax.tree.leaves(st.params), strict=True):
            kinds[t] = leaf.sharding.memory_kind
    assert masters and {kinds[t] for t in masters} == {"pinned_host"}
    assert {k for t, k in kinds.items() if t not in masters} == {"device"}
    live, grads = {}, {}
    for st in off.stage_executables:
        leaves = zip(st.param_ids, jax.tree.leaves(st.live_params()),
                     jax.tree.leaves(st.zero_grads()), strict=True)  # fmt: skip
        for t, leaf, grad in leaves:
            live[t] = (str(leaf.dtype), leaf.sharding.memory_kind)
            grads[t] = str(grad.dtype)
    assert {live[t] for t in masters} == {("bfloat16", "device")}  # the 16-bit copies
    assert {live[t] for t in live if t not in masters} == {("float32", "device")}
    assert set(grads.values()) == {"float32"}
    # the compiled forward reads the masters in bf16: no f32 copy of them on the device
    for i, st in enumerate(off.stage_executables):
        entry = off.compiled_forward(i).as_text().split("entry_computation_layout={(")[1]
        params = entry.split(")->")[0]
        n_masters = sum(t in masters for t in st.param_ids)
        assert params.count("bf16[") >= n_masters
        plain_params = plain.compiled_forward(i).as_text().split("entry_computation_layout={(")
        # without offload the weights cast once a step are read in bf16 too (cast_once)
        n_once = len(plain.stage_executables[i].cast_once)
        assert plain_params[1].split(")->")[0].count("bf16[") == (
            params.count("bf16[") - n_masters + n_once
        )


def test_pipeline_runtime_offload_refuses_interleaving():
    with pytest.raises(ValueError, match="virtual_stages=1"):
        import jax

        from autoshard.api_pipeline import auto_pipeline
        from autoshard.models import get_workload, make_optimizer

        workload = get_workload("gpt-tiny")
        opt = make_optimizer("adamw")
        params, _, batch = workload.init_train_args(opt, seed=0)
        auto_pipeline(
            workload.loss_fn, opt, params, batch, devices=jax.devices()[:2],
            num_microbatches=2, stages="equal-layer", num_stages=2, schedule="interleaved",
            virtual_stages=2, cluster="alpa-v100", offload="optimizer",
        )  # fmt: skip


@pytest.mark.slow  # the runtime tests above cover the same path through the API
@pytest.mark.parametrize("offload", ["optimizer", "optimizer,activations"])
def test_cli_run_pipeline_offload_matches_one_device(capsys, offload):
    argv = (
        "run --model gpt-tiny --pipeline equal-layer --devices 2 --stages 2 --microbatches 2 "
        f"--cluster alpa-v100 --offload {offload} --optimizer sgd-momentum --steps 2 --check"
    )
    rc, out, err = cli_in_process(capsys, *argv.split())
    assert rc == 0, out + err
    assert "optimizer state at rest in memory kind: pinned_host" in out
    if "activations" in offload:
        assert "saved activations between forward and backward in memory kind: pinned_host" in out
    assert "MATCH" in out and "MISMATCH" not in out


# -- saved activations as an offload class: priced by the stage search


@pytest.fixture(scope="module")
def act_costs():
    """gpt-tiny at 2 micro-batches, its stage costs on one alpa-v100 GPU without offload
    and with the activations offloaded over a fast, the real and a slow host link."""
    from importlib import resources

    from autoshard.api_pipeline import microbatch_graph
    from autoshard.hardware.clusters import cluster_from_json
    from autoshard.inter.stage_cost import IntraStageCost
    from autoshard.inter.submesh import cluster_for, logical_mesh_costs
    from autoshard.intra.offload.placement import Offload

    _, graph = microbatch_graph("gpt-tiny", 2, "adamw")
    text = (resources.files("autoshard.hardware") / "presets" / "alpa-v100.json").read_text()

    def cost(bandwidth=None):
        preset = json.loads(text)
        if bandwidth is None:
            return IntraStageCost(graph, logical_mesh_costs(cluster_for("alpa-v100", 1, 1)),
                                  num_microbatches=2)  # fmt: skip
        preset["host"]["link"]["bandwidth"] = bandwidth
        cl = cluster_for(cluster_from_json(preset), 1, 1)
        return IntraStageCost(graph, logical_mesh_costs(cl), num_microbatches=2,
                              offload=Offload(("activations",)), cluster=cl)  # fmt: skip

    return cost(), {bw: cost(bw) for bw in (1e18, 12e9, 1e3)}


def test_offloaded_activations_leave_the_in_flight_memory_and_stage_twice_a_layer(act_costs):
    plain, by_bw = act_costs
    n = plain.num_layers
    base = plain(0, n, (1, 1), (1, 1))
    off = by_bw[12e9](0, n, (1, 1), (1, 1))
    kept = [plain.unit(i, i + 1, (1, 1)).activation_bytes for i in range(n)]
    assert base.activation_bytes == pytest.approx(sum(kept)) and sum(kept) > 0
    assert off.activation_bytes == 0.0 and off.param_bytes == pytest.approx(base.param_bytes)
    # staging: twice the largest layer's kept activations, held once
    assert off.working_bytes == pytest.approx(base.working_bytes + 2 * max(kept))
    # with 4 micro-batches in flight the stage holds less (2 max(kept) < 4 sum(kept))
    assert off.memory_bytes(4) < base.memory_bytes(4)


def test_offloaded_activations_cost_only_what_compute_does_not_hide(act_costs):
    plain, by_bw = act_costs
    n = plain.num_layers
    base = plain(0, n, (1, 1), (1, 1)).latency_s
    fast, real, slow = (by_bw[bw](0, n, (1, 1), (1, 1)).latency_s for bw in (1e18, 12e9, 1e3))
    assert fast == pytest.approx(base, rel=1e-6)  # copies that take no time
    assert base < real < slow
    # over a 1 kB/s link nothing hides: each layer's kept bytes out and back, less the
    # forward and backward compute they overlap
    units = [plain.unit(i, i + 1, (1, 1)) for i in range(n)]
    kept = sum(u.activation_bytes for u in units)
    assert slow - base == pytest.approx(2 * kept / 1e3, rel=1e-3)
    # over alpa-v100's 12 GB/s: the preset's copy_overlap share of each copy hides behind
    # its layer's pass (the forward for the copy out, the backward for the copy back), at
    # most that pass; the rest is exposed
    share = load_cluster("alpa-v100").host.copy_overlap
    exposed = 0.0
    for u in units:
        phases = u.plan.solver["compute_s_by_phase"]
        copy = u.activation_bytes / 12e9
        exposed += 2 * copy - min(share * copy, phases["forward"])
        exposed -= min(share * copy, phases["backward"])
    assert 0 < exposed < 2 * kept / 12e9
    assert real - base == pytest.approx(exposed, rel=1e-6)


def test_pipeline_plan_offloads_activations(capsys):
    rc, text, err = cli_in_process(capsys, *PLAN.split(), "--offload", "activations", "--json")
    assert rc == 0, err
    assert json.loads(text)["offload"]["where"]["activations"] == "host"
    argv = "plan --model gpt-tiny --mesh 1 --cluster alpa-v100 --offload activations"
    rc, out, err = cli_in_process(capsys, *argv.split())  # one mesh: not modelled
    assert rc == 2 and "plan --pipeline, simulate --plan auto or run --pipeline" in err, out + err


def test_simulate_prices_offloaded_activations_as_offload(tmp_path):
    """The simulator's step breakdown books the exposed copies as ``offload``: over a
    1 kB/s host link they dominate the step, and the parts still sum to it."""
    from importlib import resources

    from autoshard.sim.simulate import simulate

    text = (resources.files("autoshard.hardware") / "presets" / "alpa-v100.json").read_text()
    preset = json.loads(text)
    preset["name"], preset["host"]["link"]["bandwidth"] = "slow-pcie", 1e3
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(preset))
    kw = dict(plan="auto", num_microbatches=1, recompute="none")
    plain = simulate("gpt-tiny", str(path), 1, **kw)
    off = simulate("gpt-tiny", str(path), 1, offload="activations", **kw)
    assert off.plan["offload"]["where"]["activations"] == "host"
    assert off.step_breakdown["offload"] > 0.5 * off.step_time_s
    assert off.step_time_s - plain.step_time_s == pytest.approx(off.step_breakdown["offload"])
    assert sum(off.step_breakdown.values()) == pytest.approx(off.step_time_s, rel=1e-9)
    # one stage, one micro-batch: the record's exposed seconds are the breakdown's
    (exposed,) = off.plan["offload"]["exposed_s_per_stage"]
    assert exposed == pytest.approx(off.step_breakdown["offload"])


# -- per-stage placements: the stage DP chooses each stage's with its recompute mode


def _stage_budget():
    """A per-device budget that the first of two gpt-tiny stages (two microbatches in
    flight) fits only with its optimizer state offloaded and the second fits as it is;
    with the plans without offload and with optimizer on every stage."""
    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    options = StageSearchOptions(2, stages="equal-layer", num_stages=2)
    kw = dict(cluster="alpa-v100", num_layers=1)
    plain = auto_stage_plan("gpt-tiny", 1, 2, options, **kw)
    off = auto_stage_plan("gpt-tiny", 1, 2, options, offload="optimizer", **kw)
    lean, plain_peak = off.stages[0].peak_bytes, plain.stages[0].peak_bytes
    budget = (lean + plain_peak) / 2
    assert plain.stages[1].peak_bytes < budget < plain_peak  # the case this is about
    return budget, plain, off


def test_auto_offloads_only_the_stage_whose_memory_binds(tmp_path):
    import dataclasses

    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    budget, plain, off = _stage_budget()
    options = StageSearchOptions(2, stages="equal-layer", num_stages=2, memory_budget_bytes=budget)
    kw = dict(cluster="alpa-v100", num_layers=1)
    mixed = auto_stage_plan("gpt-tiny", 1, 2, options, offload="auto", **kw)
    assert [s.offload for s in mixed.stages] == ["optimizer", "none"]
    assert all(s.peak_bytes <= budget for s in mixed.stages)
    record = mixed.offload
    assert record["offload"] == "per stage" and record["chosen_by"] == "auto"
    assert record["offload_per_stage"] == ["optimizer", "none"]
    assert record["where"]["optimizer"] == "some stages"
    assert record["host_bytes_per_stage"][0] > 0 == record["host_bytes_per_stage"][1]
    assert record["exposed_s_per_stage"][1] == 0
    # the second stage pays nothing for the first's offload: faster than optimizer on both
    assert mixed.objective_s < off.objective_s
    assert mixed.stages[1].latency_s == pytest.approx(plain.stages[1].latency_s)
    # a placement given outright still applies to every stage, whatever the budget
    fixed = auto_stage_plan("gpt-tiny", 1, 2, options, offload="optimizer", **kw)
    assert [s.offload for s in fixed.stages] == ["optimizer", "optimizer"]
    assert fixed.offload["offload_per_stage"] == ["optimizer", "optimizer"]
    # the plan file keeps each stage's placement
    again = InterPlan.loads(mixed.dumps())
    assert [s.offload for s in again.stages] == ["optimizer", "none"]
    assert [s.offload for s in again.stage_plan.stages] == ["optimizer", "none"]
    assert again.offload == record
    # a file written before stages had their own placement: every stage took the plan's
    old = fixed.to_json()
    for s in (*old["stages"], *old["stage_plan"]["stages"]):
        del s["offload"]
    assert [s.offload for s in InterPlan.from_json(old).stages] == ["optimizer"] * 2
    # a record from before auto said why: loads, and the plan's lines leave the reason out
    from autoshard.cli.pipeline import offload_lines

    older = mixed.to_json()
    for key in ("why", "without_offload_s", "min_gain"):
        del older["offload"][key]
    lines = offload_lines(InterPlan.from_json(older).offload)
    assert lines[0].startswith("offload per stage (chosen by auto)")
    assert not any("auto offloads" in x for x in lines)
    assert any("auto offloads" in x for x in offload_lines(again.offload))
    # without a budget that binds, auto offloads nothing (and keeps no record)
    roomy = auto_stage_plan(
        "gpt-tiny", 1, 2, dataclasses.replace(options, memory_budget_bytes=None),
        offload="auto", **kw,
    )  # fmt: skip
    assert [s.offload for s in roomy.stages] == ["none", "none"] and roomy.offload is None


def test_cli_plan_and_explain_say_what_each_stage_placed(capsys, tmp_path):
    budget, _, _ = _stage_budget()
    out = tmp_path / "mixed.json"
    argv = PLAN.split() + [
        "--layers",
        "1",
        "--recompute",  # the budget is the no-recompute stages' (recompute would fit it too)
        "none",
        "--offload",
        "auto",
        "--memory-budget",
        f"{budget / 2**30:.9f}",
    ]
    rc, text, err = cli_in_process(capsys, *argv, "--out", out)
    assert rc == 0, text + err
    assert "offload per stage (chosen by auto): optimizer | none" in text
    assert "auto offloads: no plan fits the HBM without offload" in text
    assert "stage 0: optimizer," in text and "stage 1: none," in text
    rc, explained, err = cli_in_process(capsys, "explain", out)
    assert rc == 0, err
    assert "offload chosen per stage" in explained
    assert "auto offloads: no plan fits the HBM without offload" in explained
    rc, explained, err = cli_in_process(capsys, "explain", out, "--json")
    assert rc == 0, err
    assert [s["offload"] for s in json.loads(explained)["stages"]] == ["optimizer", "none"]


def _auto_pipeline(plain, budget):
    """gpt-tiny (one layer) pipelined on 2 devices in 2 equal-layer stages, f32 AdamW,
    ``--offload auto`` under ``budget`` on alpa-v100, its stage ILPs from ``plain``'s
    cost; returns (the pipeline, its batch)."""
    import jax

    from autoshard.api_pipeline import auto_pipeline
    from autoshard.models import get_workload, make_optimizer

    workload = get_workload("gpt-tiny", num_layers=1)
    opt = make_optimizer("adamw")
    params, _, batch = workload.init_train_args(opt, seed=0)
    mixed = auto_pipeline(
        workload.loss_fn, opt, params, batch, devices=jax.devices()[:2], num_microbatches=2,
        stages="equal-layer", num_stages=2, cluster="alpa-v100", offload="auto",
        memory_budget_bytes=budget, intra_cost=plain.intra_cost,
    )  # fmt: skip
    return mixed, batch


def test_pipeline_runtime_runs_a_placement_per_stage_and_trains_the_same(plain_f32):
    import jax
    import jax.numpy as jnp

    plain, losses = plain_f32
    budget, _, _ = _stage_budget()
    mixed, batch = _auto_pipeline(plain, budget)
    assert [s.offload for s in mixed.inter_plan.stages] == ["optimizer", "none"]
    kinds = [
        {x.sharding.memory_kind for x in jax.tree.leaves(st.opt_state)
         if jnp.issubdtype(x.dtype, jnp.inexact)}
        for st in mixed.stage_executables
    ]  # fmt: skip
    assert kinds == [{"pinned_host"}, {"device"}]  # the moments where each stage put them
    got = [float(mixed.step(batch)) for _ in range(2)]
    assert got == pytest.approx(losses, rel=1e-5)
    for a, b in zip(jax.tree.leaves(mixed.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_auto_drops_a_placement_the_hosts_memory_cannot_hold():
    from importlib import resources

    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.hardware.clusters import cluster_from_json
    from autoshard.inter.options import StageSearchOptions

    budget, _, _ = _stage_budget()
    text = (resources.files("autoshard.hardware") / "presets" / "alpa-v100.json").read_text()
    preset = json.loads(text)
    preset["name"], preset["host"]["memory_bytes"] = "no-ram", 1024
    options = StageSearchOptions(2, stages="equal-layer", num_stages=2, memory_budget_bytes=budget)
    # the first stage fits only with its optimizer state on the host, which has no room:
    # the placement is dropped and nothing else fits
    with pytest.raises(ValueError, match="dropped for host memory: optimizer"):
        auto_stage_plan(
            "gpt-tiny", 1, 2, options, cluster=cluster_from_json(preset), offload="auto",
            num_layers=1,
        )  # fmt: skip


# -- auto's cost: the placements searched only where memory binds; activations per stage


def test_auto_searches_no_placement_where_memory_does_not_bind():
    """A budget nothing needs: auto solves the ILPs of the search without offload and no
    more, and a device update's placement solves none of its own (it prices its state on
    the plain plans) whatever it is asked."""
    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    options = StageSearchOptions(2, stages="equal-layer", num_stages=2)
    kw = dict(cluster="alpa-v100", num_layers=1)
    plain = auto_stage_plan("gpt-tiny", 1, 2, options, **kw)
    auto = auto_stage_plan("gpt-tiny", 1, 2, options, offload="auto", **kw)
    assert auto.offload is None and [s.offload for s in auto.stages] == ["none", "none"]
    assert auto.num_ilps == plain.num_ilps > 0
    assert auto.objective_s == plain.objective_s
    fixed = auto_stage_plan("gpt-tiny", 1, 2, options, offload="optimizer", **kw)
    assert fixed.num_ilps == plain.num_ilps  # the plain plans', counted once
    # the same plans, the state priced apart: latency no lower on any stage
    for a, b in zip(fixed.stages, plain.stages, strict=True):
        assert a.latency_s >= b.latency_s and a.peak_bytes < b.peak_bytes


def _decide(monkeypatch, plain_s, free_s, joint_s, plain_fits=True):
    """search_with_offload's choice with a stand-in search: plain_s (the plan without
    offload under the budget; None: none fits), free_s (without a budget), joint_s (the
    placements' plan, its first stage offloading). Returns (plan, the costs searched)."""
    import dataclasses

    import autoshard.inter.stage_offload as so
    from autoshard.inter.stages import StageBudgetError

    @dataclasses.dataclass(frozen=True)
    class Plan:
        objective_s: float
        stages: tuple
        offload: dict | None = None
        num_ilps: int = 0
        search_seconds: float = 0.0
        phase_seconds: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass(frozen=True)
    class St:
        offload: str

    class Base:
        graph, num_ilps, _offloaded = None, 0, {}
        num_microbatches, layer_names, folded, granularity, num_layers = 1, (), False, "layer", 0
        mesh_for = None

        def with_offload(self, p, cluster):
            return self

    searched = []

    def search(cost, bounded=True):
        searched.append(("choice" if isinstance(cost, so.PlacementChoice) else "plain", bounded))
        if isinstance(cost, so.PlacementChoice):
            return Plan(joint_s, (St("optimizer"), St("none")))
        if bounded and not plain_fits:
            raise StageBudgetError("no plan fits", 1.0, 2.0)
        return Plan(plain_s if bounded else free_s, (St("none"), St("none")))

    monkeypatch.setattr(so, "auto_placements", lambda graph: (so.Offload(("optimizer",)),))
    monkeypatch.setattr(so, "offload_summary", lambda *a: {"fits_host": True})
    return so.search_with_offload(search, "auto", Base(), None), searched


def test_auto_offloads_only_to_fit_or_for_a_gain_over_its_threshold(monkeypatch):
    from autoshard.inter.stage_offload import AUTO_MIN_GAIN

    assert 0 < AUTO_MIN_GAIN < 1
    # memory costs the plan less than the threshold: nothing else is searched
    plan, searched = _decide(monkeypatch, 1.0, 1.0 - AUTO_MIN_GAIN / 2, 0.5)
    assert plan.offload is None and searched == [("plain", True), ("plain", False)]
    # it binds, but the placements gain less than the threshold: the plan without offload
    plan, searched = _decide(monkeypatch, 1.0, 0.5, 1.0 - AUTO_MIN_GAIN / 2)
    assert plan.offload is None and plan.objective_s == 1.0 and ("choice", True) in searched
    # they gain more: kept, and the record says why
    plan, _ = _decide(monkeypatch, 1.0, 0.5, 1.0 - 2 * AUTO_MIN_GAIN)
    assert plan.objective_s == 1.0 - 2 * AUTO_MIN_GAIN
    assert plan.offload["why"].startswith(f"{2 * AUTO_MIN_GAIN:.1%} faster")
    assert plan.offload["without_offload_s"] == 1.0
    # nothing fits without offload: any gain (even a loss) is taken
    plan, searched = _decide(monkeypatch, None, None, 5.0, plain_fits=False)
    assert plan.objective_s == 5.0 and plan.offload["why"].startswith("no plan fits")
    assert plan.offload["without_offload_s"] is None
    assert searched == [("plain", True), ("choice", True)]


def _activation_budget():
    """A per-device budget the first of two gpt-tiny stages fits only with both its
    optimizer state and its saved activations on the host (f32: no master weights, so no
    host update either), the second as it is."""
    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    options = StageSearchOptions(2, stages="equal-layer", num_stages=2)
    kw = dict(cluster="alpa-v100", num_layers=1)
    peaks = {
        off: [s.peak_bytes for s in auto_stage_plan("gpt-tiny", 1, 2, options, offload=off, **kw).stages]
        for off in ("optimizer", "activations", "optimizer,activations")
    }  # fmt: skip
    both = peaks["optimizer,activations"][0]
    one = min(peaks["optimizer"][0], peaks["activations"][0])
    assert both < one
    return (both + one) / 2


def test_auto_offloads_saved_activations_where_only_they_make_a_stage_fit():
    import dataclasses

    from autoshard.api_pipeline import auto_stage_plan
    from autoshard.inter.options import StageSearchOptions

    budget = _activation_budget()
    options = StageSearchOptions(2, stages="equal-layer", num_stages=2, memory_budget_bytes=budget)
    kw = dict(cluster="alpa-v100", num_layers=1)
    mixed = auto_stage_plan("gpt-tiny", 1, 2, options, offload="auto", **kw)
    assert [s.offload for s in mixed.stages] == ["optimizer,activations", "none"]
    assert all(s.peak_bytes <= budget for s in mixed.stages)
    record = mixed.offload
    assert "activations" in record["candidates"] and record["why"].startswith("no plan fits")
    assert record["where"]["activations"] == "some stages"
    # the host holds the activations too: more than the optimizer state alone
    roomy = dataclasses.replace(options, memory_budget_bytes=None)
    state = auto_stage_plan("gpt-tiny", 1, 2, roomy, offload="optimizer", **kw)
    assert record["host_bytes_per_stage"][0] > state.offload["host_bytes_per_stage"][0]


def test_pipeline_runtime_offloads_activations_on_the_stage_auto_chose(plain_f32):
    """auto's per-stage activations run: the first stage's forward leaves its residuals in
    pinned_host, the second's on the device; two f32 AdamW steps give the losses and
    weights of the pipeline without offload within 1e-5."""
    import jax

    plain, losses = plain_f32
    mixed, batch = _auto_pipeline(plain, _activation_budget())
    assert [s.offload for s in mixed.inter_plan.stages] == ["optimizer,activations", "none"]
    assert [st.activations_on_host for st in mixed.stage_executables] == [True, False]
    kinds = [
        {s.memory_kind for s in jax.tree.leaves(mixed.compiled_forward(i).output_shardings[1])}
        for i in range(2)
    ]
    assert kinds == [{"pinned_host"}, {"device"}]
    got = [float(mixed.step(batch)) for _ in range(2)]
    assert got == pytest.approx(losses, rel=1e-5)
    for a, b in zip(jax.tree.leaves(mixed.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_pipeline_update_streams_the_state_a_parameter_at_a_time():
    """Each stage's update, lowered for GPU: its moments are fetched a parameter at a time,
    after the previous parameter's were stored (verify.state_window), where the form
    before streaming may hold all of the stage's moments at once."""
    import jax

    from autoshard.verify.state_window import state_window

    trainer, _ = _train("optimizer", steps=1)
    for st in trainer.stage_executables:
        grads = jax.tree.map(
            lambda p, sh: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sh),
            st.params,
            st.param_shardings,
        )
        lowered = st.update.trace(st.params, st.opt_state, grads).lower(
            lowering_platforms=("cuda",)
        )
        sw = state_window(lowered.as_text(), lowered.as_text(dialect="hlo"))
        moments = [x.nbytes for x in jax.tree.leaves(st.opt_state) if x.ndim]
        assert sw.fetches == len(moments) and sw.total_bytes == sum(moments)
        assert sw.window_bytes == 2 * max(moments) < sw.total_bytes  # one AdamW group


@pytest.mark.heavy  # out of the default run, as the two-microbatch test above
def test_pipeline_bf16_masters_in_pinned_host_train_the_same_at_one_microbatch():
    """One microbatch a step (backward and update as one program): the update gets the
    f32 gradient of the master, not the bf16 gradient of its 16-bit copy (which gave
    second-step losses 5.409877 against 5.409973 before 2026-11-28)."""
    import jax

    off, losses_off = _train("optimizer,master", dtype="bfloat16", microbatches=1)
    plain, losses = _train(None, dtype="bfloat16", microbatches=1)
    assert any(st.masters_on_host for st in off.stage_executables)
    assert losses_off == losses
    for a, b in zip(jax.tree.leaves(off.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
