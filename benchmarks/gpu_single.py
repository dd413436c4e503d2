"""One GPU, measured against predicted: autoshard's GPT training step, its time and memory.

``measure`` (on the GPU; imports jax, flax, optax and autoshard.models, nothing that needs
a solver) runs autoshard's own training step -- ``get_workload`` + ``make_train_step``,
AdamW, bf16 compute with f32 master weights, params and optimizer state donated -- for
each configuration (model, layers, batch) in its own process, and records: compile time,
``compiled.memory_analysis()``, XLA's cost analysis, the allocator's peak, and the step
time (median of ``--steps`` steps after warm-up, each ``block_until_ready``). With
``--profile`` a few more steps run under ``jax.profiler`` and the GPU kernels are summed
by kind (GEMM or not), to say where the time goes.

``predict`` (anywhere; no GPU) computes for the same configurations what autoshard
predicts on one H100 (cluster preset ``dgx-h100``, resized to 1 GPU):

* the simulator's step time and MFU, plan ``megatron:1x1x1`` with the whole batch as one
  micro-batch and no recompute, on both programs: ``megatron-lm`` (Megatron-LM's fused
  kernels) and ``traced`` (this JAX step, priced op by op as the search prices it);
* its peak memory on both programs, and the intra-op memory model's peak bytes of the
  1-device plan with the GPU memory layout (the cluster preset's mesh:
  ``XLA_GPU_MEMORY``, not ``XLA_CPU_MEMORY``);

* where the step's time goes: the traced step's per-operation costs by kind (GEMMs; the
  attention's S x S elementwise work, the optimizer and the rest, memory-bound), next to
  the profiled kernels by the same kinds (named through the compiled HLO that ``measure
  --dump-hlo`` writes, when ``--hlo-dir`` gives it; else GEMM or not) and the idle time
  between kernels;

then prints predicted against measured with relative errors and writes both as JSON.

    python benchmarks/gpu_single.py measure --out measured.json [--profile] [--quick]
        [--configs gpt-350m:24:8 ...] [--dump-hlo DIR] [--steps 10] [--total-s S]
    python benchmarks/gpu_single.py predict --measured measured.json \\
        --out benchmarks/results/gpu_single.json [--hlo-dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (model, layers, batch, attention); sequence 1024 and vocabulary 51200 (the presets')
CONFIGS = (("gpt-350m", 24, 8, "fused"), ("gpt-1.3b", 24, 8, "fused"), ("gpt-1.3b", 24, 4, "fused"))
QUICK_CONFIGS = (("gpt-tiny", 2, 8, "fused"),)
# "fused-qkv3": the fused program with q, k, v from three GEMMs (GPTConfig.qkv_gemms=3)
ATTENTION = ("fused", "unfused", "fused-qkv3")
BREAKDOWN_KINDS = ("gemm", "attention_kernel", "attention_sxs", "other_memory_bound", "optimizer")
# cuDNN's fused attention kernels (the fused step's attention_fwd / attention_bwd)
ATTENTION_KERNEL = re.compile(r"cudnn|fmha|flash|sdpa", re.I)
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|gmma|cublas|triton_gemm", re.I)


def _label(model: str, layers: int, batch: int, attention: str = "unfused") -> str:
    return f"{model} L{layers} B{batch} {attention}"


def parse_config(text: str) -> tuple[str, int, int, str]:
    """``model:layers:batch[:attention]`` (attention ``fused``, the default, or ``unfused``)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ATTENTION):
        raise ValueError(
            f"a configuration is model:layers:batch[:{'|'.join(ATTENTION)}], got {text!r}"
        )
    return parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else "fused"


def _run_config(run: dict) -> tuple[str, int, int, str]:
    """A measured run's configuration; runs measured before the fused attention existed
    (no ``attention`` key) ran the einsum attention."""
    return run["model"], run["layers"], run["batch"], run.get("attention", "unfused")


# ----------------------------------------------------------------------------- measure


