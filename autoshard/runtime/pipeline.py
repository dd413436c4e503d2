"""Pipeline runtime of the inter-operator pass: one loss function, S stages on S sub-meshes.

Takes the traced forward of one microbatch, its per-stage sub-programs, the stages
(:class:`~autoshard.inter.plan.Stage`: layers, sub-mesh, logical mesh, devices), the
parameters and an optax optimizer, and returns a :class:`PipelineTrainer` whose
``step(batch)`` trains on the full batch split into microbatches, with the forward and
backward of each stage on its own sub-mesh of devices, in GPipe, 1F1B or interleaved
1F1B order.  Built by
:func:`autoshard.api_pipeline.auto_pipeline`, which traces and searches the stages.

How it works:

* the forward of **one microbatch**, traced into flat equations tagged with their layer,
  is cut into per-stage sub-programs (:func:`autoshard.inter.program_cut.split_stages`);
* a parameter read by several stages (the GPT's LM head tied to ``wte``) is owned by the
  first stage that reads it and sent forward like an activation; its cotangent comes
  back and is added to the owner's gradient;
* each stage (:class:`~autoshard.runtime.stage.StageExecutable`) jits a forward
  (params, received, data) -> (sent tensors, residuals) under ``jax.vjp`` and a backward
  that applies the stored ``vjp`` to the residuals and returns parameter gradients (added
  to an accumulator) and cotangents for what it received.  Per microbatch in flight a
  stage keeps its residuals: all of them (recompute ``none``), all but the attention core
  (``selective``) or only each inner layer's inputs (``full``), as its planned
  :class:`~autoshard.inter.plan.Stage` says; nothing is recomputed unless the plan says so;
* interleaved 1F1B (``schedule="interleaved"``, ``virtual_stages = V``): the program is
  cut into ``S * V`` chunks; chunk ``c`` of stage ``s`` (virtual stage ``c * S + s``)
  runs on stage ``s``'s devices, in Megatron-LM's order
  (:func:`~autoshard.inter.schedules.interleaved_one_f_one_b`);
* tensors cross sub-meshes with :func:`~autoshard.runtime.distributed.transfer` to the
  receiving stage's sharding (``jax.device_put`` within a process; across the processes of a
  ``jax.distributed`` run, one collective over both stages' devices: every process runs the
  same schedule, so stages may sit on different processes).
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
from jax.sharding import AxisType

from autoshard.inter.flops_cost import layer_stats
from autoshard.inter.plan import LOGICAL_AXES, InterPlan, Stage, StagePlan
from autoshard.inter.program_cut import StageProgram
from autoshard.inter.schedules import (
    FORWARD,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    validate,
)
from autoshard.inter.stage_cost import IntraStageCost
from autoshard.runtime.distributed import to_host, transfer
from autoshard.runtime.stage import Probe, StageExecutable
from autoshard.runtime.stage_layout import StageLayout, data_parallel_spec
from autoshard.trace.jaxpr import TracedProgram

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
RUNNABLE_SCHEDULES = (*SCHEDULES, "interleaved")


def check_virtual_stages(schedule: str, virtual_stages: int) -> int:
    """``virtual_stages`` if it suits ``schedule``: > 1 only (and any positive int) with
    ``interleaved``; raises with what would work otherwise."""
    if schedule not in RUNNABLE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {RUNNABLE_SCHEDULES}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' (model chunks per "
            f"stage); {schedule!r} runs one chunk per stage"
        )
    return virtual_stages


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
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B)

    def __str__(self) -> str:
        chunks = f" ({self.virtual_stages} chunks per stage)" if self.virtual_stages > 1 else ""
        lines = [
            f"{len(self.stages) // self.virtual_stages} stages{chunks}, "
            f"{self.num_microbatches} microbatches, {self.schedule}"
        ]
        for st in self.stages:
            shared = f", receives {', '.join(st.received_params)}" if st.received_params else ""
            reduce = (
                f", {st.stage.logical_mesh[0]} replicas reduced once a step"
                if st.stage.grad_reduce == "step"
                else ""
            )
            name = (
                f"chunk {st.index} on stage {st.index % (len(self.stages) // self.virtual_stages)}"
                if self.virtual_stages > 1
                else f"stage {st.index}"
            )
            lines.append(
                f"  {name}: layers {st.stage.layers[0]}..{st.stage.layers[-1]} on "
                f"devices {list(st.stage.device_ids)} as (dp, tp) = "
                f"{tuple(st.stage.logical_mesh)}, {st.layout}"
                f"{' (tensor parallel)' if st.tensor_parallel else ''}, recompute "
                f"{st.stage.recompute}{reduce}{shared}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------- the runtime

# layout_fn(stage program, stage mesh) -> how the stage lays out its tensors
LayoutFn = Callable[[StageProgram, jax.sharding.Mesh], StageLayout]


def data_parallel_layout(sp: StageProgram, mesh: jax.sharding.Mesh) -> StageLayout:
    """The default layout: :func:`~autoshard.runtime.stage_layout.data_parallel_spec`."""
    return StageLayout(data_parallel_spec)


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
        virtual_stages: int = 1,
        layout_fn: LayoutFn = data_parallel_layout,
        stage_plan: StagePlan | None = None,
        inter_plan: InterPlan | None = None,
        intra_cost: IntraStageCost | None = None,
        probe: Probe | None = None,
        host_params: frozenset[int] = frozenset(),
        replica_programs: Sequence[TracedProgram | None] | None = None,
        cast_once: bool = True,
    ):
        """``stages[i]`` runs ``stage_programs[i]`` on ``devices[j] for j in
        stages[i].device_ids``, viewed as its logical mesh (axes ``data``, ``model``),
        with ``stages[i].recompute``.  With ``virtual_stages = V > 1`` (interleaved 1F1B)
        there are ``S * V`` programs: program ``c * S + s`` is model chunk ``c`` of stage
        ``s`` and runs on ``stages[s]``'s devices.  ``probe(stage, layer)`` is called each
        time a layer's forward runs (:mod:`autoshard.runtime.stage`).  A stage whose
        ``grad_reduce`` is ``"step"`` and whose logical mesh has ``dp > 1`` runs as ``dp``
        data-parallel replicas of ``replica_programs[i]`` (the loss traced at ``1/dp`` of
        the microbatch; ``layout_fn`` then lays out one replica, over ``model`` only).
        ``cast_once`` (default): each f32 weight a stage reads once, through a convert to
        16 bits, is cast once a step and its microbatches read the 16-bit copy
        (:class:`~autoshard.runtime.stage.StageExecutable`); False: every microbatch casts
        it, as the traced step does."""
        records = program.records
        self.inter_plan = inter_plan  # the search's answer, with each stage's intra-op plan
        self.intra_cost = intra_cost  # its solved ILPs: pass to auto_pipeline to reuse them
        self.num_microbatches = num_microbatches
        self.virtual_stages = check_virtual_stages(schedule, virtual_stages)
        num_programs = len(stage_programs)
        if num_programs % virtual_stages or len(stages) != num_programs:
            raise ValueError(
                f"{num_programs} stage programs and {len(stages)} stages for "
                f"{virtual_stages} virtual stages per stage: expected one stage per program "
                "and a multiple of virtual_stages"
            )
        num_physical = num_programs // virtual_stages
        if schedule == "interleaved":
            self._schedule = interleaved_one_f_one_b(num_physical, num_microbatches, virtual_stages)
        else:
            self._schedule = SCHEDULES[schedule](num_physical, num_microbatches)
        validate(self._schedule, num_physical, num_microbatches, virtual_stages)
        self._num_physical = num_physical
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        self._params_treedef = jax.tree.structure(params)
        num_params = len(leaves)
        self._param_ids = records.inputs[:num_params]
        self._data_ids = records.inputs[num_params:]
        self._batch_treedef = program.in_tree.children()[1]
        path_of = {t: path for t, (path, _) in zip(self._param_ids, leaves, strict=True)}
        values = {t: leaf for t, (_, leaf) in zip(self._param_ids, leaves, strict=True)}
        self._stages: list[StageExecutable] = []
        replica_programs = _replica_programs(replica_programs, stages)
        stage_devices = [[devices[i] for i in st.device_ids] for st in stages]
        meshes: dict[tuple, jax.sharding.Mesh] = {}
        for sp, devs, st, replica in zip(
            stage_programs, stage_devices, stages, replica_programs, strict=True
        ):
            key = (tuple(d.id for d in devs), tuple(st.logical_mesh))
            if key not in meshes:  # the chunks of one stage share its mesh
                meshes[key] = jax.sharding.Mesh(
                    np.array(devs, dtype=object).reshape(st.logical_mesh),
                    LOGICAL_AXES,
                    axis_types=(AxisType.Auto,) * len(LOGICAL_AXES),  # for sharding constraints
                )
            mesh = meshes[key]
            items = [(path_of[t], t) for t in sp.params]
            layout = layout_fn(sp, mesh)
            self._stages.append(
                StageExecutable(
                    program,
                    sp,
                    mesh,
                    layout,
                    items,
                    values,
                    optimizer,
                    st.recompute,
                    probe,
                    offload=_classes(st),
                    host_params=host_params if "master" in _classes(st) else frozenset(),
                    replica_prog=replica,
                    cast_once=cast_once,
                )  # fmt: skip
            )
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
            virtual_stages,
        )

    @property
    def schedule(self):
        """The schedule that runs (:mod:`autoshard.inter.schedules`: ticks of tasks)."""
        return self._schedule

    @property
    def stage_executables(self) -> tuple[StageExecutable, ...]:
        """The stages as they run (one per program: ``S * V`` with virtual stages)."""
        return tuple(self._stages)

    def compiled_forward(self, stage: int) -> jax.stages.Compiled:
        """The executable of stage ``stage``'s forward for one microbatch, as it runs
        (compiled for abstract arguments with the stage's shardings)."""
        st = self._stages[stage]
        return st.forward.lower(*st.abstract_args()).compile()

    def compiled_backward(self, stage: int) -> jax.stages.Compiled:
        """The executable of stage ``stage``'s backward for one microbatch, as it runs
        (adding into the gradient accumulator)."""
        st = self._stages[stage]
        return st.backward.lower(*st.abstract_backward_args()).compile()

    def compiled_update(self, stage: int) -> jax.stages.Compiled:
        """The executable of stage ``stage``'s update (once a step: the optimizer on the
        accumulated gradient; with replicas also their one reduction over ``data``)."""
        st = self._stages[stage]
        return st.update.lower(st.params, st.opt_state, st.abstract_grads()).compile()

    @property
    def params(self):
        """The full parameter pytree (host numpy arrays), each leaf from its owner stage."""
        by_id = {}
        for stage in self._stages:
            by_id.update(zip(stage.param_ids, jax.tree.leaves(stage.params), strict=True))
        return jax.tree.unflatten(
            self._params_treedef, [to_host(by_id[t]) for t in self._param_ids]
        )

    def _microbatches(self, batch) -> list[dict[int, Any]]:
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self._batch_treedef:
            raise ValueError(f"batch has structure {treedef}; expected {self._batch_treedef}")
        m = self.num_microbatches
        out: list[dict[int, Any]] = [{} for _ in range(m)]
        for t, leaf in zip(self._data_ids, leaves, strict=True):
            leaf = to_host(leaf)  # placed from the host: stages may be on other processes
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
        live = [st.live_params() for st in stages]  # the 16-bit copies made, once a step
        # one microbatch: each stage's backward and update run as one program (no
        # accumulator; StageExecutable.backward_update)
        fused = m == 1
        grads = [None if fused else st.zero_grads() for st in stages]
        inbox: dict[tuple[int, int], dict[int, Any]] = {}  # (stage, mb) -> received tensors
        cotangents: dict[tuple[int, int], dict[int, Any]] = {}  # (stage, mb) -> output cts
        saved: dict[tuple[int, int], tuple[list, list, list]] = {}  # the forward's residuals
        losses = []
        for tick in self._schedule:
            for task in tick:
                index = task.chunk * self._num_physical + task.stage  # the virtual stage
                st, key = stages[index], (index, task.microbatch)
                sp = st.sp
                if task.kind == FORWARD:
                    box = inbox.pop(key, {})
                    received = [box[t] for t in sp.received]
                    data = [
                        jax.device_put(microbatches[task.microbatch][t], sh)
                        for t, sh in zip(sp.data, st.data_shardings, strict=True)
                    ]
                    outs, residuals = st.forward(live[index], received, data)
                    for t, value, consumers in zip(
                        sp.outputs, outs, sp.output_consumers, strict=True
                    ):
                        for c in consumers:
                            sh = stages[c].received_shardings[stages[c].sp.received.index(t)]
                            inbox.setdefault((c, task.microbatch), {})[t] = transfer(value, sh)
                        if t == st.loss:
                            losses.append(value)
                    saved[key] = (received, data, residuals)
                else:
                    received, data, residuals = saved.pop(key)
                    box = cotangents.pop(key, {})
                    out_cts = [_output_cotangent(st, t, box, m) for t in st.float_out]
                    if fused:
                        own = live[index] if st.casts else None
                        live[index] = None  # (the weights themselves, donated below)
                        st.params, st.opt_state, in_cts = st.backward_update(
                            st.params, st.opt_state, received, data, residuals, out_cts, own
                        )
                    else:
                        grads[index], in_cts = st.backward(
                            live[index], received, data, residuals, out_cts, grads[index]
                        )
                    del residuals
                    for i, ct in zip(st.float_in, in_cts, strict=True):
                        t, src = sp.received[i], sp.received_from[i]
                        sender = stages[src]
                        sh = sender.output_shardings[sender.sp.outputs.index(t)]
                        ct = transfer(ct, sh)
                        box_src = cotangents.setdefault((src, task.microbatch), {})
                        box_src[t] = box_src[t] + ct if t in box_src else ct
        del live  # the 16-bit copies; the update reads the weights at rest
        for st, g in zip(stages, grads, strict=True):
            if not fused:
                st.params, st.opt_state = st.update(st.params, st.opt_state, g)
        return sum(losses[1:], losses[0]) / m


def _replica_programs(programs, stages) -> list:
    """Per stage, the program its replicas run (None: it runs as one); raises where a
    stage asks for ``grad_reduce="step"`` over ``dp > 1`` without one."""
    programs = [None] * len(stages) if programs is None else list(programs)
    if len(programs) != len(stages):
        raise ValueError(f"{len(programs)} replica programs for {len(stages)} stages")
    out = []
    for i, (prog, st) in enumerate(zip(programs, stages, strict=True)):
        replicated = st.grad_reduce == "step" and st.logical_mesh[0] > 1
        if replicated and prog is None:
            raise ValueError(
                f"stage {i} reduces its gradient once a step over dp={st.logical_mesh[0]} "
                "replicas but no replica program (the loss traced at 1/dp of the "
                "microbatch) was given"
            )
        out.append(prog if replicated else None)
    return out


def _classes(stage) -> tuple[str, ...]:
    """The tensor classes a planned stage keeps in host memory (its ``offload``
    placement, docs/offload.md; each stage its own)."""
    label = getattr(stage, "offload", "none")
    return () if label == "none" else tuple(label.split(","))


def _output_cotangent(stage: StageExecutable, t: int, box: dict[int, Any], num_microbatches: int):
    """The summed cotangents later stages sent for output ``t``; the loss is seeded with
    ``1 / num_microbatches`` (the global loss is the mean of the microbatch losses)."""
    rec = stage.tensors[t]
    ct = box.get(t)
    seed = 1.0 / num_microbatches if t == stage.loss else 0.0
    if ct is None:  # the loss, or read later only through non-differentiable paths
        sharding = stage.output_shardings[stage.sp.outputs.index(t)]
        return jax.device_put(np.full(rec.shape, seed, rec.dtype), sharding)
    if seed:
        ct = ct + jnp.asarray(seed, rec.dtype)
    return ct


def divisibility_message(batch_size: int, num_microbatches: int) -> str:
    """Why ``num_microbatches`` cannot split ``batch_size``, and the counts that would."""
    fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    return (
        f"num_microbatches={num_microbatches} does not divide the batch size {batch_size}; "
        f"use one of {fits}"
    )
