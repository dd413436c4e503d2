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
"""

from __future__ import annotations

import json
import os
from typing import Any

STEP_FILE = "autoshard_step.json"


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_state(directory: str | os.PathLike, state: Any, step: int) -> str:
    """Write ``state`` (a pytree of arrays) and ``step`` under ``directory`` (created; it
    must not exist yet).  Returns the absolute path."""
    import jax

    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(os.path.join(path, "state")):
        raise ValueError(f"{path} already holds a checkpoint; choose a new directory")
    ckptr = _checkpointer()
    ckptr.save(os.path.join(path, "state"), state)
    ckptr.wait_until_finished()
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
