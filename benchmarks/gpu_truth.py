"""Predicted vs compiled on XLA:GPU: plans made on CPU, compiled ahead of time on one lent GPU.

Two halves, so the GPU machine (jax with CUDA, no PuLP or HiGHS) never solves:

1. ``--make-plans`` (here, with the solver): plan every row of :data:`ROWS` with
   ``plan_workload(..., cluster="dgx-h100")`` and save the plan files (with their program
   fingerprints) and ``manifest.json`` under ``--plans`` (default
   ``benchmarks/results/gpu_truth_plans``).  Run it with the GPU's JAX minor version
   (jax >= 0.11 traces the same program; 0.10 does not): a plan whose fingerprint does
   not match the GPU's trace is reported, not compiled.
2. The run (on the GPU): bind every plan file to its re-traced program, compile it with
   abstract shapes for ``--target`` (default ``gpu-aot``: XLA:GPU on compile-only GPUs
   described by ``jax.experimental.topologies``, as many as the plan's mesh), compare
   predicted and compiled collectives and peak memory (``verify_plan``), and write one
   JSON (``--out``) after every row, so a run cut short keeps what it did.  XLA's
   stderr during each compile is kept per row (its "Involuntary full rematerialization"
   warnings are counted), and the compiled HLO of every row goes into one
   ``--hlo-tar`` (gzip'd texts) for reading offline.  ``--budget-s`` skips rows that
   would not finish in time.

``--dry-run`` is the same run on this process's fake CPU devices (``--target cpu``):
the pipeline tested without a GPU (tests/test_gpu_truth.py runs it on gpt-tiny)::

    python benchmarks/gpu_truth.py --make-plans                  # CPU, jax >= 0.11
    python benchmarks/gpu_truth.py --out $OUT/gpu_truth.json     # GPU (gpu_truth.sh)
    python benchmarks/gpu_truth.py --dry-run --out /tmp/t.json   # CPU, fake devices

``--reread RUN_JSON HLO...`` reads a GPU run's stored HLO again (its ``--hlo-tar``, or
``NAME.hlo.txt.gz`` files) and compares it with the plans by this tree's verifier, with
XLA:GPU's all-reduce rewrites predicted (:mod:`autoshard.verify.xla_gpu`): no compile, no
GPU (``benchmarks/results/gpu_truth_h100_2026-11-27_reread.json``; docs/truth.md). A row
whose plan file no longer binds to the program this tree traces is written with its
``not_bound`` reason and left out.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import re
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PLANS_DIR = ROOT / "benchmarks" / "results" / "gpu_truth_plans"
CLUSTER = "dgx-h100"


class Row(NamedTuple):
    model: str
    layers: int
    plan: str  # "auto" or a baseline
    mesh: str  # "2x4", "8", "8x8"
    batch: int | None = None  # the preset's batch size where None

    @property
    def name(self) -> str:
        tail = f"-B{self.batch}" if self.batch is not None else ""
        return f"{self.model}-L{self.layers}-{self.plan}-{self.mesh}{tail}"

    @property
    def overrides(self) -> dict:
        return {"num_layers": self.layers, "batch_size": self.batch}


# gpt-tiny first (seconds to compile; its HLO is small enough to commit as the first XLA:GPU
# fixtures), then gpt-1.3b at full depth (24 layers, batch 8, seq 1024, f32, AdamW) on 8
# GPUs, the 64-GPU row last (the budget skips it first)
ROWS = (
    (Row("gpt-tiny", 2, "auto", "2x4"), Row("gpt-tiny", 2, "zero3", "2x4"))
    + tuple(
        Row("gpt-1.3b", 24, plan, mesh)
        for mesh in ("2x4", "8")
        for plan in ("auto", "zero2", "zero3", "megatron")
    )
    + (Row("gpt-1.3b", 24, "auto", "8x8"),)
)

# Issue 36's GPU suite: GPT (1.3b, 6.7b, 39b at full depth), GPT-MoE and Wide-ResNet, auto
# and the baselines, on 8 / 16 / 64 GPUs and one 512-GPU row, most informative first (a
# run's --budget-s skips the tail): the GPT auto plans and each new GPU count first.
_SCALE = (  # (row, estimated H100 seconds: see below)
    (Row("gpt-1.3b", 24, "auto", "2x4"), 46),  # the one row that differed on the first H100 run
    (Row("gpt-6.7b", 32, "auto", "2x8"), 53),  # 16 GPUs
    (Row("gpt-39b", 48, "auto", "8x8"), 78),  # 64 GPUs
    (Row("gpt-39b", 48, "auto", "64x8", batch=64), 91),  # 512 GPUs
    (Row("gpt-6.7b", 32, "megatron", "2x8"), 47),
    (Row("gpt-6.7b", 32, "zero3", "2x8", batch=16), 53),  # batch 8 does not split over 16
    (Row("gpt-39b", 48, "megatron", "8x8"), 67),
    # GPT-MoE and Wide-ResNet after GPT: their first auto plans differed on XLA:CPU; remade
    # 2026-11-27 with the reshard fixes, their collectives agree there (docs/truth.md)
    (Row("moe-1.3b", 16, "expert-zero2", "2x4"), 29),
    (Row("moe-1.3b", 16, "auto", "2x4"), 34),
    (Row("wresnet-1b", 50, "auto", "2x4", batch=128), 27),
    (Row("wresnet-1b", 50, "zero3", "2x4", batch=128), 24),
    (Row("moe-1.3b", 16, "zero3", "2x4"), 29),
    (Row("gpt-6.7b", 32, "zero2", "2x8", batch=16), 47),
    (Row("gpt-6.7b", 32, "dp", "2x8", batch=16), 47),
    (Row("gpt-6.7b", 32, "heuristic", "2x8"), 47),
    (Row("gpt-39b", 48, "zero3", "8x8"), 67),
    (Row("gpt-39b", 48, "zero2", "8x8"), 67),
    (Row("moe-1.3b", 16, "megatron", "2x4"), 29),
    (Row("moe-1.3b", 16, "zero2", "2x4"), 29),
    (Row("wresnet-1b", 50, "dp", "2x4", batch=128), 24),
    (Row("wresnet-1b", 50, "zero2", "2x4", batch=128), 24),
    (Row("wresnet-1b", 50, "heuristic", "2x4", batch=128), 24),
)
SCALE_ROWS = tuple(row for row, _ in _SCALE)

# Estimated H100 seconds per scale row: XLA:GPU's AOT compile grows with the program's size,
# 7 s + 2.7 ms per traced equation (fit to the H100 run: gpt-tiny L2, 1,122 equations, 10 s;
# gpt-1.3b L24, 11,132 equations, 31-42 s), +20% for the 512-GPU partition (a guess), plus
# the trace on the first row of each program (4.4 s for gpt-1.3b L24 on the H100 host, the
# others scaled by their trace time here). Equations (jax 0.11.2): GPT L24 11,132, L32 14,772,
# L48 22,052; moe-1.3b 8,292; wresnet-1b 6,116. Wide-ResNet's convolutions may autotune
# longer than this says.
ESTIMATED_S = {r.name: 10 if r.model == "gpt-tiny" else 40 for r in ROWS}
ESTIMATED_S.update({row.name: seconds for row, seconds in _SCALE})

SUITES = {"h100-8": ROWS, "scale": SCALE_ROWS}
SUITE_PLANS = {"h100-8": PLANS_DIR, "scale": PLANS_DIR.with_name("gpu_truth_plans_scale")}


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- planning (CPU)


def make_plans(rows, plans_dir: Path, time_limit: float) -> dict:
    """Plan every row and save its plan file; a refusal is recorded with its reason."""
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions

    plans_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = plans_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    entries = {e["name"]: e for e in manifest.get("rows", [])}
    for row in rows:
        _log(f"planning {row.name} on {CLUSTER} ...")
        t0 = time.perf_counter()
        made = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        entry = {"name": row.name, **row._asdict(), "cluster": CLUSTER, "made": made}
        try:
            bound = plan_workload(
                row.model,
                row.mesh,
                baseline=None if row.plan == "auto" else row.plan,
                options=IntraOptions(solver="highs", time_limit_s=time_limit),
                cluster=CLUSTER,
                **{k: v for k, v in row.overrides.items() if v is not None},
            )
        except ValueError as err:  # a baseline refused, an infeasible budget: say why
            entry.update(refused=str(err), plan_seconds=time.perf_counter() - t0)
            _log(f"  refused: {str(err)[:200]}")
        else:
            path = plans_dir / f"{row.name}.json.gz"
            bound.save(path)
            entry.update(
                file=path.name,
                plan_seconds=time.perf_counter() - t0,
                predicted_peak_bytes=bound.plan.predicted_peak_bytes,
                solver_status=bound.plan.solver.get("status"),
            )
            _log(f"  saved {path.name} in {entry['plan_seconds']:.0f} s")
        entries[row.name] = entry
        manifest = _write_manifest(manifest_path, entries)  # after each row: a cut keeps it
    return manifest


def _write_manifest(path: Path, entries: dict) -> dict:
    import jax

    order = {r.name: i for i, r in enumerate(r for rows in SUITES.values() for r in rows)}
    manifest = {
        "made_with": {"jax": jax.__version__, "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/gpu_truth.py --make-plans [--suite NAME | --rows NAME...]",
        "rows": sorted(entries.values(), key=lambda e: order.get(e["name"], len(order))),
    }
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ----------------------------------------------------------------------------- compiling (GPU)


@contextlib.contextmanager
def captured_stderr(sink: io.StringIO):
    """XLA's C++ log lines (fd 2) into ``sink`` as well as to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sink.write(text)
            sys.stderr.write(text)


