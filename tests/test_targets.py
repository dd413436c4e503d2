"""Compile targets: ``verify --target gpu-aot[:SxHxD]`` and ``verify_plan(..., target=)``.

This machine has no CUDA jaxlib, so the GPU target must be refused with a message that
says what it needs, before any planning; ``cpu`` (and no target) must verify as before.
"""

import json
import subprocess
import sys

import pytest
from conftest import cli_without_planner_in_process, run_cli_without_planner

from autoshard.runtime.targets import (
    CompileTarget,
    TargetUnavailableError,
    default_topology,
    parse_target,
    target_devices,
)

# batch 128: its 2x2 plan in 0.8 s of CPU (batch 64 with hidden 32 is a slow case of the
# exact program, 3.5 s)
MODEL = ["--model", "mlp", "--batch", "128", "--hidden", "32", "--optimizer", "sgd"]


def _has_cuda() -> bool:
    try:
        target_devices("gpu-aot", 8)
    except TargetUnavailableError:
        return False
    return True


pytestmark = pytest.mark.skipif(_has_cuda(), reason="tests the refusal on a machine without CUDA")


@pytest.mark.parametrize(
    ("text", "target"),
    [
        (None, CompileTarget("cpu")),
        ("cpu", CompileTarget("cpu")),
        ("gpu-aot", CompileTarget("gpu-aot")),
        ("gpu-aot:1x8x8", CompileTarget("gpu-aot", "1x8x8")),
    ],
)
def test_targets_parse(text, target):
    assert parse_target(text) == target
    assert str(parse_target(text)) == (text or "cpu")


@pytest.mark.parametrize(
    "text", ["gpu", "gpu-aot:8", "gpu-aot:1x8", "tpu-aot:1x1x8", "gpu-aot:0x1x8"]
)
def test_unknown_targets_say_what_would_work(text):
    with pytest.raises(ValueError, match=r"gpu-aot:1x1x8|each of S, H, D >= 1"):
        parse_target(text)


@pytest.mark.parametrize(
    ("n", "topology"), [(1, "1x1x1"), (8, "1x1x8"), (64, "1x8x8"), (512, "1x64x8")]
)
def test_plain_gpu_aot_is_sized_to_the_plan(n, topology):
    assert default_topology(n) == topology == parse_target("gpu-aot").topology_for(n)


def test_a_topology_of_another_size_names_the_one_that_fits():
    with pytest.raises(
        ValueError, match="describes 64 GPUs but the plan's mesh has 8; use --target gpu-aot:1x1x8"
    ):
        parse_target("gpu-aot:1x8x8").topology_for(8)
    with pytest.raises(ValueError, match="do not fill hosts of 8"):
        default_topology(12)


def test_gpu_aot_without_cuda_is_refused_saying_what_it_needs():
    with pytest.raises(TargetUnavailableError) as err:
        target_devices("gpu-aot:1x1x8", 8)
    message = str(err.value)
    assert "CUDA jaxlib" in message and "one visible NVIDIA GPU" in message
    assert "drop --target" in message  # and what works here instead
    assert isinstance(err.value, ValueError)  # the CLI's exit 2


def test_cpu_target_is_this_process_devices():
    import jax

    assert target_devices("cpu", 4) == jax.devices()[:4]
    with pytest.raises(ValueError, match=r"--devices 99"):
        target_devices("cpu", 99)


# --------------------------------------------------------------------------- Python API


@pytest.fixture(scope="module")
def bound():
    from autoshard.api import plan_workload

    return plan_workload("mlp", "2x2", optimizer="sgd", batch_size=128, hidden=32)


def test_verify_plan_on_cpu_is_unchanged_by_naming_the_target(bound):
    import jax

    from autoshard.verify.check import verify_plan

    before = verify_plan(bound.program, bound.plan, devices=jax.devices()[:4], live_peak="never")
    named = verify_plan(bound.program, bound.plan, target="cpu", live_peak="never")
    assert before.target == named.target == "cpu"
    assert named.compiled_collectives == before.compiled_collectives
    assert named.memory == before.memory and named.comparison == before.comparison
    assert named.to_json()["devices"].startswith("4 x ")
    assert (
        before.hlo_text == ""
        and "HloModule"
        in verify_plan(
            bound.program, bound.plan, target="cpu", live_peak="never", keep_hlo=True
        ).hlo_text
    )