def _profile_summary(trace_dir: str, steps: int) -> dict:
    """Sum GPU kernel time per step from jax.profiler's perfetto trace: per thread of each
    device, the kernels by name, and the GEMM share (kernel names of cuBLAS / Triton GEMMs)."""
    paths = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        return {"error": f"no perfetto trace under {trace_dir}"}
    obj = json.load(gzip.open(paths[-1]))
    events = obj["traceEvents"] if isinstance(obj, dict) else obj
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    per_thread, kernels = {}, {}
    for e in events:
        if e.get("ph") != "X" or "/device:" not in procs.get(e.get("pid"), ""):
            continue
        where = f"{procs[e['pid']]} | {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
        t = per_thread.setdefault(where, {"events": 0, "us": 0.0})
        t["events"] += 1
        t["us"] += float(e.get("dur", 0.0))
        if "Stream" in where:
            name = e.get("name", "?")
            args = e.get("args", {}) or {}
            k = kernels.setdefault(name, {"count": 0, "us": 0.0, "hlo_op": args.get("hlo_op")})
            k["count"] += 1
            k["us"] += float(e.get("dur", 0.0))
    gemm_us = sum(k["us"] for n, k in kernels.items() if GEMM_KERNEL.search(n))
    total_us = sum(k["us"] for k in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:400]
    return {
        "steps": steps,
        "kernel_us_per_step": total_us / steps,
        "gemm_kernel_us_per_step": gemm_us / steps,
        "kernels_per_step": sum(k["count"] for k in kernels.values()) / steps,
        "gemm_kernels_per_step": sum(
            k["count"] for n, k in kernels.items() if GEMM_KERNEL.search(n)
        )
        / steps,
        "threads": per_thread,
        "top_kernels": [{"name": n[:200], **k} for n, k in top],
    }


def measure_one(
    model: str,
    layers: int,
    batch: int,
    steps: int,
    profile: bool,
    dump_hlo: str | None = None,
    attention: str = "fused",
    xla_options: dict | None = None,
) -> dict:
    """One configuration in this process: compile, memory, step time (and a profile).
    ``dump_hlo``: a folder for the compiled HLO text (gzip), to name the profile's kernels;
    with ``steps=0`` nothing runs. ``xla_options``: XLA debug options for this compile only
    (``Lowered.compile(compiler_options=...)``), e.g. ``{"xla_gpu_enable_cublaslt": True}``."""
    import jax
    import numpy as np

    from autoshard.models import get_workload, make_optimizer, make_train_step
    from autoshard.verify.memory import memory_stats

    dtype = "bfloat16"
    qkv3 = attention == "fused-qkv3"
    work = get_workload(
        model,
        batch_size=batch,
        num_layers=layers,
        dtype=dtype,
        attention="fused" if qkv3 else attention,
        qkv_gemms=3 if qkv3 else None,
    )
    opt = make_optimizer("adamw")
    step = jax.jit(make_train_step(work.loss_fn, opt), donate_argnums=(0, 1))
    out = {"model": model, "layers": layers, "batch": batch, "seq_len": work.config.seq_len,
           "vocab": work.config.vocab_size, "hidden": work.config.hidden, "dtype": dtype,
           "params": work.config.num_params, "optimizer": "adamw",
           "attention": attention, "xla_options": dict(xla_options or {})}  # fmt: skip
    t0 = time.perf_counter()
    compiled = step.lower(*work.abstract_train_args(opt)).compile(
        compiler_options=dict(xla_options) if xla_options else None
    )
    out["compile_s"] = time.perf_counter() - t0
    mem = memory_stats(compiled)
    out["memory_analysis"] = {
        "argument_bytes": mem.argument_bytes,
        "output_bytes": mem.output_bytes,
        "temp_bytes": mem.temp_bytes,
        "alias_bytes": mem.alias_bytes,
        "generated_code_bytes": mem.generated_code_bytes,
        "xla_peak_memory_in_bytes": mem.peak_bytes if mem.peak_from_xla else None,
        # what autoshard compares with (VerificationReport.compiled_peak_bytes)
        "compiled_peak_bytes": mem.argument_bytes + mem.output_bytes - mem.alias_bytes
        + mem.temp_bytes,
    }  # fmt: skip
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        out["xla_cost_analysis"] = {
            k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in cost
        }
    except Exception as err:  # noqa: BLE001 - optional; record why
        out["xla_cost_analysis"] = {"error": repr(err)}
    if dump_hlo:
        path = Path(dump_hlo) / f"{model}_L{layers}_B{batch}_{attention}.hlo.txt.gz"
        with gzip.open(path, "wt") as f:
            f.write(compiled.as_text())
        out["hlo_dump"] = path.name
    if steps == 0:
        return out

    t0 = time.perf_counter()
    params, opt_state, data = make_state(work, opt)
    out["init_s"] = time.perf_counter() - t0

    losses, times = [], []
    for i in range(3 + steps):  # 3 warm-up steps
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, data)
        loss = float(jax.block_until_ready(loss))
        if i >= 3:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    out["step_times_s"] = times
    out["step_time_s"] = float(np.median(times))
    out["step_time_spread"] = (max(times) - min(times)) / out["step_time_s"]
    out["losses"] = losses
    try:
        stats = jax.devices()[0].memory_stats() or {}
        out["allocator"] = {
            k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_limit") if k in stats
        }
    except Exception as err:  # noqa: BLE001 - optional; record why
        out["allocator"] = {"error": repr(err)}

    if profile:
        try:
            trace_dir = tempfile.mkdtemp(prefix="gpu_single_trace_")
            n = 3
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(n):
                    params, opt_state, loss = compiled(params, opt_state, data)
                jax.block_until_ready(loss)
            out["profile"] = _profile_summary(trace_dir, n)
        except Exception as err:  # noqa: BLE001 - optional; record why
            out["profile"] = {"error": repr(err)}
    return out


