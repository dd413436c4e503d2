"""One bench_truth row at both peaks (a diagnostic): the memory model's buffers at its
predicted peak beside what XLA:CPU holds at its live peak.

Plans the row as ``benchmarks/bench_truth.py`` does (SGD, the truth mesh, the baseline's
pins, HiGHS, exact values), prints the model's buffers live at its peak (own buffers by
producer, resharded copies with their readers, the other buffer kinds), then compiles
the step with XLA's dumps and prints the values live at XLA's live peak with their HLO
shape and ``op_name``::

    python benchmarks/studies/truth_row_at_peak.py gpt-tiny 4x2 zero3 --attention fused
    python benchmarks/studies/truth_row_at_peak.py gpt-1.3b 8 zero3 --layers 2 --batch 8 \
        --dtype bfloat16 --optimizer adamw --attention fused

``--plan-file`` reads the plan a ``memory_replay.py`` cache holds for the row instead of
planning it again (the same plan the replay predicted).

The dumps are kept in ``--dump DIR`` (default: a temporary folder, removed).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("mesh", help="e.g. 8, 2x4, 4x2")
    ap.add_argument("plan", help="auto, dp, zero2, zero3, megatron")
    ap.add_argument("--attention", choices=("fused", "unfused"))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int, help="seq_len override")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--optimizer", default="sgd", help="as the suite's row: sgd or adamw")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--dump", help="keep XLA's dumps here")
    ap.add_argument(
        "--plan-file",
        help="read the plan from this memory_replay.py cache file instead of planning",
    )
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_truth import plan_settings, truth_mesh

    from autoshard.api import trace_workload
    from autoshard.intra.memory.attention_workspace import held_buffers
    from autoshard.intra.memory.gathered_sources import own_buffer_end
    from autoshard.intra.memory.model import (
        _gathered_tails,
        _union_intervals,
        conv_copy_reads,
        predicted_live_bytes,
        program_positions,
        value_buffers,
    )
    from autoshard.intra.memory.reshard_copies import first_update, resharded_copy
    from autoshard.intra.memory.transposed_copies import conv_copy_intervals
    from autoshard.intra.problem.build import auto_shard_graph
    from autoshard.runtime.sharded import abstract_args, build_sharded_step, make_mesh
    from autoshard.verify.memory import dump_live_peak

    over = {"num_layers": args.layers} if args.layers else {}
    if args.attention:
        over["attention"] = args.attention
    if args.batch:
        over["batch_size"] = args.batch
    if args.seq:
        over["seq_len"] = args.seq
    if args.dtype:
        over["dtype"] = args.dtype
    traced = trace_workload(args.model, optimizer=args.optimizer, **over)
    graph = traced.graph
    mesh = truth_mesh(args.mesh)
    if args.plan_file:
        import json

        from autoshard.ir.plan import ParallelPlan

        with open(args.plan_file) as f:
            plan = ParallelPlan.loads(json.load(f)["plan"])
    else:
        options, pinned = plan_settings(graph, mesh, args.plan, 60)
        plan = auto_shard_graph(
            graph, mesh, options, pinned_inputs=pinned, name=args.plan, exact_values=True
        )
    spec_of = plan.specs_by_tensor(graph.inputs)
    live = predicted_live_bytes(graph, spec_of, mesh, plan.operand_specs)
    at = max(range(len(live)), key=lambda i: live[i]) - 1
    pos = program_positions(graph, mesh.memory_layout.late_updates)
    p_at = pos[at] if at >= 0 else -1
    node = graph.nodes[at] if at >= 0 else None
    where = f"{node.primitive} ({node.phase}) in {node.module_path}" if node else "inputs"
    print(f"model: peak {live[at + 1]:,.0f} B at node {at}, {where}")
    own = value_buffers(graph, mesh)
    tails = _gathered_tails(graph, mesh, own, pos)
    rows = []
    for tid, first, last, nbytes in own:
        if tid not in spec_of:
            continue
        if tid in tails:
            last = own_buffer_end(tails[tid], spec_of[tid], plan.operand_specs)
        if first <= p_at <= last:
            t = graph.tensors[tid]
            prod = graph.nodes[t.producer] if t.producer is not None else None
            what = f"{prod.primitive} {prod.phase}" if prod else f"input ({t.kind})"
            b = nbytes * spec_of[tid].shard_fraction(mesh.mesh)
            rows.append(
                (b, f"own t{tid} {t.shape} {t.dtype} {what} [{first},{last}] {spec_of[tid]}")
            )
    for first, last, b in conv_copy_intervals(graph, spec_of, mesh, plan.operand_specs):
        if first <= p_at <= last:
            rows.append((b, f"transposed conv copy [{first},{last}]"))
    read_at = conv_copy_reads(graph, mesh)
    uses: dict = {}
    for ni, slots in plan.operand_specs.items():
        for slot, spec in slots.items():
            uses.setdefault((graph.nodes[ni].inputs[slot], spec), []).append(ni)
    intervals, update = _union_intervals(own), first_update(graph)
    for (tid, spec), readers in uses.items():
        c = resharded_copy(graph, tid, spec, mesh, readers, pos, intervals, update)
        if c is None:
            continue
        nb, s, e, _, _ = c
        reads = [pos[read_at.get((tid, r), r)] for r in readers]
        s = min(reads) if s is None else s
        e = max(reads) if e is None else e
        if s <= p_at <= e:
            t = graph.tensors[tid]
            rows.append((nb, f"copy t{tid} {t.shape} {spec_of.get(tid)} -> {spec} [{s},{e}]"))
    for first, last, b in held_buffers(graph, spec_of, mesh, pos):
        if first <= p_at <= last:
            rows.append((b, f"attention workspace [{first},{last}]"))
    rows.sort(key=lambda r: -r[0])
    print(f"  listed {sum(r[0] for r in rows):,.0f} B (the rest: other buffer kinds)")
    for b, text in rows[: args.top]:
        print(f"  {b:>12,.0f}  {text}")

    jmesh = make_mesh(plan.mesh, jax.devices()[: plan.mesh.num_devices])
    step = build_sharded_step(traced.program, plan, jmesh, donate=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.dump or tmp
        os.makedirs(out, exist_ok=True)
        opts = {"xla_dump_to": out, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "NONE"}
        compiled = step.lower(*abstract_args(traced.program, plan, jmesh)).compile(opts)
        peak = dump_live_peak(out)
        texts = glob.glob(os.path.join(out, "*after_optimizations.txt"))
        text = open(max(texts, key=os.path.getsize)).read() if texts else ""
    m = compiled.memory_analysis()
    alloc = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    info = {}
    for line in text.splitlines():
        g = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
        if g:
            op = re.search(r'op_name="([^"]*)"', line)
            info[g.group(1)] = (g.group(2), op.group(1) if op else "")
    if peak is None:
        print(f"XLA: allocation {alloc:,} B; no live peak (the dumps did not parse)")
        return
    print(f"XLA: allocation {alloc:,} B, live peak {peak.bytes:,} B at {peak.instruction}")
    for name, nbytes in peak.values[: args.top]:
        shape, op = info.get(name.split("{")[0].lstrip("%"), ("?", ""))
        print(f"  {nbytes:>12,}  {name:<40} {shape:<32} {op[-70:]}")


if __name__ == "__main__":
    main()
