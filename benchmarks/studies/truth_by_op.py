"""Predicted vs compiled collectives of one plan, per op (a diagnostic, not a benchmark).

Plans a preset on fake CPU devices (``plan_workload``; ``--cluster`` as the GPU suite
plans), compiles it (``verify_plan``) and prints the (kind, axes) table, then both sides
grouped by op: the predicted collectives of each resharded value under its producer's
primitive and module path (:func:`autoshard.intra.problem.predict.collectives_by_value`), the
compiled ones under their HLO instruction's ``op_name`` metadata (the traced equation's
name stack and primitive), and XLA's "involuntary full rematerialization" warnings::

    python benchmarks/studies/truth_by_op.py --model moe-1.3b --layers 2 --mesh 2x4 \
        --cluster dgx-h100 [--batch 8] [--baseline zero3] [--details]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import tempfile
import time


def _log(text):
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _name_equations() -> None:
    """Every equation of the evaluated program in a ``jax.named_scope`` ``e<index>``, so
    that each compiled collective's ``op_name`` says which equation it came from (its
    own partitioning, or a constraint on its operands or outputs)."""
    import jax

    from autoshard.trace.jaxpr import TracedProgram

    def evaluate(self, *args, hook=None, in_hook=None):
        flat, tree = jax.tree_util.tree_flatten(args)
        env = dict(self._consts)
        env.update(zip(self.records.inputs, flat))
        for eqn, (prim, params) in zip(self.records.eqns, self._impls):
            with jax.named_scope(f"e{eqn.index}"):
                invals = [env[i] for i in eqn.inputs]
                if in_hook is not None:
                    invals = in_hook(eqn.index, invals)
                outs = prim.bind(*invals, **params)
                outs = list(outs) if prim.multiple_results else [outs]
                if hook is not None:
                    outs = hook(eqn.index, outs)
            env.update(zip(eqn.outputs, outs))
        return jax.tree_util.tree_unflatten(self.out_tree, [env[i] for i in self.records.outputs])

    TracedProgram.evaluate = evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--details", action="store_true")
    ap.add_argument("--save", default=None, help="save the plan file here")
    ap.add_argument("--plan-file", default=None, help="verify this plan file instead of planning")
    ap.add_argument("--hlo-out", default=None)
    args = ap.parse_args()
    import jax

    from autoshard.api import parse_mesh_shape

    jax.config.update("jax_num_cpu_devices", math.prod(parse_mesh_shape(args.mesh)))
    import autoshard.intra.problem.build as problem
    from autoshard.api import device_mesh_for, plan_workload
    from autoshard.intra.problem.options import IntraOptions
    from autoshard.intra.problem.predict import collectives_by_value
    from autoshard.verify.check import verify_plan
    from autoshard.verify.collectives import analyze_collectives

    asked = []
    original = problem.plan_from_solution

    def listen(ip, solution, *a, **k):
        asked.append((ip, solution))
        return original(ip, solution, *a, **k)

    problem.plan_from_solution = listen
    _name_equations()
    overrides = {"num_layers": args.layers, "batch_size": args.batch}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    t0 = time.perf_counter()
    try:
        bound = plan_workload(
            args.model,
            device_mesh_for(args.mesh) if args.cluster is None else args.mesh,
            baseline=args.baseline,
            options=IntraOptions(solver="highs", time_limit_s=args.time_limit),
            cluster=args.cluster,
            **overrides,
        )
    finally:
        problem.plan_from_solution = original
    plan = bound.plan
    _log(f"planned in {time.perf_counter() - t0:.0f} s: {plan.solver.get('status')}")
    if args.save:
        bound.save(args.save)
    ip, solution = asked[-1]
    graph = ip.graph
    producer = {t: n for n in graph.nodes for t in n.outputs}
    t0 = time.perf_counter()
    err_path = tempfile.mktemp()
    saved = os.dup(2)
    with open(err_path, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            report = verify_plan(bound.program, plan, keep_hlo=True, live_peak="never")
        finally:
            os.dup2(saved, 2)
    warnings = [ln for ln in open(err_path) if "Involuntary full rematerialization" in ln]
    _log(f"compiled in {time.perf_counter() - t0:.0f} s")
    print(report.comparison.format())
    mem = report.memory_error
    print(
        f"peak: predicted {plan.predicted_peak_bytes / 2**20:.1f} MiB, compiled "
        f"{report.compiled_peak_bytes / 2**20:.1f} MiB ({mem:+.1%})"
    )
    print(f"involuntary full rematerializations: {len(warnings)}")
    for w in warnings[: 40 if args.details else 8]:
        m = re.search(
            r"cannot go from sharding (.*?) efficiently for HLO operation (%\S+) = (\S+)", w
        )
        print("  ", m.groups() if m else w[:300])
    # predicted, per value (keyed by the value and the equations that read it)
    nodes = graph.nodes
    readers = collections.defaultdict(list)
    for n in nodes:
        for t in n.inputs:
            readers[t].append(n.index)
    op_specs = plan.operand_specs
    pred = {}
    for tid, cols in collectives_by_value(ip, solution.strategy):
        if cols:
            pred[tid] = cols
    # compiled: the equation each collective's op_name names; an operand constraint of
    # that equation says which value (the one constrained operand), else its output
    text = report.hlo_text
    if args.hlo_out:
        open(args.hlo_out, "w").write(text)
    meta = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
        if m:
            meta[m.group(1)] = m.group(2)
    found = analyze_collectives(text, plan.mesh, range(plan.mesh.num_devices))
    comp = collections.defaultdict(list)
    for c in found.collectives:
        op = meta.get(c.hlo_name.lstrip("%"), "?")
        m = re.search(r"/e(\d+)/", op)
        key = "?" + op
        if m:
            e = int(m.group(1))
            constrained = [nodes[e].inputs[k] for k in op_specs.get(e, {})]
            if len(set(constrained)) == 1:
                key = constrained[0]
            elif not constrained:
                key = nodes[e].outputs[0] if len(nodes[e].outputs) == 1 else f"e{e}"
            else:
                key = f"e{e}:" + ",".join(map(str, constrained))
        comp[key].append(c.collective)

    def fmt(cols):
        tot = collections.defaultdict(lambda: [0, 0])
        for c in cols:
            tot[(c.kind, c.axes)][0] += 1
            tot[(c.kind, c.axes)][1] += c.bytes
        return "; ".join(f"{k}/{','.join(a)} {n}x {b:,}" for (k, a), (n, b) in sorted(tot.items()))

    diff = []
    for key in list(pred) + [k for k in comp if k not in pred]:
        p, c = fmt(pred.get(key, ())), fmt(comp.get(key, ()))
        if isinstance(key, int):
            node = producer.get(key)
            where = (
                f"{node.primitive}@e{node.index} {node.phase} {node.module_path}"
                if node
                else "input"
            )
            t = graph.tensors[key]
            made = plan.tensor_specs.get(key) or "input"
            wants = sorted(
                {
                    str(op_specs[r][k])
                    for r in readers[key]
                    for k in op_specs.get(r, {})
                    if nodes[r].inputs[k] == key
                }
            )
            head = f"t{key} {t.shape} {where}: made {made}, read {wants} by e{readers[key]}"
        else:
            head = str(key)
        if p != c:
            diff.append((head, p, c))
        elif args.details:
            print(f"same  {head}\n      {p}")
    print(f"\n== values whose collectives differ ({len(diff)})")
    for head, p, c in diff:
        print(f"{head}\n   predicted: {p or '-'}\n   compiled:  {c or '-'}")


if __name__ == "__main__":
    main()
