"""What a saved plan is, read off its file (jax-free).

Takes a :class:`~autoshard.ir.planfile.PlanFile` (with its ``inputs`` table: every program
input's path, kind, shape and dtype) and returns a frozen :class:`PlanDigest`:

* the parallelism in roles, not specs (:class:`Parallelism`): which mesh axes split the
  batch (data parallel), which split weights but not the batch (tensor parallel), the
  ZeRO stage those batch axes reach (1: optimizer state split, 2: and gradients
  reduce-scattered, 3: weights split too), and a one-line summary in words;
* every parameter's sharding in scaling-book notation, grouped by layer, identical layers
  folded (``block_0..3``);
* collectives per step by mesh axis (bytes per device, as predicted);
* memory per device by category (weights, gradients, optimizer state, data, and the
  rest of the predicted peak: activations and temporaries);
* predicted against compiled, where the file holds a verification (``plan --verify``).

Nothing here solves, traces or compiles: a digest is as cheap as reading the JSON.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.ir.planfile import PlanFile, PlanFileError, PlanInput
from autoshard.ir.spec import Mesh, ShardingSpec

_KEY = re.compile(r"\['([^']+)'\]")
_NUMBERED = re.compile(r"^(.*?)_(\d+)$")


def short_path(path: str) -> str:
    """``[0]['block_0']['attn']['qkv']['kernel']`` -> ``block_0/attn/qkv/kernel``."""
    keys = _KEY.findall(path)
    return "/".join(keys) if keys else path


def layer_of(path: str) -> str:
    """The first pytree key of an input's path (``block_0``, ``embedding``, ``head``)."""
    keys = _KEY.findall(path)
    if len(keys) > 1 and keys[0] == "params":  # Flax's top-level collection
        keys = keys[1:]
    return keys[0] if keys else "(top)"


@dataclass(frozen=True)
class ParamRow:
    """One parameter: its name inside its layer, and its spec in scaling-book notation."""

    name: str  # attn/qkv/kernel
    spec: str  # f32[64, 192@model]
    bytes_per_device: float


@dataclass(frozen=True)
class LayerGroup:
    """Layers with identical parameter shardings, folded into one row group."""

    layers: tuple[str, ...]  # block_0, block_1, ...
    params: tuple[ParamRow, ...]

    @property
    def label(self) -> str:
        if len(self.layers) == 1:
            return self.layers[0]
        m = _NUMBERED.match(self.layers[0])
        nums = [int(_NUMBERED.match(name).group(2)) for name in self.layers]
        return f"{m.group(1)}_{min(nums)}..{max(nums)} ({len(self.layers)} identical)"


@dataclass(frozen=True)
class Parallelism:
    """The plan's parallelism in roles (see the module docstring)."""

    mesh: Mesh
    dp_axes: tuple[str, ...]  # axes that split the batch
    tp_axes: tuple[str, ...]  # axes that split weights, not the batch
    idle_axes: tuple[str, ...]  # axes of size > 1 that split neither
    zero_stage: int  # 0..3 over the batch axes
    num_stages: int = 1
    recompute: str = "none"

    @property
    def dp(self) -> int:
        return self.mesh.size(self.dp_axes)

    @property
    def tp(self) -> int:
        return self.mesh.size(self.tp_axes)

    def summary(self) -> str:
        """E.g. ``1 stage x (DP 2 over data, TP 4 over model), ZeRO-1 optimizer state,
        no recompute``."""
        roles = []
        if self.dp > 1:
            roles.append(f"DP {self.dp} over {'+'.join(self.dp_axes)}")
        if self.tp > 1:
            roles.append(f"TP {self.tp} over {'+'.join(self.tp_axes)}")
        for axis in self.idle_axes:
            roles.append(f"{axis} ({self.mesh.size(axis)}) replicates everything")
        stages = f"{self.num_stages} stage{'s' if self.num_stages > 1 else ''}"
        text = f"{stages} x ({', '.join(roles) or 'one device'})"
        zero = {
            1: "ZeRO-1 optimizer state",
            2: "ZeRO-2 optimizer state and gradients",
            3: "ZeRO-3 (FSDP) weights, gradients and optimizer state",
        }.get(self.zero_stage)
        if zero:
            text += f", {zero}"
        recompute = "no recompute" if self.recompute == "none" else f"{self.recompute} recompute"
        return f"{text}, {recompute}"


