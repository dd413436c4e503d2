"""Per-stage peak memory of a pipeline as it runs, read from its compiled executables,
beside the planner's prediction for the stage.

Takes a :class:`~autoshard.runtime.pipeline.PipelineTrainer`; returns one
:class:`StageMemory` per stage (per device of the stage, bytes):

* ``state_bytes``: parameters, the gradient accumulator (none with one microbatch a
  step: the backward and the update are one program, whose temporaries the gradients
  are) and the optimizer state, each at its sharding's per-device shard size;
* ``residual_bytes``: what one microbatch in flight holds from its forward until its
  backward: the residuals the compiled forward returns (at the shardings XLA chose for
  them) plus the received activations and batch slices kept for the backward;
* ``working_bytes``: the larger of the compiled forward's and backward's (or backward and
  update's) temporaries
  (``memory_analysis().temp_size_in_bytes``);
* ``compiled_bytes = state + in_flight * residual + working``, ``in_flight`` the
  schedule's peak microbatches in flight on the stage
  (:func:`~autoshard.inter.schedules.in_flight_peak`).

Device memory only: optimizer state and residuals resting in ``pinned_host`` (offload,
docs/offload.md) are left out, as the planner leaves them out of its peak.

``predicted_bytes`` is the planner's ``Stage.peak_bytes`` (the stage search's memory
model, :mod:`autoshard.inter.stage_cost`).  Guarantees: nothing runs; each stage's
forward and backward are compiled once for abstract arguments.  Interleaved schedules
(several chunks per stage) are not reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from autoshard.inter.schedules import in_flight_peak
from autoshard.runtime.sharded import HOST_MEMORY

AGREEMENT = 0.10  # |compiled / predicted - 1| within which a stage agrees


def _shard_bytes(shape, dtype, sharding) -> int:
    return int(math.prod(sharding.shard_shape(tuple(shape)))) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class StageMemory:
    """One stage's per-device peak: the runtime's terms and the planner's figure."""

    stage: int
    in_flight: int
    state_bytes: int
    residual_bytes: int
    working_bytes: int
    predicted_bytes: float

    @property
    def compiled_bytes(self) -> int:
        return self.state_bytes + self.in_flight * self.residual_bytes + self.working_bytes

    @property
    def ratio(self) -> float:
        """compiled / predicted (inf when nothing was predicted)."""
        return self.compiled_bytes / self.predicted_bytes if self.predicted_bytes else math.inf

    @property
    def agrees(self) -> bool:
        return abs(self.ratio - 1.0) <= AGREEMENT

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "in_flight": self.in_flight,
            "state_bytes": self.state_bytes,
            "residual_bytes": self.residual_bytes,
            "working_bytes": self.working_bytes,
            "compiled_bytes": self.compiled_bytes,
            "predicted_bytes": self.predicted_bytes,
            "ratio": self.ratio,
            "agrees": self.agrees,
        }


def stage_memory(trainer) -> tuple[StageMemory, ...]:
    """Per-stage compiled against predicted peak memory (see the module docstring)."""
    if trainer.virtual_stages > 1:
        raise ValueError("per-stage memory is not reported for interleaved schedules yet")
    out = []
    for index, (st, planned) in enumerate(
        zip(trainer.stage_executables, trainer.plan.stages, strict=True)
    ):
        params, received, data = st.abstract_args()
        forward = st.forward.lower(params, received, data).compile()
        outs, residuals = jax.eval_shape(st.forward, params, received, data)
        _, residual_shardings = forward.output_shardings
        kept = sum(
            _shard_bytes(r.shape, r.dtype, sh)
            for r, sh in zip(residuals, residual_shardings, strict=True)
            if sh.memory_kind != HOST_MEMORY  # offloaded activations wait on the host
        )
        kept += sum(_shard_bytes(a.shape, a.dtype, a.sharding) for a in (*received, *data))
        residual_args = [
            jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=sh)
            for r, sh in zip(residuals, residual_shardings, strict=True)
        ]
        out_cts = st.abstract_cotangents()
        # the parameters' own dtypes (f32 for a master); replicas: stacked over data
        grad_acc = st.abstract_grads()
        if trainer.num_microbatches == 1:  # the backward and the update, one program
            rest = jax.tree.map(
                lambda p, sh: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sh),
                st.params,
                st.rest_shardings,
            )
            opt_state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                st.opt_state,
            )
            live = params if st.casts else None
            backward = st.backward_update.lower(
                rest, opt_state, received, data, residual_args, out_cts, live
            ).compile()
            grad_acc = {}  # none: its gradients are temporaries of that program
        else:
            backward = st.backward.lower(
                params, received, data, residual_args, out_cts, grad_acc
            ).compile()
        state = (
            sum(  # the parameters as a step reads them (a master: its 16-bit copy)
                _shard_bytes(p.shape, p.dtype, p.sharding) for p in jax.tree.leaves(params)
            )
            + sum(  # the f32 weights cast once a step, resting on the device beside their copies
                _shard_bytes(p.shape, p.dtype, sh)
                for t, p, sh in zip(
                    st.param_ids, jax.tree.leaves(st.params), jax.tree.leaves(st.rest_shardings)
                )
                if t in st.cast_once
            )
            + sum(  # and the gradient accumulator
                _shard_bytes(g.shape, g.dtype, g.sharding) for g in jax.tree.leaves(grad_acc)
            )
        )
        state += sum(
            _shard_bytes(leaf.shape, leaf.dtype, leaf.sharding)
            for leaf in jax.tree.leaves(st.opt_state)
            if leaf.sharding.memory_kind != HOST_MEMORY  # offloaded state rests on the host
        )
        working = max(
            forward.memory_analysis().temp_size_in_bytes,
            backward.memory_analysis().temp_size_in_bytes,
        )
        out.append(
            StageMemory(
                index,
                in_flight_peak(trainer.schedule, index),
                int(state),
                int(kept),
                int(working),
                float(planned.stage.peak_bytes),
            )
        )
    return tuple(out)
