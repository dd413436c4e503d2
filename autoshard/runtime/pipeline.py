"""Pipeline runtime of the inter-operator pass: one loss function, S stages on S sub-meshes.

Takes the traced forward of one microbatch, its per-stage sub-programs, the stages
(:class:`~autoshard.inter.plan.Stage`: layers, sub-mesh, logical mesh, devices), the
parameters and an optax optimizer, and returns a :class:`PipelineTrainer` whose
``step(batch)`` trains on the full batch split into microbatches, with the forward and
backward of each stage on its own sub-mesh of devices, in GPipe or 1F1B order.  Built by
:func:`autoshard.api_pipeline.auto_pipeline`, which traces and searches the stages.

How it works:

* the forward of **one microbatch**, traced into flat equations tagged with their layer,
  is cut into per-stage sub-programs (:func:`autoshard.inter.program_cut.split_stages`);
* a parameter read by several stages (the GPT's LM head tied to ``wte``) is owned by the
  first stage that reads it and sent forward like an activation; its cotangent comes
  back and is added to the owner's gradient;
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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding

from autoshard.inter.flops_cost import layer_stats
from autoshard.inter.plan import LOGICAL_AXES, InterPlan, Stage, StagePlan
from autoshard.inter.program_cut import StageProgram
from autoshard.inter.schedules import FORWARD, gpipe, one_f_one_b, validate
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.ir.records import TensorRecord
from autoshard.runtime.stage_layout import StageLayout, data_parallel_spec
from autoshard.trace.jaxpr import TracedProgram

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PipelineStage:
    """One stage as it runs: the planned stage (its ``device_ids`` the devices' own ids)
    and what the runtime made of it: FLOPs, parameters and layout."""

    index: int
    stage: Stage
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
                f"  stage {st.index}: layers {st.stage.layers[0]}..{st.stage.layers[-1]} on "
                f"devices {list(st.stage.device_ids)} as (dp, tp) = "
                f"{tuple(st.stage.logical_mesh)}, {st.layout}"
                f"{' (tensor parallel)' if st.tensor_parallel else ''}{shared}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------- the runtime

# layout_fn(stage program, stage mesh) -> how the stage lays out its tensors
LayoutFn = Callable[[StageProgram, jax.sharding.Mesh], StageLayout]


def data_parallel_layout(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
    """The default layout: :func:`~autoshard.runtime.stage_layout.data_parallel_spec`."""
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
    """Trains ``loss_fn`` with ``optimizer`` as a pipeline; build it with
    :func:`autoshard.api_pipeline.auto_pipeline`.

    ``step(batch)`` takes the full global batch and returns its mean loss; ``params`` is
    the full parameter pytree, gathered to host numpy arrays; ``plan`` says what runs where.
    """

    def __init__(
        self,
        program: TracedProgram,
        stage_programs: Sequence[StageProgram],
        stages: Sequence[Stage],
        devices: Sequence[Any],
        params,
        optimizer: optax.GradientTransformation,
        *,
        num_microbatches: int,
        schedule: str,
        layout_fn: LayoutFn = data_parallel_layout,
        stage_plan: StagePlan | None = None,
        inter_plan: InterPlan | None = None,
        intra_cost: IntraStageCost | None = None,
    ):
        """``stages[i]`` runs ``stage_programs[i]`` on ``devices[j] for j in
        stages[i].device_ids``, viewed as its logical mesh (axes ``data``, ``model``)."""
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
        stage_devices = [[devices[i] for i in st.device_ids] for st in stages]
        for sp, devs, st in zip(stage_programs, stage_devices, stages, strict=True):
            mesh = jax.sharding.Mesh(
                np.array(devs, dtype=object).reshape(st.logical_mesh),
                LOGICAL_AXES,
                axis_types=(AxisType.Auto,) * len(LOGICAL_AXES),  # for with_sharding_constraint
            )
            items = [(path_of[t], t) for t in sp.params]
            layout = layout_fn(sp, mesh)
            self._stages.append(_Stage(program, sp, mesh, layout, items, values, optimizer))
        self._owner = {t: s for s, sp in enumerate(stage_programs) for t in sp.params}
        keystr = {t: jax.tree_util.keystr(path_of[t]) for t in self._param_ids}
        stats = layer_stats(records)
        self.plan = PipelinePlan(
            tuple(
                PipelineStage(
                    sp.index,
                    dataclasses.replace(stage, device_ids=tuple(d.id for d in devs)),
                    sum(stats.forward_flops[sp.start_layer : sp.end_layer]),
                    tuple(keystr[t] for t in sp.params),
                    tuple(keystr[t] for t in sp.received if t in keystr),
                    sum(t not in keystr for t in sp.received),
                    st.layout.name,
                    st.layout.tensor_parallel,
                )
                for sp, devs, stage, st in zip(
                    stage_programs, stage_devices, stages, self._stages, strict=True
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
                raise ValueError(divisibility_message(leaf.shape[0], m))
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


def divisibility_message(batch_size: int, num_microbatches: int) -> str:
    """Why ``num_microbatches`` cannot split ``batch_size``, and the counts that would."""
    fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    return (
        f"num_microbatches={num_microbatches} does not divide the batch size {batch_size}; "
        f"use one of {fits}"
    )
