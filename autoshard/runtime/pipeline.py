"""Pipeline runtime of the inter-operator pass: one loss function, S stages on S sub-meshes.

Takes a loss ``loss_fn(params, batch) -> scalar``, an optax optimizer, parameters, an
example batch and a stage choice, and returns a :class:`PipelineTrainer` whose
``step(batch)`` trains on the full batch split into microbatches, with the forward and
backward of each stage on its own sub-mesh of devices, in GPipe or 1F1B order.

How it works:

* the forward of **one microbatch** is traced (:func:`autoshard.trace.jaxpr.trace`) into flat
  equations tagged with their layer; a stage is a contiguous range of those layers;
* :func:`split_stages` cuts the flat program into per-stage sub-programs (jax-free): an
  equation runs on the stage of its layer, or later if an input is made later; a stage
  reads the parameters it owns, the batch leaves it uses and the tensors earlier stages
  send it; it sends on every tensor a later stage reads, and the last one the loss;
* a parameter read by several stages (the GPT's LM head tied to ``wte``) is **owned** by
  the first stage that reads it and sent forward like an activation; its cotangent comes
  back and is added to the owner's gradient.  So each parameter has one copy, one
  gradient and one optimizer update;
* each stage jits a forward (params, received, data) -> sent tensors and a backward that
  **recomputes** the forward under ``jax.vjp`` and returns parameter gradients (added to
  an accumulator) and cotangents for what it received.  Memory: per microbatch in flight
  a stage keeps only the tensors it received (its boundary activations), as with full
  rematerialisation, at the price of a second forward per microbatch;
* tensors cross sub-meshes with ``jax.device_put`` to the receiving stage's sharding.
  Within a stage the default layout is data parallel (:func:`data_parallel_spec`); any
  ``spec_fn`` with the same signature (e.g. one read from an intra-op plan) replaces it.

Guarantees: the summed microbatch gradients, with the loss cotangent seeded at ``1/B``
(``B`` microbatches of equal size, each loss a mean over its examples), equal the
full-batch gradient of the mean loss, so a step equals the single-device step up to
floating-point reassociation.  Optimizer transforms that act per leaf (SGD, Adam, AdamW)
give the same update per stage as on the whole model; ones that couple leaves across
stages (``clip_by_global_norm``) would see only their stage's leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding

from autoshard.inter.schedules import FORWARD, gpipe, one_f_one_b, validate
from autoshard.inter.search import (
    InterPlan,
    IntraStageCost,
    cluster_for,
    logical_mesh_costs,
    search_stages,
)
from autoshard.inter.stages import (
    StageCost,
    StageCostFn,
    StagePlan,
    equal_flops_stages,
    equal_layer_stages,
    optimal_stage_plan,
    place_submeshes,
)
from autoshard.ir.graph import build_graph, flops_of
from autoshard.ir.records import TensorRecord, TraceRecords
from autoshard.models import make_train_step
from autoshard.runtime.stage_layout import (
    SpecFn,
    StageLayout,
    data_parallel_spec,
    intra_op_layout,
    loss_program,
)
from autoshard.trace.jaxpr import TracedProgram, trace_train_step

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
STAGE_METHODS = ("auto", "equal-layer", "equal-flops")
LAYOUTS = ("intra-op", "data-parallel")
NOMINAL_PEAK_FLOPS = 100e12  # a placeholder peak for the FLOPs-only cost model
STAGE_AXES = ("data", "model")


# ---------------------------------------------------------------- cutting the program


@dataclass(frozen=True)
class StageProgram:
    """The equations of one stage and what flows in and out of it (tensor ids)."""

    index: int
    start_layer: int
    end_layer: int
    eqns: tuple[int, ...]
    params: tuple[int, ...]  # parameters this stage owns (updates)
    received: tuple[int, ...]  # tensors from earlier stages: activations, shared params
    received_from: tuple[int, ...]  # the stage that sends each received tensor
    data: tuple[int, ...]  # batch leaves it reads
    outputs: tuple[int, ...]  # tensors later stages read, and the loss where it is made
    output_consumers: tuple[tuple[int, ...], ...]  # the stages that read each output


def split_stages(
    records: TraceRecords, layer_ranges: Sequence[tuple[int, int]]
) -> tuple[StageProgram, ...]:
    """Cut a traced forward program (one scalar output: the loss) into pipeline stages.

    ``layer_ranges`` are contiguous ``[start, end)`` ranges over ``records.layers``.
    Equations with no layer run on the first stage; an equation never runs before the
    stage that makes its inputs.  Parameters nobody reads are owned by stage 0 (their
    gradient is zero, but the optimizer still updates them, as on one device).
    """
    num_layers = max(len(records.layers), 1)
    _check_ranges(layer_ranges, num_layers)
    if len(records.outputs) != 1 or records.tensors[records.outputs[0]].shape != ():
        raise ValueError("the loss function must return one scalar (the mean loss)")
    loss = records.outputs[0]
    layer_stage = {}
    for s, (start, end) in enumerate(layer_ranges):
        for layer in records.layers[start:end]:
            layer_stage[layer] = s
    kinds = {t: records.tensors[t].kind for t in range(len(records.tensors))}
    source: dict[int, int] = {}  # intermediate tensor -> stage that makes it
    stage_eqns: list[list[int]] = [[] for _ in layer_ranges]
    readers: dict[int, set[int]] = {}
    for eqn in records.eqns:
        s = layer_stage.get(eqn.layer, 0)
        s = max([s] + [source[t] for t in eqn.inputs if t in source])
        stage_eqns[s].append(eqn.index)
        for t in eqn.inputs:
            if kinds[t] in ("param", "data", "intermediate"):
                readers.setdefault(t, set()).add(s)
        for t in eqn.outputs:
            source[t] = s
    if loss not in source:
        raise ValueError("the loss is not computed from the parameters and batch")
    params = [t for t in records.inputs if kinds[t] == "param"]
    for t in params:
        source[t] = min(readers.get(t, {0}))
    stages = []
    for s, (start, end) in enumerate(layer_ranges):
        reads = sorted(t for t, r in readers.items() if s in r)
        received = [t for t in reads if kinds[t] != "data" and source[t] < s]
        outputs = [
            t for t in sorted(source) if source[t] == s and any(c > s for c in readers.get(t, ()))
        ]
        if source[loss] == s:
            outputs.append(loss)
        stages.append(
            StageProgram(
                index=s,
                start_layer=start,
                end_layer=end,
                eqns=tuple(stage_eqns[s]),
                params=tuple(t for t in params if source[t] == s),
                received=tuple(received),
                received_from=tuple(source[t] for t in received),
                data=tuple(t for t in reads if kinds[t] == "data"),
                outputs=tuple(outputs),
                output_consumers=tuple(
                    tuple(sorted(c for c in readers.get(t, ()) if c > s)) for t in outputs
                ),
            )
        )
    return tuple(stages)


def _check_ranges(layer_ranges: Sequence[tuple[int, int]], num_layers: int) -> None:
    if not layer_ranges:
        raise ValueError("no stages given")
    expected = 0
    for start, end in layer_ranges:
        if start != expected or end <= start:
            raise ValueError(
                f"stage layer ranges {list(layer_ranges)} must be non-empty, contiguous and "
                f"cover layers 0..{num_layers}, e.g. {list(equal_layer_stages(num_layers, 1))}"
            )
        expected = end
    if expected != num_layers:
        raise ValueError(
            f"stage layer ranges {list(layer_ranges)} end at layer {expected}; the program "
            f"has {num_layers} layers"
        )


# ---------------------------------------------------------------- a FLOPs-only cost model


@dataclass(frozen=True)
class LayerStats:
    """Per layer of one microbatch's forward: FLOPs, bytes of parameters first read
    there, and bytes of activations it reads from earlier layers."""

    layers: tuple[str, ...]
    forward_flops: tuple[float, ...]
    param_bytes: tuple[float, ...]
    input_activation_bytes: tuple[float, ...]


def layer_stats(records: TraceRecords) -> LayerStats:
    """FLOPs (graph's rules; unknown primitives count 0) and bytes per layer."""
    layers = records.layers or ("model",)
    index = {name: i for i, name in enumerate(layers)}
    flops = [0.0] * len(layers)
    param_bytes = [0.0] * len(layers)
    act_bytes = [0.0] * len(layers)
    made_in: dict[int, int] = {}
    seen_params: set[int] = set()
    tensors = records.tensors
    for eqn in records.eqns:
        li = index.get(eqn.layer, 0)
        ins = [tensors[t] for t in eqn.inputs]
        flops[li] += flops_of(eqn, ins, [tensors[t] for t in eqn.outputs]) or 0.0
        for t in dict.fromkeys(eqn.inputs):
            if tensors[t].kind == "param" and t not in seen_params:
                seen_params.add(t)
                param_bytes[li] += tensors[t].nbytes
            elif made_in.get(t, li) < li:
                act_bytes[li] += tensors[t].nbytes
        for t in eqn.outputs:
            made_in[t] = li
    return LayerStats(tuple(layers), tuple(flops), tuple(param_bytes), tuple(act_bytes))


def flops_stage_cost(
    stats: LayerStats,
    peak_flops: float = NOMINAL_PEAK_FLOPS,
    state_bytes_per_param_byte: float = 4.0,
) -> StageCostFn:
    """A stage cost for :func:`autoshard.inter.stages.optimal_stage_plan` from FLOPs alone.

    Latency of layers ``[start, end)`` on a sub-mesh of ``n`` devices: forward + backward
    + recompute = ``3 x forward FLOPs / (n x peak_flops)``; no communication.  Memory per
    device: parameters replicated (weights, gradients, two Adam moments:
    ``state_bytes_per_param_byte`` = 4) and, per microbatch in flight, the stage's input
    activations split over data parallelism.  Only the pure data-parallel logical mesh
    ``(n, 1)`` is runnable, as that is what the default runtime layout does; a cost
    backed by the intra-op ILP replaces this function later.
    """

    def cost(start: int, end: int, submesh: tuple[int, int], logical: tuple[int, int]):
        dp, tp = logical
        if tp != 1:
            return StageCost(math.inf, 0.0, 0.0)
        n = submesh[0] * submesh[1]
        latency = 3.0 * sum(stats.forward_flops[start:end]) / (n * peak_flops)
        params = state_bytes_per_param_byte * sum(stats.param_bytes[start:end])
        return StageCost(latency, params, stats.input_activation_bytes[start] / dp)

    return cost


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PipelineStage:
    """One stage as it runs: its layers, devices and parameters."""

    index: int
    layers: tuple[str, ...]
    start_layer: int
    end_layer: int
    device_ids: tuple[int, ...]
    logical_shape: tuple[int, int]
    forward_flops: float  # one microbatch
    owned_params: tuple[str, ...]  # pytree paths this stage updates
    received_params: tuple[str, ...]  # paths owned by an earlier stage and sent here
    num_received_activations: int
    layout: str = "data-parallel"  # or "intra-op": the stage's intra-op plan
    tensor_parallel: bool = False  # whether its plan splits anything over "model"


@dataclass(frozen=True)
class PipelinePlan:
    """What a :class:`PipelineTrainer` runs: its stages, microbatches and schedule."""

    stages: tuple[PipelineStage, ...]
    num_microbatches: int
    schedule: str
    stage_plan: StagePlan | None = None  # the DP's answer when stages="auto"

    def __str__(self) -> str:
        lines = [
            f"{len(self.stages)} stages, {self.num_microbatches} microbatches, {self.schedule}"
        ]
        for st in self.stages:
            shared = f", receives {', '.join(st.received_params)}" if st.received_params else ""
            lines.append(
                f"  stage {st.index}: layers {st.layers[0]}..{st.layers[-1]} on devices "
                f"{list(st.device_ids)} as (dp, tp) = {st.logical_shape}, {st.layout}"
                f"{' (tensor parallel)' if st.tensor_parallel else ''}{shared}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------- the runtime

# layout_fn(stage program, stage mesh) -> how the stage lays out its tensors
LayoutFn = Callable[[StageProgram, jax.sharding.Mesh], StageLayout]


def _data_parallel_layout(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
    return StageLayout(data_parallel_spec)


def _path_key(entry) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def _nest(items: Sequence[tuple[tuple, Any]]) -> dict:
    """Nested dict from (pytree path, value): a sub-tree that keeps the original keys."""
    root: dict = {}
    for path, value in items:
        node = root
        for entry in path[:-1]:
            node = node.setdefault(_path_key(entry), {})
        node[_path_key(path[-1])] = value
    return root


def _inexact(rec: TensorRecord) -> bool:
    return jnp.issubdtype(jnp.dtype(rec.dtype), jnp.inexact)


class _Stage:
    """The jitted functions and state of one stage."""

    def __init__(
        self,
        prog: TracedProgram,
        sp: StageProgram,
        mesh,
        layout: StageLayout,
        param_items: list[tuple[tuple, int]],
        values: dict[int, Any],
        optimizer,
    ):
        self.sp, self.mesh, self.layout = sp, mesh, layout
        spec_fn = layout.spec_fn
        self.tensors = tensors = prog.records.tensors
        self.loss = prog.records.outputs[0]

        def sharding(t: int, role: str) -> NamedSharding:
            role = "param" if tensors[t].kind == "param" else role
            return NamedSharding(mesh, spec_fn(sp.index, tensors[t], role, mesh))

        tid_tree = _nest(param_items)
        self.param_ids = jax.tree.leaves(tid_tree)
        treedef = jax.tree.structure(tid_tree)
        self.param_shardings = jax.tree.map(lambda t: sharding(t, "param"), tid_tree)
        self.received_shardings = [sharding(t, "activation") for t in sp.received]
        self.data_shardings = [sharding(t, "data") for t in sp.data]
        self.output_shardings = [sharding(t, "activation") for t in sp.outputs]
        self.params = jax.tree.unflatten(
            treedef, [jax.device_put(values[t], sharding(t, "param")) for t in self.param_ids]
        )
        self.opt_state_shardings = layout.opt_state_sharding(
            mesh, jax.eval_shape(optimizer.init, self.params)
        )
        self.opt_state = jax.jit(optimizer.init, out_shardings=self.opt_state_shardings)(
            self.params
        )

        eqns = [(prog.records.eqns[i], prog._impls[i]) for i in sp.eqns]
        needed = {t for e, _ in eqns for t in e.inputs}
        consts = {t: v for t, v in prog._consts.items() if t in needed}
        param_ids = self.param_ids
        constraints = layout.constraints

        def evaluate(params, received, data, wanted):
            env = dict(consts)
            env.update(zip(param_ids, jax.tree.leaves(params), strict=True))
            env.update(zip(sp.received, received, strict=True))
            env.update(zip(sp.data, data, strict=True))
            for eqn, (prim, bind_params) in eqns:
                invals = [env[t] for t in eqn.inputs]
                if constraints is not None:  # the plan's reshards and node output specs
                    invals = constraints.operands_hook(eqn.index, invals)
                outs = prim.bind(*invals, **bind_params)
                outs = list(outs) if prim.multiple_results else [outs]
                if constraints is not None:
                    outs = constraints.outputs_hook(eqn.index, outs)
                env.update(zip(eqn.outputs, outs, strict=True))
            return [env[t] for t in wanted]

        float_out = [t for t in sp.outputs if _inexact(tensors[t])]
        self.float_out = float_out
        float_in = [i for i, t in enumerate(sp.received) if _inexact(tensors[t])]
        self.float_in = float_in

        def forward(params, received, data):
            return evaluate(params, received, data, sp.outputs)

        def backward(params, received, data, out_cts, grad_acc):
            def f(p, diff_received):
                full = list(received)
                for i, v in zip(float_in, diff_received, strict=True):
                    full[i] = v
                return evaluate(p, full, data, float_out)

            _, vjp = jax.vjp(f, params, [received[i] for i in float_in])
            grads, in_cts = vjp(list(out_cts))
            return jax.tree.map(jnp.add, grad_acc, grads), in_cts

        def update(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.forward = jax.jit(forward, out_shardings=self.output_shardings)
        self.backward = jax.jit(
            backward,
            out_shardings=(self.param_shardings, [self.received_shardings[i] for i in float_in]),
        )
        self.update = jax.jit(
            update, out_shardings=(self.param_shardings, self.opt_state_shardings)
        )
        self.zero_grads = jax.jit(
            lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=self.param_shardings
        )


class PipelineTrainer:
    """Trains ``loss_fn`` with ``optimizer`` as a pipeline; build it with :func:`auto_pipeline`.

    ``step(batch)`` takes the full global batch and returns its mean loss; ``params`` is
    the full parameter pytree, gathered to host numpy arrays; ``plan`` says what runs where.
    """

    def __init__(
        self,
        program: TracedProgram,
        stage_programs: Sequence[StageProgram],
        stage_devices: Sequence[Sequence[Any]],
        logical_shapes: Sequence[tuple[int, int]],
        params,
        optimizer: optax.GradientTransformation,
        num_microbatches: int,
        schedule: str,
        layout_fn: LayoutFn = _data_parallel_layout,
        stage_plan: StagePlan | None = None,
        inter_plan: InterPlan | None = None,
        intra_cost: IntraStageCost | None = None,
    ):
        records = program.records
        self.inter_plan = inter_plan  # the search's answer, with each stage's intra-op plan
        self.intra_cost = intra_cost  # its solved ILPs: pass to auto_pipeline to reuse them
        self.num_microbatches = num_microbatches
        self._schedule = SCHEDULES[schedule](len(stage_programs), num_microbatches)
        validate(self._schedule, len(stage_programs), num_microbatches)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self._params_treedef = jax.tree.structure(params)
        num_params = len(leaves)
        self._param_ids = records.inputs[:num_params]
        self._data_ids = records.inputs[num_params:]
        self._batch_treedef = program.in_tree.children()[1]
        path_of = {t: path for t, (path, _) in zip(self._param_ids, leaves, strict=True)}
        values = {t: leaf for t, (_, leaf) in zip(self._param_ids, leaves, strict=True)}
        self._stages = []
        for sp, devs, shape in zip(stage_programs, stage_devices, logical_shapes, strict=True):
            mesh = jax.sharding.Mesh(
                np.array(devs, dtype=object).reshape(shape),
                STAGE_AXES,
                axis_types=(AxisType.Auto,) * len(STAGE_AXES),  # for with_sharding_constraint
            )
            items = [(path_of[t], t) for t in sp.params]
            layout = layout_fn(sp, mesh)
            self._stages.append(_Stage(program, sp, mesh, layout, items, values, optimizer))
        self._owner = {t: s for s, sp in enumerate(stage_programs) for t in sp.params}
        keystr = {t: jax.tree_util.keystr(path_of[t]) for t in self._param_ids}
        stats = layer_stats(records)
        layers = stats.layers
        self.plan = PipelinePlan(
            tuple(
                PipelineStage(
                    sp.index,
                    layers[sp.start_layer : sp.end_layer],
                    sp.start_layer,
                    sp.end_layer,
                    tuple(d.id for d in devs),
                    tuple(shape),
                    sum(stats.forward_flops[sp.start_layer : sp.end_layer]),
                    tuple(keystr[t] for t in sp.params),
                    tuple(keystr[t] for t in sp.received if t in keystr),
                    sum(t not in keystr for t in sp.received),
                    st.layout.name,
                    st.layout.tensor_parallel,
                )
                for sp, devs, shape, st in zip(
                    stage_programs, stage_devices, logical_shapes, self._stages, strict=True
                )
            ),
            num_microbatches,
            schedule,
            stage_plan,
        )

    def compiled_forward(self, stage: int) -> jax.stages.Compiled:
        """The executable of stage ``stage``'s forward for one microbatch, as it runs
        (compiled for abstract arguments with the stage's shardings)."""
        st = self._stages[stage]

        def abstract(ids, shardings):
            return [
                jax.ShapeDtypeStruct(
                    st.tensors[t].shape, np.dtype(st.tensors[t].dtype), sharding=sh
                )
                for t, sh in zip(ids, shardings, strict=True)
            ]

        received = abstract(st.sp.received, st.received_shardings)
        data = abstract(st.sp.data, st.data_shardings)
        return st.forward.lower(st.params, received, data).compile()

    @property
    def params(self):
        """The full parameter pytree (host numpy arrays), each leaf from its owner stage."""
        by_id = {}
        for stage in self._stages:
            by_id.update(zip(stage.param_ids, jax.tree.leaves(stage.params), strict=True))
        return jax.tree.unflatten(
            self._params_treedef, [np.asarray(jax.device_get(by_id[t])) for t in self._param_ids]
        )

    def _microbatches(self, batch) -> list[dict[int, Any]]:
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self._batch_treedef:
            raise ValueError(f"batch has structure {treedef}; expected {self._batch_treedef}")
        m = self.num_microbatches
        out: list[dict[int, Any]] = [{} for _ in range(m)]
        for t, leaf in zip(self._data_ids, leaves, strict=True):
            size = leaf.shape[0] // m
            if leaf.shape[0] != size * m:
                raise ValueError(_divisibility_message(leaf.shape[0], m))
            for k in range(m):
                out[k][t] = leaf[k * size : (k + 1) * size]
        return out

    def step(self, batch) -> jax.Array:
        """One training step on the global ``batch``; returns the mean loss over it."""
        microbatches = self._microbatches(batch)
        stages, m = self._stages, self.num_microbatches
        grads = [st.zero_grads(st.params) for st in stages]
        inbox: dict[tuple[int, int], dict[int, Any]] = {}  # (stage, mb) -> received tensors
        cotangents: dict[tuple[int, int], dict[int, Any]] = {}  # (stage, mb) -> output cts
        saved: dict[tuple[int, int], tuple[list, list]] = {}
        losses = []
        for tick in self._schedule:
            for task in tick:
                st, key = stages[task.stage], (task.stage, task.microbatch)
                sp = st.sp
                if task.kind == FORWARD:
                    box = inbox.pop(key, {})
                    received = [box[t] for t in sp.received]
                    data = [
                        jax.device_put(microbatches[task.microbatch][t], sh)
                        for t, sh in zip(sp.data, st.data_shardings, strict=True)
                    ]
                    outs = st.forward(st.params, received, data)
                    for t, value, consumers in zip(
                        sp.outputs, outs, sp.output_consumers, strict=True
                    ):
                        for c in consumers:
                            sh = stages[c].received_shardings[stages[c].sp.received.index(t)]
                            inbox.setdefault((c, task.microbatch), {})[t] = jax.device_put(
                                value, sh
                            )
                        if t == st.loss:
                            losses.append(value)
                    saved[key] = (received, data)
                else:
                    received, data = saved.pop(key)
                    box = cotangents.pop(key, {})
                    out_cts = [_output_cotangent(st, t, box, m) for t in st.float_out]
                    grads[task.stage], in_cts = st.backward(
                        st.params, received, data, out_cts, grads[task.stage]
                    )
                    for i, ct in zip(st.float_in, in_cts, strict=True):
                        t, src = sp.received[i], sp.received_from[i]
                        sender = stages[src]
                        sh = sender.output_shardings[sender.sp.outputs.index(t)]
                        ct = jax.device_put(ct, sh)
                        box_src = cotangents.setdefault((src, task.microbatch), {})
                        box_src[t] = box_src[t] + ct if t in box_src else ct
        for st, g in zip(stages, grads, strict=True):
            st.params, st.opt_state = st.update(st.params, st.opt_state, g)
        return sum(losses[1:], losses[0]) / m


def _output_cotangent(stage: _Stage, t: int, box: dict[int, Any], num_microbatches: int):
    """The summed cotangents later stages sent for output ``t``; the loss is seeded with
    ``1 / num_microbatches`` (the global loss is the mean of the microbatch losses)."""
    rec = stage.tensors[t]
    ct = box.get(t)
    if ct is None:  # the loss, or read later only through non-differentiable paths
        ct = jnp.zeros(rec.shape, rec.dtype)
    if t == stage.loss:
        ct = ct + jnp.asarray(1.0 / num_microbatches, rec.dtype)
    return ct


# ---------------------------------------------------------------- the public entry point


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisibility_message(batch_size: int, num_microbatches: int) -> str:
    return (
        f"num_microbatches={num_microbatches} does not divide the batch size {batch_size}; "
        f"use one of {_divisors(batch_size)}"
    )


def _batch_size(batch) -> int:
    sizes = {leaf.shape[0] if leaf.shape else None for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading (batch) dimension to be split into "
            f"microbatches; got leading sizes {sorted(map(str, sizes))}"
        )
    return sizes.pop()


def _check_stage_count(
    num_stages: int, num_layers: int, num_devices: int, equal_submeshes: bool = True
) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages for {num_layers} layers: a stage needs at least one layer; "
            f"use num_stages <= {num_layers}"
        )
    if num_stages > num_devices:
        raise ValueError(
            f"{num_stages} stages for {num_devices} devices: a stage needs at least one device; "
            f"use num_stages <= {num_devices}"
        )
    if equal_submeshes and num_devices % num_stages:
        fits = [d for d in _divisors(num_devices) if d <= num_layers]
        raise ValueError(
            f"{num_devices} devices cannot be split evenly among {num_stages} stages; use "
            f"num_stages in {fits}, or stages='auto' for sub-meshes of different sizes"
        )


def auto_pipeline(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    params,
    batch,
    devices: Sequence[Any] | None = None,
    num_microbatches: int = 4,
    stages: str | Sequence[tuple[int, int]] = "auto",
    num_stages: int | None = None,
    schedule: str = "1f1b",
    layout: str = "intra-op",
    logical_meshes: Sequence[tuple[int, int]] | None = None,
    spec_fn: SpecFn = data_parallel_spec,
    stage_cost: Callable[[LayerStats], StageCostFn] = flops_stage_cost,
    memory_budget_bytes: float | None = None,
    intra_cost: IntraStageCost | None = None,
    solver: str = "highs",
    cluster=None,
) -> PipelineTrainer:
    """Pipeline ``loss_fn(params, batch) -> mean loss`` over ``devices`` (default: all).

    ``batch`` is one global batch (arrays or ``jax.ShapeDtypeStruct`` leaves, all with the
    batch size as leading dim); it is split into ``num_microbatches`` equal microbatches.
    ``stages``: ``"auto"`` (Alpa's stage DP over sub-meshes, any number of stages unless
    ``num_stages`` is given), ``"equal-layer"`` or ``"equal-flops"`` (``num_stages``
    stages, equal sub-meshes), or explicit ``[(start, end), ...]`` ranges over the traced
    layers (in ``plan``; for the GPT ``embedding, block_0, ..., head``).  ``schedule``:
    ``"1f1b"`` or ``"gpipe"``.

    ``layout="intra-op"`` (default): stage costs come from intra-op ILPs
    (:func:`autoshard.inter.search.search_stages`, on ``cluster``'s costs, with ``solver``;
    ``intra_cost`` reuses the ILPs of an earlier call on the same step) and every stage
    runs under its own plan on its sub-mesh viewed as a ``(dp, tp)`` logical mesh (axes
    ``data``, ``model``); ``logical_meshes`` fixes each explicit range's view.
    ``layout="data-parallel"``: stage costs from FLOPs (``stage_cost``) and every stage
    lays its tensors out with ``spec_fn`` on a ``(devices, 1)`` mesh.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or (num_microbatches < 1)
    ):
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("no devices given")
    batch_size = _batch_size(batch)
    if batch_size % num_microbatches:
        raise ValueError(_divisibility_message(batch_size, num_microbatches))
    if isinstance(stages, str) and stages not in STAGE_METHODS:
        raise ValueError(
            f"unknown stages={stages!r}; use one of {STAGE_METHODS} or a list of "
            "(start, end) layer ranges"
        )
    if logical_meshes is not None and layout != "intra-op":
        raise ValueError("logical_meshes needs layout='intra-op'")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    mb_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype),
        batch,
    )
    # the train step of one microbatch; the pipeline runs its forward (same tensor ids as
    # the intra-op plans) and differentiates it per stage
    step = trace_train_step(
        make_train_step(loss_fn, optimizer),
        abstract,
        jax.eval_shape(optimizer.init, abstract),
        mb_batch,
    )
    loss = loss_program(step)
    program = loss.program
    stats = layer_stats(program.records)
    num_layers, n = len(stats.layers), len(devices)

    if stages == "auto":
        if num_stages is not None:
            _check_stage_count(num_stages, num_layers, n, equal_submeshes=False)
    elif isinstance(stages, str):
        if num_stages is None:
            raise ValueError(f"stages={stages!r} needs num_stages")
        _check_stage_count(num_stages, num_layers, n)
    else:
        stages = [tuple(r) for r in stages]
        if num_stages is not None and num_stages != len(stages):
            raise ValueError(f"num_stages={num_stages} but {len(stages)} layer ranges were given")
        _check_ranges(stages, num_layers)
        _check_stage_count(len(stages), num_layers, n)

    stage_plan = inter_plan = None
    layout_fn: LayoutFn = _data_parallel_layout
    if layout == "intra-op":
        graph = build_graph(step.records)
        if intra_cost is None:
            intra_cost = IntraStageCost(
                graph,
                logical_mesh_costs(cluster_for(cluster, 1, n)),
                solver=solver,
                num_microbatches=num_microbatches,
            )
        inter_plan = search_stages(
            graph,
            1,
            n,
            num_microbatches,
            cluster=cluster,
            memory_budget_bytes=memory_budget_bytes,
            schedule=schedule,
            stages=stages,
            num_stages=num_stages,
            logical_meshes=logical_meshes,
            cost=intra_cost,
        )
        stage_plan = inter_plan.stage_plan
        ranges = [(s.start_layer, s.end_layer) for s in inter_plan.stages]
        stage_devices = [[devices[i] for i in s.device_ids] for s in inter_plan.stages]
        logical = [s.logical_mesh for s in inter_plan.stages]

        def layout_fn(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
            return intra_op_layout(loss, inter_plan.stage_specs[sp.index], sp.eqns, mesh)

    elif stages == "auto":
        stage_plan = optimal_stage_plan(
            num_layers,
            1,
            n,
            stage_cost(stats),
            num_microbatches,
            memory_budget_bytes=memory_budget_bytes,
            schedule=schedule,
            num_stages=num_stages,
        )
        ranges = [(a.start_layer, a.end_layer) for a in stage_plan.stages]
        ids = place_submeshes([a.submesh_shape for a in stage_plan.stages], 1, n)
        stage_devices = [[devices[i] for i in group] for group in ids]
        logical = [a.logical_shape for a in stage_plan.stages]
    else:
        if stages == "equal-layer":
            ranges = list(equal_layer_stages(num_layers, num_stages))
        elif stages == "equal-flops":
            ranges = list(equal_flops_stages(stats.forward_flops, num_stages))
        else:
            ranges = stages
        per = n // len(ranges)
        stage_devices = [devices[s * per : (s + 1) * per] for s in range(len(ranges))]
        logical = [(per, 1)] * len(ranges)
    if layout == "data-parallel":

        def layout_fn(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
            return StageLayout(spec_fn)

    programs = split_stages(program.records, ranges)
    return PipelineTrainer(
        program,
        programs,
        stage_devices,
        logical,
        params,
        optimizer,
        num_microbatches,
        schedule,
        layout_fn,
        stage_plan,
        inter_plan,
        intra_cost,
    )
