"""The full weak-scaling grid in checkpointed chunks (one cluster x model family each).

``experiments/weak_scaling.py`` without ``--quick`` runs 63 full searches (three families
to 64 GPUs on three cluster presets) in one process: hours on a 2-core machine, and a stop
loses everything. This runs the same ``run`` chunk by chunk (``SUITES`` and ``CLUSTERS``
narrowed to one family and one cluster), writes each chunk's rows to
``DIR/chunk-<cluster>-<family>.json`` and skips the chunks already there, so it can be
stopped and started again. With ``--assemble`` it joins the finished clusters' chunks
into one ``weak-scaling.json`` (``data.assembled`` and ``data.chunks`` say how it was
made: each chunk's wall and CPU seconds and the commit it ran on) and draws
``weak-scaling.png`` with the script's own ``plot``.

    python benchmarks/weak_scaling_chunks.py DIR                  # run what is missing
    python benchmarks/weak_scaling_chunks.py DIR --families moe wresnet   # only these chunks
    python benchmarks/weak_scaling_chunks.py DIR --assemble OUT   # figure from finished clusters
    python benchmarks/weak_scaling_chunks.py --add-methods megatron-flash DIR  # rows added
    python benchmarks/weak_scaling_chunks.py DIR --families gpt --grad-reduce auto

``--add-methods megatron-flash`` adds Megatron-LM's flash-attention grid point
(``weak_scaling.MEGATRON_PROGRAMS``) to the finished GPT chunks of clusters whose device has
an attention table, one row beside each ``megatron`` row, without running the ``auto``
search again (the grid is closed-form: seconds per chunk). The chunk records it in
``added_methods`` (method, commit, wall seconds, what was not rerun), its ``config`` gets the
method's note, and ``--assemble`` carries ``added_methods`` into ``data.chunks``; a chunk
that has the method's rows already is left as it is.

``--grad-reduce`` is ``weak_scaling.py``'s (where the GPT searches' stages reduce
data-parallel gradients; default ``microbatch``); each chunk records it in
``config.grad_reduce`` (a chunk without it reduced every micro-batch), a finished chunk
that reduced otherwise is refused rather than skipped (give another DIR), and
``--assemble`` records it per chunk and per family as it does the optimizer.

Each chunk records the optimizer its family was traced with (``weak_scaling.OPTIMIZER``);
a chunk written before that was recorded traced AdamW, the only optimizer then, and the
assembled ``data.chunks`` says so (``optimizer_recorded: false``); ``config.optimizer``
is per family, per cluster where a family's chunks differ (each panel's title says its own).
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import figure  # noqa: E402
import weak_scaling as ws  # noqa: E402


def chunk_optimizer(part: dict, family: str) -> str:
    """The optimizer a chunk traced its family with: recorded in its config, else AdamW
    (chunks written before the optimizer was recorded traced every family with AdamW)."""
    return part["config"].get("optimizer", {}).get(family, "adamw")


def chunk_grad_reduce(part: dict, family: str) -> str:
    """Where a chunk's searches reduced data-parallel gradients: recorded in its config,
    else every micro-batch (chunks written before it was recorded)."""
    return part["config"].get("grad_reduce", {}).get(family, "microbatch")


ADDABLE = ("megatron-flash",)  # methods --add-methods can add to finished chunks


def add_methods(part: dict, cluster: str, family: str, methods: tuple[str, ...]) -> list[str]:
    """Add ``methods`` (Megatron grid methods, ``ADDABLE``) to the finished chunk ``part``
    of ``cluster`` x ``family`` in place: one row per GPU count of its ``megatron`` rows, at
    the chunk's own global batch, placed after the Megatron rows of that point; the other
    rows are not touched. Returns the methods added (not those the cluster cannot price or
    the chunk has already)."""
    unknown = [m for m in methods if m not in ADDABLE]
    if unknown:
        raise ValueError(f"cannot add {unknown}; addable: {ADDABLE}")
    have = {r["method"] for r in part["rows"]}
    todo = [m for m in methods if m in ws.megatron_methods(cluster) and m not in have]
    if family != "gpt" or not todo:
        return []
    batch = part["config"]["global_batch"]["gpt"]
    t0 = time.perf_counter()
    rows = []
    for r in part["rows"]:
        rows.append(r)
        if r["method"] == "megatron" and r["cluster"] == cluster and r["family"] == family:
            rows += [
                ws.megatron_row(cluster, family, r["model"], r["gpus"], batch, m)[0] for m in todo
            ]
    part["rows"] = rows
    wall = time.perf_counter() - t0
    part["config"]["megatron_flash"] = ws.MEGATRON_FLASH_NOTE
    part.setdefault("added_methods", []).extend(
        {"method": m, "commit": (figure.git_commit() or "")[:7] or None, "wall_s": wall,
         "note": "added to the finished chunk by weak_scaling_chunks.py --add-methods; the "
         "chunk's other rows (auto and its restricted searches) were not rerun"}
        for m in todo
    )  # fmt: skip
    return todo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="folder for the chunk files")
    ap.add_argument("--assemble", metavar="OUT", help="join finished clusters, plot into OUT")
    ap.add_argument(
        "--families", nargs="+", choices=tuple(ws.SUITES), help="run only these families' chunks"
    )
    ap.add_argument(
        "--clusters", nargs="+", choices=tuple(ws.CLUSTERS), help="run only these clusters' chunks"
    )
    ap.add_argument(
        "--add-methods",
        action="append",
        choices=ADDABLE,
        metavar="METHOD",
        help=f"add this method's rows to the finished chunks (one of {', '.join(ADDABLE)}; "
        "repeatable) without rerunning them",
    )
    ap.add_argument(
        "--grad-reduce",
        choices=ws.GRAD_REDUCE_CHOICES,
        default="microbatch",
        help="where the GPT searches' stages reduce data-parallel gradients (weak_scaling.py's "
        "--grad-reduce; default: microbatch)",
    )
    args = ap.parse_args()
    if args.assemble is not None and (args.families or args.clusters or args.add_methods):
        ap.error(
            "--families, --clusters and --add-methods work on chunks; --assemble joins every one"
        )
    src = Path(args.dir)
    src.mkdir(parents=True, exist_ok=True)
    suites, clusters = dict(ws.SUITES), tuple(ws.CLUSTERS)

    def path(cluster: str, family: str) -> Path:
        return src / f"chunk-{cluster}-{family}.json"

    if args.add_methods:
        for c in args.clusters or clusters:
            for f in args.families or suites:
                if not path(c, f).exists():
                    continue
                part = json.loads(path(c, f).read_text())
                added = add_methods(part, c, f, tuple(args.add_methods))
                if added:
                    path(c, f).write_text(json.dumps(part, indent=1) + "\n")
                print(f"chunk {c} {f}: added {', '.join(added) or 'nothing'}", flush=True)
        return

    if args.assemble is None:
        for c in args.clusters or clusters:
            for f in args.families or suites:
                want = ws.family_grad_reduce(f, args.grad_reduce)
                if path(c, f).exists():
                    had = chunk_grad_reduce(json.loads(path(c, f).read_text()), f)
                    if had != want:
                        sys.exit(f"{path(c, f)} reduced gradients by {had}, not {want}: "
                                 "give another DIR")  # fmt: skip
                    continue
                ws.SUITES, ws.CLUSTERS = {f: suites[f]}, (c,)
                # the commit at the start: the code this process runs (a checkout that
                # moves under a long chunk does not change it)
                commit = (figure.git_commit() or "")[:7] or None
                t0, cpu0 = time.perf_counter(), figure.cpu_seconds()
                data = ws.run(False, figure.progress, grad_reduce=args.grad_reduce)
                data["chunk_wall_s"] = time.perf_counter() - t0
                data["chunk_cpu_s"] = figure.cpu_seconds() - cpu0
                data["chunk_commit"] = commit
                path(c, f).write_text(json.dumps(data, indent=1) + "\n")
                print(f"chunk {c} {f}: {data['chunk_wall_s']:.0f} s wall", flush=True)
        return
    done = [c for c in clusters if all(path(c, f).exists() for f in suites)]
    if not done:
        sys.exit(f"no cluster has all its chunks in {src}; run without --assemble first")
    chunks = [(c, f) for c in done for f in suites]
    parts = [json.loads(path(c, f).read_text()) for c, f in chunks]
    data = dict(parts[0])
    data["rows"] = [r for p in parts for r in p["rows"]]

    def per_family(read):  # per family; per cluster where the chunks of a family differ
        out = {}
        for f in suites:
            by_cluster = {c: read(p, f) for (c, g), p in zip(chunks, parts) if g == f}
            names = set(by_cluster.values())
            out[f] = names.pop() if len(names) == 1 else by_cluster
        return out

    data["config"] = dict(
        parts[0]["config"], clusters=done, max_gpus={f: 64 for f in suites},
        optimizer=per_family(chunk_optimizer), grad_reduce=per_family(chunk_grad_reduce),
    )  # fmt: skip
    notes = [p["config"]["megatron_flash"] for p in parts if "megatron_flash" in p["config"]]
    if notes:  # the GPT chunks of clusters with an attention table have it
        data["config"]["megatron_flash"] = notes[0]
    data["families_skipped"] = {
        k: v for p in parts for k, v in p.get("families_skipped", {}).items()
    }
    data["assembled"] = (
        "run in chunks (one cluster x family each, one process, checkpointed: "
        "benchmarks/weak_scaling_chunks.py); per-chunk wall and CPU seconds and commit in chunks"
    )
    data["chunks"] = [
        {"cluster": c, "family": f, "wall_s": p["chunk_wall_s"], "cpu_s": p["chunk_cpu_s"],
         "commit": p.get("chunk_commit"), "optimizer": chunk_optimizer(p, f),
         "optimizer_recorded": "optimizer" in p["config"],
         "grad_reduce": chunk_grad_reduce(p, f),
         "added_methods": p.get("added_methods", [])}
        for (c, f), p in zip(chunks, parts, strict=True)
    ]  # fmt: skip
    unknown = [
        f"{c} {f}" for (c, f), p in zip(chunks, parts, strict=True) if not p.get("chunk_commit")
    ]
    if unknown:  # chunks written before chunk_commit was recorded
        print(f"warning: no commit recorded for {', '.join(unknown)}", file=sys.stderr)
    for k in ("chunk_wall_s", "chunk_cpu_s", "chunk_commit", "added_methods"):
        data.pop(k, None)
    doc = figure.record(ws, data, False, sum(p["chunk_wall_s"] for p in parts))
    doc["cpu_seconds"] = sum(p["chunk_cpu_s"] for p in parts)
    doc["command"] = "python benchmarks/weak_scaling_chunks.py DIR (then --assemble OUT)"
    out = Path(args.assemble)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weak-scaling.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure.save(ws.plot(doc), out / "weak-scaling.png")
    print(f"wrote {out / 'weak-scaling.json'} and its PNG ({', '.join(done)})", flush=True)


if __name__ == "__main__":
    main()