def make_state(work, opt):
    """(params, opt_state, batch) of ``work``'s training step, each made by one jitted
    program on the default device (seed 0), ready."""
    import jax

    k_params, k_batch = jax.random.split(jax.random.key(0))
    params = jax.jit(work.init_fn)(k_params)
    opt_state = jax.jit(opt.init)(params)
    data = jax.jit(work.random_batch)(k_batch)
    jax.block_until_ready((params, opt_state, data))
    return params, opt_state, data


def parse_xla_options(items: list[str] | None) -> dict:
    """``["xla_gpu_enable_cublaslt=true", "xla_gpu_autotune_level=2"]`` -> a dict with
    booleans and numbers converted (what ``compile(compiler_options=...)`` takes)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("xla_"):
            raise ValueError(f"an XLA option is xla_name=value, got {item!r}")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def cmd_measure(args) -> int:
    import jax

    parse_xla_options(args.xla_options)  # refuse a malformed option before any child runs

    configs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.configs:
        configs = [parse_config(c) for c in args.configs]
    dev = jax.devices()[0]
    result = {
        "device_kind": dev.device_kind,
        "core_count": getattr(dev, "core_count", None),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "runs": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    out = Path(args.out)
    t_start = time.monotonic()
    for model, layers, batch, attention in configs:
        # one process per configuration: a clean allocator peak, and an OOM stays contained
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            child = tmp.name
        cmd = [
            sys.executable,
            __file__,
            "_one",
            model,
            str(layers),
            str(batch),
            child,
            "--steps",
            str(args.steps),
            "--attention",
            attention,
        ]
        cmd += ["--profile"] if args.profile else []  # fmt: skip
        cmd += ["--xla-options", *args.xla_options] if args.xla_options else []
        cmd += ["--dump-hlo", args.dump_hlo] if args.dump_hlo else []
        t0 = time.perf_counter()
        left = args.total_s - (time.monotonic() - t_start)
        try:  # subprocess.run kills the child when it runs out of time
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=min(args.timeout_s, max(left, 1))
            )
            error = None if proc.returncode == 0 else proc.stderr[-3000:]
        except subprocess.TimeoutExpired as err:
            error = f"timed out after {err.timeout:.0f} s; stderr: {str(err.stderr)[-2000:]}"
        if error is None:
            run = json.loads(Path(child).read_text())
        else:
            run = {"model": model, "layers": layers, "batch": batch, "attention": attention,
                   "error": error}  # fmt: skip
        run["wall_s"] = time.perf_counter() - t0
        result["runs"].append(run)
        out.write_text(json.dumps(result, indent=1) + "\n")
        if args.xla_options:
            run.setdefault("xla_options", parse_xla_options(args.xla_options))
        if "error" in run:
            print(f"{_label(model, layers, batch, attention)}: FAILED\n{run['error']}", flush=True)
        elif "step_time_s" not in run:
            print(
                f"{_label(model, layers, batch, attention)}: compiled in {run['compile_s']:.1f} s"
            )
        else:
            mem = run["memory_analysis"]["compiled_peak_bytes"] / 2**30
            print(
                f"{_label(model, layers, batch, attention)}: step {run['step_time_s'] * 1e3:.1f} ms "
                f"(spread {run['step_time_spread']:.1%}), compiled peak {mem:.2f} GiB, "
                f"compile {run['compile_s']:.1f} s, wall {run['wall_s']:.0f} s, "
                f"loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}",
                flush=True,
            )
    return 0


def cmd_one(args) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    run = measure_one(
        args.model, args.layers, args.batch, args.steps, args.profile, args.dump_hlo,
        args.attention, parse_xla_options(args.xla_options),
    )  # fmt: skip
    Path(args.child_out).write_text(json.dumps(run))
    return 0


# ----------------------------------------------------------------------------- predict


def predict_one(
    model: str, layers: int, batch: int, cluster: str = "dgx-h100", attention: str = "fused"
) -> dict:
    """What autoshard predicts for one configuration on one GPU of ``cluster``."""
    from autoshard.api import device_mesh_for, trace_workload
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.sim.simulate import simulate

    out = {}
    for program in ("megatron-lm", "megatron-lm-flash", "traced"):
        if program == "megatron-lm-flash" and attention == "unfused":
            continue  # the flash program is the fused step's peer
        report = simulate(
            model, cluster, 1, plan="megatron:1x1x1", global_batch=batch,
            microbatch_size=batch, recompute="none", dtype="bf16", program=program,
            num_layers=layers, **({"attention": attention} if program == "traced" else {}),
        )  # fmt: skip
        out[program] = {
            "step_time_s": report.step_time_s,
            "mfu": report.mfu,
            "tflops_per_device": report.tflops_per_device,
            "peak_bytes": report.peak_bytes_per_device,
            "breakdown": dict(report.breakdown),
        }
    traced = trace_workload(
        model, "adamw", batch_size=batch, num_layers=layers, dtype="bfloat16", attention=attention
    )
    mesh = device_mesh_for((1,), ("data",), cluster=cluster)  # GPU layout: flags off
    flags = ("narrow_dots_in_f32", "reductions_read_memory", "late_updates",
             "early_input_reshards")  # fmt: skip
    assert not any(getattr(mesh.memory_layout, f) for f in flags), "expected the GPU memory layout"
    assert mesh.memory_layout.fused_transcendentals, "expected the GPU memory layout"
    plan = auto_shard_graph(traced.graph, mesh, IntraOptions(solver="highs", time_limit_s=60.0))
    out["intra_predicted_peak_bytes"] = float(plan.predicted_peak_bytes)
    cfg = traced.workload.config
    out["traced_breakdown_s"] = traced_breakdown(
        traced.graph, mesh, cfg.seq_len, cfg.batch_size * cfg.num_heads
    )
    return out


def traced_breakdown(graph, mesh, seq_len: int, batch_heads: int) -> dict:
    """The traced step's 1-device cost by kind, node by node as the search prices it:
    GEMMs (the GEMM table), and memory-bound work (bytes over HBM bandwidth) split into
    the attention's S x S elementwise ops, the optimizer update and the rest."""
    from autoshard.intra.memory.model import streamed_tensors
    from autoshard.intra.rules.strategies import node_context, replicated_strategy

    kept = streamed_tensors(graph, mesh)  # as the search prices
    out = dict.fromkeys(BREAKDOWN_KINDS, 0.0)
    for node in graph.nodes:
        seconds = replicated_strategy(node_context(graph, node, kept), mesh).compute_cost
        shapes = [graph.tensors[t].shape for t in (*node.inputs, *node.outputs)]
        if node.primitive == "dot_general":
            kind = "gemm"
        elif node.primitive.startswith("attention_"):
            kind = "attention_kernel"
        elif node.phase == "update":
            kind = "optimizer"
        elif any(_is_attention_square(shape, seq_len, batch_heads) for shape in shapes):
            kind = "attention_sxs"
        else:
            kind = "other_memory_bound"
        out[kind] += seconds
    return out


