"""``autoshard explain PLAN.json`` and ``autoshard export PLAN.json --to TARGET``.

``explain`` reads a plan file (``plan --out``) and prints what the plan is: the mesh and
the role of each axis, a one-line summary in words, every parameter's spec grouped by
layer (identical layers folded), collectives per step by mesh axis, memory per device by
category, predicted vs compiled when the file holds a verification, and, with
``--cluster``, the simulated step time and MFU of the plan's nearest Megatron-LM
configuration on that cluster (GPT presets). ``--html OUT`` writes a self-contained page
(pictures inlined, no network); ``--pictures DIR`` writes the PNGs; ``--json`` prints one
JSON document.

``export`` prints Megatron-LM arguments, a DeepSpeed JSON config or MaxText settings
(:mod:`autoshard.report.export`), then, on stderr, where the target's nearest
configuration differs from the plan, tensor by tensor (``--json``: one document with
``config``, ``text``, ``exact`` and ``differences``).

Neither traces nor compiles: both read the file alone (``--cluster`` simulates with the
simulator, which is analytic for Megatron grids).
"""

from __future__ import annotations

import json
import re
import sys

TARGETS = ("megatron", "deepspeed", "maxtext")


def _digest(path: str):
    """A PlanDigest, or a PipelineDigest for a pipeline plan file."""
    from autoshard.ir.planfile import load_plan
    from autoshard.report.digest import digest

    pf = load_plan(path)
    if pf.kind == "pipeline":
        from autoshard.report.pipeline import pipeline_digest

        return pipeline_digest(pf)
    return digest(pf)


def _explain_pipeline(d, args) -> int:
    """``explain`` of a pipeline plan file: stages, timeline, mesh, exports."""
    from autoshard.report.html import render_page, write_page
    from autoshard.report.pictures import Pictures
    from autoshard.report.pipeline import (
        export_pipeline,
        pipeline_json,
        pipeline_pictures,
        pipeline_sections,
    )

    for flag, given in (("--cluster", args.cluster), ("--tensor", args.tensor)):
        if given:
            raise ValueError(
                f"explain {flag} reads one-mesh plans; a pipeline plan file keeps no per-tensor "
                "specs and is simulated with `autoshard simulate --plan auto`: drop it"
            )
    written = []
    if args.pictures or args.html:
        png = pipeline_pictures(d)
        if args.pictures:
            written += Pictures(png, "").save(args.pictures)
        if args.html:
            exports = {}
            for target in TARGETS:
                try:
                    exports[target] = export_pipeline(d, target)
                except ValueError as err:
                    exports[target] = str(err)
            captions = {
                "mesh": "Devices coloured by pipeline stage.",
                "timeline": "The pipeline schedule per stage: forward, backward, update; "
                "idle is the bubble.",
            }
            title = f"autoshard pipeline plan for {d.plan_file.model}"
            write_page(render_page(title, pipeline_sections(d), png, captions, exports), args.html)
            written.append(args.html)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(pipeline_json(d), indent=2))
    else:
        _print_sections(pipeline_sections(d))
    return 0


def simulated_step(d, cluster: str) -> dict:
    """The step time and MFU of the plan's nearest Megatron-LM grid on ``cluster``, with
    as many GPUs as the plan has devices (GPT presets only; ValueError otherwise)."""
    from autoshard.report.export import export
    from autoshard.sim.simulate import simulate

    model = d.plan_file.model
    if not model or not model.startswith("gpt"):
        raise ValueError(
            f"--cluster simulates GPT presets; this plan is for {model or 'your own function'}"
            " (drop --cluster)"
        )
    cfg = export(d, "megatron").config
    tp, pp = cfg["tensor-model-parallel-size"], cfg["pipeline-model-parallel-size"]
    gpus = d.mesh.num_devices
    dp = gpus // (tp * pp)
    roles = d.parallelism
    overrides = {
        k: v
        for k, v in d.plan_file.overrides.items()
        if k in ("seq_len", "vocab_size", "num_layers", "hidden")
    }
    if roles.zero_stage and tp == 1 and pp == 1:
        plan = {1: "zero2", 2: "zero2", 3: "zero3"}[roles.zero_stage]
    else:
        plan = f"megatron:{tp}x{pp}x{dp}"
    report = simulate(
        model, cluster, gpus, plan, global_batch=d.global_batch, dtype=None, **overrides
    )
    return {
        "cluster": cluster,
        "gpus": gpus,
        "plan": plan,
        "what": f"simulated as {plan}, the nearest Megatron-LM grid or ZeRO baseline to the plan",
        "step_time_s": report.step_time_s,
        "mfu": report.mfu,
        "tokens_per_s": report.tokens_per_s,
        "peak_bytes_per_device": report.peak_bytes_per_device,
    }


