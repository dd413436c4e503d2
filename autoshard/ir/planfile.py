"""Plan files: a plan saved with what it was made for (jax-free).

Takes a :class:`~autoshard.ir.plan.ParallelPlan`, the :class:`~autoshard.ir.graph.Graph`
it was made for and where that graph came from (model preset, size overrides,
optimizer, planner options); returns one versioned JSON document::

    {"schema": "autoshard.plan/1", "kind": "intra",
     "fingerprint": {"program": {...}, "mesh": {...}, "model": ..., "overrides": {...},
                     "optimizer": ..., "options": {...}},
     "inputs": [{"path": ..., "kind": "param", "shape": [...], "dtype": ..., "bytes": ...}],
     "parallel_plan": {...}}

``inputs`` (one row per program input, in the plan's ``input_specs`` order) lets a reader
that has no jax (``autoshard explain``, ``autoshard export``) know each input's shape,
dtype and kind; files written before it existed read back with ``inputs == ()``.

A pipeline plan (``"kind": "pipeline"``) holds ``"inter_plan"`` (the inter-operator plan's
JSON) instead of ``"parallel_plan"`` and loads as a :class:`PipelinePlanFile`.

Reading one back (:func:`load_plan`, :func:`plan_file_from_json`) checks the schema and
every key and raises :class:`PlanFileError` (a ValueError) with what is wrong, never a
KeyError; :func:`check_fingerprint` refuses a re-traced program or a mesh that is not
the one the plan was made for, naming what differs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autoshard.ir.graph import Graph
from autoshard.ir.plan import ParallelPlan
from autoshard.ir.spec import Mesh

SCHEMA = "autoshard.plan/1"
KINDS = ("intra", "pipeline")


class PlanFileError(ValueError):
    """A plan file that cannot be read, or one made for another program or mesh."""


def program_fingerprint(graph: Graph) -> dict:
    """A hash over the tensors' shapes, dtypes and kinds and the nodes' primitives and
    wiring (inputs, outputs, aliases), with the counts that make a difference readable."""
    h = hashlib.sha256()
    for t in graph.tensors:
        h.update(f"t{t.id}:{t.shape}:{t.dtype}:{t.kind};".encode())
    for n in graph.nodes:
        h.update(f"n{n.index}:{n.primitive}:{n.inputs}:{n.outputs};".encode())
    h.update(f"in{graph.inputs}out{graph.outputs}alias{graph.aliases}".encode())
    return {
        "sha256": h.hexdigest(),
        "nodes": len(graph.nodes),
        "tensors": len(graph.tensors),
        "params": graph.num_params(),
        "layers": len(graph.layers),
    }


def mesh_json(mesh: Mesh) -> dict:
    return {"axis_names": list(mesh.axis_names), "shape": list(mesh.shape)}


def describe_mesh(mesh: Mesh) -> str:
    """``2x4 (data, model)``."""
    return "x".join(map(str, mesh.shape)) + f" ({', '.join(mesh.axis_names)})"


@dataclass(frozen=True)
class PlanInput:
    """One program input as a plan file lists it: pytree path, kind (param, opt_state,
    data, ...), shape, dtype and bytes (of the whole, unsharded array)."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
        }

    @staticmethod
    def from_json(obj: dict) -> PlanInput:
        return PlanInput(
            str(obj["path"]),
            str(obj["kind"]),
            tuple(int(s) for s in obj["shape"]),
            str(obj["dtype"]),
            int(obj["bytes"]),
        )


def input_table(graph: Graph) -> tuple[PlanInput, ...]:
    """The graph's program inputs as :class:`PlanInput` rows, in ``graph.inputs`` order."""
    return tuple(
        PlanInput(t.path, t.kind, tuple(t.shape), t.dtype, int(t.nbytes))
        for t in (graph.tensors[i] for i in graph.inputs)
    )


