"""Measure what XLA:GPU achieves on ``C = A @ B`` over a grid of shapes; write a GEMM table.

Two sub-commands:

``measure`` (on the GPU; jax only, no planner imports) times ``C[M, N] = A[M, K] @ B[K, N]``
under ``jax.jit`` for every dtype and every (M, N, K) of a power-of-two grid and writes the
raw results (per-shape median, min, max, the samples, compile time, the GEMM kernels XLA
picked) as JSON. Dtypes: ``bf16`` and ``fp16`` (16-bit operands and result), ``tf32`` (an
f32 dot at ``Precision.DEFAULT``) and ``fp32`` (an f32 dot at ``Precision.HIGHEST``). An
accuracy probe per dtype (relative Frobenius error against a float64 product of the same
inputs) records what arithmetic each setting really gets.

How one shape is timed. One jitted program holds ``copies`` dots, each on operands of
its own (distinct input arrays: XLA merges dots of equal operands, even across
optimization barriers); every dot is its own GEMM kernel, issued back to back as XLA
issues the kernels of a training step. A *burst* dispatches the program ``calls`` times
without waiting and blocks once at the end; the per-dot time of a burst is its wall time
over ``calls x copies`` dots. So host dispatch overlaps the GPU's work and the per-dot
time is the kernel plus its launch gap, as in a step. ``copies`` (at most 64, and at most
1 GiB of operands) and ``calls`` are chosen so that a call lasts about 1 ms and a burst
about 10 ms; the reported time is the median of ``bursts`` (5) bursts after a warm-up
call. Inputs are random normal (never zeros), uploaded from a host pool (no per-shape
compile for them); with many copies the operands of small shapes do not all sit in L2.

The grid is walked coarse first (every other size, all dtypes), then fine (every size,
dtypes in priority order), so that a deadline still leaves a full grid per dtype. The raw
file is rewritten every few shapes; ``--resume`` skips shapes a raw file already has.

``table`` (anywhere) turns one or more raw files into a GEMM table in the format of
:mod:`autoshard.hardware.gemm` (per dtype the finest complete grid the raw files hold;
achieved TFLOP/s = 2 M N K / median per-dot seconds), with the data-sheet dense peaks.

    python benchmarks/measure_gemm_table.py measure --out raw.json [--sizes 64 16384]
        [--dtypes bf16 fp32 fp16 tf32] [--deadline-s 400] [--resume raw.json] [--quick]
    python benchmarks/measure_gemm_table.py table raw.json [raw2.json ...] \\
        --out autoshard/hardware/gemm_tables/h100.json --command "the measure command" \\
        [--raw-out benchmarks/results/gemm_h100_raw.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# data-sheet dense peaks (TFLOP/s) of the parts we know, keyed by a piece of device_kind
DATASHEET_PEAKS = {
    "H100 80GB HBM3": ("H100-SXM5-80GB", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    "H200": ("H200-SXM-141GB", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    "A100-SXM4-80GB": ("A100-SXM4-80GB", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
}  # fmt: skip
DTYPE_ORDER = ("bf16", "fp32", "fp16", "tf32")  # priority of the fine pass
ITEMSIZE = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}
BURST_S = 10e-3  # target wall time of one burst
CALL_S = 1e-3  # target device time of one call (sets copies)
MAX_COPIES = 64
MAX_CALLS = 32
MAX_OPERAND_BYTES = 2**30  # of all copies' operands together


def _jax_dtype(name: str):
    import jax
    import jax.numpy as jnp

    precision = {"tf32": jax.lax.Precision.DEFAULT, "fp32": jax.lax.Precision.HIGHEST}
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(name, jnp.float32)
    return dtype, precision.get(name, jax.lax.Precision.DEFAULT)


def _guess_seconds(m: int, n: int, k: int, dtype: str) -> float:
    """A rough a-priori time, only to size copies and calls (not a prediction)."""
    rate = {"bf16": 600e12, "fp16": 600e12, "tf32": 300e12, "fp32": 45e12}[dtype]
    nbytes = ITEMSIZE[dtype] * (m * k + k * n + m * n)
    return max(2.0 * m * n * k / rate, nbytes / 2.5e12) + 4e-6


def plan_shape(m: int, n: int, k: int, dtype: str) -> dict:
    """Dots per program (each on its own operands) and calls per burst of one shape."""
    guess = _guess_seconds(m, n, k, dtype)
    in_bytes = ITEMSIZE[dtype] * (m * k + k * n)
    copies = min(MAX_COPIES, math.ceil(CALL_S / guess), MAX_OPERAND_BYTES // in_bytes)
    copies = int(max(1, copies))
    calls = int(min(MAX_CALLS, max(1, math.ceil(BURST_S / (copies * guess)))))
    return {"copies": copies, "calls": calls, "guess_s": guess}


class HostPool:
    """Random normal numbers on the host, one array per dtype; operands are views of it."""

    def __init__(self, elements: int, seed: int = 0) -> None:
        import numpy as np

        self.elements = elements
        self._f32 = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
        self._cache = {}

    def array(self, dtype_name: str, shape: tuple[int, int], salt: int):
        import numpy as np

        if dtype_name not in self._cache:
            dtype, _ = _jax_dtype(dtype_name)
            self._cache[dtype_name] = self._f32.astype(np.dtype(dtype))
        pool = self._cache[dtype_name]
        size = shape[0] * shape[1]
        span = self.elements - size
        start = (salt * 1_000_003) % span if span > 0 else 0
        return pool[start : start + size].reshape(shape)


def _gemm_program(copies: int, precision):
    import jax

    def program(*operands):  # a0, b0, a1, b1, ...: every dot has operands of its own
        return [
            jax.lax.dot(operands[2 * i], operands[2 * i + 1], precision=precision)
            for i in range(copies)
        ]

    return program


def _kernels(hlo_text: str) -> list[str]:
    """Custom-call targets and fusion kinds in compiled HLO: which GEMM path XLA chose."""
    found = set()
    for line in hlo_text.splitlines():
        if "custom_call_target=" in line:
            found.add(line.split('custom_call_target="', 1)[1].split('"', 1)[0])
        if "kind=kCustom" in line or "__triton" in line:
            found.add("triton-fusion" if "triton" in line else "custom-fusion")
    return sorted(found)


def time_shape(m: int, n: int, k: int, dtype_name: str, pool: HostPool, bursts: int) -> dict:
    import jax
    import numpy as np

    _, precision = _jax_dtype(dtype_name)
    sizing = plan_shape(m, n, k, dtype_name)
    copies, calls = sizing["copies"], sizing["calls"]
    device = jax.devices()[0]
    operands = []
    for s in range(copies):
        operands.append(jax.device_put(pool.array(dtype_name, (m, k), 2 * s), device))
        operands.append(jax.device_put(pool.array(dtype_name, (k, n), 2 * s + 1), device))
    jax.block_until_ready(operands)
    t0 = time.perf_counter()
    compiled = jax.jit(_gemm_program(copies, precision)).lower(*operands).compile()
    compile_s = time.perf_counter() - t0
    kernels = _kernels(compiled.as_text())
    jax.block_until_ready(compiled(*operands))  # warm-up
    samples = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(calls):
            outs = compiled(*operands)
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / (calls * copies))
        result_dtype = str(outs[0].dtype)
        del outs
    median = float(np.median(samples))
    return {
        "dtype": dtype_name,
        "m": m,
        "n": n,
        "k": k,
        "median_s": median,
        "min_s": float(min(samples)),
        "max_s": float(max(samples)),
        "samples_s": [float(s) for s in samples],
        "tflops": 2.0 * m * n * k / median / 1e12,
        "copies": copies,
        "calls_per_burst": calls,
        "compile_s": compile_s,
        "kernels": kernels,
        "result_dtype": result_dtype,
    }


def accuracy_probe(dtype_name: str, size: int, pool: HostPool) -> dict:
    """Relative Frobenius error of one product against float64 on the same (rounded) inputs,
    and the HLO lines of its dot: what arithmetic the dtype setting really gets."""
    import jax
    import numpy as np

    _, precision = _jax_dtype(dtype_name)
    a_host = pool.array(dtype_name, (size, size), 11)
    b_host = pool.array(dtype_name, (size, size), 12)
    fn = jax.jit(lambda a, b: jax.lax.dot(a, b, precision=precision))
    compiled = fn.lower(a_host, b_host).compile()
    out = np.asarray(compiled(jax.device_put(a_host), jax.device_put(b_host)), dtype=np.float64)
    ref = a_host.astype(np.float64) @ b_host.astype(np.float64)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    lines = [ln.strip()[:400] for ln in compiled.as_text().splitlines() if "custom-call" in ln]
    return {"size": size, "relative_error": err, "kernels": _kernels(compiled.as_text()),
            "hlo_custom_calls": lines[:4]}  # fmt: skip


def environment() -> dict:
    import jax

    dev = jax.devices()[0]
    env = {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "core_count": getattr(dev, "core_count", None),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import jax.extend
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
        env["platform_version"] = jax.extend.backend.get_backend().platform_version
    except Exception as err:  # noqa: BLE001 - best effort; record why
        env["platform_version_error"] = repr(err)
    try:
        query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        env["nvidia_smi"] = repr(err)
    return env


def _grid_order(sizes: list[int], dtypes: list[str]) -> list[tuple[str, int, int, int]]:
    """Coarse grid of the first dtype, its fine grid, the others' coarse grids, their fine
    grids: a deadline leaves every dtype measured a full grid, the first the finest."""
    coarse = sizes[::2] if len(sizes) > 2 else sizes
    if sizes[-1] not in coarse:
        coarse = [*coarse[:-1], sizes[-1]] if len(coarse) > 1 else coarse
    passes = [(dtypes[0], coarse), (dtypes[0], sizes)]
    passes += [(d, coarse) for d in dtypes[1:]] + [(d, sizes) for d in dtypes[1:]]
    order = []
    for dtype, grid in passes:
        order += [(dtype, m, n, k) for m in grid for n in grid for k in grid]
    seen, out = set(), []
    for item in order:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def prewarm(shapes: list[tuple[int, int, int]], dtype_name: str) -> float:
    """Compile one module holding a dot of every shape (abstract operands, nothing runs):
    XLA autotunes all of them at once, compiling candidate kernels in parallel, and keeps
    the choices in its in-process cache, so each shape's own program compiles without
    autotuning again. Returns the seconds it took."""
    import jax

    dtype, precision = _jax_dtype(dtype_name)
    specs = []
    for m, n, k in shapes:
        specs += [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)]

    def module(*ops):
        return [
            jax.lax.dot(ops[2 * i], ops[2 * i + 1], precision=precision) for i in range(len(shapes))
        ]

    t0 = time.perf_counter()
    jax.jit(module).lower(*specs).compile()
    return time.perf_counter() - t0


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def cmd_measure(args) -> int:
    import jax

    if args.quick:
        args.sizes = [16, 64]
        args.bursts = 2
    lo, hi = args.sizes
    sizes = [2**i for i in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
    dtypes = [d for d in DTYPE_ORDER if d in args.dtypes]
    out = Path(args.out)
    raw = {"environment": environment(), "command": " ".join(sys.argv), "rows": [],
           "accuracy": {}, "settings": {"sizes": sizes, "dtypes": dtypes, "bursts": args.bursts,
           "burst_s": BURST_S, "call_s": CALL_S, "max_copies": MAX_COPIES,
           "max_operand_bytes": MAX_OPERAND_BYTES}}  # fmt: skip
    if args.resume and Path(args.resume).exists():
        old = json.loads(Path(args.resume).read_text())
        raw["rows"] = old.get("rows", [])
        raw["accuracy"] = old.get("accuracy", {})
        raw["resumed_from"] = old.get("environment", {})
        print(f"resumed {len(raw['rows'])} rows from {args.resume}", flush=True)
    print(json.dumps(raw["environment"], indent=1), flush=True)
    if jax.default_backend() != "gpu" and not args.quick:
        print("warning: no GPU; this measures the CPU", flush=True)
    t_start = time.monotonic()
    pool = HostPool(sizes[-1] ** 2 + 2**20)
    print(f"host pool ready in {time.monotonic() - t_start:.1f} s", flush=True)
    probe = min(1024, sizes[-1])
    for dtype in dtypes:
        if dtype not in raw["accuracy"]:
            raw["accuracy"][dtype] = accuracy_probe(dtype, probe, pool)
            print(f"accuracy {dtype}: {raw['accuracy'][dtype]}", flush=True)
    done = {(r["dtype"], r["m"], r["n"], r["k"]) for r in raw["rows"]}
    todo = [item for item in _grid_order(sizes, dtypes) if item not in done]
    raw.setdefault("prewarm", [])
    warmed: set = set()
    timed = 0
    for index, (dtype, m, n, k) in enumerate(todo):
        if time.monotonic() - t_start > args.deadline_s:
            print(f"deadline reached: {len(todo) - timed} shapes left", flush=True)
            break
        if args.prewarm and (dtype, m, n, k) not in warmed:
            group = []
            for item in todo[index:]:
                if item[0] != dtype or len(group) == args.prewarm:
                    break
                group.append(item)
            warmed.update(group)
            try:
                seconds = prewarm([item[1:] for item in group], dtype)
                raw["prewarm"].append({"dtype": dtype, "shapes": len(group), "seconds": seconds})
            except Exception as err:  # noqa: BLE001 - the shapes then autotune one by one
                raw["prewarm"].append({"dtype": dtype, "shapes": len(group), "error": repr(err)})
        row = time_shape(m, n, k, dtype, pool, args.bursts)
        raw["rows"].append(row)
        timed += 1
        if timed % 25 == 0 or timed == len(todo):
            _write(out, raw)
            recent = raw["rows"][-25:]
            print(
                f"{timed}/{len(todo)} shapes, {time.monotonic() - t_start:.0f} s; last "
                f"{dtype} {m}x{n}x{k}: {row['tflops']:.1f} TFLOP/s; mean compile "
                f"{sum(r['compile_s'] for r in recent) / len(recent):.3f} s",
                flush=True,
            )
    raw["environment_end"] = environment()
    raw["elapsed_s"] = time.monotonic() - t_start
    _write(out, raw)
    print(f"wrote {out}: {len(raw['rows'])} rows in {raw['elapsed_s']:.0f} s", flush=True)
    return 0


# ----------------------------------------------------------------------------- table


def complete_grid(rows: list[dict]) -> list[int]:
    """The finest size list S such that every (M, N, K) in S^3 has a row: all sizes, else
    every other one (keeping both ends), and so on."""
    have = {(r["m"], r["n"], r["k"]) for r in rows}
    sizes = sorted({r["m"] for r in rows} | {r["n"] for r in rows} | {r["k"] for r in rows})
    step = 1
    while step < len(sizes):
        cand = sizes[::step]
        if all((m, n, k) in have for m in cand for n in cand for k in cand):
            return cand
        step *= 2
    return []


def merge_raw(raws: list[dict]) -> dict:
    """One raw record of several measure runs (each resumed from the one before): every
    run's environment and command, and each shape once, tagged with the run that timed it."""
    runs, rows = [], {}
    for i, raw in enumerate(raws):
        keep = ("environment", "environment_end", "command", "elapsed_s", "prewarm", "settings")
        runs.append({k: raw[k] for k in keep if k in raw})
        for r in raw["rows"]:
            rows.setdefault((r["dtype"], r["m"], r["n"], r["k"]), {**r, "run": i})
    accuracy = next((raw["accuracy"] for raw in raws if raw.get("accuracy")), {})
    return {"runs": runs, "accuracy": accuracy, "rows": list(rows.values())}


