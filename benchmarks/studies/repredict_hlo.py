"""A stored plan file's collectives predicted again by this tree from its specs, against
a compiled module's HLO stored beside it (a diagnostic: no compile, no solve).

The plan's specs are kept and its collectives predicted per value
(:func:`autoshard.verify.xla_gpu._values`, as ``collectives_by_value`` does for a solved
plan); the HLO is read by the verifier (collective-permutes included) and both are
compared per (kind, axes) with the verifier's 2% rule::

    python benchmarks/studies/repredict_hlo.py PLAN.json.gz HLO [--out F]

``HLO``: a ``.hlo.txt`` / ``.hlo.txt.gz`` file, or a run's ``--hlo-tar`` (the member
named after the plan file).  The plan binds only to the program of the JAX it was made
with (run it with that JAX).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
import time
from pathlib import Path


def _hlo_text(path: Path, row: str) -> str:
    if path.name.endswith(".gz") and not path.name.endswith(".tar.gz"):
        return gzip.open(path, "rt").read()
    if path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.isfile() and Path(m.name).name == f"{row}.hlo.txt":
                    return tar.extractfile(m).read().decode()
        raise SystemExit(f"{path}: no member {row}.hlo.txt")
    return path.read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan_file")
    ap.add_argument("hlo")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    from autoshard.api import trace_workload
    from autoshard.ir.planfile import check_fingerprint, load_plan
    from autoshard.verify.collectives import analyze_collectives
    from autoshard.verify.compare import compare_collectives
    from autoshard.verify.xla_gpu import _values

    pf = load_plan(args.plan_file)
    row = Path(args.plan_file).name.removesuffix(".gz").removesuffix(".json")
    t0 = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] tracing {pf.model} ...", file=sys.stderr, flush=True)
    traced = trace_workload(pf.model, pf.optimizer or "adamw", **pf.overrides)
    check_fingerprint(pf, traced.graph, pf.plan.mesh)
    values = _values(traced.graph, pf.plan)
    predicted = [c for _, cols in sorted(values.items()) for c in cols]
    text = _hlo_text(Path(args.hlo), row)
    mesh = pf.plan.mesh
    compiled = list(analyze_collectives(text, mesh, range(mesh.num_devices)).compared())
    cmp = compare_collectives(predicted, compiled)
    print(cmp.format())
    doc = {
        "command": "python benchmarks/studies/repredict_hlo.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jax": jax.__version__,
        "plan": args.plan_file,
        "hlo": args.hlo,
        "collectives_agree": cmp.agree,
        "rows": [r.to_json() for r in cmp.rows],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
