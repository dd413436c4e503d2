"""The ``autoshard`` command line.

``autoshard [--devices N] COMMAND ...``; ``--devices`` sets the number of fake CPU
devices (XLA host platform) before any JAX backend starts, so plans for N devices can be
run and verified on a laptop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

from autoshard.cli.args import (
    HelpfulParser,
    add_intra_option_args,
    cluster_presets,
    positive_float,
)
from autoshard.cli.args import add_model_args as _model_args
from autoshard.cli.args import model_overrides as _overrides
from autoshard.cli.args import positive_int as _positive_int
from autoshard.cli.config_file import expand_config
from autoshard.cli.console import out_console, progress, results_only_stdout, version
from autoshard.cli.interrupt import INTERRUPTED, MESSAGE, install_interrupt_hook
from autoshard.cli.launch import add_launch_args
from autoshard.cli.pipeline import (
    add_pipeline_args,
)
from autoshard.cli.plan import cmd_plan, cmd_verify, plan_from_args
from autoshard.cli.planfile import add_plan_file_arg, apply_plan_file
from autoshard.cli.run import cmd_run
from autoshard.intra.baselines.tables import BASELINES


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
    from autoshard.models import get_workload

    with progress(args, f"tracing {args.model} ..."):
        summary = inspect_model(args.model, args.optimizer, **_overrides(args))
    config = get_workload(args.model, **_overrides(args)).config
    shape = {"batch": config.batch_size, "seq_len": getattr(config, "seq_len", None)}
    if args.json:
        print(json.dumps({**summary.to_json(), **shape, "optimizer": args.optimizer}, indent=2))
        return 0
    from autoshard.cli.report import print_summary

    print_summary(summary, out_console(), batch=shape["batch"], seq_len=shape["seq_len"])
    return 0


def cmd_demo(args) -> int:
    """Plan, run and verify gpt-tiny on 8 (fake) devices.

    Exit status: 0 when the planned step runs and matches the single-device step (the
    demo worked); whether the predictions agree with XLA is printed, not folded into the
    status (``autoshard verify`` exits 1 on a disagreement)."""

    with _compilation_cache_for_this_run():
        return _demo(args)


@contextlib.contextmanager
def _compilation_cache_for_this_run():
    """A persistent compilation cache in a temporary folder for one command, unless the
    user keeps one (``JAX_COMPILATION_CACHE_DIR``): the demo compiles the planned step to
    check it, then again to run it, and the second compile is then a cache hit (step 1:
    7.5 s -> 0.4 s on 2 cores)."""
    import tempfile

    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        yield
        return
    names = (
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = [getattr(jax.config, n) for n in names]
    with tempfile.TemporaryDirectory(prefix="autoshard-xla-cache-") as folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        for n in names:
            jax.config.update(n, 0)
        _reset_compilation_cache()  # jax decides once per process whether a cache is used
        try:
            yield
        finally:
            jax.config.update("jax_compilation_cache_dir", None)
            for n, v in zip(names, before):
                jax.config.update(n, v)
            _reset_compilation_cache()


def _reset_compilation_cache() -> None:
    """Have jax look at its cache settings again (a private function, jax 0.10-0.12; where
    it is missing the settings hold from the process's first compile on)."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


def _demo(args) -> int:
    from autoshard.api import inspect_model
    from autoshard.cli.report import human

    console = out_console()
    s = inspect_model("gpt-tiny", "sgd")
    console.rule("[bold]autoshard demo: gpt-tiny on a 2x4 mesh of 8 devices")
    console.print(
        f"gpt-tiny: {s.params:,} parameters, {human(s.flops_per_step)} FLOPs per step, "
        f"{s.num_eqns} equations traced (forward, backward, SGD update)"
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
        quiet=getattr(args, "quiet", False),
        verify=True,
        steps=2,
        check=True,
        rtol=1e-5,
    )
    console.rule("plan (ILP) and its check against XLA")
    bound = plan_from_args(ns)
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
    parser = HelpfulParser(
        prog="autoshard",
        description="Plan, run, verify, explain and export parallel training plans for JAX.",
        epilog="`autoshard COMMAND --help` lists a command's flags and their defaults.",
    )
    parser.add_argument("--version", action="version", version=f"autoshard {version()}")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of flags, one [command] table each (flags typed after it win)",
    )
    parser.add_argument(
        "--devices",
        type=_positive_int,
        default=None,
        help="number of fake CPU devices to create (default: what JAX finds)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=HelpfulParser)

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
            choices=BASELINES,
            help="a hand-written plan instead of the ILP's",
        )
        p.add_argument(
            "--memory-budget", type=positive_float, help="per-device memory budget in GiB"
        )
        p.add_argument(
            "--cluster",
            help=f"cost the plan on a cluster preset ({cluster_presets()}, or a preset "
            ".json): seconds instead of Alpa's relative units (default: no cluster)",
        )
        p.add_argument(
            "--offload",
            metavar="PLACEMENT",
            help="keep training state in host memory (needs --cluster): auto (one mesh: the "
            "cheapest placement that fits, only when the plan alone does not; --pipeline: "
            "each stage its own, activations included, only where memory binds and offload "
            "fits or gains 10%%), none, or classes joined by commas, every stage the same: "
            "optimizer, master, gradients, activations (--pipeline) (docs/offload.md)",
        )
        p.add_argument(
            "--solver",
            choices=("cbc", "highs"),
            default=None,
            help="ILP solver (default: highs; cbc through PuLP)",
        )
        p.add_argument(
            "--time-limit",
            type=positive_float,
            default=None,
            help="ILP wall-clock limit in s (default 120; 60 per ILP with --pipeline). "
            "Without --memory-budget the per-demand solve stops at its node budget (200) and "
            "5 times this is only its safety net; a plan that a clock stopped says it "
            "depends on the machine's load (solver load_dependent)",
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
        if name == "verify":
            p.add_argument(
                "--target",
                default=None,
                help="where to compile: cpu (this process's devices, the default), gpu-aot "
                "(XLA:GPU ahead of time on as many GPUs as the mesh: needs a CUDA jaxlib and "
                "one GPU) or gpu-aot:SxHxD (slices x hosts x GPUs per host, e.g. 1x1x8, 1x8x8)",
            )
        if name == "run":
            p.add_argument("--steps", type=_positive_int, default=2, help="training steps")
            p.add_argument(
                "--check", action="store_true", help="compare with the single-device step"
            )
            p.add_argument(
                "--rtol",
                type=positive_float,
                default=1e-5,
                help="relative tolerance of --check (meant for float32 SGD)",
            )
            p.add_argument(
                "--save", metavar="DIR", help="save params and optimizer state (Orbax) at the end"
            )
            p.add_argument(
                "--resume",
                metavar="DIR",
                help="start from a state --save wrote, resharded to this run's plan",
            )
            add_launch_args(p)
        if name != "verify":
            add_pipeline_args(p, run=name == "run")
        # None on run and verify: a --plan file's optimizer, else sgd / adamw
        p.set_defaults(func=func, optimizer="adamw" if name == "plan" else None)

    p = sub.add_parser("demo", help="plan, run and verify gpt-tiny on 8 fake CPU devices")
    p.add_argument("--solver", choices=("cbc", "highs"), default="highs")
    p.add_argument("--time-limit", type=positive_float, default=120.0, help="ILP time limit (s)")
    p.set_defaults(func=cmd_demo)

    from autoshard.cli.pipeline import register as register_pipeline

    register_pipeline(sub)

    from autoshard.cli.simulate import register as register_simulate

    register_simulate(sub)

    from autoshard.cli.explain import register as register_explain

    register_explain(sub)

    from autoshard.cli.reproduce import register as register_reproduce

    register_reproduce(sub)
    return parser


def _warn_plainly(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``autoshard: warning: ...`` lines on stderr (no source lines)."""
    print(f"autoshard: warning: {message}", file=sys.stderr)


def _multi_process(args, argv: list[str] | None, devices: int | None) -> bool:
    """Start the local processes (``--processes N``: True, status in ``args.launch_status``),
    or join a multi-process run (a launched child, ``--distributed``), or set up the fake
    devices of a one-process run (False)."""
    from autoshard.runtime.distributed import initialize, process_group_from_env

    group = process_group_from_env()
    processes = getattr(args, "processes", 1)
    if group is None and processes > 1:
        from autoshard.cli.launch import launch

        try:
            args.launch_status = launch(
                list(sys.argv[1:] if argv is None else argv), processes, devices or processes
            )
        except ValueError as err:
            print(f"autoshard: error: {err}", file=sys.stderr)
            args.launch_status = 2
        return True
    if group is not None or getattr(args, "distributed", False):
        try:  # the child's share of the devices, or the cluster's settings
            initialize(group)
        except (ValueError, RuntimeError) as err:
            print(
                f"autoshard: error: cannot join the multi-process run: {err}; --distributed "
                "is for processes a cluster job started (SLURM, ...), --processes N starts "
                "local ones",
                file=sys.stderr,
            )
            args.launch_status = 2
            return True
    else:
        _setup_devices(devices)
    return False


# the most fake CPU devices a command makes (4,096: 8 s and 0.6 GB to start here; a
# million would take ~100 GB)
MAX_FAKE_DEVICES = 4096


def _warn_mesh_rank(text: str, shape: tuple[int, ...]) -> None:
    """Meshes of more than two axes are accepted but planned poorly: say so at once."""
    if len(shape) <= 2:
        return
    n = 1
    for s in shape:
        n *= s
    two = sorted({f"{a}x{n // a}" for a in range(2, n) if n % a == 0})[:3]
    print(
        f"autoshard: warning: mesh {text} has {len(shape)} axes; the cost model and the ILP are "
        "built for one- and two-axis meshes (Alpa's), and a 3-axis mesh makes the ILP much "
        f"larger and slower to solve; the same {n} devices as a 2-axis mesh: "
        f"{', '.join(two) or str(n)} (or {n})",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status.  Ctrl-C ends it with one line and status 130
    (also when Python would drop it: :mod:`autoshard.cli.interrupt`); what libraries print on
    descriptor 1 goes to stderr (:func:`results_only_stdout`)."""
    install_interrupt_hook()
    try:
        with results_only_stdout():
            return _main(argv)
    except KeyboardInterrupt:
        print(MESSAGE, file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = expand_config(argv, parser)
    except ValueError as err:
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2
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
        from autoshard.hardware.mesh import parse_mesh_shape

        try:
            shape = parse_mesh_shape(args.mesh)
        except ValueError as err:
            parser.error(str(err))
        devices = 1
        for s in shape:
            devices *= s
        _warn_mesh_rank(args.mesh, shape)
    if devices is None and getattr(args, "exact", False):
        from autoshard.sim.exact import MAX_EXACT_DEVICES

        if args.gpus <= MAX_EXACT_DEVICES:  # more: simulate() says why
            devices = args.gpus  # simulate --exact compiles on one fake device per GPU
    if devices is not None and devices > MAX_FAKE_DEVICES:
        what = f"--mesh {args.mesh}" if getattr(args, "mesh", None) else f"{devices} devices"
        print(
            f"autoshard: error: {what} asks for {devices:,} fake CPU devices; this command "
            f"makes at most {MAX_FAKE_DEVICES:,} (each takes memory and start-up time: 4,096 "
            "took 8 s and 0.6 GB here): plan a mesh of at most that many devices, or price a "
            "larger cluster with `autoshard simulate --cluster PRESET --gpus N`",
            file=sys.stderr,
        )
        return 2
    if _multi_process(args, argv, devices):
        return args.launch_status
    warnings.showwarning = _warn_plainly
    from autoshard.intra.ilp import SolverTimeLimitError
    from autoshard.runtime.checkpoint import CheckpointError

    try:
        return args.func(args)
    except CheckpointError as err:  # Orbax's threads wait on: end the process here
        print(f"autoshard: error: {err}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except ValueError as err:  # bad input: say what was wrong, no traceback
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2
    except SolverTimeLimitError as err:  # nothing feasible found in time: say how to get a plan
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