def _is_attention_square(shape, seq_len: int, batch_heads: int) -> bool:
    """[B, H, S, S] (or XLA's [B H, S, S]): the attention scores and what is made of them."""
    if len(shape) < 3 or tuple(shape[-2:]) != (seq_len, seq_len):
        return False
    return (shape[0] if len(shape) == 3 else shape[0] * shape[1]) == batch_heads


def _hlo_instructions(hlo_text: str) -> dict[str, tuple[str, list[str], str]]:
    """name -> (result shape, operand names, op_name) of every instruction."""
    out = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(?:, |$)")
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            operands = re.findall(r"%([\w.\-]+)", m.group(4))
            out[m.group(1)] = (m.group(2), operands, op.group(1) if op else "")
    return out


def _shape_dims(shape_text: str) -> list[tuple[int, ...]]:
    return [
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\w+\[([\d,]*)\]", shape_text)
    ]


def measured_breakdown(run: dict, hlo_text: str | None) -> dict | None:
    """Seconds per step of the profiled GPU kernels by kind, and the idle time between
    them (step time - kernel time). GEMMs are known by kernel name (cuBLAS's nvjet, XLA's
    Triton gemm fusions); with the compiled HLO the other kernels are named too (XLA calls a
    fusion's kernel after the instruction, '.' -> '_'): the attention's S x S work (a fusion
    reading or writing an S x S tensor), the optimizer (an op outside the forward and
    backward passes) and the rest."""
    profile = run.get("profile")
    if not profile or "top_kernels" not in profile:
        return None
    from autoshard.models import GPT_PRESETS

    steps, seq = profile["steps"], run["seq_len"]
    batch_heads = run["batch"] * GPT_PRESETS[run["model"]].num_heads
    out = {"gemm": 0.0, "attention_kernel": 0.0, "other_kernels": 0.0}
    if hlo_text is not None:
        out = dict.fromkeys(BREAKDOWN_KINDS, 0.0) | {"unnamed": 0.0}
        inst = _hlo_instructions(hlo_text)
    for k in profile["top_kernels"]:
        seconds = k["us"] / steps / 1e6
        if ATTENTION_KERNEL.search(k["name"]):  # before GEMMs: cuDNN's names say wgmma too
            out["attention_kernel"] = out.get("attention_kernel", 0.0) + seconds
        elif GEMM_KERNEL.search(k["name"]):
            out["gemm"] += seconds
        elif hlo_text is None:
            out["other_kernels"] += seconds
        else:
            name = re.sub(r"_(\d+)$", r".\1", k["name"])
            if name not in inst:
                out["unnamed"] += seconds
                continue
            shape, operands, op_name = inst[name]
            dims = _shape_dims(shape) + [
                d for o in operands if o in inst for d in _shape_dims(inst[o][0])
            ]
            if op_name and "jvp(" not in op_name and "transpose(" not in op_name:
                out["optimizer"] += seconds
            elif any(_is_attention_square(d, seq, batch_heads) for d in dims):
                out["attention_sxs"] += seconds
            else:
                out["other_memory_bound"] += seconds
    out["not_profiled"] = profile["kernel_us_per_step"] / 1e6 - sum(out.values())
    out["idle_between_kernels"] = run["step_time_s"] - profile["kernel_us_per_step"] / 1e6
    out["kernels_per_step"] = profile["kernels_per_step"]
    return out


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def cmd_predict(args) -> int:
    from autoshard.sim import formulas

    measured = json.loads(Path(args.measured).read_text())
    rows = []
    for run in measured["runs"]:
        if "error" in run:
            rows.append({"config": _label(*_run_config(run)), "measured": run})
            continue
        model, layers, batch, attention = _run_config(run)
        if attention == "fused-qkv3":  # the simulator traces the default q/k/v only
            print(f"predict: {_label(model, layers, batch, attention)}: measured only "
                  "(the simulator has no qkv_gemms option)", file=sys.stderr)  # fmt: skip
            rows.append({"config": _label(model, layers, batch, attention), "measured": run})
            continue
        pred = predict_one(model, layers, batch, args.cluster, attention)
        step = run["step_time_s"]
        hlo = None
        if args.hlo_dir:
            folder = Path(args.hlo_dir)
            path = folder / f"{model}_L{layers}_B{batch}_{attention}.hlo.txt.gz"
            if not path.exists():  # named before the attention option existed
                path = folder / f"{model}_L{layers}_B{batch}.hlo.txt.gz"
            hlo = gzip.open(path, "rt").read() if path.exists() else None
        flops = formulas.model_flops_per_step(
            run["batch"], run["seq_len"], run["layers"], run["hidden"], run["vocab"]
        )
        mfu = formulas.flops_utilization(flops, step, 1, args.peak_tflops * 1e12)
        compiled = run["memory_analysis"]["compiled_peak_bytes"]
        row = {
            "config": _label(model, layers, batch, attention),
            "attention": attention,
            "model_flops_per_step": flops,
            "measured_step_time_s": step,
            "measured_mfu": mfu,
            "measured_compiled_peak_bytes": compiled,
            "measured_allocator_peak_bytes": run.get("allocator", {}).get("peak_bytes_in_use"),
            "measured_breakdown_s": measured_breakdown(run, hlo),
            "predicted": pred,
            "errors": {
                "step_time_megatron_lm": _err(pred["megatron-lm"]["step_time_s"], step),
                "step_time_traced": _err(pred["traced"]["step_time_s"], step),
                **(
                    {"step_time_megatron_lm_flash": _err(flash["step_time_s"], step)}
                    if (flash := pred.get("megatron-lm-flash"))
                    else {}
                ),
                "peak_megatron_lm": _err(pred["megatron-lm"]["peak_bytes"], compiled),
                "peak_traced": _err(pred["traced"]["peak_bytes"], compiled),
                "peak_intra": _err(pred["intra_predicted_peak_bytes"], compiled),
            },
        }
        rows.append(row)
    result = {
        "device": {k: measured.get(k) for k in ("device_kind", "core_count", "jax", "date")},
        "measure_command": measured.get("command"),
        "cluster": args.cluster,
        "peak_tflops_for_mfu": args.peak_tflops,
        "rows": rows,
        "measured": measured,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown_table(rows))
    print()
    print(breakdown_table(rows))
    print(f"wrote {args.out}")
    return 0


