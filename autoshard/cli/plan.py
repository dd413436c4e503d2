"""`autoshard plan` and `autoshard verify` on one mesh (the pipeline path is in
:mod:`autoshard.cli.pipeline`, plan files in :mod:`autoshard.cli.planfile`).

``cmd_plan`` solves (or takes a loaded plan), prints it or writes its plan file, and with
``--verify`` compiles it to compare with XLA; ``cmd_verify`` is ``plan --verify`` whose exit
status says whether they agree. ``route`` checks the flags and says whether a ``plan`` or
``run`` goes to the pipeline path.
"""

from __future__ import annotations

import json
import sys

from autoshard.cli.args import intra_options
from autoshard.cli.args import model_overrides as _overrides
from autoshard.cli.console import out_console, progress
from autoshard.cli.pipeline import (
    cmd_pipeline_plan,
    pipeline_defaults,
    refuse_ignored_pipeline_flags,
)
from autoshard.cli.planfile import bound_from_args, needs_model


def plan_from_args(args):
    from autoshard.api import plan_workload
    from autoshard.inter.progress import Progress

    return plan_workload(
        args.model,
        args.mesh,
        optimizer=args.optimizer,
        baseline=args.baseline,
        options=intra_options(args),
        cluster=getattr(args, "cluster", None),
        offload=getattr(args, "offload", None),
        progress=Progress("autoshard", enabled=not getattr(args, "quiet", False)),
        **_overrides(args),
    )


def _plan_file(model: str, bound, report):
    """The plan file (:class:`autoshard.ir.planfile.PlanFile`) with a readable summary."""
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
    if plan.offload:
        out["offload"] = dict(plan.offload)
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
    return dataclasses.replace(bound.plan_file(), extra=out)


def route(args, command: str) -> bool:
    """Whether ``plan`` / ``run`` should pipeline (``--pipeline``); checks the flags."""
    pipeline = getattr(args, "pipeline", None)
    pipeline_defaults(args, command, pipeline is not None)
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
    saved = _given(args, (("--save", "save"), ("--resume", "resume")))
    if saved:
        raise ValueError(
            f"{command} --pipeline: {', '.join(saved)} checkpoint one-mesh runs only (for now); "
            "drop them, or run one mesh with --mesh"
        )
    knobs = _given(
        args,
        (
            ("--force-batch-axis", "force_batch_axis"),
            ("--no-mixed-mesh-shape", "no_mixed_mesh_shape"),
            ("--no-all-gather", "no_all_gather"),
            ("--no-all-to-all", "no_all_to_all"),
            ("--prefer-reduce-scatter", "prefer_reduce_scatter"),
            ("--per-demand-pricing", "per_demand_pricing"),
        ),
    )
    if knobs:
        raise ValueError(
            f"{command} --pipeline: {', '.join(knobs)} set the one-mesh ILP; the stage "
            "search's ILPs do not take them yet: drop them, or plan one mesh with --mesh"
        )
    refuse_ignored_pipeline_flags(args, command)
    args.devices = args.pipeline_devices or args.devices
    if not args.devices:
        raise ValueError(f"{command} --pipeline needs --devices N")
    return True


def _given(args, flags) -> list[str]:
    """The flags of ``(flag, dest)`` pairs that were set on ``args``."""
    return [flag for flag, dest in flags if getattr(args, dest, None)]


def single_mesh_defaults(args) -> None:
    args.solver = args.solver or "highs"
    args.time_limit = 120.0 if args.time_limit is None else args.time_limit


def cmd_plan(args, verify_exit: bool = False, bound=None) -> int:
    from autoshard.cli.args import check_writable
    from autoshard.cli.report import print_plan, print_verification

    if getattr(args, "out", None):  # before the search: a file that cannot be written
        check_writable(args.out, "--out")

    if bound is None and not verify_exit and route(args, "plan"):
        return cmd_pipeline_plan(args)
    single_mesh_defaults(args)
    if bound is None:
        with progress(args, f"planning {args.model} on mesh {args.mesh} ..."):
            bound = plan_from_args(args)
    report = None
    if args.verify or verify_exit:
        target = getattr(args, "target", None)
        where = f" for {target}" if target else ""
        with progress(args, f"compiling the plan{where} to compare with XLA ..."):
            if target is None:
                report = bound.verify()
            else:
                report = bound.verify(devices=args.target_devices, target=target)
    out_path = getattr(args, "out", None)
    if args.json or out_path:
        plan_file = _plan_file(args.model, bound, report)
    if out_path:
        plan_file.save(out_path)  # PlanFileError (a ValueError) says why it could not
        print(f"plan saved to {out_path}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan_file.to_json(), indent=2))
    else:
        console = out_console()
        print_plan(bound.plan, bound.graph, console, cluster=getattr(args, "cluster", None))
        _print_in_words(bound, console)
        if report is not None:
            print_verification(report, console)
    if report is not None and not report.agree:  # collectives or memory: as verify
        return 1
    return 0


def _print_in_words(bound, console) -> None:
    """The plan's parallelism in one line (:mod:`autoshard.report.digest`)."""
    from autoshard.report.digest import parallelism_of

    console.print(
        f"in words: {parallelism_of(bound.plan_file()).summary()}", markup=False, highlight=False
    )


def cmd_verify(args) -> int:
    args.verify = True
    needs_model(args, "verify")
    loaded = getattr(args, "loaded_plan", None)
    if loaded is None and not args.mesh:
        raise ValueError("verify needs --mesh (e.g. 2x4), or --plan FILE")
    if getattr(args, "target", None) is not None:  # refused here, before any planning
        args.target_devices = _target_devices(args, loaded)
    if loaded is not None:
        return cmd_plan(args, verify_exit=True, bound=bound_from_args(args))
    args.optimizer = args.optimizer or "adamw"
    return cmd_plan(args, verify_exit=True)


def _target_devices(args, loaded) -> list:
    """The devices of ``--target`` for the plan's mesh (TargetUnavailableError, a ValueError,
    where this process cannot compile for it)."""
    import math

    from autoshard.runtime.targets import target_devices

    if loaded is not None:
        num_devices = loaded.plan.mesh.num_devices
    else:
        from autoshard.api import parse_mesh_shape

        num_devices = math.prod(parse_mesh_shape(args.mesh))
    return target_devices(args.target, num_devices)
