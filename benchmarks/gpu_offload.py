"""Issue 34's GPU check: a plan that keeps training state in host memory, run on one GPU.

``plans`` (here, with the solver): writes the plan files the GPU runs, each with what
autoshard predicts for it (the planner's step time = objective + the offload's exposed
transfer; the simulator's step time and peak for the same configuration):

* gpt-6.7b, 32 layers, batch 8, bf16, AdamW on one dgx-h100 GPU with ``--offload auto``:
  107 GB of f32 weights and optimizer state do not fit in 80 GB; the planner's choice runs;
* gpt-1.3b, 24 layers, batch 8, the same plan with and without ``offload=optimizer``: the
  losses must be equal (the transfers change no arithmetic).

``measure`` (on the GPU; no solver needed): each plan in its own process (an out-of-memory
error ends that row only): the state made where the plan keeps it
(``init_placed``), the step compiled (``memory_analysis``, device and host bytes), run
``--steps`` times (median after the first), the allocator's peak, the memory kinds of
the state that comes back, and the host link's measured bandwidth (a 2 GiB pinned_host
array to the device and back). Then predicted vs measured, written as JSON.

    python benchmarks/gpu_offload.py plans --dir benchmarks/results/gpu_offload_plans
    run(command="bash benchmarks/gpu_offload.sh", timeout_s=...)   # measure, on the GPU
    python benchmarks/gpu_offload.py measure --dir DIR --out out.json [--steps 4] [--quick]
        [--xla-option xla_name=value ...] [--hlo-dir DIR] [--stream-window W ...]

``--xla-option``: compile each step with these XLA options (e.g. the latency-hiding
scheduler's flags: whether XLA:GPU then overlaps the copies of the state in
``pinned_host``); ``--hlo-dir``: the compiled step's HLO, gzipped (where XLA put those
copies; on GPU the step's ``jax.device_put`` calls lower to ``annotate_device_placement``
custom calls, on CPU to nothing), with counts of copy-start/-done in the row;
``--stream-window W`` (repeat): each offloaded row once per window (``1``: the runtime's
default, the state streamed a parameter at a time; ``none``: every fetch where the step
starts, the form of 2026-11-27, which held the whole state on the H100).
    python benchmarks/gpu_offload.py plans --quick --dir /tmp/offq   # gpt-tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (file stem, model, overrides, offload)
# a stem ending in "-fallback" runs only when the row before it failed (out of memory, say)
ROWS = (
    ("gpt-6.7b-auto", "gpt-6.7b", dict(batch_size=8), "auto"),
    ("gpt-6.7b-auto-b4-fallback", "gpt-6.7b", dict(batch_size=4), "auto"),
    ("gpt-1.3b-optimizer", "gpt-1.3b", dict(batch_size=8), "optimizer"),
    ("gpt-1.3b-none", "gpt-1.3b", dict(batch_size=8), "none"),
)
QUICK_ROWS = (
    ("gpt-tiny-optimizer", "gpt-tiny", dict(batch_size=8, num_layers=2), "optimizer"),
    ("gpt-tiny-none", "gpt-tiny", dict(batch_size=8, num_layers=2), "none"),
)
COMMON = dict(dtype="bfloat16", attention="fused")
CLUSTER = "dgx-h100"


def make_plans(directory: Path, quick: bool) -> None:
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.sim.simulate import simulate

    directory.mkdir(parents=True, exist_ok=True)
    for stem, model, over, offload in QUICK_ROWS if quick else ROWS:
        t0 = time.perf_counter()
        print(f"[plans] {stem}: planning ...", file=sys.stderr, flush=True)
        bound = plan_workload(
            model,
            "1",
            options=IntraOptions(solver="highs", time_limit_s=120.0),
            cluster=CLUSTER,
            optimizer="adamw",
            offload=offload,
            **COMMON,
            **over,
        )
        bound.save(directory / f"{stem}.json")
        record = bound.plan.offload or {}
        chosen = record.get("offload", "none")
        sims = {}
        for name, which in (("chosen", chosen), ("auto", "auto" if offload == "auto" else chosen)):
            if name == "auto" and which == chosen:
                sims[name] = sims["chosen"]
                continue
            sims[name] = simulate(
                model,
                CLUSTER,
                1,
                plan="auto",
                offload=which,
                global_batch=over["batch_size"],
                num_microbatches=1,
                recompute="none",
                attention="fused",
                **({"num_layers": over["num_layers"]} if "num_layers" in over else {}),
            )
        sim = sims["chosen"]
        predicted = {
            "stem": stem,
            "model": model,
            "overrides": over,
            "offload_asked": offload,
            "offload_chosen": record.get("offload", "none"),
            "where": dict(record.get("where") or {}),
            "host_inputs": len(record.get("host_inputs", ())),
            "planner_step_s": float(bound.plan.objective) + float(record.get("exposed_s", 0.0)),
            "planner_peak_bytes": bound.plan.predicted_peak_bytes,
            "transfer_s": record.get("transfer_s"),
            "exposed_s": record.get("exposed_s"),
            "link_bytes_per_s": record.get("link_bandwidth"),
            "sim_step_s": sim.step_time_s,
            "sim_peak_bytes": sim.peak_bytes_per_device,
            "sim_breakdown_s": dict(sim.step_breakdown),
            "sim_offload": (sim.plan or {}).get("offload", {}).get("offload"),
            "sim_auto_offload": (sims["auto"].plan or {}).get("offload", {}).get("offload"),
            "sim_auto_step_s": sims["auto"].step_time_s,
            "sim_auto_peak_bytes": sims["auto"].peak_bytes_per_device,
            "plan_s": round(time.perf_counter() - t0, 1),
            # a plan binds only to the program traced by the same jax (the GPU's: 0.11.2)
            "planned_with_jax": __import__("jax").__version__,
        }
        (directory / f"{stem}.predicted.json").write_text(
            json.dumps(predicted, indent=1, default=dict)
        )
        print(
            f"[plans] {stem}: offload {predicted['offload_chosen']}, planner "
            f"{predicted['planner_step_s'] * 1e3:.1f} ms, simulator {sim.step_time_s * 1e3:.1f} ms, "
            f"peak {predicted['planner_peak_bytes'] / 2**30:.2f} GiB ({predicted['plan_s']} s)",
            file=sys.stderr,
            flush=True,
        )


def _link_bandwidth(nbytes: int = 2 << 30) -> dict:
    """Seconds for ``nbytes`` pinned_host -> device and back (median of 3 each)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), host)
    x.block_until_ready()
    h2d, d2h = [], []
    for _ in range(3):
        t = time.perf_counter()
        y = jax.device_put(x, on_dev)
        y.block_until_ready()
        h2d.append(time.perf_counter() - t)
        t = time.perf_counter()
        z = jax.device_put(y, host)
        z.block_until_ready()
        d2h.append(time.perf_counter() - t)
        del y, z
    return {
        "bytes": nbytes,
        "h2d_bytes_per_s": nbytes / statistics.median(h2d),
        "d2h_bytes_per_s": nbytes / statistics.median(d2h),
    }


