"""Hand-written parallel plans as rule tables (jax-free).

Each baseline fixes the specs of the program inputs (parameters, optimizer state, data)
by rules on their pytree paths, MaxText-style; the intra-operator ILP then places every
other tensor, so baselines go through the same plan object, runtime, verifier and
simulator as automatic plans.

* ``dp``    -- parameters and optimizer state replicated; batch split over every axis.
* ``zero2`` -- as dp, but optimizer state split over every axis (first divisible dim):
  gradients are reduce-scattered, updated parameters all-gathered.
* ``zero3`` -- parameters and optimizer state split (FSDP): weights are all-gathered
  before use.
* ``megatron`` -- tensor parallel over the last mesh axis ("model"): attention qkv and
  MLP fc kernels column-split, attention and MLP output projections row-split (a GPT-MoE's
  experts likewise: ``wi [E, h, f]`` split on f, ``wo [E, f, h]`` on f), the token
  embedding (tied LM head) vocabulary-parallel; batch split over the other axes (TP x DP
  on a 2-D mesh).  On a 1-D mesh the one axis is the tensor-parallel axis.
* ``expert-zero2`` -- DeepSpeed-MoE's expert parallelism with ZeRO-2 data parallelism:
  as ``zero2``, but a GPT-MoE's expert weights (``wi [E, h, f]``, ``wo [E, f, h]``) and
  their optimizer state split on the expert dim E over the data-parallel axes (each
  device holds E / n experts; tokens travel to them by all-to-all); where the axes
  together do not divide E, over the largest group of them that does (an expert-parallel
  group repeated over the others, as DeepSpeed-MoE's ``ep_size``); a mesh none of whose
  axes divides E is refused. On a model without experts it is ``zero2``.
* ``heuristic`` -- Alpa's "shard the largest dimension" baseline (its intra-op ablation):
  every input and every operator that chooses its layout splits the largest dimension of
  its (output) tensor over the mesh's axes (:func:`autoshard.intra.problem.ties.largest_dim_spec`;
  ``IntraOptions.shard_largest_dim``), whatever that costs in resharding; followers take
  their operand's layout. The ILP only prices what that leaves (a few operand layouts).

A baseline means its name or is refused: a batch the data-parallel axes do not divide,
or a Megatron-split dim the tensor-parallel axis does not divide, raises ValueError naming
the tensor and what would divide (never a silently replicated tensor under the label).
:func:`baseline_options` adds what pins alone cannot say: ``dp`` and ``megatron`` keep
every activation split over their data-parallel axes (``IntraOptions.data_parallel_axes``),
so the ILP cannot leave data parallelism where the pins stop. Where an op of the model
cannot keep its operand split that way (a MoE's batch folded into fewer expert groups than
data-parallel devices), the problem has no solution; :func:`data_parallel_refusal` finds
that op by propagating the forbidden pairs, and the caller raises
:class:`BaselineRefusedError` with what it says.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import deque
from collections.abc import Sequence

import numpy as np

from autoshard.intra.ilp.problem import resolve_ties
from autoshard.intra.problem.options import IntraOptions
from autoshard.intra.problem.ties import largest_dim_spec
from autoshard.ir.graph import Graph
from autoshard.ir.spec import Mesh, ShardingSpec

BASELINES = ("dp", "zero2", "zero3", "megatron", "heuristic", "expert-zero2")
EXPERT_RULE = re.compile(r"\['moe'\]\['w[io]'\]")  # a GPT-MoE's expert weights


class BaselineRefusedError(ValueError):
    """A baseline that cannot mean its name for this model, batch and mesh: the message
    names the op where it breaks and what would work; ``devices`` is the data-parallel
    degree it could not keep."""

    def __init__(self, message: str, devices: int) -> None:
        super().__init__(message)
        self.devices = devices


# (path regex, dim to split over the tensor-parallel axis); first match wins
MEGATRON_RULES: tuple[tuple[str, int | None], ...] = (
    (r"\['attn'\]\['qkv'\]\['kernel'\]", 1),
    (r"\['attn'\]\['qkv'\]\['bias'\]", 0),
    (r"\['attn'\]\['proj'\]\['kernel'\]", 0),
    (r"\['mlp'\]\['fc'\]\['kernel'\]", 1),
    (r"\['mlp'\]\['fc'\]\['bias'\]", 0),
    (r"\['mlp'\]\['proj'\]\['kernel'\]", 0),
    (r"\['moe'\]\['wi'\]", 2),  # GPT-MoE experts [E, h, f]: each expert's MLP column-split
    (r"\['moe'\]\['wo'\]", 1),  # [E, f, h]: row-split (the gate wg stays replicated)
    (r"\['embedding'\]\['wte'\]", 0),
    (r"\['dense_\d+'\]\['kernel'\]", None),  # MLP model: handled by alternation below
)


def _split_first_divisible(shape: Sequence[int], axes: tuple[str, ...], mesh: Mesh) -> ShardingSpec:
    n = mesh.size(axes)
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return ShardingSpec.replicated(len(shape)).with_dim(d, axes)
    return ShardingSpec.replicated(len(shape))


def _split_dim(
    shape: Sequence[int], dim: int, axes: tuple[str, ...], mesh: Mesh, what: str
) -> ShardingSpec:
    """``dim`` of ``shape`` split over ``axes``; ValueError (naming ``what`` and the sizes
    that would divide) where the axes do not divide it."""
    spec = ShardingSpec.replicated(len(shape))
    if not axes or dim >= len(shape):
        return spec
    n = mesh.size(axes)
    if shape[dim] % n:
        raise ValueError(
            f"{what} (shape {tuple(shape)}): dim {dim} of size {shape[dim]} is not divisible "
            f"by the {n} devices of mesh axes {axes}; use a size that is a multiple of {n}, "
            "or a mesh whose axes divide it"
        )
    return spec.with_dim(dim, axes)


def _split_experts(
    shape: Sequence[int], axes: tuple[str, ...], mesh: Mesh, what: str
) -> ShardingSpec:
    """An expert weight (or its optimizer state) split on its expert dim (0) over the
    data-parallel ``axes``, as expert-zero2 places it. Where ``axes`` together do not
    divide the experts, over the largest group of them that does (DeepSpeed-MoE's
    expert-parallel group: on a 2 x 16 view of 32 devices, 48 experts split over the 16
    axis, each group of 16 holding all experts and the two groups data-parallel);
    :class:`BaselineRefusedError` saying what does not divide, and which view would, where
    no axis divides them."""
    spec = ShardingSpec.replicated(len(shape))
    if not axes:
        return spec
    n, experts = mesh.size(axes), shape[0]
    if experts % n == 0:
        return spec.with_dim(0, axes)
    groups = [
        sub
        for k in range(len(axes) - 1, 0, -1)
        for sub in itertools.combinations(axes, k)
        if mesh.size(sub) > 1 and experts % mesh.size(sub) == 0
    ]
    if groups:  # the largest group; of equal ones the later axes (the inner devices)
        return spec.with_dim(0, max(reversed(groups), key=mesh.size))
    group = math.gcd(experts, n)
    counts = [d for d in range(2, experts + 1) if experts % d == 0]
    raise BaselineRefusedError(
        f"baseline 'expert-zero2': the experts of {what} (shape {tuple(shape)}): its "
        f"{experts} experts do not divide over the {n} data-parallel devices of mesh axes "
        f"{axes}, nor over any of those axes. DeepSpeed-MoE would use an expert-parallel "
        f"group of {group} devices (the largest count that divides both {experts} and {n}: "
        f"{experts // group} experts per device) repeated {n // group} times: this baseline "
        f"does so on a {n // group} x {group} mesh (experts split over the {group}-device "
        f"axis); or use a device count that divides {experts} ({', '.join(map(str, counts))})",
        n,
    )


def _dp_tp_axes(mesh: Mesh, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(data-parallel axes, tensor-parallel axes) of baseline ``name`` on ``mesh``."""
    if name == "megatron":
        last = mesh.axis_names[-1]
        tp = (last,) if mesh.size(last) > 1 else ()
        return tuple(a for a in mesh.axis_names[:-1] if mesh.size(a) > 1), tp
    return tuple(a for a in mesh.axis_names if mesh.size(a) > 1), ()


