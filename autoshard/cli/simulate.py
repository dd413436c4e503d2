"""``autoshard simulate``: predict a plan's step time, MFU and memory on a cluster preset.

Calls :func:`autoshard.sim.simulate.simulate` and prints a table (rich) or, with
``--json``, the report's JSON. :func:`register` adds the sub-command to the main parser.
"""

from __future__ import annotations

import json

from autoshard.cli.args import cluster_presets
from autoshard.cli.args import gib as _gib
from autoshard.cli.args import positive_int as _positive_int
from autoshard.inter.stages import RECOMPUTE_MODES as _PLANNED_MODES

RECOMPUTE_MODES = (*_PLANNED_MODES, "auto")
PROGRAM_TEXT = {
    "megatron-lm": "Megatron-LM's fused kernels (the program published measurements ran)",
    "megatron-lm-flash": "Megatron-LM's fused kernels with flash attention (today's "
    "--use-flash-attn; the attention kernel from the device's attention table)",
    "traced": "the traced JAX step, op by op, as the search prices it (XLA:GPU fusion model)",
}


def microbatches_arg(text: str):
    """``--microbatches``: a positive int (fixed), ``search`` (``--plan auto`` searches the
    default candidates), or counts and ``search`` separated by commas (``search,256``:
    those and 256; ``32,64``: these two): :func:`autoshard.sim.simulate.simulate`'s
    ``num_microbatches``."""
    import argparse

    parts = [p.strip() for p in str(text).split(",")]
    out = []
    for part in parts:
        if part == "search":
            out.append(part)
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a positive int, 'search', or counts and 'search' separated "
                "by commas (e.g. search,256)"
            )
    return out[0] if len(out) == 1 and isinstance(out[0], int) else tuple(out)


def _searched_text(plan: dict) -> str:
    """The micro-batch counts a search tried, e.g. ``32: 1.2 s; 64: 1.1 s (chosen); ...``."""
    return "; ".join(
        f"{c['num_microbatches']}: {c['step_time_s']:.4g} s"
        + ("" if c["fits"] else " (out of memory)")
        + (" (chosen)" if c["chosen"] else "")
        for c in plan["microbatch_search"]
    )


def _plan_text(plan: dict) -> str:
    if plan["kind"] == "auto":
        stages = "; ".join(
            f"{s['layers'][0]}..{s['layers'][1]} on {s['submesh'][0]}x{s['submesh'][1]} "
            f"as (dp, tp)=({s['logical_mesh_dp_tp'][0]}, {s['logical_mesh_dp_tp'][1]}), "
            f"recompute {s['recompute']}"
            + (", gradients reduced once a step" if s.get("grad_reduce") == "step" else "")
            for s in plan["stages"]
        )
        return f"auto: {plan['pp']} stage(s): {stages}"
    grid = f"TP {plan['tp']} x PP {plan['pp']} x DP {plan['dp']}"
    extra = f", ZeRO-{plan['zero_stage']}" if plan["zero_stage"] else ""
    if plan.get("sequence_parallel"):
        extra += ", sequence parallel"
    if plan.get("virtual_stages", 1) > 1:
        extra += f", {plan['virtual_stages']} virtual stages (interleaved 1F1B)"
    if plan.get("program") == "traced":
        extra += ", timed on the traced JAX step (the search's cost model)"
        reduced = {s.get("grad_reduce") for s in plan.get("stages", ())}
        if "step" in reduced:
            extra += ", data-parallel gradients reduced once a step"
    if plan.get("program") == "megatron-lm-flash":
        extra += ", flash attention"
    searched = (
        f" (best of {plan['candidates_evaluated']} configurations)"
        if plan["candidates_evaluated"] > 1
        else ""
    )
    return f"{plan['kind']}: {grid}{extra}{searched}"


