"""Plans taken elsewhere: Megatron-LM arguments, a DeepSpeed config, MaxText settings
(jax-free).

Takes a :class:`~autoshard.report.digest.PlanDigest`; returns an :class:`Export`: the
target's settings (``config``, plain data), the text to paste (command-line arguments,
a JSON document, ``key=value`` lines), and, per tensor, where the target's nearest
configuration lays a tensor out differently from the plan (``differences``).

How the nearest configuration is found: the digest's roles (data-parallel axes, tensor-
parallel axes, ZeRO stage) are mapped onto what the target can express (DeepSpeed's
config has no tensor parallelism; Megatron-LM has no ZeRO-3; MaxText no ZeRO-1/2); the
specs that configuration gives every parameter, optimizer-state array and data input are
built with the same rule tables as autoshard's baselines
(:func:`autoshard.intra.baselines.tables.baseline_inputs`), and compared with the plan's. A
baseline plan (``dp``, ``zero2``, ``zero3``, ``megatron``) whose roles the target can
express exports with no differences; an ILP plan that is not uniform lists each tensor
that differs, with both specs.

Exporters sit in a registry (:data:`EXPORTERS`, ``@register("megatron")``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autoshard.ir.graph import Graph, Tensor
from autoshard.ir.spec import Mesh, ShardingSpec
from autoshard.report.digest import PlanDigest, short_path

Exporter = Callable[[PlanDigest], "Export"]
EXPORTERS: dict[str, Exporter] = {}


def register(name: str):
    def deco(fn: Exporter) -> Exporter:
        EXPORTERS[name] = fn
        return fn

    return deco


@dataclass(frozen=True)
class TensorDifference:
    """One input the target lays out otherwise than the plan."""

    path: str
    kind: str  # param, opt_state, data
    plan_spec: str  # scaling-book notation
    export_spec: str

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "kind": self.kind,
            "plan": self.plan_spec,
            "export": self.export_spec,
        }


@dataclass(frozen=True)
class Export:
    """One target's settings for a plan (module docstring)."""

    target: str
    config: Mapping[str, object]
    text: str
    differences: tuple[TensorDifference, ...]
    notes: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.differences

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "config": dict(self.config),
            "text": self.text,
            "exact": self.exact,
            "differences": [d.to_json() for d in self.differences],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Layout:
    """A target's nearest configuration, in autoshard's terms."""

    tp_axes: tuple[str, ...]
    dp_axes: tuple[str, ...]  # the batch axes of the target (every axis not TP)
    state_split: bool  # optimizer state split over dp_axes (ZeRO >= 1)
    weights_split: bool  # weights split over dp_axes (ZeRO-3 / FSDP)


def _as_graph(d: PlanDigest) -> Graph:
    """A graph of the plan's inputs alone, enough for the baselines' rule tables."""
    tensors = tuple(
        Tensor(k, i.shape, i.dtype, i.nbytes, i.kind, i.path, None, (), -1, 0)
        for k, i in enumerate(d.plan_file.inputs)
    )
    return Graph((), tensors, (), tuple(range(len(tensors))), (), (), (), ())


def _split_free_dim(spec: ShardingSpec, shape, axes: tuple[str, ...], mesh: Mesh):
    """``spec`` with the first dimension it leaves whole split over ``axes`` (the
    baselines' ZeRO rule: the first dimension ``axes`` divide)."""
    n = mesh.size(axes)
    for dim, size in enumerate(shape):
        if not spec.dims[dim] and size % n == 0 and size >= n:
            return spec.with_dim(dim, axes)
    return spec


def _has_rule(path: str) -> bool:
    """Whether the Megatron rule table places this parameter (GPT and MLP presets)."""
    from autoshard.intra.baselines.tables import MEGATRON_RULES

    return any(re.search(p, path) for p, _ in MEGATRON_RULES)


def layout_specs(d: PlanDigest, layout: Layout) -> list[ShardingSpec]:
    """The spec of every program input under ``layout`` (input order)."""
    from autoshard.intra.baselines.tables import baseline_inputs

    mesh = d.mesh
    own_model = d.plan_file.model is None  # the rule table knows only the presets
    if layout.tp_axes:  # Megatron's rules take the last mesh axis as the TP axis
        tp = layout.tp_axes[-1]
        order = [a for a in mesh.axis_names if a != tp] + [tp]
        mesh = Mesh(tuple(order), tuple(d.mesh.size(a) for a in order))
        try:
            base = baseline_inputs(_as_graph(d), mesh, "megatron")
        except ValueError:  # no weight the rule table knows: all are your model's own
            if not own_model:
                raise
            base = baseline_inputs(_as_graph(d), mesh, "dp")
    else:
        base = baseline_inputs(_as_graph(d), mesh, "dp")
    dp = tuple(a for a in d.mesh.axis_names if a in layout.dp_axes)
    out = []
    for k, (inp, planned) in enumerate(d.specs()):
        spec = base[k]
        if (
            own_model
            and layout.tp_axes
            and inp.kind in ("param", "opt_state")
            and not _has_rule(inp.path)
        ):
            # no Megatron rule knows this tensor of your own model: keep the plan's split
            # over the TP axis, which a Megatron-style layer would have to reproduce
            spec = ShardingSpec(tuple(tuple(a for a in ax if a == tp) for ax in planned.dims))
        if inp.kind == "data" and inp.shape:
            spec = ShardingSpec.replicated(len(inp.shape))
            if inp.shape[0] % d.mesh.size(dp) == 0:
                spec = spec.with_dim(0, dp)
        split = layout.state_split if inp.kind == "opt_state" else layout.weights_split
        if inp.kind in ("param", "opt_state") and inp.shape and split and dp:
            spec = _split_free_dim(spec, inp.shape, dp, d.mesh)
        out.append(spec)
    return out