def build_table(merged: dict, command: str) -> dict:
    """The GEMM table of a merged raw record (:func:`merge_raw`)."""
    envs = [run["environment"] for run in merged["runs"]]
    env = envs[0]
    kind = env["device_kind"]
    if any(e["device_kind"] != kind or e.get("jax") != env.get("jax") for e in envs):
        raise ValueError("the raw files come from different devices or jax versions")
    match = next((v for key, v in DATASHEET_PEAKS.items() if key in kind), None)
    if match is None:
        raise ValueError(f"no data-sheet peaks known for device {kind!r}")
    device, peaks = match
    by_dtype: dict[str, dict] = {}
    for r in merged["rows"]:
        by_dtype.setdefault(r["dtype"], {})[(r["m"], r["n"], r["k"])] = r
    rows, grids = {}, {}
    for dtype in DTYPE_ORDER:
        measured = list(by_dtype.get(dtype, {}).values())
        grid = complete_grid(measured) if measured else []
        if len(grid) < 2:
            continue
        pick = by_dtype[dtype]
        rows[dtype] = [
            [m, n, k, float(f"{pick[(m, n, k)]['tflops']:.5g}")]
            for m in grid
            for n in grid
            for k in grid
        ]
        grids[dtype] = grid
    grid_text = "; ".join(
        f"{d} {g[0]}..{g[-1]} ({len(g)} sizes per dim, {len(g) ** 3} shapes)"
        for d, g in grids.items()
    )
    left_out = [d for d in DTYPE_ORDER if d not in rows]
    accuracy = merged.get("accuracy", {})
    probe = next((a["size"] for a in accuracy.values()), "?")
    acc_text = ", ".join(
        f"{d} {accuracy[d]['relative_error']:.1e}" for d in DTYPE_ORDER if d in accuracy
    )
    dates = sorted({e["date"][:10] for e in envs})
    source = (
        f"Measured, not modelled: C = A @ B under jax.jit on one {kind} "
        f"({env.get('core_count')} SMs), jax {env.get('jax')} / jaxlib {env.get('jaxlib')} "
        f"({env.get('platform_version', 'unknown platform')}), {', '.join(dates)}, "
        f"{len(envs)} run(s); XLA:GPU's own GEMM choice (Triton or cuBLASLt, autotuned); "
        f"per shape the median of 5 bursts of back-to-back calls, each call "
        f"{MAX_COPIES} or fewer dots, each on random inputs of its own, so each dot's time "
        f"includes its launch as XLA issues it. bf16/fp16: 16-bit operands and result; "
        f"fp32: f32 dot at Precision.HIGHEST (true fp32; relative error vs float64 at "
        f"{probe}^3: {acc_text}; tf32 is an f32 dot at Precision.DEFAULT, JAX's default)"
        f". Grid: {grid_text}"
        + (f"; not measured: {', '.join(left_out)}" if left_out else "")
        + f". Peaks: data-sheet dense. Command: {command}; raw results in "
        f"benchmarks/results/gemm_h100_raw.json; table written by "
        f"benchmarks/measure_gemm_table.py table."
    )
    return {
        "device": device,
        "dtypes": sorted(rows),
        "peak_tflops": {d: peaks[d] for d in rows},
        "source": source,
        "rows": rows,
    }