def baseline_options(options: IntraOptions, mesh: Mesh, name: str) -> IntraOptions:
    """``options`` for baseline ``name``: ``dp`` and ``megatron`` keep data split over
    their data-parallel axes in every op (``data_parallel_axes``); ``heuristic`` splits
    every operator's largest output dim (``shard_largest_dim``); ZeRO gathers its
    parameters over those axes by design, so it keeps ``options`` as they are."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    if name == "heuristic":
        return options.replace(shard_largest_dim=True)
    if name == "megatron":  # Megatron-LM: weights never move, activations all-reduced
        return options.replace(
            data_parallel_axes=_dp_tp_axes(mesh, name)[0],
            keep_weight_layout=True,
            all_reduce_only=True,
        )
    if name == "dp":
        return options.replace(data_parallel_axes=_dp_tp_axes(mesh, name)[0])
    return options


def baseline_inputs(graph: Graph, mesh: Mesh, name: str) -> dict[int, ShardingSpec]:
    """Pinned specs for every program input under baseline ``name``."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    dp, tp = _dp_tp_axes(mesh, name)
    dense_layer = re.compile(r"\['dense_(\d+)'\]\['(kernel|bias)'\]")
    pinned: dict[int, ShardingSpec] = {}
    for pos, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        if name == "heuristic":  # every input, the batch too: its largest dim
            pinned[pos] = largest_dim_spec(t.shape, mesh)
            continue
        if t.kind == "data":
            what = f"baseline {name!r}: the batch of data input {t.path or pos}"
            pinned[pos] = _split_dim(t.shape, 0, dp, mesh, what) if t.shape else ShardingSpec(())
            continue
        if not t.shape:
            pinned[pos] = ShardingSpec(())
            continue
        state = t.kind == "opt_state"
        # an expert weight, or state with its expert dim first (Adafactor's factored [E, h]
        # and [E, f] too); not the (1,) placeholder Adafactor keeps for a factored weight
        if name == "expert-zero2" and EXPERT_RULE.search(t.path) and len(t.shape) > 1:
            pinned[pos] = _split_experts(t.shape, dp, mesh, f"{t.kind} {t.path}")
        elif name == "dp":
            pinned[pos] = ShardingSpec.replicated(len(t.shape))
        elif name in ("zero2", "expert-zero2"):
            pinned[pos] = (
                _split_first_divisible(t.shape, dp, mesh)
                if state
                else ShardingSpec.replicated(len(t.shape))
            )
        elif name == "zero3":
            pinned[pos] = _split_first_divisible(t.shape, dp, mesh)
        else:
            spec = ShardingSpec.replicated(len(t.shape))
            what = f"baseline 'megatron': {t.kind} {t.path}"
            for pattern, dim in MEGATRON_RULES:
                if dim is not None and re.search(pattern, t.path):
                    spec = _split_dim(t.shape, dim, tp, mesh, what)
                    break
            m = dense_layer.search(t.path)
            if m is not None:  # Alpa's MLP: alternate column / row splits
                column = int(m.group(1)) % 2 == 0
                if m.group(2) == "kernel":
                    spec = _split_dim(t.shape, 1 if column else 0, tp, mesh, what)
                elif column:
                    spec = _split_dim(t.shape, 0, tp, mesh, what)
            pinned[pos] = spec
    if (
        name == "megatron"
        and tp
        and not any(set(tp) & set(d) for spec in pinned.values() for d in spec.dims)
    ):
        raise BaselineRefusedError(
            f"baseline 'megatron' cannot mean its name here: no weight of this model has a "
            f"Megatron-LM split (attention QKV/projection, MLP fc/projection, expert MLPs, "
            f"the token embedding, the mlp preset's dense layers), so its tensor-parallel "
            f"axes {tp} ({mesh.size(tp)} devices) would only repeat the work; use 'dp' or "
            "the automatic plan, or a mesh without a tensor-parallel axis",
            mesh.size(dp) if dp else 1,
        )
    return pinned


