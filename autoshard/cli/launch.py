"""``autoshard run ... --processes N``: start N local processes that train one plan together.

The launcher picks a free port on 127.0.0.1 for the coordinator, starts N copies of the
same command line (``python -m autoshard ...``) with a
:class:`~autoshard.runtime.distributed.ProcessGroup` in their environment, and waits.
Each child joins the run with ``jax.distributed.initialize``
(:func:`autoshard.runtime.distributed.initialize`), makes its share of the fake CPU
devices, and runs the command on the global device list: one mesh, one plan.

Only process 0's standard output comes through (``--json`` stays one document); the
others' standard error is kept and shown if they fail.  When a process exits with a
non-zero status, or is killed, the launcher stops every other process (SIGTERM, then
SIGKILL after a grace period), says which process failed and how, and exits 1.  On a real
cluster there is no launcher: the job scheduler starts the processes and ``--distributed``
makes each call ``jax.distributed.initialize()`` with no arguments (docs/distributed.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from autoshard.cli.args import positive_int
from autoshard.runtime.distributed import ProcessGroup

GRACE_S = 5.0


def add_launch_args(p) -> None:
    """``--processes`` (local launcher) and ``--distributed`` (real cluster) on ``run``."""
    g = p.add_argument_group("multi-process (jax.distributed)")
    g.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="start N local processes on 127.0.0.1, each with devices/N fake CPU devices",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="this process is one of a cluster job (SLURM, ...): jax.distributed.initialize() "
        "reads the job's settings",
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ProcessFailure:
    """Which process failed and how."""

    process_id: int
    pid: int
    returncode: int

    def describe(self, num_processes: int) -> str:
        if self.returncode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"was killed by signal {-self.returncode}"
        else:
            how = f"exited with status {self.returncode}"
        return f"process {self.process_id} of {num_processes} (pid {self.pid}) {how}"


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every running process, SIGKILL what is left after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(argv: list[str], num_processes: int, num_devices: int) -> int:
    """Run ``python -m autoshard *argv`` as ``num_processes`` processes sharing
    ``num_devices`` fake CPU devices; returns process 0's status, or 1 if any failed."""
    if num_devices % num_processes:
        fits = [k for k in range(1, num_devices + 1) if num_devices % k == 0]
        raise ValueError(
            f"--processes {num_processes} does not split {num_devices} devices evenly; "
            f"use --processes in {fits}"
        )
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for i in range(num_processes):
            group = ProcessGroup(coordinator, num_processes, i, num_devices // num_processes)
            env = {**os.environ, **group.to_env(), "JAX_PLATFORMS": "cpu"}
            log = tempfile.TemporaryFile()
            logs.append(log)
            if i == 0:
                out = tempfile.TemporaryFile()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "autoshard", *argv],
                    env=env,
                    stdout=out if i == 0 else subprocess.DEVNULL,
                    stderr=log,
                )
            )
            print(
                f"autoshard: started process {i} of {num_processes} (pid {procs[-1].pid}, "
                f"{group.local_devices} devices, coordinator {coordinator})",
                file=sys.stderr,
                flush=True,
            )
        failure = _wait(procs)
    except BaseException:  # Ctrl-C included: leave no process behind
        _stop(procs)
        raise
    out.seek(0)
    # Gloo's connection lines went to each child's stderr (main's results_only_stdout)
    sys.stdout.write(out.read().decode(errors="replace"))
    sys.stdout.flush()
    if failure is None:
        _replay(logs[0])
        return procs[0].returncode
    _stop(procs)
    _replay(logs[0] if failure.process_id == 0 else logs[failure.process_id])
    print(
        f"autoshard: error: {failure.describe(num_processes)}; stopped the other "
        f"{num_processes - 1} process(es)",
        file=sys.stderr,
    )
    return 1 if failure.returncode != 2 else 2


def _wait(procs: list[subprocess.Popen]) -> ProcessFailure | None:
    """Wait until every process ends (None) or one fails (the first failure seen)."""
    while True:
        running = False
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                running = True
            elif rc != 0:
                return ProcessFailure(i, p.pid, rc)
        if not running:
            return None
        time.sleep(0.05)


def _replay(log) -> None:
    """A process's standard error, less JAX's and gloo's start-up chatter."""
    log.seek(0)
    for line in log.read().decode(errors="replace").splitlines():
        if line.startswith(("[Gloo]", "I0000", "W0000")) or "external/xla" in line:
            continue
        print(line, file=sys.stderr)