def _print_sections(secs) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    for s in secs:
        console.rule(f"[bold]{s.title}")
        for line in s.lines:
            console.print(line, markup=False, highlight=False)
        if s.rows:
            table = Table()
            for col in s.header:
                table.add_column(col, justify="right" if "bytes" in col else "left")
            for row in s.rows:
                table.add_row(*row)
            console.print(table)


def cmd_explain(args) -> int:
    from autoshard.cli.args import check_writable
    from autoshard.report.text import explain_json, sections

    if args.html:
        check_writable(args.html, "--html")
    if args.pictures:
        check_writable(args.pictures, "--pictures", directory=True)
    d = _digest(args.plan_path)
    if not hasattr(d, "parallelism"):
        return _explain_pipeline(d, args)
    simulated = simulated_step(d, args.cluster) if args.cluster else None
    if args.tensor is not None:
        _check_tensor(d, args.tensor)
    written = []
    if args.pictures or args.html:
        from autoshard.report.pictures import write_pictures

        pictures = write_pictures(d, tensor=args.tensor)
        if args.pictures:
            written += pictures.save(args.pictures)
        if args.html:
            from autoshard.report.html import write_html

            write_html(d, pictures, args.html, simulated)
            written.append(args.html)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(explain_json(d, simulated), indent=2))
    else:
        _print_sections(sections(d, simulated))
    return 0


def _check_tensor(d, pattern: str) -> None:
    names = [i.path for i in d.plan_file.inputs if i.shape]
    if not any(re.search(pattern, n) for n in names):
        raise ValueError(
            f"--tensor {pattern!r} matches no input of the plan; e.g. "
            + ", ".join(repr(n) for n in names[:3])
        )


def cmd_export(args) -> int:
    from autoshard.report.export import export

    d = _digest(args.plan_path)
    if hasattr(d, "parallelism"):
        out = export(d, args.to)
    else:
        from autoshard.report.pipeline import export_pipeline

        out = export_pipeline(d, args.to)
    if args.json:
        print(json.dumps(out.to_json(), indent=2))
        return 0
    print(out.text)
    for note in out.notes:
        print(f"autoshard: note: {note}", file=sys.stderr)
    if out.exact:
        print(f"autoshard: the {args.to} configuration lays out every tensor as the plan does",
              file=sys.stderr)  # fmt: skip
    else:
        print(
            f"autoshard: {len(out.differences)} tensor(s) differ from the plan in the nearest "
            f"{args.to} configuration (plan -> {args.to}):",
            file=sys.stderr,
        )
        for path, planned, exported, n in fold_differences(out.differences):
            times = f" (x{n})" if n > 1 else ""
            print(f"  {path}{times}: {planned} -> {exported}", file=sys.stderr)
    return 0


def fold_differences(differences) -> list[tuple[str, str, str, int]]:
    """Rows of identical layers (same name but for the layer number, same specs and
    shapes) folded into one ``block_*`` row with its count; a row alone keeps its name."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for diff in differences:
        key = (re.sub(r"_\d+(?=\W|$)", "_*", diff.path), diff.plan_spec, diff.export_spec)
        groups.setdefault(key, []).append(diff.path)
    return [
        (pattern if len(paths) > 1 else paths[0], planned, exported, len(paths))
        for (pattern, planned, exported), paths in groups.items()
    ]


def register(sub) -> None:
    """Add ``explain`` and ``export`` to ``sub`` (argparse sub-parsers)."""
    from autoshard.cli.args import cluster_presets

    p = sub.add_parser(
        "explain", help="what a saved plan is: roles, specs, collectives, memory, pictures"
    )
    p.add_argument("plan_path", metavar="PLAN.json", help="a plan saved by `plan --out`")
    p.add_argument("--html", metavar="OUT", help="write a self-contained HTML page to OUT")
    p.add_argument("--pictures", metavar="DIR", help="write the PNG pictures into DIR")
    p.add_argument(
        "--tensor",
        metavar="REGEX",
        help="the tensor whose blocks the sharding picture shows (default: the largest parameter)",
    )
    p.add_argument(
        "--cluster",
        help=f"also simulate the step on this cluster preset ({cluster_presets()}): "
        "step time and MFU",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("export", help="Megatron-LM / DeepSpeed / MaxText settings of a plan")
    p.add_argument("plan_path", metavar="PLAN.json", help="a plan saved by `plan --out`")
    p.add_argument("--to", choices=TARGETS, required=True, help="the framework to export to")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_export)