def _phase(out: dict, what: str, seconds: float) -> None:
    """A line per phase on stderr, so that a row cut short by its cap says how far it got."""
    print(f"[one] {out['plan_file']}: {what} in {seconds:.1f} s", file=sys.stderr, flush=True)


def measure_one(
    plan_file: Path,
    steps: int,
    xla_options: list[str] | None = None,
    hlo_dir: Path | None = None,
    stream_window: str | None = None,
) -> dict:
    import jax
    from gpu_single import parse_xla_options

    from autoshard.api import bind_plan
    from autoshard.ir.planfile import load_plan
    from autoshard.models import get_workload, make_optimizer
    from autoshard.runtime.init_state import init_placed
    from autoshard.runtime.offload_stream import STREAM_WINDOW
    from autoshard.runtime.sharded import build_sharded_step, run_steps
    from autoshard.verify.memory import memory_stats

    options = parse_xla_options(xla_options)
    out: dict = {"plan_file": plan_file.name, "xla_options": options}
    t = time.perf_counter()
    pf = load_plan(str(plan_file))
    bound = bind_plan(pf)
    out["bind_s"] = time.perf_counter() - t
    _phase(out, "bound (re-traced)", out["bind_s"])
    window = _window(stream_window) if stream_window is not None else STREAM_WINDOW
    step = build_sharded_step(
        bound.program, bound.plan, bound.mesh(jax.devices()[:1]), True, window
    )
    if step.stream is not None:  # the offloaded state streamed a group at a time
        out["stream"] = {"window": window, "groups": len(step.stream.groups)}
    elif step.host_inputs:
        out["stream"] = {"window": None}  # every fetch where the step starts
    workload = get_workload(pf.model, **pf.overrides)
    opt = make_optimizer(pf.optimizer or "adamw")
    t = time.perf_counter()
    args = init_placed(step, workload, opt)
    jax.block_until_ready(args)
    out["init_s"] = time.perf_counter() - t
    _phase(out, "state made where the plan keeps it", out["init_s"])
    flat = jax.tree_util.tree_leaves(args)
    out["state_bytes_host"] = sum(a.nbytes for a in flat if a.sharding.memory_kind == "pinned_host")
    out["state_bytes_device"] = sum(
        a.nbytes for a in flat if a.sharding.memory_kind != "pinned_host"
    )
    t = time.perf_counter()
    compiled = step.compile(options or None)
    out["compile_s"] = time.perf_counter() - t
    _phase(out, "compiled", out["compile_s"])
    if hlo_dir is not None:  # where XLA scheduled the host copies: the optimized HLO
        import gzip

        hlo_dir.mkdir(parents=True, exist_ok=True)
        form = f".w{stream_window}" if stream_window is not None else ""
        name = f"{plan_file.stem}{form}{'.opts' if options else ''}.hlo.txt.gz"
        text = compiled.as_text()
        (hlo_dir / name).write_bytes(gzip.compress(text.encode()))
        out["hlo"] = {
            "file": name,
            **{k: text.count(k) for k in ("copy-start", "copy-done", "S(5)", "custom-call")},
        }
    mem = memory_stats(compiled)
    out["memory_analysis"] = {
        "argument_bytes": mem.argument_bytes,
        "output_bytes": mem.output_bytes,
        "alias_bytes": mem.alias_bytes,
        "temp_bytes": mem.temp_bytes,
        "peak_bytes": mem.peak_bytes,
    }
    try:
        ma = compiled.memory_analysis()
        out["memory_analysis"]["host"] = {
            k: int(getattr(ma, k))
            for k in dir(ma)
            if k.startswith("host_") and isinstance(getattr(ma, k), int)
        }
    except Exception as e:  # noqa: BLE001 -- recorded, not fatal
        out["memory_analysis"]["host"] = repr(e)
    print(f"[one] {out['plan_file']}: running {steps} step(s) ...", file=sys.stderr, flush=True)
    seconds: list[float] = []
    placed, losses = run_steps(step, args, steps, seconds=seconds, copy=False)  # compiled above
    for i, (sec, loss) in enumerate(zip(seconds, losses, strict=True)):
        _phase(out, f"step {i + 1} (loss {loss:.4f})", sec)
    flat_out = jax.tree_util.tree_leaves(placed)
    host_in = set((bound.plan.offload or {}).get("host_inputs", ()))
    out["host_inputs_kinds"] = sorted({flat_out[i].sharding.memory_kind for i in host_in})
    out["losses"] = losses
    out["step_s"] = seconds
    out["step_median_s"] = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    stats = jax.devices()[0].memory_stats() or {}
    out["allocator"] = {
        k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_limit") if k in stats
    }
    return out


