"""A pipeline stage's forward and gradients run as data-parallel replicas inside
``shard_map`` manual over ``data`` (``grad_reduce="step"``; a mixin of
:class:`~autoshard.runtime.stage.StageExecutable`; the batch dims and ZeRO layout are
:mod:`autoshard.runtime.stage_replicas`')."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from autoshard.runtime.stage_replicas import _combine


class ReplicatedRun:
    """Wraps one replica's forward and gradients (needs the stage's ``replicas``, ``sp``,
    ``mesh``, ``float_in``, ``float_out`` and ``output_shardings``)."""

    def _replicated(self, forward, gradients):
        """``forward`` and ``gradients`` of one replica (the stage's equations at ``1/D``
        of the microbatch) run as ``D`` replicas inside ``shard_map`` manual over
        ``data``: the full microbatch's tensors in and out, the residuals and parameter
        gradients stacked ``(D, ...)`` over ``data``."""
        replicas, sp, mesh = self.replicas, self.sp, self.mesh
        d = replicas.replicas
        shared = {t for t, dim in replicas.batch_dims.items() if dim is None}
        stacked = PartitionSpec("data")

        def specs(ids):
            return [replicas.manual_spec(t) for t in ids]

        def manual(f, in_specs, out_specs):
            return jax.shard_map(
                f,
                mesh=mesh,
                in_specs=in_specs,
                out_specs=out_specs,
                axis_names={"data"},
                check_vma=False,  # the traced equations carry no varying casts
            )

        # an output the replicas share (the loss, a weight sent on) leaves stacked and is
        # averaged outside; a received one's cotangents leave stacked and are summed
        out_specs = [stacked if t in shared else s for t, s in zip(sp.outputs, specs(sp.outputs))]
        float_received = [sp.received[i] for i in self.float_in]
        in_ct_specs = [
            stacked if t in shared else s
            for t, s in zip(float_received, specs(float_received), strict=True)
        ]

        def forward_body(params, received, data):
            outs, kept = forward(params, received, data)
            outs = [o[None] if t in shared else o for t, o in zip(sp.outputs, outs, strict=True)]
            return outs, [r[None] for r in kept]

        def replicated_forward(params, received, data):
            outs, kept = manual(
                forward_body,
                (PartitionSpec(), specs(sp.received), specs(sp.data)),
                (out_specs, stacked),
            )(params, received, data)
            outs = [_combine(o) if t in shared else o for t, o in zip(sp.outputs, outs)]
            outs = [
                jax.lax.with_sharding_constraint(o, sh)
                for o, sh in zip(outs, self.output_shardings, strict=True)
            ]
            return outs, kept

        def gradients_body(params, received, data, residuals, out_cts):
            residuals = [r[0] for r in residuals]
            # the adjoint of the mean over replicas: each replica's share is 1/D
            out_cts = [
                ct / d if t in shared else ct for t, ct in zip(self.float_out, out_cts, strict=True)
            ]
            grads, in_cts = gradients(params, received, data, residuals, out_cts)
            in_cts = [
                c[None] if t in shared else c for t, c in zip(float_received, in_cts, strict=True)
            ]
            return jax.tree.map(lambda g: g[None], grads), in_cts

        def replicated_gradients(params, received, data, residuals, out_cts):
            grads, in_cts = manual(
                gradients_body,
                (
                    PartitionSpec(),
                    specs(sp.received),
                    specs(sp.data),
                    stacked,
                    specs(self.float_out),
                ),
                (stacked, in_ct_specs),
            )(params, received, data, residuals, out_cts)
            in_cts = [c.sum(0) if t in shared else c for t, c in zip(float_received, in_cts)]
            return grads, in_cts

        return replicated_forward, replicated_gradients
