import json
import os
import subprocess
import sys

import pytest
from conftest import cli_in_process


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, timeout=timeout
    )


def test_inspect_gpt_76b_without_allocating_parameters():
    # two of its 60 layers (10240 wide): 3.05e9 parameters, 12.2 GB in f32 if allocated,
    # still 3x the bound below; tracing all 60 took ~5x the CPU time (12.7 s vs 2.6 s)
    from autoshard.models import get_workload

    config = get_workload("gpt-76b").config
    assert (config.num_layers, config.hidden, config.vocab_size) == (60, 10240, 51200)
    code = (
        "import json, resource, sys\n"
        "from autoshard.cli.main import main\n"
        "rc = main(['inspect', '--model', 'gpt-76b', '--layers', '2', '--json'])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "params",
        "matmul_flops_per_step",
        "flops_per_step",
        "num_eqns",
        "layers",
        "eqns_by_primitive",
    ):
        assert key in out

    def params(layers):  # per layer: QKV, out, two MLP GEMMs and their biases, 2 norms
        return (
            12 * layers * 10240**2 + 13 * layers * 10240 + 51200 * 10240 + 1024 * 10240 + 2 * 10240
        )

    assert out["params"] == params(2)
    assert params(config.num_layers) == 76_040_253_440  # the preset's 76B
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    assert peak_kib * 1024 < 4 * 2**30  # its f32 parameters would be 12.2 GB


def test_unknown_model_lists_presets(capsys):
    rc, _, err = cli_in_process(capsys, "inspect", "--model", "gpt-3b")
    assert rc == 2
    assert "gpt-39b" in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--seq", "-1"), ("--hidden", "1.5")])
def test_bad_sizes_name_the_field(capsys, flag, value):
    rc, _, err = cli_in_process(capsys, "inspect", "--model", "gpt-tiny", flag, value)
    assert rc == 2 and flag in err


def test_bad_mesh_is_a_clear_error(capsys):
    rc, _, err = cli_in_process(capsys, "plan", "--model", "gpt-tiny", "--mesh", "2by4")
    assert rc == 2 and "2x4" in err and "Traceback" not in err


def test_verify_json_has_the_documented_keys():
    env = dict(os.environ)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard",
            "verify",
            "--model",
            "mlp",
            "--batch",
            "64",
            "--hidden",
            "32",
            "--mesh",
            "4",
            "--baseline",
            "dp",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode in (0, 1), proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "objective",
        "specs",
        "predicted_collectives",
        "compiled_collectives",
        "predicted_peak_bytes",
        "compiled_peak_bytes",
        "memory_explained_by_heap_gap",
        "agree",
        "solver",
    ):
        assert key in out
    for key in ("compiled_live_peak_bytes", "live_peak_error", "memory_explanation"):
        assert key in out["verification"]
    verification = out["verification"]
    assert (verification["memory_explanation"] == "") == verification["memory_agree"]
    for key in ("status", "gap", "seconds", "num_variables"):
        assert key in out["solver"]
    assert proc.returncode == (0 if out["agree"] else 1)  # collectives and memory


