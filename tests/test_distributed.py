"""Multi-process runs: the local launcher, its clean-up when a process dies, jax.distributed.

The launched runs start fresh interpreters (``python -m autoshard``), each joining a
``jax.distributed`` run on 127.0.0.1 with its share of fake CPU devices.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from autoshard.cli.launch import ProcessFailure, free_port, launch
from autoshard.cli.main import main
from autoshard.runtime.distributed import ProcessGroup, process_group_from_env

RUN = [sys.executable, "-m", "autoshard", "run", "--model", "gpt-tiny", "--mesh", "2x4"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_process_group_round_trips_through_the_environment():
    group = ProcessGroup("127.0.0.1:1234", 2, 1, 4)
    assert process_group_from_env(group.to_env()) == group
    assert process_group_from_env({}) is None


def test_failure_says_which_process_and_how():
    assert ProcessFailure(1, 42, -signal.SIGKILL).describe(2) == (
        "process 1 of 2 (pid 42) was killed by SIGKILL"
    )
    assert ProcessFailure(0, 7, 3).describe(4) == "process 0 of 4 (pid 7) exited with status 3"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_processes_must_split_the_devices(capsys):
    with pytest.raises(ValueError, match=r"does not split 8 devices evenly; use --processes in"):
        launch(["run"], 3, 8)
    assert main(["run", "--model", "gpt-tiny", "--mesh", "2x4", "--processes", "3"]) == 2
    assert "--processes 3 does not split 8 devices" in capsys.readouterr().err


def test_a_killed_process_stops_the_run_and_leaves_no_process_behind():
    launcher = subprocess.Popen(
        [*RUN, "--processes", "2", "--steps", "100000"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = {}
    try:
        while len(pids) < 2:
            line = launcher.stderr.readline()
            assert line, "the launcher ended before starting its processes"
            m = re.match(r"autoshard: started process (\d) of 2 \(pid (\d+)", line)
            if m:
                pids[int(m[1])] = int(m[2])
        time.sleep(2.0)  # let both start their interpreters
        os.kill(pids[1], signal.SIGKILL)
        err = launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1
    assert f"process 1 of 2 (pid {pids[1]}) was killed by SIGKILL" in err
    assert "stopped the other 1 process(es)" in err
    assert _gone(pids[0]) and _gone(pids[1])


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2])
def test_intra_op_plan_across_processes_matches_one_device(processes):
    out = subprocess.run(
        [*RUN, "--processes", str(processes), "--steps", "2", "--check"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MATCH" in out.stdout and "MISMATCH" not in out.stdout
    assert "[Gloo]" not in out.stdout


@pytest.mark.slow
def test_pipeline_stages_on_two_processes_match_one_device():
    # 2 stages on 4 devices each: stage 0 on process 0's devices, stage 1 on process 1's
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard",
            "run",
            "--model",
            "gpt-tiny",
            "--layers",
            "4",
            "--devices",
            "8",
            "--pipeline",
            "equal-layer",
            "--stages",
            "2",
            "--processes",
            "2",
            "--steps",
            "2",
            "--check",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "on devices [0, 1, 2, 3]" in out.stdout
        and "on devices [2048, 2049, 2050, 2051]" in out.stdout
    )
    assert "MATCH" in out.stdout and "MISMATCH" not in out.stdout


def test_distributed_outside_a_cluster_job_says_what_to_use():
    proc = subprocess.run(
        [*RUN, "--distributed", "--steps", "1"], env=ENV, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "cannot join the multi-process run" in proc.stderr
    assert "--processes N starts local ones" in proc.stderr and "Traceback" not in proc.stderr
