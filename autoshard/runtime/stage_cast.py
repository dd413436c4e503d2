"""Weights a pipeline stage reads as 16-bit copies made once a step
(:class:`~autoshard.runtime.stage.StageExecutable`'s ``cast_once`` and masters resting in
host memory): which converts hand the copy straight through, and the program that makes
the copies (a mixin of the stage)."""

from __future__ import annotations

import jax

from autoshard.inter.program_cut import StageProgram
from autoshard.runtime.offload_stream import _narrow_copy
from autoshard.trace.jaxpr import TracedProgram


class CastOnce:
    """The stage's 16-bit copies made once a step (needs the stage's ``params``,
    ``param_ids``, ``param_shardings``, ``live_dtypes``, ``cast_once``,
    ``masters_on_host``, ``tensors`` and ``_read_once_narrow``)."""

    def _passthrough(self, run: TracedProgram, sp: StageProgram, constraints) -> frozenset[int]:
        """The equations that convert a weight cast once a step (or a master resting in
        host memory) read only there, whose plan reads and makes it in the weight's own
        layout: each gives the 16-bit copy itself (no new
        value), so the backward takes the copy back as an argument instead of keeping a
        copy of it per microbatch in flight as a residual (replicas: their plan's layouts
        on the stage mesh, as the weights enter their ``shard_map`` whole over ``data``)."""
        if not self._read_once_narrow:
            return frozenset()
        sharding = dict(zip(self.param_ids, jax.tree.leaves(self.param_shardings), strict=True))
        out = set()
        for i in sp.eqns:
            eqn = run.records.eqns[i]
            if len(eqn.inputs) != 1 or eqn.inputs[0] not in self._read_once_narrow:
                continue
            t = eqn.inputs[0]
            wanted = []
            if constraints is not None:
                wanted = [sh for _, sh in constraints.operands.get(i, ())]
                wanted += [sh for pos, sh in constraints.outputs.get(i, ()) if pos == 0]
            ndim = len(self.tensors[t].shape)
            if all(sh.is_equivalent_to(sharding[t], ndim) for sh in wanted):
                out.add(i)
        return frozenset(out)

    @property
    def casts(self) -> bool:
        """Whether a step reads some weights as 16-bit copies made once a step (masters
        resting in host memory, weights cast once): :meth:`live_params` makes them."""
        return self.masters_on_host or bool(self.cast_once)

    def live_params(self):
        """The stage's parameters on the device for one step: each master weight resting in
        host memory as its 16-bit copy, made once per step (every microbatch reads it),
        one weight at a time (copied in, converted); each weight cast once as its 16-bit
        copy, all made by one program; the rest as they are."""
        if not self.casts:
            return self.params
        leaves, treedef = jax.tree.flatten(self.params)
        shardings = jax.tree.leaves(self.param_shardings)
        once = [t in self.cast_once for t in self.param_ids]
        cast = iter(self._cast_once_program()([x for x, o in zip(leaves, once) if o]))
        live = [
            next(cast) if o else x if x.dtype == dt else _narrow_copy(sh, dt)(x)
            for x, sh, dt, o in zip(leaves, shardings, self.live_dtypes, once, strict=True)
        ]
        return jax.tree.unflatten(treedef, live)

    def _cast_once_program(self):
        """The jitted cast of the weights cast once, to their 16-bit copies in the
        weights' shardings (the convert the traced step makes every microbatch)."""
        if getattr(self, "_cast_program", None) is None:
            picked = [
                (sh, dt)
                for t, sh, dt in zip(
                    self.param_ids,
                    jax.tree.leaves(self.param_shardings),
                    self.live_dtypes,
                    strict=True,
                )
                if t in self.cast_once
            ]
            dtypes = [dt for _, dt in picked]
            self._cast_program = jax.jit(
                lambda xs: [x.astype(dt) for x, dt in zip(xs, dtypes, strict=True)],
                out_shardings=[sh for sh, _ in picked],
            )
        return self._cast_program