def test_plan_pipeline_json_has_the_documented_keys():
    """Also the stage search's case of the one-JSON-document test below: HiGHS solves
    every stage's ILP here, and stdout is that one document."""
    argv = "plan --model gpt-tiny --layers 4 --devices 8 --pipeline auto --microbatches 4"
    proc = _run(*argv.split(), "--solver", "highs", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # the whole of stdout, nothing before or after
    assert {"stages", "objective_s", "search_seconds"} <= set(out)
    stages = out["stages"]
    for s in stages:
        assert {"layers", "submesh", "logical_mesh", "latency_s", "peak_bytes"} <= set(s)
        n = s["submesh"][0] * s["submesh"][1]
        assert s["logical_mesh"][0] * s["logical_mesh"][1] == n == len(s["device_ids"])
    assert [name for s in stages for name in s["layers"]] == [
        "embedding",
        *(f"block_{i}" for i in range(4)),
        "head",
    ]
    assert sorted(d for s in stages for d in s["device_ids"]) == list(range(8))
    latencies = [s["latency_s"] for s in stages]
    assert out["objective_s"] == pytest.approx(sum(latencies) + 3 * max(latencies))
    assert out["search_seconds"] > 0


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_run_pipeline_check_matches_single_device():
    proc = _run(
        *(
            "run --model gpt-tiny --layers 4 --devices 8 --pipeline equal-layer --stages 2 "
            "--schedule gpipe --microbatches 4 --steps 2 --check"
        ).split()
    )
    assert proc.returncode == 0, proc.stderr
    assert "MATCH" in proc.stdout and "MISMATCH" not in proc.stdout
    assert "2 stages, 4 microbatches, gpipe" in proc.stdout
    assert "intra-op" in proc.stdout  # each stage under its intra-op plan


@pytest.mark.parametrize(
    "argv, message",
    [
        ("plan --model gpt-tiny --pipeline auto", "needs --devices"),
        ("plan --model gpt-tiny --mesh 2x4 --devices 8 --pipeline auto", "not both"),
        ("run --model gpt-tiny --devices 8 --pipeline auto --baseline dp", "drop --baseline"),
        ("run --model gpt-tiny --steps 1", "needs --mesh"),
    ],
)
def test_pipeline_flag_errors_are_clear(capsys, argv, message):
    rc, _, err = cli_in_process(capsys, *argv.split())
    assert rc == 2 and message in err and "Traceback" not in err


def test_demo_runs_plans_and_reports_its_checks():
    """The README's first command: the plan runs and matches one device (exit 0); the
    predicted-vs-compiled table is printed whatever it says."""
    proc = _run("demo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "predicted vs compiled" in out and "collectives agree" in out
    assert "MATCH" in out and "the plan runs and matches one device" in out


@pytest.mark.parametrize(
    "argv",
    [
        # plan --pipeline auto --solver highs --json: test_plan_pipeline_json_has_the_documented_keys
        # each solver on the MLP (CBC solves its four programs on 8 in-process), and on
        # gpt-tiny in CI's heavy step (11.6 and 6.2 CPU-s against about 2 s each)
        "plan --model mlp --batch 128 --hidden 32 --devices 8 --mesh 2x4 --solver highs --json",
        "plan --model mlp --batch 128 --hidden 32 --devices 8 --mesh 8 --solver cbc --json",
        pytest.param(
            "plan --model gpt-tiny --layers 2 --devices 8 --mesh 2x4 --solver highs --json",
            marks=pytest.mark.heavy,
        ),
        pytest.param(
            "plan --model gpt-tiny --layers 2 --devices 8 --mesh 8 --solver cbc --json",
            marks=pytest.mark.heavy,
        ),
        "simulate --model gpt-350m --cluster dgx-a100 --gpus 2 --plan auto --json",
        "simulate --model gpt-350m --cluster dgx-a100 --gpus 8 --json",
    ],
)
def test_json_output_is_one_document_whichever_solver_runs(argv):
    """The solvers print from C/C++ and from a child process (HiGHS 1.16 its banner on
    stdout): stdout must still be exactly one JSON document."""
    proc = _run(*argv.split())
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # the whole of stdout, nothing before or after


def test_the_demo_compiles_its_step_once_through_a_temporary_cache(tmp_path, monkeypatch):
    """The demo checks the planned step's compile against the plan, then runs it: inside
    ``_compilation_cache_for_this_run`` jax writes what it compiles to a temporary
    persistent cache (so the run's compile is a hit), which is gone afterwards with the
    settings restored; a user's own ``JAX_COMPILATION_CACHE_DIR`` is left alone."""
    import os

    import jax
    import jax.numpy as jnp

    from autoshard.cli.main import _compilation_cache_for_this_run

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    with _compilation_cache_for_this_run():
        folder = jax.config.jax_compilation_cache_dir
        assert folder and os.path.isdir(folder)
        jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).block_until_ready()
        assert os.listdir(folder)  # the compile went to the cache
    assert not os.path.exists(folder) and not jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    with _compilation_cache_for_this_run():
        assert not jax.config.jax_compilation_cache_dir  # the user's setting, not ours
