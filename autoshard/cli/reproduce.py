"""``autoshard reproduce``: run the experiment scripts of ``experiments/`` and draw the figures.

The experiments are top-level scripts on the public API, not part of the package: this
command finds the repository's ``experiments/`` folder beside the package (a clone or an
editable install), or the folder ``--experiments DIR`` names, and says so when there is
none (a wheel install has no experiments).  It discovers the experiments by reading each
script's ``NAME``, ``TITLE`` and ``SOURCE`` (and ``FIGURE``, its number, for the order) with :mod:`ast` (nothing is imported), runs
each as ``python SCRIPT [--quick] --out DIR`` in its own process (so each sets up its own
fake devices), logs its output to ``DIR/<name>.log`` and turns its ``##progress`` lines
into a progress bar. Each script writes ``DIR/<name>.json`` and ``DIR/<name>.png``.

``--list`` names the experiments; ``--only NAME`` (repeatable) runs some; ``--plot-only``
redraws the PNGs from the JSON already in ``DIR``; ``--json`` prints one JSON document
(the list, or what ran, its status and wall time) instead of tables.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import autoshard
from autoshard.cli.args import check_writable

SOURCES = ("simulated", "compiled", "measured")


@dataclass(frozen=True)
class Experiment:
    """One experiment script: its name, title, where its numbers come from, its path."""

    name: str
    title: str
    source: str
    script: Path


def default_experiments_dir() -> Path:
    """``experiments/`` beside the installed package (the repository root)."""
    return Path(autoshard.__file__).resolve().parent.parent / "experiments"


def discover(folder: Path) -> list[Experiment]:
    """The experiments in ``folder``: every ``*.py`` that assigns ``NAME``, ``TITLE`` and
    ``SOURCE`` string constants at top level; ValueError if the folder has none."""
    if not folder.is_dir():
        raise ValueError(
            f"no experiments folder at {folder}: `autoshard reproduce` runs the scripts in a "
            "clone of the repository (pip install -e . from the clone), or pass "
            "--experiments DIR"
        )
    found = []
    for path in sorted(folder.glob("*.py")):
        consts = {}
        for node in ast.parse(path.read_text(), str(path)).body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str | int)
            ):
                consts[node.targets[0].id] = node.value.value
        if {"NAME", "TITLE", "SOURCE"} <= set(consts):
            exp = Experiment(consts["NAME"], consts["TITLE"], consts["SOURCE"], path)
            found.append((consts.get("FIGURE", 99), exp))
    if not found:
        raise ValueError(f"{folder} holds no experiment scripts (NAME, TITLE, SOURCE constants)")
    return [exp for _, exp in sorted(found, key=lambda f: (f[0], f[1].name))]


def select(experiments: list[Experiment], only: list[str] | None) -> list[Experiment]:
    if not only:
        return experiments
    names = [e.name for e in experiments]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(
            f"unknown experiment(s) {', '.join(unknown)}; `autoshard reproduce --list` names "
            f"them: {', '.join(names)}"
        )
    return [e for e in experiments if e.name in only]


def _run_one(exp: Experiment, args, out: Path, on_progress) -> dict:
    cmd = [sys.executable, str(exp.script), "--out", str(out)]
    if args.quick:
        cmd.append("--quick")
    if args.plot_only:
        cmd.append("--plot-only")
    t0 = time.perf_counter()
    log_path = out / f"{exp.name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            cwd=exp.script.parent,
        )  # fmt: skip
        for line in proc.stdout:
            log.write(line)
            if line.startswith("##progress "):
                parts = line.split(maxsplit=3)
                on_progress(
                    int(parts[1]), int(parts[2]), parts[3].strip() if len(parts) > 3 else ""
                )
        rc = proc.wait()
    return {
        "name": exp.name,
        "returncode": rc,
        "wall_seconds": time.perf_counter() - t0,
        "json": str(out / f"{exp.name}.json"),
        "png": str(out / f"{exp.name}.png"),
        "log": str(log_path),
    }


def cmd_reproduce(args) -> int:
    folder = Path(args.experiments) if args.experiments else default_experiments_dir()
    experiments = select(discover(folder), args.only)
    if args.list:
        if args.json:
            print(json.dumps([{"name": e.name, "title": e.title, "source": e.source,
                               "script": str(e.script)} for e in experiments], indent=2))  # fmt: skip
        else:
            width = max(len(e.name) for e in experiments)
            for e in experiments:
                print(f"{e.name:{width}}  [{e.source}]  {e.title}")
        return 0
    check_writable(args.out, "--out", directory=True)
    out = Path(args.out).resolve()  # the scripts run in experiments/, not here
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    if args.json:
        for e in experiments:
            results.append(_run_one(e, args, out, lambda *a: None))
    else:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns) as bar:
            for k, e in enumerate(experiments):
                head = f"[{k + 1}/{len(experiments)}] {e.name}"
                task = bar.add_task(head, total=None)

                def update(done, total, label, task=task, head=head):
                    bar.update(task, completed=done, total=total, description=f"{head}: {label}")

                r = _run_one(e, args, out, update)
                bar.update(task, completed=1, total=1, description=f"{head}: "
                           + ("done" if r["returncode"] == 0 else "FAILED"))  # fmt: skip
                results.append(r)
    total = time.perf_counter() - t0
    failed = [r for r in results if r["returncode"] != 0]
    if args.json:
        print(json.dumps({"out": str(out), "quick": args.quick, "wall_seconds": total,
                          "experiments": results}, indent=2))  # fmt: skip
    else:
        for r in results:
            status = "ok" if r["returncode"] == 0 else f"FAILED (exit {r['returncode']})"
            print(f"{r['name']}: {status} in {r['wall_seconds']:.1f} s -> {r['png']}")
        print(f"total {total:.1f} s")
        for r in failed:
            print(f"autoshard: error: {r['name']} failed; see {r['log']}", file=sys.stderr)
    return 1 if failed else 0


def register(subparsers) -> None:
    """Add ``reproduce`` to ``subparsers`` (argparse)."""
    p = subparsers.add_parser(
        "reproduce",
        help="run the experiments/ scripts: Alpa's figures and autoshard's own (PNG + JSON)",
    )
    p.add_argument("--quick", action="store_true", help="small grids (under 20 min on 2 cores)")
    p.add_argument("--only", action="append", metavar="NAME", help="run this experiment only")
    p.add_argument("--out", default="reproduce-out", help="folder for JSON, PNG and logs")
    p.add_argument("--list", action="store_true", help="name the experiments and exit")
    p.add_argument("--plot-only", action="store_true", help="redraw PNGs from the JSON in --out")
    p.add_argument("--experiments", help="the experiments folder (default: the clone's)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_reproduce)
