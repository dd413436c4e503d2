"""The ``autoshard`` command line.

``autoshard [--devices N] COMMAND ...``; ``--devices`` sets the number of fake CPU
devices (XLA host platform) before any JAX backend starts, so plans for N devices can be
run and verified on a laptop.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from autoshard.cli.args import add_intra_option_args, intra_options
from autoshard.cli.args import add_model_args as _model_args
from autoshard.cli.args import model_overrides as _overrides
from autoshard.cli.args import positive_int as _positive_int
from autoshard.cli.pipeline import add_pipeline_args, cmd_pipeline_plan, cmd_pipeline_run
from autoshard.cli.planfile import add_plan_file_arg, apply_plan_file, bound_from_args, needs_model


def _setup_devices(n: int | None) -> None:
    if not n:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # backend already started
        raise SystemExit(f"autoshard: cannot set {n} CPU devices: {err}") from None


def cmd_inspect(args) -> int:
    from autoshard.api import inspect_model

    summary = inspect_model(args.model, args.optimizer, **_overrides(args))
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
        return 0
    from autoshard.cli.report import print_summary

    print_summary(summary)
    return 0


def _plan(args):
    from autoshard.api import plan_workload

    return plan_workload(
        args.model,
        args.mesh,
        optimizer=args.optimizer,
        baseline=args.baseline,
        options=intra_options(args),
        cluster=getattr(args, "cluster", None),
        **_overrides(args),
    )


def _plan_json(model: str, bound, report) -> dict:
    """The plan file's document (:mod:`autoshard.ir.planfile`) with a readable summary."""
    import dataclasses

    plan, graph = bound.plan, bound.graph
    out = {
        "model": model,
        "plan": plan.name,
        "mesh": {"axis_names": list(plan.mesh.axis_names), "shape": list(plan.mesh.shape)},
        "objective": plan.objective,
        "specs": {
            graph.tensors[t].path: s.format(graph.tensors[t].shape, graph.tensors[t].dtype)
            for t, s in zip(graph.inputs, plan.input_specs)
        },
        "predicted_collectives": [c.to_json() for c in plan.predicted_collectives],
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "solver": dict(plan.solver),
        "notes": list(plan.notes),
    }
    if report is not None:
        verification = report.to_json()
        out.update(
            compiled_collectives=verification["compiled_collectives"],
            compiled_peak_bytes=report.compiled_peak_bytes,
            collectives_agree=report.collectives_agree,
            memory_error=report.memory_error,
            memory_explained_by_heap_gap=report.memory_explained_by_heap_gap,
            agree=report.agree,
            verification=verification,
        )
    return dataclasses.replace(bound.plan_file(), extra=out).to_json()


def _route(args, command: str) -> bool:
    """Whether ``plan`` / ``run`` should pipeline (``--pipeline``); checks the flags."""
    pipeline = getattr(args, "pipeline", None)
    if pipeline is None:
        if not args.mesh:
            raise ValueError(
                f"{command} needs --mesh (one mesh, e.g. 2x4) or --pipeline "
                "auto|equal-layer|equal-flops with --devices N (pipeline stages)"
            )
        return False
    if args.mesh:
        raise ValueError(f"{command}: give --mesh (one mesh) or --pipeline (stages), not both")
    if args.baseline:
        raise ValueError(f"{command} --pipeline plans stages with the ILP; drop --baseline")
    if getattr(args, "out", None):
        raise ValueError(f"{command} --pipeline: --out saves one-mesh plans only (for now)")
    knobs = [
        flag
        for flag, on in (
            ("--force-batch-axis", getattr(args, "force_batch_axis", None)),
            ("--no-mixed-mesh-shape", getattr(args, "no_mixed_mesh_shape", False)),
        )
        if on
    ]
    if knobs:
        raise ValueError(
            f"{command} --pipeline: {', '.join(knobs)} set the one-mesh ILP; the stage "
            "search's ILPs do not take them yet: drop them, or plan one mesh with --mesh"
        )
    args.devices = args.pipeline_devices or args.devices
    if not args.devices:
        raise ValueError(f"{command} --pipeline needs --devices N")
    return True


def _single_mesh_defaults(args) -> None:
    args.solver = args.solver or "highs"
    args.time_limit = 120.0 if args.time_limit is None else args.time_limit