def _xla_warnings(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if "Involuntary full rematerialization" in ln]
    return {
        "involuntary_full_rematerializations": len(lines),
        "examples": [ln.strip()[:400] for ln in lines[:3]],
    }


_TRACED: dict = {}  # (model, optimizer, overrides) -> TracedWorkload: one trace per program


def bind(pf, mesh):
    """``bind_plan`` with the trace shared by the rows of one program (a 24-layer GPT takes
    seconds to trace); PlanFileError (a ValueError) where the program is not the planned one."""
    from autoshard.api import BoundPlan, trace_workload
    from autoshard.ir.planfile import check_fingerprint, require_one_mesh
    from autoshard.ir.spec import Mesh

    require_one_mesh(pf)
    key = (pf.model, pf.optimizer or "adamw", json.dumps(pf.overrides, sort_keys=True))
    if key not in _TRACED:
        _TRACED[key] = trace_workload(pf.model, pf.optimizer or "adamw", **pf.overrides)
    traced = _TRACED[key]
    logical = Mesh(tuple(mesh.axis_names), tuple(int(s) for s in mesh.devices.shape))
    check_fingerprint(pf, traced.graph, logical)
    return BoundPlan(pf.plan, traced.program, traced.graph, mesh)


def verify_row(entry: dict, plans_dir: Path, target: str, live_peak: str) -> dict:
    """Bind one plan file and compile it for ``target``; the row's JSON."""
    import jax

    from autoshard.ir.planfile import load_plan
    from autoshard.runtime.sharded import make_mesh
    from autoshard.runtime.targets import target_devices

    out = {k: entry[k] for k in ("name", "model", "layers", "plan", "mesh")}
    if "refused" in entry:
        return {**out, "status": "refused when planned", "reason": entry["refused"]}
    pf = load_plan(plans_dir / entry["file"])
    t0 = time.perf_counter()
    devices = target_devices(target, pf.plan.mesh.num_devices)
    try:
        bound = bind(pf, make_mesh(pf.plan.mesh, devices))
    except ValueError as err:  # the traced program is not the one planned (jax version)
        return {**out, "status": "not compiled", "reason": f"plan file does not bind: {err}"}
    trace_s = time.perf_counter() - t0
    log = io.StringIO()
    with captured_stderr(log):
        report = bound.verify(devices, target=target, live_peak=live_peak, keep_hlo=True)
    rows = [r.to_json() for r in report.comparison.rows]
    return {
        **out,
        "status": "compiled",
        "target": report.target,
        "devices": report.devices,
        "jax": jax.__version__,
        "collectives": rows,
        "collectives_agree": report.collectives_agree,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "compiled_peak_bytes": report.compiled_peak_bytes,
        "memory_error_signed": (report.predicted_peak_bytes - report.compiled_peak_bytes)
        / max(report.compiled_peak_bytes, 1.0),
        "memory_agree": report.memory_agree,
        "verification": {**report.to_json(), "notes": _condensed(report.compiled_notes)},
        "xla_warnings": _xla_warnings(log.getvalue()),
        "trace_seconds": trace_s,
        "compile_seconds": report.compile_seconds,
        "_hlo": report.hlo_text,
    }