def _offload_text(record: dict) -> str:
    where = record["where"]
    labels = record.get("offload_per_stage", [])
    if len(set(labels)) > 1:  # each stage chose its own
        return (
            f"per stage: {' | '.join(labels)} ({_gib(record['host_bytes_per_device'])} per GPU "
            f"at most, {_gib(record['host_bytes_per_node'])} per node of "
            f"{_gib(record['host_memory_bytes'])} usable); exposed transfer + host update "
            "per step: " + ", ".join(f"{s:.3g} s" for s in record["exposed_s_per_stage"])
        )
    host = [c for c, w in where.items() if w == "host" and c != "update"]
    return (
        f"{', '.join(host)} in host memory ({_gib(record['host_bytes_per_device'])} per GPU, "
        f"{_gib(record['host_bytes_per_node'])} per node of {_gib(record['host_memory_bytes'])} "
        f"usable), update on {where['update']}; exposed transfer + host update per step: "
        + ", ".join(f"{s:.3g} s" for s in record["exposed_s_per_stage"])
        + " (per stage)"
    )


def print_report(report) -> None:
    """A readable table of a :class:`~autoshard.sim.report.SimulationReport`."""
    from rich.console import Console
    from rich.table import Table

    data = report.to_json()
    plan = data["plan"]
    table = Table(title=f"{report.model} on {report.gpus} x {report.cluster}", show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    per = "global, split over each stage's DP" if plan["kind"] == "auto" else "per DP replica"
    rows = [
        ("plan", _plan_text(plan)),
        ("program priced", PROGRAM_TEXT[plan.get("program", "megatron-lm")]),
        (
            "batch",
            f"global {plan['global_batch']}, {plan['num_microbatches']} micro-batches of "
            f"{plan['microbatch_size']} ({per}), recompute {plan['recompute']}, {plan['dtype']}",
        ),
    ]
    if report.oom:  # the step would not run: no speed to report, only what it would need
        from autoshard.hardware.clusters import load_cluster

        try:
            hbm = load_cluster(report.cluster).device.hbm_bytes
        except (ValueError, OSError):
            hbm = None
        rows += [
            (
                "does not fit",
                f"[red]OUT OF MEMORY[/red]: the step does not run on {report.cluster}"
                + (f" ({_gib(hbm)} HBM per device)" if hbm else ""),
            ),
            ("step time", f"- (it would take {report.step_time_s:.4g} s with enough memory)"),
            ("throughput, TFLOP/s, MFU / HFU", "- (the step does not run)"),
        ]
    else:
        rows += [
            ("step time", f"{report.step_time_s:.4g} s"),
            ("throughput", f"{report.tokens_per_s:,.0f} tokens/s"),
            ("TFLOP/s per device", f"{report.tflops_per_device:.1f} (hardware FLOPs)"),
            ("MFU / HFU", f"{report.mfu:.1%} / {report.hfu:.1%}"),
        ]
    rows.append(
        (
            "peak memory per device",
            _gib(report.peak_bytes_per_device)
            + ("  [red]OUT OF MEMORY[/red]" if report.oom else ""),
        )
    )
    if plan.get("microbatch_search"):
        rows.append(("micro-batches searched", _searched_text(plan)))
    if plan.get("offload"):
        rows.append(("offload", _offload_text(plan["offload"])))
    rows.append(("step breakdown", "compute, recompute, exposed comm per mesh axis, ..."))
    rows += [
        (f"  {name}", f"{seconds:.4g} s ({seconds / report.step_time_s:.1%})")
        for name, seconds in report.step_breakdown.items()
        if seconds > 0
    ]
    rows.append(("search", f"{report.search_seconds:.2f} s"))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _size(nbytes: float) -> str:
    from autoshard.ir.units import format_bytes

    return format_bytes(nbytes)


def print_exact(exact) -> None:
    """Compiled next to predicted: a :class:`~autoshard.sim.exact.ExactReport` as a table."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not exact.available:
        console.print(f"exact mode: not available: {exact.why}")
        return
    dp, tp = exact.mesh_dp_tp
    table = Table(
        title=f"exact: {exact.intra_plan} plan compiled on {exact.devices} fake CPU devices, "
        f"(dp, tp) = ({dp}, {tp}), batch {exact.compiled_batch}"
    )
    for name in ("per device", "compiled", "predicted", "predicted / compiled"):
        table.add_column(name, justify="left" if name == "per device" else "right")

    def row(name, compiled, predicted):
        ratio = f"{predicted / compiled:.2f}" if compiled and predicted else "-"
        table.add_row(name, _size(compiled), _size(predicted), ratio)

    row("peak memory (simulator)", exact.compiled_peak_bytes, exact.predicted_peak_bytes)
    row("peak memory (intra-op plan)", exact.compiled_peak_bytes, exact.intra_predicted_peak_bytes)
    compiled, predicted = exact.compiled_collective_bytes, exact.predicted_collective_bytes
    for key in sorted(set(compiled) | set(predicted)):
        row(f"  {key}", compiled.get(key, 0), predicted.get(key, 0))
    console.print(table)
    fits = "fits" if exact.fits_hbm else "[red]does NOT fit[/red]"
    console.print(
        f"compiled peak {fits} in {_gib(exact.hbm_bytes)} HBM; memory error vs the simulator "
        f"{exact.memory_error:.1%}; plan {exact.plan_seconds:.1f} s, compile "
        f"{exact.compile_seconds:.1f} s"
    )
    for note in exact.notes:
        console.print(f"  note: {note}")


def _model_overrides(args) -> dict:
    """The model-dimension flags that were given, as ``simulate`` overrides."""
    given = {
        "num_layers": args.layers,
        "hidden": args.hidden,
        "num_heads": args.heads,
        "seq_len": args.seq,
        "vocab_size": args.vocab,
        "num_experts": args.experts,
        "attention": args.attention,
    }
    return {k: v for k, v in given.items() if v is not None}


def cmd_simulate(args) -> int:
    from autoshard.inter.progress import Progress
    from autoshard.sim.simulate import simulate

    report = simulate(
        args.model,
        args.cluster,
        args.gpus,
        plan=args.plan,
        microbatch_size=args.microbatch_size,
        global_batch=args.global_batch,
        recompute=args.recompute,
        dtype=args.sim_dtype,
        ilp_time_limit_s=args.time_limit,
        exact=args.exact,
        program=args.program,
        num_microbatches=args.microbatches,
        sequence_parallel=args.sequence_parallel,
        virtual_stages=args.virtual_stages,
        optimizer=args.optimizer,
        progress=Progress(f"{args.model} {args.plan}", enabled=not getattr(args, "quiet", False)),
        offload=args.offload,
        grad_reduce=args.grad_reduce,
        **_model_overrides(args),
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
        if report.exact is not None:
            print_exact(report.exact)
    return fits_status(report)


def fits_status(report) -> int:
    """The exit status: 0 the step fits the device's memory (and, with ``--exact``, the
    compiled step does too), 1 it does not (as ``verify`` exits 1 on a disagreement)."""
    exact = report.exact
    compiled_over = exact is not None and exact.available and not exact.fits_hbm
    return 1 if report.oom or compiled_over else 0


def register(subparsers) -> None:
    """Add ``simulate`` to ``subparsers`` (argparse)."""
    p = subparsers.add_parser(
        "simulate",
        help="predict step time, MFU and memory of a plan on a cluster preset",
        description=(
            f"Simulate a GPT preset on a cluster preset ({cluster_presets()} or a "
            "preset .json): data parallel, ZeRO-2/3, a Megatron TPxPPxDP grid (or the best "
            "grid), or Alpa's search (auto)."
        ),
    )
    p.add_argument(
        "--model",
        required=True,
        help=(
            "GPT preset, e.g. gpt-350m, gpt-39b (or a GPT-MoE / Wide-ResNet preset with --plan "
            "auto); the dimension flags below override a GPT or GPT-MoE preset's sizes"
        ),
    )
    dims = p.add_argument_group("model dimensions (override the preset's)")
    dims.add_argument("--layers", type=_positive_int, help="transformer layers")
    dims.add_argument("--hidden", type=_positive_int, help="hidden size")
    dims.add_argument("--heads", type=_positive_int, help="attention heads (divide --hidden)")
    dims.add_argument("--seq", type=_positive_int, help="sequence length (tokens)")
    dims.add_argument("--vocab", type=_positive_int, help="vocabulary size")
    dims.add_argument(
        "--experts", type=_positive_int, help="experts per MoE layer (GPT-MoE presets, --plan auto)"
    )
    dims.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        help="the traced step's attention (--program traced or --plan auto; default fused)",
    )
    p.add_argument(
        "--cluster", required=True, help=f"cluster preset ({cluster_presets()}) or a preset .json"
    )
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of GPUs")
    p.add_argument(
        "--plan",
        default="megatron",
        help="auto | dp | zero2 | zero3 | megatron | megatron:TPxPPxDP (default: megatron)",
    )
    p.add_argument(
        "--microbatch-size",
        type=_positive_int,
        help="sequences per micro-batch per data-parallel replica (Megatron-LM's "
        "--micro-batch-size); not with --plan auto, which picks a DP degree per stage: give "
        "--microbatches there. Default: searched",
    )
    p.add_argument(
        "--microbatches",
        type=microbatches_arg,
        help="micro-batches per step (gradient-accumulation steps), on every plan; default: "
        "searched (grids) or chosen (auto). With --plan auto also 'search' (the whole search "
        "at the default count, a quarter, half, 2x and 4x it; the fastest that fits wins) or "
        "counts and 'search' separated by commas (search,256: those and 256; 32,64: these "
        "two)",
    )
    p.add_argument(
        "--global-batch", type=_positive_int, help="sequences per step; default: the preset's"
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron-LM sequence parallelism (needs TP > 1; Megatron plans on the "
        "megatron-lm and megatron-lm-flash programs only)",
    )
    p.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=1,
        help="model chunks per pipeline stage, interleaved 1F1B (Megatron-LM: layers / (PP x "
        "this) layers per virtual stage); needs PP > 1, layers divisible by PP x this and "
        "micro-batches by PP (default: 1)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default=None,
        help="activation recompute; auto (the default for --plan auto) lets the stage DP "
        "choose per stage, none is the default for the other plans",
    )
    p.add_argument(
        "--dtype",
        dest="sim_dtype",
        choices=("bf16", "fp16", "fp32"),
        help="training dtype (default: the device's 16-bit dtype)",
    )
    p.add_argument(
        "--time-limit", type=float, default=20.0, help="per-ILP time limit for --plan auto (s)"
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adafactor", "sgd", "sgd-momentum"),  # models.OPTIMIZERS (tested)
        default="adamw",
        help="optimizer of the traced step, --plan auto only (default: adamw; Alpa's GPT-MoE "
        "benchmark trains with adafactor: factored second moments, no momentum; its "
        "Wide-ResNet benchmark with sgd-momentum: Nesterov momentum 0.9)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="also build the plan with the intra-op runtime, compile it with abstract shapes "
        "on --gpus fake CPU devices (at most 512) and report compiled vs predicted peak memory "
        "and collective bytes (single-mesh plans: dp, zero2, zero3, megatron:TPx1xDP, auto "
        "with one stage)",
    )
    p.add_argument(
        "--program",
        choices=("megatron-lm", "megatron-lm-flash", "traced"),  # sim.simulate.PROGRAMS
        default="megatron-lm",
        help="what a Megatron grid is timed on: Megatron-LM's fused kernels (default; the "
        "program of published measurements), the same with flash attention "
        "(megatron-lm-flash: today's Megatron-LM, on presets with an attention table: "
        "dgx-a100, dgx-h100) or the traced JAX step with the search's stage costs, the "
        "program --plan auto is timed on",
    )
    p.add_argument(
        "--offload",
        metavar="PLACEMENT",
        help="--plan auto: keep training state in host memory: auto (each stage chooses "
        "none or a placement with its logical mesh and recompute, the fastest that fits), "
        "none, or classes joined by commas, every stage the same: optimizer, master, "
        "gradients (docs/offload.md)",
    )
    p.add_argument(
        "--grad-reduce",
        choices=("microbatch", "step", "auto"),  # inter.stages.GRAD_REDUCE_CHOICES
        default="microbatch",
        help="on the traced step (--plan auto, or --program traced): where a stage with "
        "several data-parallel replicas reduces its gradients: every micro-batch (default: "
        "the pipeline runtime's default), once per step (replicas of a plan over the model "
        "axis, as Megatron-LM does), or auto (each stage chooses) (docs/weak_scaling.md)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_simulate)
