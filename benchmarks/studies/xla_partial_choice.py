"""Which layout XLA reduces a shared partial sum into (issue 36, gpt-1.3b auto 2x4's 16 KiB).

A partial sum over ``model`` on a 2x4 mesh, ``[8, 1024@data, ...]``, read by consumers that
want it split over model (``S``: ``[8@model, 1024@data, ...]``) or in the producer's own
layout (``R``: ``[8, 1024@data, ...]``), in the orders given. Made by a reduce (a sum over a
dim split over model, as the cross-entropy's sum) or by a dot (contracting dim split over
model). Prints the compiled collectives and slices per case and writes JSON::

    python benchmarks/studies/xla_partial_choice.py [--out FILE]

Found (jax 0.10.2, XLA:CPU, 2026-11-27): a *reduce* all-reduces into its own layout and
every ``S`` reader slices from there (``SR``: one all-reduce, read whole by ``R``); a *dot*
reduces into the split (all-reduce + slice, read as a reduce-scatter) and all-gathers for
``R`` -- what :func:`autoshard.intra.cost.consumers.reshard_to_consumers` predicts for both
(the most split target first). The planner's rule is right for dots, not for reduces.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

CASES = ("S", "R", "SR", "RS", "SRR", "SSR")
KEEP = re.compile(
    r"= (\S+) (all-reduce|reduce-scatter|all-gather|collective-permute|dynamic-slice)\("
)


def compiled_ops(producer: str, order: str) -> list[str]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def sh(*spec):
        return NamedSharding(mesh, P(*spec))

    tail = (None,) if producer == "dot" else ()

    def f(x):
        x = jax.lax.with_sharding_constraint(x, sh(None, "data", "model"))
        if producer == "dot":
            w = jax.lax.with_sharding_constraint(jnp.ones((64, 32)), sh("model", None))
            s = x @ w
        else:
            s = x.sum(-1)
        outs = []
        for i, c in enumerate(order):
            want = sh("model", "data", *tail) if c == "S" else sh(None, "data", *tail)
            y = jax.lax.with_sharding_constraint(s, want) * (i + 2.0)
            outs.append(jax.lax.with_sharding_constraint(y, want))
        return outs

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((8, 1024, 64), jnp.float32)).compile().as_text()
    return [f"{m.group(2)} {m.group(1)}" for m in KEEP.finditer(text) if "f32" in m.group(1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/xla_partial_choice.json")
    args = p.parse_args(argv)
    rows = []
    for producer in ("reduce", "dot"):
        for order in CASES:
            ops = compiled_ops(producer, order)
            rows.append({"producer": producer, "readers": order, "compiled": ops})
            print(f"{producer:6} {order:4} {ops}", file=sys.stderr, flush=True)
    doc = {"jax": jax.__version__, "backend": jax.default_backend(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