def _condensed(notes) -> dict[str, int]:
    """The verifier's distinct notes, without the "operand k of n of a combined ..." part
    that makes one note per operand: note -> how many distinct notes it stood for."""
    out: dict[str, int] = {}
    for note in notes:
        parts = [p for p in note.split("; ") if not _COMBINED.match(p)]
        key = "; ".join(parts) or "an operand of a combined collective"
        out[key] = out.get(key, 0) + 1
    return out


_COMBINED = re.compile(
    r"operand \d+ of \d+ of a combined |part \d+ of \d+ of an all-reduce combined by concat"
)


def _summary(row: dict) -> str:
    if row["status"] != "compiled":
        return f"{row['name']}: {row['status']}: {row.get('reason', '')[:200]}"

    def size(b: float) -> str:
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"

    bad = [f"{r['kind']}@{','.join(r['axes'])}" for r in row["collectives"] if not r["agree"]]
    return (
        f"{row['name']}: peak {size(row['predicted_peak_bytes'])} predicted, "
        f"{size(row['compiled_peak_bytes'])} compiled ({row['memory_error_signed']:+.1%}); "
        f"collectives {'agree' if row['collectives_agree'] else 'differ: ' + ' '.join(bad)}; "
        f"{row['xla_warnings']['involuntary_full_rematerializations']} involuntary remats; "
        f"compile {row['compile_seconds']:.0f} s"
    )