@dataclass(frozen=True)
class PlanDigest:
    """A plan file read for people: see the module docstring."""

    plan_file: PlanFile
    parallelism: Parallelism
    layers: tuple[LayerGroup, ...]
    memory_bytes: Mapping[str, float]  # category -> bytes per device
    collectives_by_axes: Mapping[tuple[str, ...], Mapping[str, int]]  # axes -> kind -> bytes
    global_batch: int | None
    dtype: str | None
    verification: Mapping | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def plan(self):
        return self.plan_file.plan

    @property
    def mesh(self) -> Mesh:
        return self.plan_file.plan.mesh

    def specs(self) -> list[tuple[PlanInput, ShardingSpec]]:
        return list(zip(self.plan_file.inputs, self.plan.input_specs, strict=True))


def _axes_of(spec: ShardingSpec) -> set[str]:
    return {a for d in spec.dims for a in d}


def _fraction_over(rows, axes: tuple[str, ...]) -> float:
    """Of the bytes in ``rows`` (input, spec), the fraction split over any of ``axes``."""
    total = sum(i.nbytes for i, _ in rows)
    split = sum(i.nbytes for i, s in rows if _axes_of(s) & set(axes))
    return split / total if total else 0.0


def parallelism_of(plan_file: PlanFile) -> Parallelism:
    """Roles of the mesh axes, read off the input specs (module docstring)."""
    mesh = plan_file.plan.mesh
    rows = list(zip(plan_file.inputs, plan_file.plan.input_specs, strict=True))
    live = [a for a in mesh.axis_names if mesh.size(a) > 1]
    data = [(i, s) for i, s in rows if i.kind == "data" and i.shape]
    dp_axes = tuple(a for a in live if any(s.dims and a in s.dims[0] for _, s in data))
    weights = [(i, s) for i, s in rows if i.kind == "param" and len(i.shape) >= 2]
    tp_axes = tuple(
        a for a in live if a not in dp_axes and any(a in _axes_of(s) for _, s in weights)
    )
    idle = tuple(a for a in live if a not in dp_axes and a not in tp_axes)
    zero = 0
    states = [(i, s) for i, s in rows if i.kind == "opt_state" and i.shape]
    if dp_axes and _fraction_over(states, dp_axes) > 0.5:
        zero = 1
        if _fraction_over(weights, dp_axes) > 0.5:
            zero = 3
        elif any(
            c.kind == "reduce-scatter" and set(c.axes) & set(dp_axes)
            for c in plan_file.plan.predicted_collectives
        ):
            zero = 2
    return Parallelism(mesh, dp_axes, tp_axes, idle, zero)


def _layer_groups(plan_file: PlanFile) -> tuple[LayerGroup, ...]:
    mesh = plan_file.plan.mesh
    by_layer: dict[str, list[ParamRow]] = {}
    for inp, spec in zip(plan_file.inputs, plan_file.plan.input_specs, strict=True):
        if inp.kind != "param":
            continue
        name = short_path(inp.path).removeprefix("params/")
        layer = layer_of(inp.path)
        inner = name[len(layer) + 1 :] if name.startswith(layer + "/") else name
        by_layer.setdefault(layer, []).append(
            ParamRow(
                inner, spec.format(inp.shape, inp.dtype), inp.nbytes * spec.shard_fraction(mesh)
            )
        )
    groups: list[LayerGroup] = []
    folded: dict[tuple, int] = {}  # (prefix, rows) -> index in groups
    for layer, params in by_layer.items():
        m = _NUMBERED.match(layer)
        key = (m.group(1), tuple(params)) if m else None
        if key is not None and key in folded:
            g = groups[folded[key]]
            groups[folded[key]] = LayerGroup((*g.layers, layer), g.params)
            continue
        if key is not None:
            folded[key] = len(groups)
        groups.append(LayerGroup((layer,), tuple(params)))
    return tuple(groups)


