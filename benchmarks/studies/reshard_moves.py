"""Which reshards XLA makes with a collective-permute or its other moves, and whether autoshard
predicts them (issue 31).

Compiles every move of a tensor between two specs over the mesh axes ``data`` and
``model`` (``jax.jit`` of the identity with the source as input sharding and the
destination as output sharding; a 2-D ``f32[16, 32]``, or ``--rank 3`` for
``f32[8, 16, 32]``, ``--rank 4`` for ``f32[8, 8, 16, 16]``) on 2x2, 2x4 and 4x2 fake CPU devices, reads the compiled collectives
(collective-permutes included, replica groups over part of an axis as sub-axes,
:mod:`autoshard.verify.collectives`) and compares kind, axes (as a set), count and bytes with
:func:`autoshard.intra.cost.resharding.reshard`'s prediction.  ``--without-tile-moves`` predicts as
before issue 31 (no :mod:`autoshard.intra.cost.reshard_tiles` routes).  Where the priced route
has steps the runtime pins them (``with_sharding_constraint`` one after the other), and XLA
left to itself may take another route; ``--pin-steps`` compiles each move that way, as the
runtime runs it.  Prints a table of the moves that compile to a collective-permute or
differ, and a summary per mesh; writes JSON::

    python benchmarks/studies/reshard_moves.py [--rank 2|3|4] [--meshes 2x2,2x4,4x2] \\
        [--without-tile-moves] [--pin-steps] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autoshard.intra.cost.resharding as cost  # noqa: E402
from autoshard.hardware.mesh import uniform_mesh  # noqa: E402
from autoshard.ir.spec import Mesh, ShardingSpec  # noqa: E402
from autoshard.verify.collectives import analyze_collectives  # noqa: E402

AXES = ("data", "model")
SHAPES = {2: (16, 32), 3: (8, 16, 32), 4: (8, 8, 16, 16)}


def all_specs(rank: int) -> list[ShardingSpec]:
    """Every spec of a rank-``rank`` tensor over ``data`` and ``model`` (each axis unused
    or on one dim; both on one dim in either order)."""
    out = []
    for place in itertools.product(range(rank + 1), repeat=len(AXES)):  # rank = unused
        dims = [[a for a, d in zip(AXES, place) if d == i] for i in range(rank)]
        for orders in itertools.product(*(itertools.permutations(d) for d in dims)):
            out.append(ShardingSpec(tuple(tuple(o) for o in orders)))
    return list(dict.fromkeys(out))


def partition_spec(spec: ShardingSpec) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in spec.dims))


def compile_move(jmesh, src: ShardingSpec, dst: ShardingSpec, shape, steps=()) -> str:
    """The move compiled: the identity from ``src`` to ``dst``, through ``steps`` pinned
    one after the other (``with_sharding_constraint``, as the runtime pins a priced
    route) where given."""

    def move_through(x):
        for step in steps:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(jmesh, partition_spec(step)))
        return x

    move = jax.jit(
        move_through,
        in_shardings=NamedSharding(jmesh, partition_spec(src)),
        out_shardings=NamedSharding(jmesh, partition_spec(dst)),
    )
    return move.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()


def records(collectives) -> list[tuple[str, tuple[str, ...], int]]:
    """(kind, axes as a sorted tuple, bytes), sorted: what the comparison looks at."""
    return sorted((c.kind, tuple(sorted(c.axes)), c.bytes) for c in collectives)


def compiled_records(text: str, mesh: Mesh):
    found = analyze_collectives(text, mesh, range(mesh.num_devices))
    return records(found.compared())


def predicted(src, dst, shape, mesh: Mesh, tile_moves: bool = True) -> cost.Reshard:
    priced = uniform_mesh(mesh.shape, mesh.axis_names, alpha=1e-5, beta=1e-10)
    if tile_moves:
        return cost.reshard(src, dst, shape, 4, priced)
    saved = cost.tile_route, cost.xla_route
    cost.tile_route = cost.xla_route = lambda *args: None
    cost._reshard.cache_clear()
    try:
        return cost.reshard(src, dst, shape, 4, priced)
    finally:
        cost.tile_route, cost.xla_route = saved
        cost._reshard.cache_clear()


def _fmt(recs) -> str:
    return " + ".join(f"{k} {','.join(a)} {b} B" for k, a, b in recs) or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, choices=(2, 3, 4), default=2)
    p.add_argument("--meshes", default="2x2,2x4,4x2")
    p.add_argument("--without-tile-moves", action="store_true")
    p.add_argument(
        "--pin-steps",
        action="store_true",
        help="compile each move as the runtime runs it: the predicted route's steps pinned",
    )
    p.add_argument("--out", default="benchmarks/results/reshard_moves.json")
    args = p.parse_args(argv)
    shape = SHAPES[args.rank]
    specs = all_specs(args.rank)
    rows, summary = [], {}
    start = time.perf_counter()
    for mesh_text in args.meshes.split(","):
        mshape = tuple(int(s) for s in mesh_text.split("x"))
        mesh = Mesh(AXES, mshape)
        devices = np.array(jax.devices()[: math.prod(mshape)]).reshape(mshape)
        jmesh = jax.sharding.Mesh(devices, AXES)
        moves = list(itertools.permutations(specs, 2))
        agree = permutes = pinned = 0
        for n, (src, dst) in enumerate(moves):
            if n % 50 == 0:
                elapsed = time.perf_counter() - start
                print(f"{mesh_text}: move {n}/{len(moves)} ({elapsed:.0f} s)", file=sys.stderr)
            route = predicted(src, dst, shape, mesh, not args.without_tile_moves)
            steps = route.steps if args.pin_steps else ()
            compiled = compiled_records(compile_move(jmesh, src, dst, shape, steps), mesh)
            predicted_recs = records(route.collectives)
            has_permute = any(k == "collective-permute" for k, _, _ in compiled)
            agree += compiled == predicted_recs
            pinned += bool(route.steps)
            permutes += has_permute
            rows.append(
                {
                    "mesh": mesh_text,
                    "src": str(src),
                    "dst": str(dst),
                    "compiled": [list(r) for r in compiled],
                    "predicted": [list(r) for r in predicted_recs],
                    "pinned": [str(st) for st in route.steps],
                    "agree": compiled == predicted_recs,
                    "collective_permute": has_permute,
                }
            )
        summary[mesh_text] = {
            "moves": len(moves),
            "with_permute": permutes,
            "pinned_routes": pinned,
            "agree": agree,
        }
    print("| mesh | from | to | XLA compiles | autoshard predicts |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["collective_permute"] or not r["agree"]:
            same = "same" if r["agree"] else _fmt(r["predicted"]) + " (DIFFERS)"
            print(f"| {r['mesh']} | `{r['src']}` | `{r['dst']}` | {_fmt(r['compiled'])} | {same} |")
    for mesh_text, s in summary.items():
        print(
            f"{mesh_text}: {s['moves']} moves, {s['with_permute']} with a collective-permute, "
            f"{s['pinned_routes']} priced routes the runtime pins, "
            f"{s['agree']} predicted exactly (kind, axes, count, bytes)"
        )
    doc = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "shape": list(shape),
        "tile_moves": not args.without_tile_moves,
        "pin_steps": args.pin_steps,
        "command": "python benchmarks/studies/reshard_moves.py " + " ".join(argv or sys.argv[1:]),
        "summary": summary,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