def run(args) -> dict:
    import jax

    manifest = json.loads((args.plans / "manifest.json").read_text())
    entries = [e for e in manifest["rows"] if not args.rows or e["name"] in args.rows]
    doc = {
        "command": "python benchmarks/gpu_truth.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "target": args.target,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "local_devices": [d.device_kind for d in jax.local_devices()],
        "plans_made_with": manifest.get("made_with"),
        "rows": [],
    }
    hlo = {}
    start, slowest = time.perf_counter(), 0.0
    for entry in entries:
        elapsed = time.perf_counter() - start
        # a row is skipped where its estimate (or the slowest row so far) would overrun the
        # budget; a cheaper row after it may still run
        need = 0.0 if "refused" in entry else ESTIMATED_S.get(entry["name"], slowest)
        if args.budget_s and elapsed + need > args.budget_s:
            row = {k: entry[k] for k in ("name", "model", "layers", "plan", "mesh")}
            row.update(
                status="skipped", reason=f"time budget: {elapsed:.0f} s of {args.budget_s} s used"
            )
        else:
            _log(f"{entry['name']}: compiling for {args.target} ...")
            t0 = time.perf_counter()
            try:
                row = verify_row(entry, args.plans, args.target, args.live_peak)
            except Exception as err:  # one failing row must not lose the others
                row = {k: entry[k] for k in ("name", "model", "layers", "plan", "mesh")}
                row.update(status="failed", reason=f"{type(err).__name__}: {str(err)[:2000]}")
            slowest = max(slowest, time.perf_counter() - t0)
        if "_hlo" in row:
            hlo[row["name"]] = row.pop("_hlo")
        doc["rows"].append(row)
        _log(_summary(row))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        if args.hlo_tar and hlo:
            write_hlo_tar(args.hlo_tar, hlo)
    return doc