def test_verify_plan_for_a_gpu_without_cuda_is_refused(bound):
    from autoshard.verify.check import verify_plan

    with pytest.raises(TargetUnavailableError, match="CUDA jaxlib"):
        verify_plan(bound.program, bound.plan, target="gpu-aot")
    with pytest.raises(TargetUnavailableError, match="CUDA jaxlib"):
        bound.verify(target="gpu-aot:1x1x4")


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def plan_path(bound, tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "mlp.json"
    bound.save(path)
    return path


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--target", "gpu-aot"], "needs a CUDA jaxlib"),
        (
            ["--target", "gpu-aot:1x1x8"],
            "describes 8 GPUs but the plan's mesh has 4; use --target gpu-aot:1x1x4",
        ),
        (["--target", "tpu"], "unknown compile target 'tpu'"),
    ],
)
def test_verify_refuses_a_target_it_cannot_compile_for_before_planning(
    capsys, monkeypatch, flags, says
):
    argv = ["verify", *MODEL, "--mesh", "2x2", *flags]
    rc, _, err = cli_without_planner_in_process(capsys, monkeypatch, *argv)
    assert rc == 2, err
    assert says in err and "Traceback" not in err
    assert "the planner ran" not in err  # in this process: its AssertionError fails the test


def test_verify_a_plan_file_for_a_gpu_without_cuda_is_refused(capsys, monkeypatch, plan_path):
    argv = ["verify", "--plan", str(plan_path), "--target", "gpu-aot"]
    rc, _, err = cli_without_planner_in_process(capsys, monkeypatch, *argv)
    assert rc == 2 and "one visible NVIDIA GPU" in err, err


def test_verify_a_plan_file_on_cpu_names_its_target(plan_path):
    proc = run_cli_without_planner("verify", "--plan", str(plan_path), "--target", "cpu", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["agree"] else 1), proc.stderr
    assert out["verification"]["target"] == "cpu"
    assert out["collectives_agree"] is True


# --------------------------------------------------------------------------- the GPU path's
# plumbing, with jax.experimental.topologies answering with this process's CPU devices

FAKE_TOPOLOGY = (
    "import sys, types, jax\n"
    "from jax.experimental import topologies\n"
    "def fake(**kw):\n"
    "    assert kw == {'topology_name': 'gpu', 'platform': 'cuda', 'topology': '1x1x4'}, kw\n"
    "    return types.SimpleNamespace(devices=jax.devices()[:4])\n"
    "topologies.get_topology_desc = fake\n"
)


def test_verify_plan_compiles_on_the_topology_s_devices(bound, monkeypatch):
    import jax
    from jax.experimental import topologies

    from autoshard.verify.check import verify_plan

    asked = []

    def fake(**kw):
        asked.append(kw)
        return type("Topology", (), {"devices": jax.devices()[4:8]})()

    monkeypatch.setattr(topologies, "get_topology_desc", fake)
    report = verify_plan(bound.program, bound.plan, target="gpu-aot", live_peak="never")
    assert asked == [{"topology_name": "gpu", "platform": "cuda", "topology": "1x1x4"}]
    assert report.target == "gpu-aot:1x1x4"  # the topology it was sized to
    assert report.collectives_agree  # device ids 4..7 read back as the mesh's positions
    assert bound.verify(target="gpu-aot:1x1x4", live_peak="never").target == "gpu-aot:1x1x4"


def test_cli_verify_a_plan_file_for_a_topology(plan_path):
    code = FAKE_TOPOLOGY + "from autoshard.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "verify",
            "--plan",
            str(plan_path),
            "--target",
            "gpu-aot",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["agree"] else 1), proc.stderr
    assert out["verification"]["target"] == "gpu-aot:1x1x4"
    assert out["collectives_agree"] is True
