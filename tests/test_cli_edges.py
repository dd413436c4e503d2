"""The command line at its edges: Ctrl-C, unwritable outputs, exit statuses.

Subprocess tests (with timeouts) where the behaviour is the process's: its exit status
after a signal, what it leaves on stdout and stderr.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

MLP = ["--model", "mlp", "--batch", "16", "--hidden", "16"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _interrupt_when(argv, marker: str, timeout=300):
    """Start ``autoshard *argv`` in its own process group, send the group SIGINT (as a
    terminal's Ctrl-C does) once ``marker`` shows on stderr; its status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoshard", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    seen = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, "".join(seen) + err


@pytest.mark.parametrize(
    "argv, marker",
    [
        (["run", *MLP, "--mesh", "2", "--steps", "100000"], "HiGHS"),
        (
            ["run", *MLP, "--mesh", "2", "--steps", "100000", "--processes", "2"],
            "started process 1 of 2",
        ),
    ],
    ids=["one process", "two processes"],
)
def test_ctrl_c_is_one_line_and_status_130(argv, marker):
    rc, out, err = _interrupt_when(argv, marker)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.count("autoshard: interrupted (Ctrl-C)") == 1