def _window(text: str) -> int | None:
    """``--stream-window``: ``none`` (every fetch where the step starts) or groups."""
    return None if text == "none" else int(text)


def _child(argv: list[str], timeout_s: float) -> dict:
    """Run this script's ``argv`` in a process of its own (its GPU memory, its failure);
    the last JSON line it prints, or the error with the end of its stderr. Its stderr
    lines that start with ``[`` (phases) are echoed here once it ends."""
    import tempfile

    with tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=timeout_s,
            )
            failure = None
        except subprocess.TimeoutExpired:
            proc, failure = None, f"timed out after {timeout_s} s"
        err.seek(0)
        text = err.read()
    for line in text.splitlines():
        if line.startswith("[one]"):
            print(line, file=sys.stderr, flush=True)
    lines = [ln for ln in (proc.stdout if proc else "").splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"error": f"{failure or f'exit {proc.returncode}'}; its last lines: {text[-2500:]}"}


def _device_info() -> dict:
    import jax

    return {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}


def measure(
    directory: Path,
    out_path: Path,
    steps: int,
    timeout_s: float,
    rows: list[str] | None = None,
    xla_options: list[str] | None = None,
    hlo_dir: Path | None = None,
    stream_windows: list[str] | None = None,
) -> None:
    # the parent never starts a backend: each child has the whole GPU
    result: dict = {
        "what": "issue 34: plans with training state in host memory (pinned_host) on one GPU",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **_child(["info"], 120),
        "link": _child(["link"], 120),
        "rows": [],
    }
    print(f"[measure] {result.get('device')}, link {result['link']}", file=sys.stderr, flush=True)
    order = {f"{stem}.predicted.json": i for i, (stem, *_) in enumerate(ROWS + QUICK_ROWS)}
    files = sorted(
        directory.glob("*.predicted.json"), key=lambda p: (order.get(p.name, 99), p.name)
    )
    for predicted_file in files:
        plan_file = predicted_file.with_name(predicted_file.name.replace(".predicted", ""))
        predicted = json.loads(predicted_file.read_text()) if predicted_file.exists() else {}
        if (
            plan_file.stem.endswith("-fallback")
            and result["rows"]
            and "losses" in result["rows"][-1]
        ):
            continue
        if rows and plan_file.stem not in rows:
            continue
        offloaded = predicted.get("host_inputs", 1) > 0
        for window in (stream_windows or [None]) if offloaded else [None]:
            row = _measure_row(
                plan_file, predicted, result.get("jax"), steps, timeout_s, xla_options,
                hlo_dir, window,
            )  # fmt: skip
            result["rows"].append(row)
            out_path.write_text(json.dumps(result, indent=1))
    pairs: dict = {}  # each plan's first row (with --stream-window: the first window's)
    for r in result["rows"]:
        if "losses" in r:
            pairs.setdefault(r["plan_file"], r)
    a, b = pairs.get("gpt-1.3b-optimizer.json"), pairs.get("gpt-1.3b-none.json")
    if a is None:
        a, b = pairs.get("gpt-tiny-optimizer.json"), pairs.get("gpt-tiny-none.json")
    if a and b:
        result["losses_equal"] = a["losses"] == b["losses"]
        result["losses_max_rel_diff"] = max(
            abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)
        )
    out_path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


