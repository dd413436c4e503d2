"""Readable tables for the command line (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autoshard.api import ModelSummary
from autoshard.ir.units import format_bytes


def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}{unit}"
    return f"{n:.3g}{unit}"


def print_summary(
    s: ModelSummary,
    console: Console | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
) -> None:
    console = console or Console()
    console.print(f"[bold]{s.model}[/bold]: {s.params:,} parameters ({human(s.params)})")
    shape = f"global batch {batch}" + (f", sequence {seq_len}" if seq_len else "")
    console.print(
        f"FLOPs per step ({shape}; forward + backward): matmul {human(s.matmul_flops_per_step, ' FLOP')}, "
        f"all ops {human(s.flops_per_step, ' FLOP')}; optimizer update "
        f"{human(s.update_flops_per_step, ' FLOP')}"
    )
    if s.unknown_flops:
        console.print(f"[yellow]no FLOP rule (counted as 0): {', '.join(s.unknown_flops)}[/yellow]")
    table = Table(title=f"{s.num_eqns} equations by primitive")
    table.add_column("primitive")
    table.add_column("count", justify="right")
    for prim, count in s.eqns_by_primitive.items():
        table.add_row(prim, str(count))
    console.print(table)
    table = Table(title="FLOP per layer")
    for col in ("layer", "forward", "backward", "update"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    for layer in s.layers:
        f = s.layer_flops[layer]
        table.add_row(layer, human(f["forward"]), human(f["backward"]), human(f["update"]))
    console.print(table)


def _short_path(path: str) -> str:
    import re

    keys = re.findall(r"\['([^']+)'\]", path)
    return "/".join(keys) if keys else path


def print_plan(plan, graph, console: Console | None = None, cluster: str | None = None) -> None:
    """The plan in scaling-book notation: every parameter / data input and its spec
    (identical blocks folded), then the predicted collectives and memory."""
    import re

    console = console or Console()
    solver = plan.solver or {}
    unit = f"s on {cluster}" if cluster else "(Alpa's relative cost units; --cluster for seconds)"
    console.print(
        f"[bold]plan {plan.name}[/bold] on mesh {plan.mesh} — objective {plan.objective:.6g} "
        f"{unit}; "
        f"solver {solver.get('solver', '?')} {solver.get('status', '')} in "
        f"{float(solver.get('seconds', 0.0)):.2f} s, {solver.get('num_variables', '?')} variables"
        + (
            f" (the per-value program: {solver['exact_stopped']})"
            if solver.get("exact_stopped")
            else ""
        )
    )
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    table = Table(title="inputs (identical blocks folded as block_*)")
    table.add_column("input")
    table.add_column("kind")
    table.add_column("spec")
    seen = set()
    for tid, spec in zip(graph.inputs, plan.input_specs):
        t = graph.tensors[tid]
        if t.kind == "opt_state":
            continue
        name = re.sub(r"block_\d+", "block_*", _short_path(t.path))
        text = spec.format(t.shape, t.dtype)
        if (name, text) in seen:
            continue
        seen.add((name, text))
        table.add_row(name, t.kind, text)
    console.print(table)
    states = [
        (graph.tensors[t], s)
        for t, s in zip(graph.inputs, plan.input_specs)
        if graph.tensors[t].kind == "opt_state" and graph.tensors[t].shape
    ]
    if states:
        sharded = sum(1 for _, s in states if not s.is_replicated)
        console.print(f"optimizer state: {sharded} of {len(states)} arrays sharded")
    print_collectives(plan.collective_totals(), "predicted collectives (per device)", console)
    console.print(f"predicted peak memory per device: {format_bytes(plan.predicted_peak_bytes)}")


def print_collectives(totals, title: str, console: Console) -> None:
    table = Table(title=title)
    table.add_column("kind")
    table.add_column("mesh axes")
    table.add_column("bytes", justify="right")
    for (kind, axes), nbytes in sorted(totals.items()):
        table.add_row(kind, ",".join(axes), f"{nbytes:,}")
    console.print(table)


def print_verification(report, console: Console | None = None) -> None:
    console = console or Console()
    where = f" ({report.target}: {report.devices})" if report.target != "cpu" else ""
    table = Table(title=f"predicted vs compiled: plan {report.plan} on {report.mesh}{where}")
    for col in (
        "collective",
        "mesh axes",
        "pred #",
        "pred bytes",
        "compiled #",
        "compiled bytes",
        "agree",
    ):
        table.add_column(col, justify="right" if "#" in col or "bytes" in col else "left")
    for r in report.comparison.rows:
        table.add_row(
            r.kind,
            ",".join(r.axes),
            str(r.predicted_count),
            f"{r.predicted_bytes:,}",
            str(r.compiled_count),
            f"{r.compiled_bytes:,}",
            "[green]yes[/green]" if r.agree else "[red]NO[/red]",
        )
    console.print(table)
    for note in getattr(report, "prediction_notes", ()):  # XLA:GPU's rewrites, predicted
        console.print(f"predicted for XLA:GPU: {note}", markup=False, highlight=False)
    mem_ok = "[green]yes[/green]" if report.memory_agree else "[red]NO[/red]"
    console.print(
        f"peak memory per device: predicted {format_bytes(report.predicted_peak_bytes)}, compiled "
        f"{format_bytes(report.compiled_peak_bytes)} (error {report.memory_error:.1%}, "
        f"tolerance {report.memory_rtol:.0%}) agree: {mem_ok}"
    )
    if not report.memory_agree:
        mark = (
            "[yellow]explained[/yellow]"
            if report.memory_explained_by_heap_gap
            else "[red]not explained[/red]"
        )
        console.print(f"memory disagreement {mark}: {report.memory_explanation}")
    verdict = "[green]AGREE[/green]" if report.agree else "[red]DISAGREE[/red]"
    console.print(
        f"collectives agree: {report.collectives_agree}; overall: {verdict} "
        f"(compile {report.compile_seconds:.1f} s)"
    )