def _feasible_domains(pb):
    """(roots, maps, domains, culprit): arc consistency over the forbidden (infinite) node
    costs and edge pairs of problem ``pb`` in tie-root space. ``culprit`` is ``(root, by)``
    for the first root left without a strategy (``by``: the neighbour root that removed
    its last one, -1 for its own costs), or None when every root keeps one."""
    roots, maps = resolve_ties(pb)
    dom: dict[int, np.ndarray] = {}
    for v in range(pb.num_nodes):
        m = np.asarray(maps[v])
        ok = (m >= 0) & np.isfinite(np.asarray(pb.node_costs[v], dtype=float))[np.maximum(m, 0)]
        r = roots[v]
        dom[r] = dom[r] & ok if r in dom else ok
        if not dom[r].any():
            return roots, maps, dom, (r, -1)
    adj: dict[int, list[tuple[int, np.ndarray]]] = {}
    for e in pb.edges:
        a, b = roots[e.src], roots[e.dst]
        ma, mb = np.asarray(maps[e.src]), np.asarray(maps[e.dst])
        ok = np.isfinite(np.asarray(e.costs, dtype=float))[
            np.ix_(np.maximum(ma, 0), np.maximum(mb, 0))
        ]
        ok[ma < 0, :] = False
        ok[:, mb < 0] = False
        if a == b:  # both ends on one root: only its agreeing strategies
            dom[a] &= np.diag(ok)
            if not dom[a].any():
                return roots, maps, dom, (a, -1)
            continue
        adj.setdefault(a, []).append((b, ok))
        adj.setdefault(b, []).append((a, ok.T))
    todo = deque(dom)
    while todo:
        a = todo.popleft()
        for b, ok in adj.get(a, ()):
            kept = dom[b] & ok[dom[a], :].any(axis=0)
            if (kept != dom[b]).any():
                dom[b] = kept
                if not kept.any():
                    return roots, maps, dom, (b, a)
                todo.append(b)
    return roots, maps, dom, None