def cmd_plan(args, verify_exit: bool = False, bound=None) -> int:
    from autoshard.cli.report import print_plan, print_verification

    if bound is None and not verify_exit and _route(args, "plan"):
        return cmd_pipeline_plan(args)
    _single_mesh_defaults(args)
    bound = bound or _plan(args)
    report = bound.verify() if (args.verify or verify_exit) else None
    out_path = getattr(args, "out", None)
    if args.json or out_path:
        obj = _plan_json(args.model, bound, report)
    if out_path:
        try:
            with open(out_path, "w") as f:
                json.dump(obj, f, indent=2)
                f.write("\n")
        except OSError as err:
            raise ValueError(f"cannot write the plan to {out_path!r}: {err.strerror}") from None
        print(f"plan saved to {out_path}", file=sys.stderr)
    if args.json:
        print(json.dumps(obj, indent=2))
    else:
        print_plan(bound.plan, bound.graph)
        if report is not None:
            print_verification(report)
    if verify_exit and report is not None and not report.agree:  # collectives or memory
        return 1
    return 0


def cmd_verify(args) -> int:
    args.verify = True
    needs_model(args, "verify")
    if getattr(args, "loaded_plan", None) is not None:
        return cmd_plan(args, verify_exit=True, bound=bound_from_args(args))
    if not args.mesh:
        raise ValueError("verify needs --mesh (e.g. 2x4), or --plan FILE")
    args.optimizer = args.optimizer or "adamw"
    return cmd_plan(args, verify_exit=True)


def cmd_run(args, bound=None) -> int:
    from rich.console import Console

    from autoshard.models import get_workload, make_optimizer
    from autoshard.runtime.sharded import check_against_single_device, run_steps

    needs_model(args, "run")
    if bound is None and getattr(args, "loaded_plan", None) is not None:
        bound = bound_from_args(args)
    if bound is None and _route(args, "run"):
        return cmd_pipeline_run(args)
    _single_mesh_defaults(args)
    console = Console()
    args.optimizer = args.optimizer or "sgd"
    bound = bound or _plan(args)
    workload = get_workload(args.model, **_overrides(args))
    opt = make_optimizer(args.optimizer)
    concrete = workload.init_train_args(opt, seed=0)
    step = bound.jit()
    _, losses = run_steps(step, concrete, args.steps)
    console.print(
        f"plan {bound.plan.name} on {bound.plan.mesh}: losses "
        + ", ".join(f"{x:.6f}" for x in losses)
    )
    if not args.check:
        return 0
    report = check_against_single_device(
        bound.program,
        bound.plan,
        step.mesh,
        concrete,
        num_steps=args.steps,
        rtol=args.rtol,
        step=step,
    )
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
    return 0 if report.ok else 1


