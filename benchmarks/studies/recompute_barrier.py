"""What XLA compiles for the flat traced step against the plain ``jax.jit`` step: the
number of ``tanh`` ops and the temp bytes (``memory_analysis``), per GPT preset.

The fused GELU (``models/gpt.py::gelu_saving_input``, a ``jax.checkpoint``) recomputes its
``tanh`` in the backward pass. The runtime runs the flat traced program
(:meth:`TracedProgram.evaluate`); until 2026-11-28 the tracer inlined the checkpoint's body
bare and XLA's CSE merged the recompute into the forward's ``tanh``, which it then held
for the backward (half the ``tanh`` ops, more temp). Since then the recompute reads its
operands through ``optimization_barrier``s, as JAX lowers a checkpoint, and both programs
compile alike. Abstract shapes, one CPU device, AdamW, the presets' own batch::

    python benchmarks/studies/recompute_barrier.py [--models gpt-tiny gpt-350m] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax


def compiled(fn, args) -> dict:
    c = jax.jit(fn).lower(*args).compile()
    return {
        "tanh_ops": c.as_text().count(" tanh("),
        "temp_bytes": int(c.memory_analysis().temp_size_in_bytes),
    }


def row(name: str) -> dict:
    from autoshard.models import get_workload, make_optimizer, make_train_step
    from autoshard.trace.jaxpr import trace_train_step

    w = get_workload(name)
    opt = make_optimizer("adamw")
    step = make_train_step(w.loss_fn, opt)
    args = w.abstract_train_args(opt)
    program = trace_train_step(step, *args)
    barriers = sum(e.primitive == "optimization_barrier" for e in program.records.eqns)
    plain, flat = compiled(step, args), compiled(program.evaluate, args)
    return {
        "model": name,
        "layers": w.config.num_layers,
        "barriers_traced": barriers,
        "plain": plain,
        "flat": flat,
        "flat_over_plain_temp": flat["temp_bytes"] / plain["temp_bytes"],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt-350m"])
    ap.add_argument("--out", help="write the rows, the command and the jax version as JSON")
    a = ap.parse_args(argv)
    rows = []
    for name in a.models:
        print(f"{name}: tracing and compiling both programs ...", file=sys.stderr, flush=True)
        r = row(name)
        rows.append(r)
        print(
            f"{name}: tanh ops plain {r['plain']['tanh_ops']}, flat {r['flat']['tanh_ops']}; "
            f"temp plain {r['plain']['temp_bytes']:,} B, flat {r['flat']['temp_bytes']:,} B "
            f"(x{r['flat_over_plain_temp']:.4f}); barriers traced {r['barriers_traced']}"
        )
    if a.out:
        doc = {
            "command": "python benchmarks/studies/recompute_barrier.py "
            + " ".join(argv or sys.argv[1:]),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "jax": jax.__version__,
            "rows": rows,
        }
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