class _Fingerprinted:
    """What both plan files read off their fingerprint, and how they are written."""

    @property
    def model(self) -> str | None:
        return self.fingerprint.get("model")

    @property
    def overrides(self) -> dict:
        return dict(self.fingerprint.get("overrides") or {})

    @property
    def optimizer(self) -> str | None:
        return self.fingerprint.get("optimizer")

    def save(self, path) -> None:
        """Write the plan file; a path ending in ``.gz`` is written gzip'd (a 24-layer
        GPT's plan is ~3 MB of JSON, ~80 KB gzip'd)."""
        try:
            opener = gzip.open if str(path).endswith(".gz") else open
            with opener(path, "wt") as f:
                json.dump(self.to_json(), f, indent=2)
                f.write("\n")
        except OSError as err:
            raise PlanFileError(f"cannot write the plan to {str(path)!r}: {err.strerror}") from None


@dataclass(frozen=True)
class PlanFile(_Fingerprinted):
    """A loaded plan file: the plan, and the fingerprint of what it was made for."""

    plan: ParallelPlan
    fingerprint: Mapping[str, Any]
    kind: str = "intra"
    extra: Mapping[str, Any] = field(default_factory=dict)  # summary keys, kept as read
    inputs: tuple[PlanInput, ...] = ()  # one per program input, () in older files

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "kind": self.kind,
            **self.extra,
            "fingerprint": dict(self.fingerprint),
            **({"inputs": [i.to_json() for i in self.inputs]} if self.inputs else {}),
            "parallel_plan": self.plan.to_json(),
        }


@dataclass(frozen=True)
class PipelinePlanFile(_Fingerprinted):
    """A saved pipeline plan (``plan --pipeline ... --out``): the inter-operator pass's
    plan as its JSON (``inter_plan``: read it with ``autoshard.inter.plan.InterPlan.
    from_json``; the ir layer does not know the type), what it was made for, and the global
    batch. ``explain`` and ``export`` read it; ``run --plan`` does not run it yet."""

    inter_plan: Mapping[str, Any]
    fingerprint: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "pipeline"

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "kind": self.kind,
            **self.extra,
            "fingerprint": dict(self.fingerprint),
            "inter_plan": dict(self.inter_plan),
        }


def make_fingerprint(
    graph: Graph,
    mesh: Mesh,
    *,
    model: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    optimizer: str | None = None,
    options: Mapping[str, Any] | None = None,
    cluster: str | None = None,
) -> dict:
    """What a plan was made for; ``options``: the planner's settings as plain data
    (``dataclasses.asdict(IntraOptions)``)."""
    return {
        "program": program_fingerprint(graph),
        "mesh": mesh_json(mesh),
        "model": model,
        "overrides": {k: v for k, v in (overrides or {}).items() if v is not None},
        "optimizer": optimizer,
        "options": dict(options or {}),
        "cluster": cluster,
    }


