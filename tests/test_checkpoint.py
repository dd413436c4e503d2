"""Checkpoint and resume (Orbax): a run saved on one plan resumes on another mesh.

Save after step 2 of gpt-tiny on a 2x4 plan, resume on a 4x2 plan: step 3's loss and
parameters equal the uninterrupted 2x4 run's (rtol 1e-5, the project's sharded ==
single-device tolerance: the two meshes sum in different orders).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from autoshard.api import plan_workload
from autoshard.cli.main import main
from autoshard.models import get_workload, make_optimizer
from autoshard.runtime.checkpoint import restore_state, save_state
from autoshard.runtime.sharded import abstract_args, run_steps


def _bound(mesh: str):
    # Megatron tensor parallelism over "model": the two meshes split the weights differently
    return plan_workload("gpt-tiny", mesh, optimizer="sgd", baseline="megatron", num_layers=2)


@pytest.mark.slow  # ~40 s of CPU: two plans, six steps
def test_resume_on_another_mesh_equals_the_uninterrupted_run(tmp_path):
    workload = get_workload("gpt-tiny", num_layers=2)
    concrete = workload.init_train_args(make_optimizer("sgd"), seed=0)
    first = _bound("2x4")
    step_a = first.jit()
    straight, want = run_steps(step_a, concrete, 3)
    saved, losses = run_steps(step_a, concrete, 2)
    assert losses == want[:2]
    save_state(tmp_path / "ckpt", tuple(saved[:2]), 2)

    second = _bound("4x2")
    step_b = second.jit()
    params, opt_state, _ = abstract_args(second.program, second.plan, step_b.mesh)
    (params, opt_state), step = restore_state(tmp_path / "ckpt", (params, opt_state))
    assert step == 2
    # restored with the new plan's layout, values bit for bit
    for got, sds, old in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(abstract_args(second.program, second.plan, step_b.mesh)[0]),
        jax.tree.leaves(saved[0]),
        strict=True,
    ):
        assert got.sharding.is_equivalent_to(sds.sharding, got.ndim)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(old))
    resumed, loss3 = run_steps(step_b, (params, opt_state, concrete[2]), 1)
    np.testing.assert_allclose(loss3[0], want[2], rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(resumed[0]), jax.tree.leaves(straight[0]), strict=True):
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_restore_refuses_what_is_not_there(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint in"):
        restore_state(tmp_path / "nothing", {})
    save_state(tmp_path / "c", {"w": np.zeros(3, np.float32)}, 1)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save_state(tmp_path / "c", {"w": np.zeros(3, np.float32)}, 1)


def test_pipeline_runs_refuse_checkpoint_flags(capsys):
    argv = ["run", "--model", "gpt-tiny", "--pipeline", "auto", "--devices", "8"]
    assert main([*argv, "--save", "x"]) == 2
    assert "--save checkpoint one-mesh runs only" in capsys.readouterr().err


def _unwritable(tmp_path, kind: str) -> str:
    if kind == "parent is a file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file" / "ckpt")
    # a read-only file system (root may write any directory, not a read-only mount)
    return "/sys/autoshard-ckpt"


@pytest.mark.parametrize("kind", ["parent is a file", "read-only file system"])
def test_run_refuses_an_unwritable_save_dir_before_any_work(tmp_path, kind, capsys, monkeypatch):
    import autoshard.cli.run as run_cli

    def no_planning(*a, **k):
        raise AssertionError("planned before checking --save")

    monkeypatch.setattr(run_cli, "plan_from_args", no_planning)
    save = _unwritable(tmp_path, kind)
    argv = ["run", "--model", "mlp", "--batch", "16", "--hidden", "16", "--mesh", "2x4"]
    assert main([*argv, "--save", save]) == 2
    err = capsys.readouterr().err
    assert f"autoshard: error: cannot save the checkpoint to {save}" in err
    assert "not a directory" in err or "is not writable" in err
    assert not list(tmp_path.glob("**/.autoshard-probe-*"))  # the probe left nothing behind


def test_a_save_that_fails_in_orbax_ends_in_one_line_not_a_hang(tmp_path):
    """Orbax's failure (its own threads wait forever behind it) ends the command: one
    error line, exit 2, within the timeout. The up-front check is bypassed to reach it."""
    import os
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    script = (
        "import os, sys\n"
        "import autoshard.runtime.checkpoint as c\n"
        "c.check_save_dir = lambda d: os.path.abspath(os.fspath(d))\n"
        "from autoshard.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["run", "--model", "mlp", "--batch", "16", "--hidden", "16", "--mesh", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv, "--steps", "1", "--save", str(tmp_path / "file/c")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"autoshard: error: cannot save the checkpoint to {tmp_path / 'file/c'}: Not a directory"
    ]
    assert "Traceback" not in proc.stderr


def test_save_state_has_a_deadline(tmp_path, monkeypatch):
    import threading

    import autoshard.runtime.checkpoint as ckpt

    never = threading.Event()

    class Stuck:
        def save(self, *a, **k):
            never.wait(30)

        def wait_until_finished(self):
            pass

    monkeypatch.setattr(ckpt, "_checkpointer", Stuck)
    with pytest.raises(ckpt.CheckpointError, match="did not finish in 0 s"):
        save_state(tmp_path / "c", {"w": np.zeros(3, np.float32)}, 1, deadline_s=0.2)
    never.set()