def _measure_row(
    plan_file, predicted, jax_version, steps, timeout_s, xla_options, hlo_dir, window=None
) -> dict:
    """One plan file, in a child process."""
    print(f"[measure] {plan_file.name} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    made_with = predicted.get("planned_with_jax")
    if made_with and jax_version and made_with != jax_version:
        row = {
            "plan_file": plan_file.name,
            "error": f"planned with jax {made_with}, this machine has jax {jax_version}: "
            "a plan binds only to the program the same jax traces; re-make the plans with "
            f"jax {jax_version} (python benchmarks/gpu_offload.py plans --dir ...)",
        }
    else:
        argv = ["one", str(plan_file), "--steps", str(steps)]
        for o in xla_options or ():
            argv += ["--xla-option", o]
        if hlo_dir is not None:
            argv += ["--hlo-dir", str(hlo_dir)]
        if window is not None:
            argv += ["--stream-window", window]
        row = _child(argv, timeout_s)
        row.setdefault("plan_file", plan_file.name)
    row["wall_s"] = time.perf_counter() - t
    row["stream_window_asked"] = window
    row["predicted"] = predicted
    if "step_median_s" in row and predicted:
        row["vs_planner"] = row["step_median_s"] / predicted["planner_step_s"] - 1
        row["vs_simulator"] = row["step_median_s"] / predicted["sim_step_s"] - 1
    print(
        f"[measure] {plan_file.name}{f' (stream window {window})' if window else ''}: "
        + (
            f"step {row['step_median_s'] * 1e3:.1f} ms (planner "
            f"{predicted.get('planner_step_s', float('nan')) * 1e3:.1f}, simulator "
            f"{predicted.get('sim_step_s', float('nan')) * 1e3:.1f}), peak "
            f"{row['allocator'].get('peak_bytes_in_use', 0) / 2**30:.2f} GiB, losses "
            f"{row['losses']}"
            if "step_median_s" in row
            else f"FAILED: {row.get('error', '')[-600:]}"
        ),
        file=sys.stderr,
        flush=True,
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plans", help="plan the rows here (needs the solver)")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="gpt-tiny rows (CPU)")
    m = sub.add_parser("measure", help="run each plan file of --dir on this machine's device 0")
    m.add_argument("--dir", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--steps", type=int, default=4)
    m.add_argument("--timeout-s", type=float, default=300.0, help="per plan (s)")
    m.add_argument("--rows", nargs="+", help="plan file stems to run (default: all)")
    o = sub.add_parser("one", help="(internal) one plan file, JSON on stdout")
    o.add_argument("plan_file", type=Path)
    o.add_argument("--steps", type=int, default=4)
    for p_ in (m, o):
        p_.add_argument(
            "--xla-option",
            action="append",
            dest="xla_options",
            help="xla_name=value for the step's compile (repeat)",
        )
        p_.add_argument("--hlo-dir", type=Path, help="write each compiled step's HLO here (gz)")
    m.add_argument(
        "--stream-window",
        action="append",
        dest="stream_windows",
        help="offloaded rows: run each with this stream window (repeat; 'none': every "
        "fetch where the step starts, the form before streaming; default the runtime's)",
    )
    o.add_argument("--stream-window")
    sub.add_parser("link", help="(internal) the host link's bandwidth, JSON on stdout")
    sub.add_parser("info", help="(internal) jax version and device, JSON on stdout")
    args = ap.parse_args(argv)
    if args.cmd == "plans":
        make_plans(args.dir, args.quick)
    elif args.cmd == "measure":
        measure(
            args.dir, args.out, args.steps, args.timeout_s, args.rows, args.xla_options,
            args.hlo_dir, args.stream_windows,
        )  # fmt: skip
    elif args.cmd == "link":
        print(json.dumps(_link_bandwidth()))
    elif args.cmd == "info":
        print(json.dumps(_device_info()))
    else:
        row = measure_one(
            args.plan_file, args.steps, args.xla_options, args.hlo_dir, args.stream_window
        )
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.97")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
