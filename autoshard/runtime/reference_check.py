"""A plan's step against the single-device step: the same inputs through both, losses,
parameters and updates compared (``autoshard run --check``, the tests)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from autoshard.ir.plan import ParallelPlan
from autoshard.runtime.distributed import to_host
from autoshard.runtime.sharded import (
    ShardedStep,
    _alias_positions,
    _loss_of,
    _next_args,
    build_sharded_step,
)
from autoshard.trace.jaxpr import TracedProgram


@dataclass(frozen=True)
class CheckReport:
    """Largest relative errors of a sharded run against the single-device run.

    Relative error of a leaf = max|sharded - reference| / max|reference| (normwise, so
    values near zero do not blow it up); every field is the maximum over leaves/steps.
    """

    plan: str
    mesh: str
    num_steps: int
    rtol: float
    loss_rel_error: float  # over every step's loss
    update_rel_error: float  # first step's parameter update (SGD: lr * gradient), beyond 1 ulp
    params_rel_error: float  # parameters after num_steps
    outputs_rel_error: float  # every output leaf after num_steps (optimizer state too)
    worst_output: str  # path of the output leaf with the largest error
    ok: bool  # every error above is at most rtol


def _rel_error(a, b) -> float:
    a = to_host(a).astype(np.float64)
    b = to_host(b).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    diff = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _update_rel_error(old, new_sharded, new_reference) -> float:
    """Relative error of the update ``new - old`` beyond the rounding of the stored params.

    Both runs store their new parameters rounded to the parameter dtype, so two correct
    updates may differ by one unit in the last place of the parameter; only the excess
    over that is counted (an update of 1e-3 on a weight of 1 would otherwise show a
    relative error of ~1e-4 in float32).
    """
    new_reference = to_host(new_reference)
    # eps * |x| bounds the spacing of floats at x from above (by at most a factor of 2)
    eps = (
        float(jnp.finfo(new_reference.dtype).eps)
        if jnp.issubdtype(new_reference.dtype, jnp.floating)
        else 0.0
    )
    ulp = eps * np.abs(new_reference.astype(np.float64))
    old = np.asarray(old, np.float64)
    ref_update = new_reference.astype(np.float64) - old
    shd_update = to_host(new_sharded).astype(np.float64) - old
    excess = np.maximum(np.abs(shd_update - ref_update) - ulp, 0.0)
    if excess.size == 0:
        return 0.0
    scale = float(np.max(np.abs(ref_update)))
    diff = float(np.max(excess))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


# One jitted single-device step per program, so that checking several plans of one
# program compiles its reference once (jax caches compiles per jitted function). The
# function holds the program weakly: the entry goes when the program does.
_REFERENCE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reference_step(program: TracedProgram):
    step = _REFERENCE_STEPS.get(program)
    if step is None:
        program_ref = weakref.ref(program)
        step = _REFERENCE_STEPS[program] = jax.jit(lambda *a: program_ref().evaluate(*a))
    return step


def check_against_single_device(
    program: TracedProgram,
    plan: ParallelPlan,
    mesh: jax.sharding.Mesh,
    args,
    num_steps: int = 1,
    rtol: float = 1e-5,
    step: ShardedStep | None = None,
) -> CheckReport:
    """Run ``plan`` on ``mesh`` and ``jax.jit(program.evaluate)`` on one device; compare.

    ``step`` reuses an already built (and compiled) ``ShardedStep`` of the same plan.

    ``args`` are concrete arguments of a train step (copied to the host first, so they
    are never donated).  Both runs take ``num_steps`` steps from the same arguments.
    """
    host_args = jax.tree_util.tree_map(to_host, args)
    records = program.records
    params_pos = [i for i, tid in enumerate(records.inputs) if records.tensors[tid].kind == "param"]
    aliases = _alias_positions(program)

    # the reference runs on this process's first device of the mesh (every process runs it)
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    reference = _reference_step(program)
    ref_args = jax.device_put(host_args, device)
    sharded = step if step is not None else build_sharded_step(program, plan, mesh)
    shd_args = host_args

    loss_err = update_err = 0.0
    for step in range(num_steps):
        ref_out = reference(*ref_args)
        shd_out = sharded(*shd_args)
        loss_err = max(loss_err, _rel_error(_loss_of(program, shd_out), _loss_of(program, ref_out)))
        if step == 0:
            before = jax.tree_util.tree_leaves(host_args)
            ref_flat = jax.tree_util.tree_leaves(ref_out)
            shd_flat = jax.tree_util.tree_leaves(shd_out)
            for i in params_pos:
                if i in aliases:
                    j = aliases[i]
                    update_err = max(
                        update_err, _update_rel_error(before[i], shd_flat[j], ref_flat[j])
                    )
        ref_args = _next_args(program, ref_args, ref_out)
        shd_args = _next_args(program, shd_args, shd_out)

    ref_flat = jax.tree_util.tree_leaves(ref_out)
    shd_flat = jax.tree_util.tree_leaves(shd_out)
    errors = [_rel_error(s, r) for s, r in zip(shd_flat, ref_flat, strict=True)]
    worst = int(np.argmax(errors)) if errors else 0
    param_outs = {aliases[i] for i in params_pos if i in aliases}
    errors_by_kind = dict(
        loss_rel_error=loss_err,
        update_rel_error=update_err,
        params_rel_error=max((errors[j] for j in param_outs), default=0.0),
        outputs_rel_error=max(errors, default=0.0),
    )
    return CheckReport(
        plan=plan.name,
        mesh=str(plan.mesh),
        num_steps=num_steps,
        rtol=rtol,
        **errors_by_kind,
        worst_output=records.tensors[records.outputs[worst]].path if errors else "",
        ok=max(errors_by_kind.values()) <= rtol,
    )
