"""The pipeline runtime's ``grad_reduce="step"`` against ``"microbatch"``, on 8 fake CPU
devices: the collectives over ``data`` each stage's compiled backward (once a microbatch)
and update (once a step) hold, and how far each mode's training is from one device's.

Runs, from the same weights, 3 steps of each mode and of one device:

* ``mlp-dp``: the MLP preset (hidden 32, 4 layers, batch 32, AdamW), one stage of 8
  data-parallel devices (``layout="data-parallel"``: a (8, 1) mesh);
* ``mlp-tp``: the same MLP, 2 stages on (2, 2) meshes (``layout="intra-op"``);
* ``gpt-tiny`` (``--gpt``): 4 layers, SGD, 2 stages ``(0, 2), (2, 6)`` on (2, 2) meshes
  (the LM head's tied ``wte`` sent from stage 0 to stage 1); ~1 min more.

2 microbatches each. Prints one row per run and stage; ``--out FILE`` writes them as JSON::

    python benchmarks/grad_reduce_step.py [--gpt] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from autoshard.api_pipeline import auto_pipeline  # noqa: E402
from autoshard.ir.spec import Mesh  # noqa: E402
from autoshard.models import get_workload, make_optimizer, make_train_step  # noqa: E402
from autoshard.verify.collectives import analyze_collectives  # noqa: E402

STEPS, MICROBATCHES = 3, 2
CASES = {
    "mlp-dp": ("mlp", "adamw", {"stages": ((0, 4),), "layout": "data-parallel"}),
    "mlp-tp": ("mlp", "adamw", {"stages": ((0, 2), (2, 4)), "logical_meshes": ((2, 2),) * 2}),
    "gpt-tiny": ("gpt", "sgd", {"stages": ((0, 2), (2, 6)), "logical_meshes": ((2, 2),) * 2}),
}


def workload(name: str):
    if name == "mlp":
        return get_workload("mlp", hidden=32, num_layers=4, batch_size=32)
    return get_workload("gpt-tiny", num_layers=4)


def on_data(trainer, stage: int, compiled) -> dict:
    st = trainer.stage_executables[stage]
    shape = tuple(int(n) for n in st.mesh.devices.shape)
    ids = [d.id for d in st.mesh.devices.flat]
    found = analyze_collectives(compiled.as_text(), Mesh(("data", "model"), shape), ids)
    picked = [c for c in found.compared() if "data" in c.axes]
    return {
        "count": len(picked),
        "bytes": int(sum(c.bytes for c in picked)),
        "kinds": sorted({c.kind for c in picked}),
    }


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def run_case(name: str) -> list[dict]:
    model, opt_name, kw = CASES[name]
    w = workload(model)
    opt = make_optimizer("sgd", 0.1) if opt_name == "sgd" else make_optimizer("adamw")
    params, opt_state, batch = w.init_train_args(opt, seed=1)
    step = jax.jit(make_train_step(w.loss_fn, opt))
    p, one = params, []
    for _ in range(STEPS):
        p, opt_state, loss = step(p, opt_state, batch)
        one.append(float(loss))
    rows = []
    for mode in ("microbatch", "step"):
        trainer = auto_pipeline(
            w.loss_fn,
            opt,
            params,
            batch,
            num_microbatches=MICROBATCHES,
            grad_reduce=mode,
            **kw,
        )
        losses = [float(trainer.step(batch)) for _ in range(STEPS)]
        loss_err = float(np.max(np.abs(np.subtract(losses, one)) / np.abs(one)))
        param_err = max_diff(trainer.params, p)
        for s, planned in enumerate(trainer.plan.stages):
            rows.append(
                {
                    "case": name,
                    "grad_reduce": mode,
                    "stage": s,
                    "logical_mesh": list(planned.stage.logical_mesh),
                    "backward_per_microbatch": on_data(trainer, s, trainer.compiled_backward(s)),
                    "update_per_step": on_data(trainer, s, trainer.compiled_update(s)),
                    "loss_rel_err_vs_one_device": loss_err,
                    "param_abs_err_vs_one_device": param_err,
                }
            )
    return rows


def fmt(c: dict) -> str:
    return f"{c['count']} ({c['bytes']:,} B{', ' + '/'.join(c['kinds']) if c['kinds'] else ''})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt", action="store_true", help="also gpt-tiny (~1 min)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    names = ["mlp-dp", "mlp-tp"] + (["gpt-tiny"] if args.gpt else [])
    rows = [row for name in names for row in run_case(name)]
    print(f"jax {jax.__version__}; collectives over data per device")
    print("case      mode        stage mesh    backward / microbatch     update / step")
    for r in rows:
        print(
            f"{r['case']:9} {r['grad_reduce']:11} {r['stage']:5} {str(r['logical_mesh']):7} "
            f"{fmt(r['backward_per_microbatch']):25} {fmt(r['update_per_step']):25} "
            f"loss {r['loss_rel_err_vs_one_device']:.1e} params "
            f"{r['param_abs_err_vs_one_device']:.1e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
