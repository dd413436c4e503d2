"""Checkpoint and resume a planned run's training state with Orbax.

Takes the training state of a sharded run (parameters and optimizer state: global
``jax.Array`` s laid out as the plan says) and a directory; :func:`save_state` writes it
with Orbax's ``StandardCheckpointer`` (each process writes its own shards; every process
of a multi-process run must call it).  :func:`restore_state` reads it back **laid out as
another plan says**: it takes the new plan's abstract state (``jax.ShapeDtypeStruct`` s
with the new shardings, e.g. from :func:`autoshard.runtime.sharded.abstract_args`) and
Orbax reads each device's slice of each array, whatever mesh wrote it.  So a run saved on
a 2x4 plan resumes on a 4x2 plan (or on another number of processes).

Guarantees: restored values equal the saved ones bit for bit; a state whose tree,
shapes or dtypes differ from the checkpoint's raises ``ValueError`` naming the first
difference.  The step number is kept beside the state.

A directory that cannot be written is refused before any work by
:func:`check_save_dir` (``ValueError``: a parent that is a file, a read-only file
system, an existing checkpoint).  A save that fails anyway, or does not finish within
its deadline (:func:`save_deadline_s`), raises :class:`CheckpointError`: Orbax leaves
non-daemon threads waiting behind a failed save, so the process cannot exit normally
afterwards; the command line ends it with ``os._exit`` after printing the error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from typing import Any

STEP_FILE = "autoshard_step.json"
# the slowest write we wait for: a fixed start-up allowance plus the bytes at a slow disk's rate
SAVE_DEADLINE_BASE_S = 60.0
SAVE_DEADLINE_BYTES_PER_S = 20e6


class CheckpointError(RuntimeError):
    """A save failed or ran past its deadline; Orbax's background threads may be left
    waiting, so the process should end (``os._exit``) once the error is reported."""


def check_save_dir(directory: str | os.PathLike) -> str:
    """The absolute path ``save_state`` would write, checked before any work: its nearest
    existing ancestor is a directory this process can create files in (probed with a
    temporary file, removed again), and it holds no checkpoint yet.  Creates nothing.
    ``ValueError`` says what is wrong and what would work."""
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(os.path.join(path, "state")):
        raise ValueError(f"{path} already holds a checkpoint; choose a new directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cannot save the checkpoint to {path}: it is a file, not a directory")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(
            f"cannot save the checkpoint to {path}: {probe} is a file, not a directory; "
            "give --save a directory path"
        )
    try:
        fd, name = tempfile.mkstemp(prefix=".autoshard-probe-", dir=probe)
    except OSError as err:
        raise ValueError(
            f"cannot save the checkpoint to {path}: {probe} is not writable "
            f"({err.strerror or err}); give --save a directory you can write"
        ) from None
    os.close(fd)
    os.unlink(name)
    return path


def save_deadline_s(state: Any) -> float:
    """How long :func:`save_state` waits for Orbax: 60 s plus the state's bytes at 20 MB/s."""
    import jax

    nbytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
    return SAVE_DEADLINE_BASE_S + nbytes / SAVE_DEADLINE_BYTES_PER_S


@contextlib.contextmanager
def _quiet_orbax_errors():
    """Orbax logs each failure of its background threads with a traceback (absl ERROR
    lines); the caller reports the failure once, in one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_state(
    directory: str | os.PathLike, state: Any, step: int, deadline_s: float | None = None
) -> str:
    """Write ``state`` (a pytree of arrays) and ``step`` under ``directory`` (created; it
    must not hold a checkpoint yet).  Returns the absolute path.  ``ValueError``: the
    directory cannot be written (:func:`check_save_dir`); :class:`CheckpointError`: Orbax
    failed, or did not finish within ``deadline_s`` (default :func:`save_deadline_s`)."""
    import jax

    path = check_save_dir(directory)
    deadline = save_deadline_s(state) if deadline_s is None else deadline_s
    failure: list[BaseException] = []

    def write() -> None:
        try:
            ckptr = _checkpointer()
            ckptr.save(os.path.join(path, "state"), state)
            ckptr.wait_until_finished()
        except BaseException as err:  # reported by the caller's thread
            failure.append(err)

    with _quiet_orbax_errors():
        writer = threading.Thread(target=write, name="autoshard-save", daemon=True)
        writer.start()
        writer.join(deadline)
    if writer.is_alive():
        raise CheckpointError(
            f"saving the checkpoint to {path} did not finish in {deadline:.0f} s; "
            "check that the file system is writable and not full"
        )
    if failure:
        err = failure[0]
        why = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise CheckpointError(f"cannot save the checkpoint to {path}: {why}")
    if jax.process_index() == 0:
        with open(os.path.join(path, STEP_FILE), "w") as f:
            json.dump({"step": int(step)}, f)
    return path


def restore_state(directory: str | os.PathLike, abstract_state: Any) -> tuple[Any, int]:
    """The state saved under ``directory``, laid out as ``abstract_state``'s shardings
    say, and its step number."""
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(os.path.join(path, "state")):
        raise ValueError(f"no checkpoint in {path} (expected {path}/state, written by save)")
    try:
        state = _checkpointer().restore(os.path.join(path, "state"), abstract_state)
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"the checkpoint in {path} does not fit this run's state (another model, "
            f"optimizer or size?): {err}"
        ) from None
    with open(os.path.join(path, STEP_FILE)) as f:
        step = int(json.load(f)["step"])
    return state, step