# metadata={op_type="..." op_name="..." source_file="..." ...}: most of a module's text,
# none of what the verifier reads
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def write_hlo_tar(path: Path, texts: dict[str, str]) -> None:
    """Every row's compiled HLO (less its metadata), one ``NAME.hlo.txt`` each, in one
    gzip'd tar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in texts.items():
            data = _METADATA.sub("", text).encode()
            info = tarfile.TarInfo(f"{name}.hlo.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _remade_since(entry: dict, run_date: str | None) -> str:
    """Why a row's plan file is not the one a run compiled ("" where it may be): the
    manifest says it was made after the run started (``made`` and a run's ``date`` both
    begin ``YYYY-MM-DD HH:MM``; a run's may go on: "06:58-07:05 UTC", "... and ...")."""
    made = entry.get("made")
    if not made or not run_date or made[:16] <= run_date[:16]:  # no date: not known
        return ""
    return (
        f"its plan file was re-made ({made}) after this run ({run_date}); the plan it "
        "compiled is in git's history (git log -- benchmarks/results/gpu_truth_plans_scale)"
    )


def reread(before_path: Path, sources, plans_dir: Path, out_path: Path) -> dict:
    """The collectives of a GPU run's stored HLO (its ``--hlo-tar``, or ``NAME.hlo.txt.gz``
    files) compared again with its
    plans, by this tree's verifier and with XLA:GPU's rewrites of the predictions
    (:mod:`autoshard.verify.xla_gpu`): no compile, no GPU. Each row keeps the GPU run's
    figures (``before``: its comparison; memory) beside the new comparison."""
    import jax

    from autoshard.ir.planfile import PlanFileError, check_fingerprint, load_plan
    from autoshard.verify.collectives import analyze_collectives
    from autoshard.verify.compare import compare_collectives
    from autoshard.verify.xla_gpu import xla_gpu_collectives

    before = json.loads(before_path.read_text())
    rows_before = {r["name"]: r for r in before["rows"]}
    manifest = {e["name"]: e for e in json.loads((plans_dir / "manifest.json").read_text())["rows"]}
    doc = {
        "command": "python benchmarks/gpu_truth.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "what": f"the HLO of {before_path.name} ({before.get('date')}, "
        f"{before.get('local_devices')}) read again and compared with its plans, with "
        "XLA:GPU's all-reduce rewrites applied to the predictions; no compile",
        "jax": jax.__version__,
        "rows": [],
    }
    texts = {}
    for path in sources:
        if path.name.endswith(".hlo.txt.gz"):  # one module (the committed fixtures)
            texts[path.name.removesuffix(".hlo.txt.gz")] = gzip.open(path, "rt").read()
            continue
        with tarfile.open(path) as tar:  # a run's --hlo-tar
            for m in tar.getmembers():  # ("./" and its entry in a tar made by tar -C)
                if m.isfile():
                    name = Path(m.name).name.removesuffix(".hlo.txt")
                    texts[name] = tar.extractfile(m).read().decode()
    for name in [n for n in texts if n not in rows_before]:  # another run's, or a slice
        _log(f"{name}: not a row of {before_path.name}, left out")
        del texts[name]
    texts = {n: texts[n] for n in sorted(texts, key=lambda n: list(rows_before).index(n))}
    for name, text in texts.items():
        _log(f"{name}: reading its HLO again ...")
        remade = _remade_since(manifest[name], before.get("date"))
        if remade:  # the plan file is not the one this run compiled
            _log(f"  not read again: {remade}")
            doc["rows"].append({"name": name, "not_this_plan": remade})
            continue
        pf = load_plan(plans_dir / manifest[name]["file"])
        key = (pf.model, pf.optimizer or "adamw", json.dumps(pf.overrides, sort_keys=True))
        if key not in _TRACED:
            from autoshard.api import trace_workload

            _TRACED[key] = trace_workload(pf.model, pf.optimizer or "adamw", **pf.overrides)
        graph = _TRACED[key].graph
        try:
            check_fingerprint(pf, graph, pf.plan.mesh)
        except PlanFileError as err:  # the program changed since: no prediction to redo
            _log(f"  not read again: {err}")
            doc["rows"].append({"name": name, "not_bound": str(err)})
            continue
        parsed = analyze_collectives(text, pf.plan.mesh, range(pf.plan.mesh.num_devices))
        compiled = list(parsed.compared())  # collective-permutes included
        gpu = xla_gpu_collectives(graph, pf.plan)
        cmp = compare_collectives(gpu.collectives, compiled)
        plain = compare_collectives(pf.plan.predicted_collectives, compiled)
        old = rows_before.get(name, {})
        row = {
            "name": name,
            "collectives": [r.to_json() for r in cmp.rows],
            "collectives_agree": cmp.agree,
            "collectives_agree_without_gpu_rewrites": plain.agree,
            "prediction_notes": list(gpu.notes),
            "before": {
                "collectives": old.get("collectives"),
                "collectives_agree": old.get("collectives_agree"),
            },
            "memory_error_signed": old.get("memory_error_signed"),
            "memory_agree": old.get("memory_agree"),
            "memory": reread_memory(graph, pf, manifest[name], text, old),
            "xla_warnings": old.get("xla_warnings"),
        }
        doc["rows"].append(row)
        bad = [f"{r['kind']}@{','.join(r['axes'])}" for r in row["collectives"] if not r["agree"]]
        _log(f"  collectives {'agree' if cmp.agree else 'differ: ' + ' '.join(bad)}")
        mem = row["memory"]
        if mem.get("error_signed") is not None:
            _log(
                f"  peak: predicted {mem['predicted_peak_bytes'] / 2**30:.2f} GiB now "
                f"({mem['predicted_peak_bytes_when_planned'] / 2**30:.2f} when planned), "
                f"compiled {mem['compiled_peak_bytes'] / 2**30:.2f} GiB "
                f"({mem['error_signed']:+.1%}, was {mem['error_signed_when_planned']:+.1%})"
            )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def reread_memory(graph, pf, entry: dict, text: str, old: dict) -> dict:
    """A row's peak memory read again: the plan's prediction by this tree's memory model
    (the cluster's GPU layout) beside the one made when planned, against the GPU run's
    compiled peak; and the live peak of the stored HLO's schedule
    (:func:`~autoshard.verify.hlo_liveness.hlo_live_peak`) with the optimizer updates XLA:GPU
    holds there (:func:`~autoshard.verify.hlo_liveness.held_updates`)."""
    from autoshard.hardware.mesh import preset_mesh
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.verify.hlo_liveness import held_updates, hlo_live_peak

    mesh = preset_mesh(entry.get("cluster", CLUSTER), pf.plan.mesh.shape, pf.plan.mesh.axis_names)
    out: dict = {"predicted_peak_bytes_when_planned": pf.plan.predicted_peak_bytes}
    if pf.plan.offload:  # host-offloaded plans add staging the prediction alone lacks
        out["note"] = "offloaded plan: not predicted again"
    else:
        spec_of = pf.plan.specs_by_tensor(graph.inputs)
        out["predicted_peak_bytes"] = predicted_peak_bytes(
            graph, spec_of, mesh, pf.plan.operand_specs
        )
    compiled = old.get("compiled_peak_bytes")
    out["compiled_peak_bytes"] = compiled
    if compiled and "predicted_peak_bytes" in out:
        out["error_signed"] = (out["predicted_peak_bytes"] - compiled) / compiled
        out["error_signed_when_planned"] = (pf.plan.predicted_peak_bytes - compiled) / compiled
        out["agree"] = abs(out["error_signed"]) <= 0.10
    peak = hlo_live_peak(text)
    held = [h for h in held_updates(text) if h.gathered_at <= peak.position <= h.added_at]
    out["hlo_live_peak"] = {
        "bytes": peak.bytes,
        "temp_bytes": peak.temp_bytes,
        "position": peak.position,
        "instruction": peak.instruction,
        "held_updates": len(held),
        "held_update_bytes": sum(h.bytes for h in held),
    }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-plans", action="store_true", help="plan the rows (needs the solver)")
    p.add_argument(
        "--suite",
        choices=tuple(SUITES),
        default="h100-8",
        help="which rows: h100-8 (gpt-tiny and gpt-1.3b on 8 GPUs, the first H100 run) or "
        "scale (GPT 1.3b/6.7b/39b, GPT-MoE, Wide-ResNet on 8 to 512 GPUs); default h100-8",
    )
    p.add_argument(
        "--plans", type=Path, default=None, help="the plan files' folder (default: the suite's)"
    )
    p.add_argument("--rows", nargs="*", default=[], help="only these rows (names)")
    p.add_argument("--time-limit", type=float, default=120.0, help="ILP time limit (s)")
    p.add_argument("--target", default="gpu-aot", help="gpu-aot (default), gpu-aot:SxHxD, cpu")
    p.add_argument("--dry-run", action="store_true", help="--target cpu on fake CPU devices")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_truth.json")
    p.add_argument("--hlo-tar", type=Path, default=None, help="write the compiled HLO here")
    p.add_argument(
        "--live-peak",
        choices=("never", "on_disagreement", "always"),
        default="never",
        help="also compile with an XLA dump to read XLA's live peak (default never: time)",
    )
    p.add_argument(
        "--list", action="store_true", help="print the suite's rows, estimates and plan status"
    )
    p.add_argument("--budget-s", type=float, default=0.0, help="skip rows past this (0: none)")
    p.add_argument(
        "--reread",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="RUN_JSON HLO...: compare a GPU run's stored HLO (its --hlo-tar, or "
        "NAME.hlo.txt.gz files) with its plans again, no compile; writes --out",
    )
    args = p.parse_args(argv)
    if args.plans is None:
        args.plans = SUITE_PLANS[args.suite]
    if args.reread:
        if len(args.reread) < 2:
            p.error("--reread takes the run's JSON, then its HLO (a tar or .hlo.txt.gz files)")
        reread(args.reread[0], args.reread[1:], args.plans, args.out)
        return 0
    if args.list:
        list_suite(args.suite, args.plans)
        return 0
    if args.make_plans:
        rows = [r for r in SUITES[args.suite] if not args.rows or r.name in args.rows]
        make_plans(rows, args.plans, args.time_limit)
        return 0
    if not (args.plans / "manifest.json").exists():
        print(
            f"gpu_truth: error: no manifest.json under {args.plans}; make the plans first "
            f"(python benchmarks/gpu_truth.py --make-plans --suite {args.suite}, with the "
            "GPU's JAX and the solver) or name the folder that holds them (--plans)",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        args.target = "cpu"
        import jax

        manifest = json.loads((args.plans / "manifest.json").read_text())
        need = max(
            _num_devices(args.plans / e["file"])
            for e in manifest["rows"]
            if "file" in e and (not args.rows or e["name"] in args.rows)
        )
        with contextlib.suppress(RuntimeError):  # a test's conftest may have set them
            jax.config.update("jax_num_cpu_devices", need)
    else:  # refuse a target this process cannot compile for, before any row
        from autoshard.runtime.targets import target_devices

        manifest = json.loads((args.plans / "manifest.json").read_text())
        first = next((e for e in manifest["rows"] if "file" in e), None)
        try:
            if first is not None:
                target_devices(args.target, _num_devices(args.plans / first["file"]))
        except ValueError as err:
            print(f"gpu_truth: error: {err}", file=sys.stderr)
            return 2
    doc = run(args)
    compiled = [r for r in doc["rows"] if r["status"] == "compiled"]
    _log(f"{len(compiled)} of {len(doc['rows'])} rows compiled; wrote {args.out}")
    return 0 if compiled else 1


def list_suite(suite: str, plans_dir: Path) -> None:
    """The suite's rows in run order: estimated H100 seconds, their running total, and
    whether the plan is made (its file), refused when planned, or not made yet."""
    path = plans_dir / "manifest.json"
    made = {e["name"]: e for e in json.loads(path.read_text())["rows"]} if path.exists() else {}
    total = 0.0
    print(f"{'row':44} {'GPUs':>5} {'est. s':>7} {'total':>6}  plan")
    for row in SUITES[suite]:
        entry = made.get(row.name)
        if entry is None:
            status, est = "not made (--make-plans)", ESTIMATED_S.get(row.name, 0)
        elif "refused" in entry:
            status, est = "refused: " + entry["refused"][:60], 0
        else:
            status, est = entry["file"], ESTIMATED_S.get(row.name, 0)
        total += est
        gpus = 1
        for s in row.mesh.split("x"):
            gpus *= int(s)
        print(f"{row.name:44} {gpus:5d} {est:7.0f} {total:6.0f}  {status}")


def _num_devices(path: Path) -> int:
    from autoshard.ir.planfile import load_plan

    return load_plan(path).plan.mesh.num_devices


if __name__ == "__main__":
    sys.exit(main())