def state_path(path: str) -> str:
    """An optimizer-state input's path for people: ``[1][0].mu['params']['Dense_0']
    ['kernel']`` -> ``opt_state/mu/params/Dense_0/kernel`` (the leading argument and
    chain indices dropped; attribute names and keys kept in order)."""
    parts = re.findall(r"\.(\w+)|\['([^']+)'\]|\[(\d+)\]", path)
    names, started = [], False
    for attr, key, index in parts:
        if attr or key:
            started = True
            names.append(attr or key)
        elif started:
            names.append(index)
    return "/".join(["opt_state", *names]) if names else path


def differences(d: PlanDigest, layout: Layout) -> tuple[TensorDifference, ...]:
    """Every param, optimizer-state and data input whose spec under ``layout`` is not the
    plan's."""
    out = []
    for (inp, spec), want in zip(d.specs(), layout_specs(d, layout), strict=True):
        if inp.kind not in ("param", "opt_state", "data") or not inp.shape:
            continue
        if spec.dims != want.dims:
            out.append(
                TensorDifference(
                    short_path(inp.path) if inp.kind != "opt_state" else state_path(inp.path),
                    inp.kind,
                    spec.format(inp.shape, inp.dtype),
                    want.format(inp.shape, inp.dtype),
                )
            )
    return tuple(out)


