"""``--out`` and ``--plan``: saving a plan to a file and running or verifying it again.

``plan --out FILE`` writes the plan file (:mod:`autoshard.ir.planfile`); ``run --plan
FILE`` and ``verify --plan FILE`` read it, take the model, sizes, optimizer and mesh
from it (a flag that says otherwise is refused, naming both values), re-trace the model,
check the program and mesh against the file's fingerprint and use the plan as it is:
nothing is solved again.
"""

from __future__ import annotations

import sys

# flag -> (argparse dest, the get_workload keyword it sets)
SIZE_FLAGS = (
    ("--batch", "batch", "batch_size"),
    ("--seq", "seq", "seq_len"),
    ("--vocab", "vocab", "vocab_size"),
    ("--layers", "layers", "num_layers"),
    ("--hidden", "hidden", "hidden"),
    ("--dtype", "dtype", "dtype"),
    ("--attention", "attention", "attention"),
)
# flags that choose how a plan is made: a saved plan is not made again
PLANNING_FLAGS = (
    ("--baseline", "baseline"),
    ("--memory-budget", "memory_budget"),
    ("--cluster", "cluster"),
    ("--offload", "offload"),
    ("--solver", "solver"),
    ("--time-limit", "time_limit"),
    ("--merge-elementwise", "merge_elementwise"),
    ("--force-batch-axis", "force_batch_axis"),
    ("--no-mixed-mesh-shape", "no_mixed_mesh_shape"),
    ("--no-all-gather", "no_all_gather"),
    ("--no-all-to-all", "no_all_to_all"),
    ("--prefer-reduce-scatter", "prefer_reduce_scatter"),
    ("--per-demand-pricing", "per_demand_pricing"),
    ("--pipeline", "pipeline"),
    ("--stages", "stages"),
    ("--microbatches", "microbatches"),
    ("--schedule", "schedule"),
    ("--grad-reduce", "grad_reduce"),
    ("run --devices", "pipeline_devices"),  # the mesh in the file sets the devices
)


def add_plan_file_arg(p, command: str) -> None:
    if command == "plan":
        p.add_argument(
            "--out",
            metavar="FILE",
            help="save the plan (with a fingerprint of the program and mesh) to FILE; "
            "run --plan and verify --plan read it",
        )
    else:
        p.add_argument(
            "--plan",
            dest="plan_file",
            metavar="FILE",
            help="use the plan saved by `plan --out FILE` (model, sizes, optimizer and mesh "
            "come from the file; nothing is solved again)",
        )


def apply_plan_file(args, command: str) -> None:
    """Load ``args.plan_file`` into ``args`` (``args.loaded_plan``, model, sizes,
    optimizer, mesh); ValueError when a flag contradicts the file or the file is bad."""
    from autoshard.ir.planfile import load_plan, require_one_mesh

    refused = [flag for flag, dest in PLANNING_FLAGS if getattr(args, dest, None)]
    if refused:
        raise ValueError(
            f"{command} --plan runs the saved plan without planning again; drop "
            f"{', '.join(refused)} (to plan with other settings, run `autoshard plan ... --out`)"
        )
    pf = require_one_mesh(load_plan(args.plan_file), f"plan file {args.plan_file!r}")
    if not pf.model:
        raise ValueError(
            f"plan file {args.plan_file!r} names no model preset (it was saved from auto_shard "
            "on your own function); load it in Python with autoshard.bind_plan"
        )
    differ = []
    if args.model is not None and args.model != pf.model:
        differ.append(f"--model {args.model} (the plan is for {pf.model})")
    overrides = pf.overrides
    given_sizes = [(f, d, k) for f, d, k in SIZE_FLAGS if getattr(args, d, None) is not None]
    if given_sizes:  # compare with the sizes the plan was made for, preset defaults included
        from autoshard.models import get_workload

        config = get_workload(pf.model, **overrides).config
        for flag, dest, key in given_sizes:
            given, made = getattr(args, dest), getattr(config, key, None)
            if given != made:
                differ.append(f"{flag} {given} (the plan is for {flag} {made})")
    if args.optimizer is not None and pf.optimizer and args.optimizer != pf.optimizer:
        differ.append(f"--optimizer {args.optimizer} (the plan is for {pf.optimizer})")
    mesh = pf.plan.mesh
    if args.mesh:
        from autoshard.api import default_axis_names, parse_mesh_shape  # jax: only here

        shape = parse_mesh_shape(args.mesh)
        if shape != mesh.shape:
            from autoshard.ir.planfile import describe_mesh

            names = default_axis_names(shape)
            differ.append(
                f"--mesh {args.mesh}: the plan was made for mesh {describe_mesh(mesh)}, not "
                + "x".join(map(str, shape))
                + f" ({', '.join(names)})"
            )
    if differ:
        raise ValueError(
            f"plan file {args.plan_file!r} was made for another setting: {'; '.join(differ)}; "
            "drop these flags or re-plan"
        )
    args.model = pf.model
    for _flag, dest, key in SIZE_FLAGS:
        setattr(args, dest, overrides.get(key))
    args.optimizer = pf.optimizer or args.optimizer
    args.mesh = "x".join(map(str, mesh.shape))
    args.loaded_plan = pf


def bound_from_args(args):
    """The BoundPlan for ``args.loaded_plan``: re-traced and checked, not solved."""
    from autoshard.api import bind_plan
    from autoshard.ir.planfile import describe_mesh
    from autoshard.runtime.sharded import make_mesh

    pf = args.loaded_plan
    bound = bind_plan(pf, make_mesh(pf.plan.mesh, getattr(args, "target_devices", None)))
    print(
        f"loaded plan {pf.plan.name!r} from {args.plan_file} (made for {pf.model}, mesh "
        f"{describe_mesh(pf.plan.mesh)}): program and mesh match, not solving again",
        file=sys.stderr,
    )
    return bound


def needs_model(args, command: str) -> None:
    if getattr(args, "plan_file", None) is None and args.model is None:
        raise ValueError(f"{command} needs --model (or --plan FILE, a plan saved by plan --out)")