def write_table(table: dict, path: Path) -> None:
    """One row per line, like benchmarks/make_gemm_tables.py; the file must load."""
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = [json.dumps(head)[:-1] + ', "rows": {']
    items = list(table["rows"].items())
    for i, (dtype, rows) in enumerate(items):
        body = ",\n".join("  " + json.dumps(r) for r in rows)
        lines.append(f"{json.dumps(dtype)}: [\n{body}\n]" + ("," if i < len(items) - 1 else ""))
    lines.append("}}")
    path.write_text("\n".join(lines) + "\n")
    from autoshard.hardware.gemm import GemmTable

    GemmTable.load(path)  # the file must parse and form a valid table


def cmd_table(args) -> int:
    merged = merge_raw([json.loads(Path(p).read_text()) for p in args.raw])
    if args.raw_out:
        Path(args.raw_out).write_text(json.dumps(merged, indent=0) + "\n")
        print(f"wrote {args.raw_out}: {len(merged['rows'])} shapes")
    table = build_table(merged, args.command)
    write_table(table, Path(args.out))
    for dtype, rows in table["rows"].items():
        best = max(r[3] for r in rows)
        print(f"{dtype}: {len(rows)} rows, best {best:.1f} TFLOP/s")
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the grid on this machine's first device")
    m.add_argument("--out", required=True)
    m.add_argument("--sizes", nargs=2, type=int, default=[64, 16384], metavar=("LO", "HI"))
    m.add_argument("--dtypes", nargs="+", default=list(DTYPE_ORDER), choices=DTYPE_ORDER)
    m.add_argument("--bursts", type=int, default=5)
    m.add_argument("--deadline-s", type=float, default=math.inf)
    m.add_argument("--resume", default=None, help="a raw file whose shapes are skipped")
    m.add_argument("--quick", action="store_true", help="sizes 16..64, 2 bursts (a CPU check)")
    m.add_argument(
        "--prewarm", type=int, default=48, help="shapes autotuned together (0: one by one)"
    )
    m.set_defaults(func=cmd_measure)
    t = sub.add_parser("table", help="raw files -> GEMM table")
    t.add_argument("raw", nargs="+")
    t.add_argument("--out", required=True)
    t.add_argument("--command", required=True, help="the measure command, for the source")
    t.add_argument("--raw-out", help="write the merged raw record here")
    t.set_defaults(func=cmd_table)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