def markdown_table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "| config | measured step | simulated (megatron-lm) | simulated (megatron-lm-flash) | "
        "simulated (traced) | measured MFU | sim. MFU (traced) | XLA:GPU peak | "
        "sim. peak (traced) | intra-op peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "predicted" not in r:
            lines.append(f"| {r['config']} | failed | | | | | | | | |")
            continue
        p, e = r["predicted"], r["errors"]
        flash = p.get("megatron-lm-flash")
        flash_cell = (
            f"{flash['step_time_s'] * 1e3:.1f} ms ({e['step_time_megatron_lm_flash']:+.1%})"
            if flash
            else "-"
        )
        lines.append(
            f"| {r['config']} | {r['measured_step_time_s'] * 1e3:.1f} ms | "
            f"{p['megatron-lm']['step_time_s'] * 1e3:.1f} ms ({e['step_time_megatron_lm']:+.1%}) | "
            f"{flash_cell} | {p['traced']['step_time_s'] * 1e3:.1f} ms ({e['step_time_traced']:+.1%}) | "
            f"{r['measured_mfu']:.1%} | {p['traced']['mfu']:.1%} | "
            f"{r['measured_compiled_peak_bytes'] / gib:.2f} GiB | "
            f"{p['traced']['peak_bytes'] / gib:.2f} GiB ({e['peak_traced']:+.1%}) | "
            f"{p['intra_predicted_peak_bytes'] / gib:.2f} GiB ({e['peak_intra']:+.1%}) |"
        )
    return "\n".join(lines)