def _dp_axes(d: PlanDigest, tp_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Every axis of size > 1 that is not tensor parallel: these frameworks give every
    device not in a TP group to data parallelism."""
    return tuple(a for a in d.mesh.axis_names if d.mesh.size(a) > 1 and a not in tp_axes)


def _batch(d: PlanDigest) -> int:
    if d.global_batch is None:
        raise ValueError("the plan has no data input with a batch dimension: nothing to export")
    return d.global_batch


def _micro_batch(d: PlanDigest, dp: int, target: str) -> int:
    batch = _batch(d)
    if batch % dp:
        raise ValueError(
            f"{target}: global batch {batch} does not split over {dp} data-parallel devices"
        )
    return batch // dp


# autoshard's recompute -> MaxText's remat_policy: nothing recomputed is nearest to
# 'minimal_with_context' (it keeps the matmul outputs and the attention context);
# selective recompute (the attention core again) is 'minimal' (the context not kept)
MAXTEXT_REMAT = {"none": "minimal_with_context", "selective": "minimal", "full": "full"}


def megatron_recompute(recompute: str) -> dict[str, object]:
    """Megatron-LM's recompute flags: full recompute of every layer is ``--recompute-method
    uniform --recompute-num-layers 1`` (Megatron-LM refuses ``full`` without a method)."""
    if recompute == "full":
        return {
            "recompute-granularity": "full",
            "recompute-method": "uniform",
            "recompute-num-layers": 1,
        }
    if recompute == "selective":
        return {"recompute-granularity": "selective"}
    return {}


def megatron_args(config: dict[str, object]) -> str:
    """Megatron-LM's command-line arguments for ``config``: a true flag bare, a false one
    left out, any other value after its flag."""
    args: list[str] = []
    for key, value in config.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not False:
            args.extend((f"--{key}", str(value)))
    return " ".join(args)


@register("megatron")
def megatron(d: PlanDigest) -> Export:
    """Megatron-LM arguments: TP over the plan's TP axes, every other device DP; the
    distributed optimizer for ZeRO-1/2 (Megatron-LM has no ZeRO-3: the nearest keeps the
    weights whole and lists them as differences)."""
    roles = d.parallelism
    notes = []
    tp_axes = roles.tp_axes
    if len(tp_axes) > 1:
        notes.append(
            f"the plan splits weights over {len(tp_axes)} axes ({', '.join(tp_axes)}); "
            f"Megatron-LM has one tensor-parallel group: TP over {tp_axes[-1]}"
        )
        tp_axes = tp_axes[-1:]
    dp_axes = _dp_axes(d, tp_axes)
    tp, pp, dp = d.mesh.size(tp_axes), roles.num_stages, d.mesh.size(dp_axes)
    distributed = roles.zero_stage >= 1
    if roles.zero_stage == 3:
        notes.append("ZeRO-3 has no Megatron-LM equivalent: nearest is the distributed optimizer")
    layout = Layout(tp_axes, dp_axes, distributed, False)
    config: dict[str, object] = {
        "tensor-model-parallel-size": tp,
        "pipeline-model-parallel-size": pp,
        "micro-batch-size": _micro_batch(d, dp, "megatron"),
        "global-batch-size": _batch(d),
        "sequence-parallel": False,
        "use-distributed-optimizer": distributed,
    }
    config.update(megatron_recompute(roles.recompute))
    if d.dtype == "bfloat16":
        config["bf16"] = True
    return Export("megatron", config, megatron_args(config), differences(d, layout), tuple(notes))


@register("deepspeed")
def deepspeed(d: PlanDigest) -> Export:
    """A DeepSpeed JSON config: every device data parallel, the plan's ZeRO stage;
    tensor parallelism has no key in DeepSpeed's config (weights split by TP are listed
    as differences)."""
    roles = d.parallelism
    notes = []
    if roles.tp > 1:
        notes.append(
            f"the plan is tensor parallel ({roles.tp} over {'+'.join(roles.tp_axes)}); "
            "DeepSpeed's config has none (Megatron-DeepSpeed would add it): nearest is ZeRO "
            "data parallelism over every device"
        )
    dp_axes = _dp_axes(d, ())
    dp = d.mesh.size(dp_axes)
    zero = roles.zero_stage
    layout = Layout((), dp_axes, zero >= 1, zero >= 3)
    config: dict[str, object] = {
        "train_batch_size": _batch(d),
        "train_micro_batch_size_per_gpu": _micro_batch(d, dp, "deepspeed"),
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero},
    }
    if d.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    return Export(
        "deepspeed", config, json.dumps(config, indent=2), differences(d, layout), tuple(notes)
    )


@register("maxtext")
def maxtext(d: PlanDigest) -> Export:
    """MaxText settings: ``ici_*`` parallelism from the roles (ZeRO-3 as FSDP), ``dcn_*``
    all 1 (one host), ``per_device_batch_size``, ``remat_policy``."""
    roles = d.parallelism
    notes = []
    tp_axes = roles.tp_axes
    dp_axes = _dp_axes(d, tp_axes)
    dp, tp = d.mesh.size(dp_axes), d.mesh.size(tp_axes)
    fsdp = roles.zero_stage == 3
    if roles.zero_stage in (1, 2):
        notes.append(
            f"ZeRO-{roles.zero_stage} has no MaxText equivalent (its optimizer state is laid "
            "out like the weights): nearest is plain data parallelism"
        )
    layout = Layout(tp_axes, dp_axes, fsdp, fsdp)
    batch = _batch(d)
    if batch % d.mesh.num_devices:
        raise ValueError(
            f"maxtext: global batch {batch} is not a multiple of {d.mesh.num_devices} devices "
            "(per_device_batch_size would not be whole)"
        )
    remat = MAXTEXT_REMAT[roles.recompute]
    if roles.recompute == "none":
        notes.append(
            "MaxText has no remat-off policy: 'minimal_with_context' keeps every matmul "
            "output and the attention context, and recomputes only elementwise work"
        )
    config: dict[str, object] = {
        "ici_data_parallelism": 1 if fsdp else dp,
        "ici_fsdp_parallelism": dp if fsdp else 1,
        "ici_tensor_parallelism": tp,
        "ici_pipeline_parallelism": roles.num_stages,
        "dcn_data_parallelism": 1,
        "dcn_fsdp_parallelism": 1,
        "dcn_tensor_parallelism": 1,
        "dcn_pipeline_parallelism": 1,
        "per_device_batch_size": batch // d.mesh.num_devices,
        "remat_policy": remat,
    }
    text = "\n".join(f"{k}={v}" for k, v in config.items())
    return Export("maxtext", config, text, differences(d, layout), tuple(notes))


def export(d: PlanDigest, target: str) -> Export:
    """``target``'s export of the plan, checked against the target's start-up rules
    (:mod:`autoshard.report.launchable`); ValueError naming the targets for another, or
    the rules an export breaks."""
    from autoshard.report.launchable import launch_problems

    if target not in EXPORTERS:
        raise ValueError(f"unknown export target {target!r}; choose one of {', '.join(EXPORTERS)}")
    out = EXPORTERS[target](d)
    problems = launch_problems(target, out.config, one_mesh_facts(d), d.parallelism.num_stages)
    if problems:
        raise ValueError(f"{target} cannot launch this plan's export: {'; '.join(problems)}")
    return out


def one_mesh_facts(d: PlanDigest):
    """The job a one-mesh plan's export must fit: its devices, transformer blocks, batch."""
    from autoshard.report.digest import layer_of
    from autoshard.report.launchable import JobFacts

    blocks = {layer_of(i.path) for i in d.plan_file.inputs if i.kind == "param"}
    layers = len({b for b in blocks if re.fullmatch(r"block_\d+", b)}) or None
    return JobFacts(d.mesh.num_devices, layers, _batch(d), 1)
