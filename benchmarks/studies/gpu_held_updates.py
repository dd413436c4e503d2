"""What XLA:GPU holds at its peak: the live peak of each GPU run's stored HLO, read from the
scheduled text alone (autoshard/verify/hlo_liveness.py), beside XLA's own allocation and the
plan's predicted peak, with the optimizer updates XLA:GPU gathers early and adds into their
parameters late (``held_update_gathers``, autoshard/intra/memory/reshard_copies.py).

    python benchmarks/studies/gpu_held_updates.py \\
        benchmarks/results/gpu_truth_scale_h100_2026-11-27.json \\
        benchmarks/results/gpu_truth_scale_hlo_h100_2026-11-27.tar.gz \\
        --out benchmarks/results/gpu_held_updates_2026-11-27.json

``--cpu LAYERS`` instead plans gpt-39b with LAYERS layers on 8x8 for dgx-h100 (the GPU's
memory layout; needs the solver) and compiles it on 64 fake CPU devices (jax >= 0.11, the
plan files' JAX), to see whether XLA:CPU holds the gathered updates too: its compiled peak
against the plan's prediction in XLA:CPU's layout, and each gathered update's distance to
its add in XLA:CPU's schedule (``--out`` gets the figures)::

    python benchmarks/studies/gpu_held_updates.py --cpu 4 \\
        --out benchmarks/results/gpu_held_updates_xla_cpu_2026-11-27.json

``--slice ROW PATH`` also writes the gathered updates of one row's module (each
``all-gather-start``/``-done`` and the add that reads it, in the schedule's order, the
instructions they read replaced by parameters, ``backend_config`` dropped) as a small
gzip'd HLO module: the test fixture ``tests/fixtures/xla_gpu/h100_2026-11-27/
gpt-39b-L48-auto-8x8.held-updates.hlo.txt.gz``.  Jax-free but for ``--cpu``; a few seconds a row.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoshard.verify.hlo_liveness import (  # noqa: E402
    entry_instructions,
    held_updates,
    hlo_live_peak,
)

GB = 1e9


def _texts(path: Path) -> dict[str, str]:
    with tarfile.open(path) as tar:
        return {
            Path(m.name).name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if m.isfile()
        }


def row_figures(name: str, text: str, run_row: dict) -> dict:
    peak = hlo_live_peak(text)
    held = held_updates(text)
    live_held = [h for h in held if h.gathered_at <= peak.position <= h.added_at]
    memory = (run_row.get("verification") or {}).get("compiled_memory") or {}
    temp = memory.get("temp_bytes")
    args = memory.get("argument_bytes")
    kinds: dict[str, list[int]] = {}
    held_names = {h.gathered for h in live_held}
    for b in peak.live:
        if b.parameter:
            continue
        kind = b.opcode if b.made_by[0] not in held_names else "held update (all-gather)"
        kinds.setdefault(kind, []).append(b.bytes)
    return {
        "name": name,
        "schedule_length": len(entry_instructions(text)),
        "live_peak_position": peak.position,
        "live_peak_instruction": peak.instruction,
        "live_peak_temp_bytes": peak.temp_bytes,
        "xla_temp_bytes": temp,
        "live_peak_vs_xla_temp": None if not temp else peak.temp_bytes / temp - 1,
        "parameter_bytes": peak.parameter_bytes,
        "xla_argument_bytes": args,
        "held_updates": len(held),
        "held_update_bytes": sum(h.bytes for h in held),
        "held_updates_live_at_peak": len(live_held),
        "held_update_bytes_live_at_peak": sum(h.bytes for h in live_held),
        "median_gather_to_add_instructions": (
            sorted(h.added_at - h.gathered_at for h in held)[len(held) // 2] if held else None
        ),
        "live_at_peak_by_opcode": {
            k: {"buffers": len(v), "bytes": sum(v)}
            for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
        },
        "predicted_peak_bytes": run_row.get("predicted_peak_bytes"),
        "compiled_peak_bytes": run_row.get("compiled_peak_bytes"),
    }


def _drop_backend_config(line: str) -> str:
    at = line.find(", backend_config={")
    if at < 0:
        return line
    i, depth = at + len(", backend_config="), 0
    while True:
        if line[i] == "{":
            depth += 1
        elif line[i] == "}":
            depth -= 1
            if not depth:
                return line[:at] + line[i + 1 :]
        i += 1


def held_slice(text: str) -> str:
    """A module of the held updates alone (module docstring's ``--slice``)."""
    instrs = entry_instructions(text)
    held = held_updates(text)
    keep: set[str] = set()
    for h in held:
        done = next(i for i in instrs if i.name == h.gathered)
        keep |= {h.gathered, h.add, *done.operands}
    lines = {}
    start = text.index("\nENTRY")
    for line in text[start:].splitlines()[1:]:
        if line.startswith("}"):
            break
        name = line.split(" = ", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
        if name in keep:
            lines[name] = _drop_backend_config(line.replace("ROOT ", ""))
    params, body, n = {}, [], 0
    for ins in instrs:
        if ins.name not in keep:
            continue
        for o in ins.operands:
            if o not in keep and o not in params:
                src = next(i for i in instrs if i.name == o)
                params[o] = (n, src.leaves[0][2])
                n += 1
        body.append(lines[ins.name])
    adds = [h.add for h in held]
    alias_of = {}
    for h in held:  # the add's output lives in the parameter it reads
        add = next(i for i in instrs if i.name == h.add)
        p = next(o for o in add.operands if o in params)
        alias_of[len(alias_of)] = params[p][0]
    shapes = ", ".join(next(i for i in instrs if i.name == a).leaves[0][2] for a in adds)
    alias = ", ".join(f"{{{k}}}: ({v}, {{}}, may-alias)" for k, v in alias_of.items())
    out = [
        f"HloModule held_updates, is_scheduled=true, input_output_alias={{ {alias} }}",
        "",
        f"ENTRY %main ({', '.join(f'{o}: {s}' for o, (_, s) in params.items())}) -> ({shapes}) {{",
    ]
    out += [f"  %{o} = {s} parameter({k})" for o, (k, s) in params.items()]
    out += body
    out.append(f"  ROOT %tuple.held = ({shapes}) tuple({', '.join('%' + a for a in adds)})")
    out.append("}")
    return "\n".join(out) + "\n"


def cpu_check(layers: int) -> dict:
    """gpt-39b at ``layers`` layers, planned for dgx-h100 on 8x8 and compiled on 64 fake CPU
    devices (module docstring's ``--cpu``)."""
    import dataclasses

    import jax

    jax.config.update("jax_num_cpu_devices", 64)
    from autoshard.api import plan_workload, xla_cpu_memory_layout
    from autoshard.intra.memory.model import predicted_peak_bytes
    from autoshard.intra.problem.options import IntraOptions

    t0 = time.perf_counter()
    bound = plan_workload(
        "gpt-39b", "8x8", options=IntraOptions(solver="highs"), cluster="dgx-h100",
        num_layers=layers,
    )  # fmt: skip
    planned_s = time.perf_counter() - t0
    print(f"planned in {planned_s:.0f} s; compiling on 64 CPU devices ...", file=sys.stderr)
    t0 = time.perf_counter()
    report = bound.verify(jax.devices()[:64], target="cpu", live_peak="never", keep_hlo=True)
    compile_s = time.perf_counter() - t0
    graph, plan = bound.graph, bound.plan
    spec_of = plan.specs_by_tensor(graph.inputs)
    cpu_layout = xla_cpu_memory_layout()
    from autoshard.hardware.mesh import preset_mesh

    mesh = preset_mesh("dgx-h100", (8, 8), ("data", "model"))
    cpu_pred = predicted_peak_bytes(
        graph, spec_of, dataclasses.replace(mesh, memory_layout=cpu_layout), plan.operand_specs
    )
    off = dataclasses.replace(
        mesh, memory_layout=dataclasses.replace(mesh.memory_layout, held_update_gathers=False)
    )
    text = report.hlo_text
    held = held_updates(text)
    peak = hlo_live_peak(text)
    memory = report.to_json().get("compiled_memory") or {}
    return {
        "model": "gpt-39b",
        "layers": layers,
        "mesh": "8x8",
        "jax": jax.__version__,
        "plan_seconds": planned_s,
        "compile_seconds": compile_s,
        "predicted_peak_bytes_gpu_layout": plan.predicted_peak_bytes,
        "predicted_peak_bytes_gpu_layout_without_held_updates": predicted_peak_bytes(
            graph, spec_of, off, plan.operand_specs
        ),
        "predicted_peak_bytes_cpu_layout": cpu_pred,
        "xla_cpu_compiled_peak_bytes": report.compiled_peak_bytes,
        "xla_cpu_memory": memory,
        "collectives_agree": report.collectives_agree,
        "hlo_live_peak_temp_bytes": peak.temp_bytes,
        "gathered_updates": len(held),
        "gathered_update_bytes": sum(h.bytes for h in held),
        "median_gather_to_add_instructions": (
            sorted(h.added_at - h.gathered_at for h in held)[len(held) // 2] if held else None
        ),
        "gathered_updates_live_at_peak": sum(
            h.gathered_at <= peak.position <= h.added_at for h in held
        ),
        "schedule_length": len(entry_instructions(text)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, nargs="?", help="a gpu_truth run's JSON")
    p.add_argument("hlo", type=Path, nargs="?", help="its --hlo-tar")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--slice", nargs=2, metavar=("ROW", "PATH"))
    p.add_argument("--cpu", type=int, metavar="LAYERS", help="the XLA:CPU check instead")
    args = p.parse_args(argv)
    if args.cpu is not None:
        doc = {
            "command": "python benchmarks/studies/gpu_held_updates.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **cpu_check(args.cpu),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc, indent=1))
        return 0
    if args.run is None or args.hlo is None:
        p.error("give a gpu_truth run's JSON and its --hlo-tar (or --cpu LAYERS)")
    run = json.loads(args.run.read_text())
    rows = {r["name"]: r for r in run["rows"]}
    texts = _texts(args.hlo)
    doc = {
        "command": "python benchmarks/studies/gpu_held_updates.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "what": f"the live peak of {args.hlo.name}'s modules read from their scheduled "
        "text (autoshard/verify/hlo_liveness.py) and the updates XLA:GPU holds there",
        "rows": [],
    }
    for name, text in texts.items():
        print(f"{name}: reading its schedule ...", file=sys.stderr, flush=True)
        r = row_figures(name, text, rows.get(name, {}))
        doc["rows"].append(r)
        temp = r["xla_temp_bytes"]
        print(
            f"  live peak {r['live_peak_temp_bytes'] / GB:.2f} GB above the parameters "
            f"(XLA {temp / GB if temp else float('nan'):.2f} GB) at {r['live_peak_position']}"
            f"/{r['schedule_length']}; {r['held_updates_live_at_peak']} held updates live "
            f"there, {r['held_update_bytes_live_at_peak'] / GB:.2f} GB",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.slice:
        name, path = args.slice
        data = held_slice(texts[name]).encode()
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(data)
        print(f"wrote {path} ({len(data)} B of HLO text)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