def cmd_demo(args) -> int:
    """Plan, run and verify gpt-tiny on 8 (fake) devices.

    Exit status: 0 when the planned step runs and matches the single-device step (the
    demo worked); whether the predictions agree with XLA is printed, not folded into the
    status (``autoshard verify`` exits 1 on a disagreement)."""
    from rich.console import Console

    from autoshard.api import inspect_model
    from autoshard.cli.report import human

    console = Console()
    s = inspect_model("gpt-tiny")
    console.rule("[bold]autoshard demo: gpt-tiny on a 2x4 mesh of 8 devices")
    console.print(
        f"gpt-tiny: {s.params:,} parameters, {human(s.flops_per_step)} FLOPs per step, "
        f"{s.num_eqns} equations traced (forward, backward, AdamW update)"
    )
    ns = argparse.Namespace(
        model="gpt-tiny",
        mesh="2x4",
        baseline=None,
        memory_budget=None,
        solver=args.solver,
        time_limit=args.time_limit,
        optimizer="sgd",
        batch=None,
        seq=None,
        vocab=None,
        layers=None,
        hidden=None,
        dtype=None,
        json=False,
        verify=True,
        steps=2,
        check=True,
        rtol=1e-5,
    )
    console.rule("plan (ILP) and its check against XLA")
    bound = _plan(ns)
    verify_rc = cmd_plan(ns, bound=bound)
    console.rule("run the plan and compare with one device")
    rc = cmd_run(ns, bound=bound)
    console.rule("summary")
    console.print(
        "the plan runs and matches one device"
        if rc == 0
        else "[red]the plan does NOT match one device[/red]"
    )
    console.print(
        "predictions agree with XLA's compiled step"
        if verify_rc == 0
        else "[yellow]some predictions disagree with XLA's compiled step (table above); "
        "docs/truth.md says how far each prediction holds[/yellow]"
    )
    return rc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        type=_positive_int,
        default=None,
        help="number of fake CPU devices to create (default: what JAX finds)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="parameters, FLOPs and equations of a training step")
    _model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

    for name, func, text in (
        ("plan", cmd_plan, "choose a sharding plan (ILP or a baseline) and print it"),
        (
            "verify",
            cmd_verify,
            "plan, compile, and compare predicted with compiled (exit 1 on disagreement)",
        ),
        ("run", cmd_run, "plan and run training steps (fake CPU devices when no accelerator)"),
    ):
        p = sub.add_parser(name, help=text)
        _model_args(p, model_required=name == "plan")  # run and verify may read --plan
        p.add_argument("--mesh", help="device mesh shape, e.g. 8, 2x4, 1x8")
        add_plan_file_arg(p, name)
        p.add_argument(
            "--baseline",
            choices=("dp", "zero2", "zero3", "megatron"),
            help="a hand-written plan instead of the ILP's",
        )
        p.add_argument("--memory-budget", type=float, help="per-device memory budget in GiB")
        p.add_argument(
            "--cluster",
            help="cost the plan on a cluster preset (dgx-a100, dgx-h100, alpa-v100, or a preset "
            ".json): seconds instead of Alpa's relative units",
        )
        p.add_argument(
            "--solver",
            choices=("cbc", "highs"),
            default=None,
            help="ILP solver (default: highs; cbc through PuLP)",
        )
        p.add_argument(
            "--time-limit", type=float, default=None, help="ILP time limit (s; 120, 60 per ILP)"
        )
        p.add_argument(
            "--merge-elementwise",
            action="store_true",
            help="Alpa's follower rule for binary elementwise ops: a smaller, faster ILP "
            "(plans can be a few percent worse)",
        )
        add_intra_option_args(p)
        p.add_argument("--json", action="store_true", help="print JSON")
        if name == "plan":
            p.add_argument("--verify", action="store_true", help="also compile and compare")
        if name == "run":
            p.add_argument("--steps", type=_positive_int, default=2)
            p.add_argument(
                "--check", action="store_true", help="compare with the single-device step"
            )
            p.add_argument("--rtol", type=float, default=1e-5)
        if name != "verify":
            add_pipeline_args(p, run=name == "run")
        # None on run and verify: a --plan file's optimizer, else sgd / adamw
        p.set_defaults(func=func, optimizer="adamw" if name == "plan" else None)

    p = sub.add_parser("demo", help="plan, run and verify gpt-tiny on 8 fake CPU devices")
    p.add_argument("--solver", choices=("cbc", "highs"), default="highs")
    p.add_argument("--time-limit", type=float, default=120.0)
    p.set_defaults(func=cmd_demo)

    from autoshard.cli.pipeline import register as register_pipeline

    register_pipeline(sub)

    from autoshard.cli.simulate import register as register_simulate

    register_simulate(sub)
    return parser


def _warn_plainly(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``autoshard: warning: ...`` lines on stderr (no source lines)."""
    print(f"autoshard: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "plan_file", None):
        try:  # before the devices are set up: the mesh comes from the file
            apply_plan_file(args, args.command)
        except ValueError as err:
            print(f"autoshard: error: {err}", file=sys.stderr)
            return 2
    devices = args.devices or getattr(args, "pipeline_devices", None)
    if devices is None and args.command == "demo":
        devices = 8
    if devices is None and getattr(args, "mesh", None):
        from autoshard.api import parse_mesh_shape

        try:
            shape = parse_mesh_shape(args.mesh)
        except ValueError as err:
            parser.error(str(err))
        devices = 1
        for s in shape:
            devices *= s
    if devices is None and getattr(args, "exact", False):
        from autoshard.sim.exact import MAX_EXACT_DEVICES

        if args.gpus <= MAX_EXACT_DEVICES:  # more: simulate() says why
            devices = args.gpus  # simulate --exact compiles on one fake device per GPU
    _setup_devices(devices)
    warnings.showwarning = _warn_plainly
    from autoshard.intra.ilp import SolverTimeLimitError

    try:
        return args.func(args)
    except ValueError as err:  # bad input: say what was wrong, no traceback
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2
    except SolverTimeLimitError as err:  # nothing feasible found in time: say how to get a plan
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