def memory_by_category(plan_file: PlanFile) -> dict[str, float]:
    """Bytes per device: weights, gradients (one per weight, laid out like the optimizer
    state under ZeRO-2/3, like the weight otherwise: an estimate), optimizer state, data,
    and activations and temporaries (the predicted peak less the rest, never below 0)."""
    mesh = plan_file.plan.mesh
    rows = list(zip(plan_file.inputs, plan_file.plan.input_specs, strict=True))
    per_device = {
        kind: sum(i.nbytes * s.shard_fraction(mesh) for i, s in rows if i.kind == kind)
        for kind in ("param", "opt_state", "data")
    }
    roles = parallelism_of(plan_file)
    params = [(i, s) for i, s in rows if i.kind == "param"]
    if roles.zero_stage >= 2:  # gradients reduce-scattered over the batch axes
        grads = sum(i.nbytes * s.shard_fraction(mesh) / roles.dp for i, s in params)
        if roles.zero_stage == 3:  # the weights are split over the batch axes already
            grads = per_device["param"]
    else:
        grads = per_device["param"]
    out = {
        "weights": per_device["param"],
        "gradients": grads,
        "optimizer state": per_device["opt_state"],
        "data": per_device["data"],
    }
    where = dict(plan_file.plan.offload.get("where", {}))  # offload: what the host holds
    for cls, key in (("master", "weights"), ("optimizer", "optimizer state")):
        if where.get(cls) == "host":
            out[f"{key} (host memory)"] = out.pop(key)
    if where.get("gradients") == "host":
        out["gradients (host memory)"] = out.pop("gradients")
    on_device = sum(v for k, v in out.items() if not k.endswith("(host memory)"))
    rest = plan_file.plan.predicted_peak_bytes - on_device
    out["activations and temporaries"] = max(rest, 0.0)
    return out


def collectives_by_axes(plan_file: PlanFile) -> dict[tuple[str, ...], dict[str, int]]:
    out: dict[tuple[str, ...], dict[str, int]] = {}
    for (kind, axes), nbytes in sorted(plan_file.plan.collective_totals().items()):
        out.setdefault(tuple(axes), {})[kind] = nbytes
    return out


def digest(plan_file: PlanFile) -> PlanDigest:
    """The :class:`PlanDigest` of ``plan_file``; PlanFileError when the file has no
    ``inputs`` table (written before it existed: save the plan again)."""
    if not plan_file.inputs:
        raise PlanFileError(
            "the plan file lists no 'inputs' (shapes and kinds of the program inputs); it was "
            "written by an older autoshard: save it again with `autoshard plan ... --out`"
        )
    data = [i for i in plan_file.inputs if i.kind == "data" and i.shape]
    params = [i for i in plan_file.inputs if i.kind == "param"]
    extra = plan_file.extra
    verification = None
    if "compiled_peak_bytes" in extra:
        checked = extra.get("verification") or {}
        rows: dict[tuple, dict] = {}
        for side in ("predicted", "compiled"):
            for c in checked.get(f"{side}_collectives", []):
                row = rows.setdefault(
                    (c["kind"], tuple(c["axes"])),
                    {"kind": c["kind"], "axes": list(c["axes"]), "predicted_bytes": 0,
                     "compiled_bytes": 0},
                )  # fmt: skip
                row[f"{side}_bytes"] = c["bytes"]
        verification = {
            "compiled_peak_bytes": extra.get("compiled_peak_bytes"),
            "predicted_peak_bytes": plan_file.plan.predicted_peak_bytes,
            "memory_error": extra.get("memory_error"),
            "collectives_agree": extra.get("collectives_agree"),
            "agree": extra.get("agree"),
            "rows": [rows[k] for k in sorted(rows)],
        }
    return PlanDigest(
        plan_file=plan_file,
        parallelism=parallelism_of(plan_file),
        layers=_layer_groups(plan_file),
        memory_bytes=memory_by_category(plan_file),
        collectives_by_axes=collectives_by_axes(plan_file),
        global_batch=data[0].shape[0] if data else None,
        dtype=params[0].dtype if params else None,
        verification=verification,
        notes=tuple(plan_file.plan.notes),
    )
