"""`autoshard run` on one mesh: plan (or load a plan), train N steps, print the losses and
step times, optionally save or resume the state (Orbax) and compare with one device
(``--check``). The pipeline path is :func:`autoshard.cli.pipeline.cmd_pipeline_run`.
"""

from __future__ import annotations

import json
import sys

from autoshard.cli.args import model_overrides as _overrides
from autoshard.cli.console import out_console, progress
from autoshard.cli.pipeline import cmd_pipeline_run
from autoshard.cli.plan import plan_from_args, route, single_mesh_defaults
from autoshard.cli.planfile import bound_from_args, needs_model


def cmd_run(args, bound=None) -> int:
    from autoshard.models import get_workload, make_optimizer
    from autoshard.runtime.reference_check import check_against_single_device
    from autoshard.runtime.sharded import run_steps

    needs_model(args, "run")
    if getattr(args, "save", None) and getattr(args, "pipeline", None) is None:
        from autoshard.runtime.checkpoint import check_save_dir

        check_save_dir(args.save)  # before any work: a save that cannot happen is bad input
    if bound is None and getattr(args, "loaded_plan", None) is not None:
        bound = bound_from_args(args)
    if bound is None and route(args, "run"):
        return cmd_pipeline_run(args)
    single_mesh_defaults(args)
    console = out_console()
    args.optimizer = args.optimizer or "sgd"
    workload = get_workload(args.model, **_overrides(args))
    opt = make_optimizer(args.optimizer)
    refuse_beyond_host_memory(args, workload, opt)  # before planning: seconds, not minutes
    if bound is None:
        with progress(args, f"planning {args.model} on mesh {args.mesh} ..."):
            bound = plan_from_args(args)
    step = bound.jit()
    # the state is made where the plan keeps it (sharded, host memory), never whole on one
    # device first; --check and --resume still start from the single-device state
    placed = not args.check and not getattr(args, "resume", None)
    if placed:
        from autoshard.runtime.init_state import init_placed

        concrete = init_placed(step, workload, opt, seed=0)
    else:
        concrete = workload.init_train_args(opt, seed=0)
    concrete, first = _resume(args, bound, step, concrete)
    seconds: list[float] = []
    with progress(args, f"compiling and running {args.steps} step(s) ..."):
        final, losses = run_steps(step, concrete, args.steps, seconds=seconds, copy=not placed)
    out = {
        "model": args.model,
        "plan": bound.plan.name,
        "mesh": {
            "axis_names": list(bound.plan.mesh.axis_names),
            "shape": list(bound.plan.mesh.shape),
        },
        "optimizer": args.optimizer,
        "first_step": first + 1,
        "losses": losses,
        "step_seconds": seconds,
    }
    if not args.json:
        console.print(
            f"plan {bound.plan.name} on {bound.plan.mesh}: losses "
            + ", ".join(f"{x:.6f}" for x in losses)
            + (f" (steps {first + 1}..{first + args.steps})" if first else "")
        )
        console.print(_step_times(seconds, first))
    if getattr(args, "save", None):
        from autoshard.runtime.checkpoint import save_state

        path = save_state(args.save, tuple(final[:2]), first + args.steps)
        print(f"saved the state after step {first + args.steps} to {path}", file=sys.stderr)
    report = None
    if args.check:
        with progress(args, "running the single-device step to compare ..."):
            report = check_against_single_device(
                bound.program,
                bound.plan,
                step.mesh,
                concrete,
                num_steps=args.steps,
                rtol=args.rtol,
                step=step,
            )
        out["check"] = {
            "rtol": report.rtol,
            "loss_rel_error": report.loss_rel_error,
            "params_rel_error": report.params_rel_error,
            "update_rel_error": report.update_rel_error,
            "ok": report.ok,
            "worst_output": report.worst_output,
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if report is None or report.ok else 1
    if report is None:
        return 0
    console.print(
        f"vs single device over {report.num_steps} step(s): loss rel. error "
        f"{report.loss_rel_error:.2e}, parameter rel. error {report.params_rel_error:.2e}, "
        f"update rel. error {report.update_rel_error:.2e} (rtol {report.rtol:g}): "
        + (
            "[green]MATCH[/green]"
            if report.ok
            else f"[red]MISMATCH[/red] (worst: {report.worst_output})"
        )
    )
    hint = _mismatch_hint(args, report)
    if hint:
        console.print(f"[yellow]hint:[/yellow] {hint}")
    return 0 if report.ok else 1


def available_host_bytes() -> float | None:
    """This host's available memory (Linux's MemAvailable, bytes), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def refuse_beyond_host_memory(args, workload, opt) -> None:
    """``run`` on CPU devices keeps everything in this host's memory: the parameters,
    optimizer state and batch are made whole first (``init_train_args``), then again as the
    devices' shards (which add up to at least the whole). Refuse, before planning, a model
    whose two copies already exceed the memory available (gpt-6.7b on 2 devices grew past
    6 GB and kept going)."""
    import jax

    if jax.devices()[0].platform != "cpu":  # accelerators hold the shards in their own memory
        return
    available = available_host_bytes()
    if available is None:
        return
    from autoshard.ir.units import format_bytes

    leaves = jax.tree_util.tree_leaves(workload.abstract_train_args(opt))
    whole = float(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves))
    need = 2 * whole
    if need <= available:
        return
    mesh = f" --mesh {args.mesh}" if getattr(args, "mesh", None) else ""
    raise ValueError(
        f"run --model {args.model} needs at least {format_bytes(need)} of this host's memory: "
        f"its parameters, {args.optimizer} state and batch ({format_bytes(whole)}) are made "
        f"whole, then again as the shards of the {jax.device_count()} CPU devices, which live "
        f"in host memory too, activations on top; {format_bytes(available)} is available. Run a "
        "smaller size (--layers, --hidden, --batch), or plan it without running: "
        f"`autoshard plan --model {args.model}{mesh}` (add --cluster PRESET to "
        "check it against a GPU's memory)"
    )


def _step_times(seconds: list[float], done: int = 0) -> str:
    """Step times, numbered from the step after the ``done`` ones a resume starts from."""
    one = done + 1
    first = f"step {one} {seconds[0] * 1e3:.1f} ms (includes compilation)"
    if len(seconds) == 1:
        return f"step time: {first}"
    rest = seconds[1:]
    later = f"step {one + 1}" if len(rest) == 1 else f"steps {one + 1}-{done + len(seconds)}"
    return (
        f"step time: {first}; {later} {sum(rest) / len(rest) * 1e3:.1f} ms each "
        "(wall time on these devices)"
    )


def _mismatch_hint(args, report) -> str | None:
    """Why a mismatch may be rounding, not a wrong plan: the default rtol is for f32 SGD."""
    if report.ok:
        return None
    reasons = []
    if args.optimizer == "adamw":
        reasons.append("AdamW divides by the root of tiny second moments, which magnifies rounding")
    if args.dtype == "bfloat16":
        reasons.append("bfloat16 keeps 8 bits of mantissa")
    if not reasons or args.rtol > 1e-5:
        return None
    return (
        f"the default --rtol 1e-5 is meant for float32 SGD; {' and '.join(reasons)}: "
        "to check a plan at 1e-5, plan it with --optimizer sgd in float32; or give a looser "
        "--rtol on purpose"
    )


def _resume(args, bound, step, concrete):
    """``run --resume DIR``: the saved params and optimizer state, laid out as this run's
    plan says (any mesh), with the concrete batch; and the step they were saved after."""
    if not getattr(args, "resume", None):
        return concrete, 0
    from autoshard.runtime.checkpoint import restore_state
    from autoshard.runtime.sharded import abstract_args

    params, opt_state, _ = abstract_args(bound.program, bound.plan, step.mesh)
    (params, opt_state), first = restore_state(args.resume, (params, opt_state))
    return (params, opt_state, concrete[2]), first