def breakdown_table(rows: list[dict]) -> str:
    """Where the step's time goes, predicted (traced program) next to the profile (ms)."""
    kinds = (*BREAKDOWN_KINDS, "other_kernels", "unnamed", "not_profiled",
             "idle_between_kernels")  # fmt: skip
    lines = ["| config | side | " + " | ".join(kinds) + " | total |",
             "|---|---|" + "---|" * (len(kinds) + 1)]  # fmt: skip
    for r in rows:
        if "predicted" not in r:
            continue
        measured = r["measured_breakdown_s"] or {}
        for side, b, total in (
            (
                "predicted",
                r["predicted"]["traced_breakdown_s"],
                r["predicted"]["traced"]["step_time_s"],
            ),
            ("measured", measured, r["measured_step_time_s"]),
        ):
            cells = [f"{b[k] * 1e3:.1f}" if k in b else "-" for k in kinds]
            lines.append(
                f"| {r['config']} | {side} | " + " | ".join(cells) + f" | {total * 1e3:.1f} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run the steps on this machine's first device")
    m.add_argument("--out", required=True)
    m.add_argument(
        "--configs",
        nargs="+",
        help="model:layers:batch[:fused|unfused|fused-qkv3], e.g. gpt-350m:24:8:unfused (default fused)",
    )
    m.add_argument("--steps", type=int, default=10, help="0: compile only")
    m.add_argument("--profile", action="store_true")
    m.add_argument("--dump-hlo", help="folder for the compiled HLO of each configuration")
    m.add_argument("--quick", action="store_true", help="gpt-tiny only (a CPU check)")
    m.add_argument("--timeout-s", type=float, default=300.0, help="per configuration")
    m.add_argument("--total-s", type=float, default=1e9, help="for all configurations")
    m.add_argument(
        "--xla-options",
        nargs="+",
        metavar="xla_NAME=VALUE",
        help="XLA options for every configuration's compile, e.g. xla_gpu_enable_cublaslt=true",
    )
    m.set_defaults(func=cmd_measure)
    one = sub.add_parser("_one")  # internal: one configuration in a child process
    one.add_argument("model")
    one.add_argument("layers", type=int)
    one.add_argument("batch", type=int)
    one.add_argument("child_out")
    one.add_argument("--steps", type=int, default=10)
    one.add_argument("--profile", action="store_true")
    one.add_argument("--dump-hlo")
    one.add_argument("--attention", choices=ATTENTION, default="fused")
    one.add_argument("--xla-options", nargs="+")
    one.set_defaults(func=cmd_one)
    p = sub.add_parser("predict", help="autoshard's predictions next to a measured file")
    p.add_argument("--measured", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense, for MFU")
    p.add_argument(
        "--hlo-dir", help="folder of measure --dump-hlo files, to name the profile's kernels"
    )
    p.set_defaults(func=cmd_predict)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