def plan_file_from_json(obj: Any, source: str = "the plan file") -> PlanFile | PipelinePlanFile:
    """Read a plan file's document; PlanFileError naming what is wrong."""
    if not isinstance(obj, dict):
        raise PlanFileError(f"{source} is not a JSON object (a plan file written by plan --out)")
    schema = obj.get("schema")
    if schema is None:
        raise PlanFileError(
            f"{source} has no 'schema' key: not a plan file (write one with "
            "`autoshard plan ... --out plan.json`)"
        )
    if schema != SCHEMA:
        newer = _schema_version(schema) > _schema_version(SCHEMA)
        raise PlanFileError(
            f"{source} has schema {schema!r}; this autoshard reads {SCHEMA!r} "
            + (
                "(a newer autoshard wrote it: upgrade autoshard to read it)"
                if newer
                else "(re-plan with this version to write one)"
            )
        )
    kind = obj.get("kind")
    if kind not in KINDS:
        raise PlanFileError(
            f"{source} is a plan of kind {kind!r}; this autoshard runs plans of kind "
            f"{', '.join(map(repr, KINDS))}"
        )
    if kind == "pipeline":
        for key in ("fingerprint", "inter_plan"):
            if not isinstance(obj.get(key), dict):
                raise PlanFileError(f"{source} has no {key!r} object (the file was cut or edited)")
        extra = {
            k: v for k, v in obj.items() if k not in ("schema", "kind", "fingerprint", "inter_plan")
        }
        return PipelinePlanFile(obj["inter_plan"], obj["fingerprint"], extra)
    for key in ("fingerprint", "parallel_plan"):
        if not isinstance(obj.get(key), dict):
            raise PlanFileError(f"{source} has no {key!r} object (the file was cut or edited)")
    fp = obj["fingerprint"]
    for key in ("program", "mesh"):
        if not isinstance(fp.get(key), dict):
            raise PlanFileError(f"{source}: fingerprint has no {key!r} object")
    try:
        plan = ParallelPlan.from_json(obj["parallel_plan"])
        fp_mesh = Mesh(tuple(fp["mesh"]["axis_names"]), tuple(fp["mesh"]["shape"]))
        inputs = tuple(PlanInput.from_json(row) for row in obj.get("inputs", ()))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        what = f"missing key {err}" if isinstance(err, KeyError) else str(err)
        raise PlanFileError(f"{source}: the plan cannot be read ({what})") from None
    if fp_mesh != plan.mesh:
        raise PlanFileError(
            f"{source}: the plan is on mesh {describe_mesh(plan.mesh)} but its fingerprint "
            f"says {describe_mesh(fp_mesh)} (the file was edited)"
        )
    if inputs and len(inputs) != len(plan.input_specs):
        raise PlanFileError(
            f"{source}: {len(inputs)} rows in 'inputs' but {len(plan.input_specs)} input specs "
            "in the plan (the file was edited)"
        )
    extra = {
        k: v
        for k, v in obj.items()
        if k not in ("schema", "kind", "fingerprint", "inputs", "parallel_plan")
    }
    return PlanFile(plan, fp, kind, extra, inputs)


def _schema_version(schema) -> int:
    """``autoshard.plan/3`` -> 3 (-1: not of that form)."""
    prefix = SCHEMA.rsplit("/", 1)[0] + "/"
    rest = str(schema)[len(prefix) :] if str(schema).startswith(prefix) else ""
    return int(rest) if rest.isdigit() else -1


def load_plan(path) -> PlanFile | PipelinePlanFile:
    """Read a plan file from ``path``, gzip'd or not (PlanFileError: missing, not JSON,
    not a plan file)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()
    except (OSError, EOFError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {why}") from None
    except UnicodeDecodeError:
        raise PlanFileError(
            f"plan file {str(path)!r} is not text (a PNG, an archive?): a plan file is the "
            "JSON `autoshard plan ... --out FILE` writes"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFileError(
            f"plan file {str(path)!r} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg})"
        ) from None
    return plan_file_from_json(obj, f"plan file {str(path)!r}")


def require_one_mesh(plan_file, source: str = "the plan file") -> PlanFile:
    """``plan_file`` if it is a one-mesh plan; PlanFileError for a pipeline plan."""
    if plan_file.kind != "intra":
        raise PlanFileError(
            f"{source} is a pipeline plan: `autoshard explain` and `autoshard export` read "
            "it; run and verify take one-mesh plans only (for now)"
        )
    return plan_file


def check_fingerprint(plan_file: PlanFile, graph: Graph, mesh: Mesh | None = None) -> None:
    """Refuse (PlanFileError) a traced ``graph`` or a ``mesh`` that is not what the plan
    was made for, saying what differs."""
    plan_mesh = plan_file.plan.mesh
    if mesh is not None and mesh != plan_mesh:
        raise PlanFileError(
            f"the plan was made for mesh {describe_mesh(plan_mesh)}, not {describe_mesh(mesh)}"
        )
    want = plan_file.fingerprint["program"]
    got = program_fingerprint(graph)
    if want.get("sha256") == got["sha256"]:
        return
    diffs = [
        f"{want.get(k, '?'):,} {k} in the plan's, {got[k]:,} traced"
        if isinstance(want.get(k), int)
        else f"{k}: {want.get(k)!r} in the plan's, {got[k]!r} traced"
        for k in ("nodes", "tensors", "params", "layers")
        if want.get(k) != got[k]
    ]
    raise PlanFileError(
        "the program differs from the one the plan was made for: "
        + ("; ".join(diffs) if diffs else "same sizes, different shapes, dtypes or wiring")
    )