def data_parallel_refusal(ip, name: str) -> BaselineRefusedError | None:
    """Why baseline ``name`` has no plan on the intra-op problem ``ip`` (an
    :class:`~autoshard.intra.problem.build.IntraProblem` built with its pins and options): the
    op that cannot keep its operand split over the data-parallel axes (or, for
    ``megatron``, cannot take it without moving a weight or a collective other than an
    all-reduce), with what would work, as the error to raise; None when propagation finds
    no contradiction (the cause is then elsewhere: a budget, a solver)."""
    roots, maps, dom, culprit = _feasible_domains(ip.problem)
    if culprit is None:
        return None
    root, by = culprit
    graph, n_in, mesh = ip.graph, ip.num_inputs, ip.mesh.mesh
    axes = _dp_tp_axes(mesh, name)[0]
    devices = mesh.size(axes) if axes else 1

    def strategies_of(v: int) -> list[int]:  # node v's strategies its root still allows
        m = np.asarray(maps[v])
        return sorted({int(p) for p in m[dom[roots[v]]] if p >= 0}) if roots[v] != root else []

    def label(v: int) -> str:
        if v < n_in:
            t = graph.tensors[graph.inputs[v]]
            return f"input {t.path or v} {tuple(t.shape)}"
        node = graph.nodes[v - n_in]
        ins = ", ".join(str(tuple(graph.tensors[t].shape)) for t in node.inputs)
        outs = ", ".join(str(tuple(graph.tensors[t].shape)) for t in node.outputs)
        where = f" in layer {node.layer!r}" if node.layer else ""
        return f"{node.primitive}{where} ({ins} -> {outs})"

    head = (
        f"baseline {name!r} cannot mean its name here: it keeps every activation split over "
        f"mesh axes {axes} ({devices} devices)"
    )
    advice = (
        f"use a batch (or mesh) for which that dim stays a multiple of {devices}, or the "
        "'zero2' / 'zero3' baselines or the automatic plan, which may reshard there"
    )
    delivers, n_div = "data parallelism", devices
    if name == "megatron":
        delivers = "Megatron-LM's layout"
        tp = _dp_tp_axes(mesh, name)[1]
        tp_devices = n_div = mesh.size(tp) if tp else 1
        head = (
            f"baseline 'megatron' cannot mean its name here: as in Megatron-LM, no weight "
            f"moves and activations move only by all-reduce over the tensor-parallel axes "
            f"{tp} ({tp_devices} devices; no all-gather, all-to-all or reduce-scatter)"
            + (f", and every activation stays split over {axes}" if axes else "")
        )
        advice = (
            f"use sizes that stay multiples of {tp_devices} there (for a GPT: attention heads "
            f"and MLP width divisible by {tp_devices}), a smaller tensor-parallel axis (the "
            "mesh's last), or the automatic plan, which may reshard there"
        )
    for op in ip.operands:  # the use along which the last strategy went
        if op.slot < 0 or {roots[op.src], roots[op.dst]} != {root, by}:
            continue
        src_specs = {str(ip.strategies[op.src][p].output_specs[_out_index(ip, op)])
                     for p in strategies_of(op.src)}  # fmt: skip
        if roots[op.dst] != root or not src_specs:
            continue
        takes = sorted({str(s.input_specs[op.slot]) for s in ip.strategies[op.dst]
                        if s.input_specs[op.slot] is not None})  # fmt: skip
        return BaselineRefusedError(
            f"{head}, but {label(op.dst)} takes operand {op.slot} only as "
            f"{' or '.join(takes)}, while {delivers} delivers it as "
            f"{' or '.join(sorted(src_specs))}: the {n_div} devices do not divide the dim "
            f"its split would move to; {advice}",
            devices,
        )
    return BaselineRefusedError(
        f"{head}, but {label(root)} has no strategy that keeps that split; {advice}", devices
    )


def _out_index(ip, op) -> int:
    """Which output of ILP node ``op.src`` is the tensor ``op`` reads."""
    if op.src < ip.num_inputs:
        return 0
    return ip.graph.nodes[op.src - ip.num_inputs].outputs.index(op.tensor)
