"""Activation recompute in a pipeline stage (:class:`~autoshard.runtime.stage.StageExecutable`):
the ``jax.checkpoint`` policy of each recompute mode and the runs of equations, layer by
layer, that a stage checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import jax

from autoshard.inter.stage_memory import is_attention_sized
from autoshard.inter.stages import RECOMPUTE_MODES


def recompute_policy(mode: str):
    """The ``jax.checkpoint`` policy of a recompute mode (None: no checkpoint)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "selective":
        return _save_all_but_attention
    return jax.checkpoint_policies.nothing_saveable


def _save_all_but_attention(prim, *avals, **params) -> bool:
    """Selective recompute's policy: keep a value unless it is attention-sized or made
    from one (scores, softmax and their masks are rebuilt from the saved Q, K, V)."""
    if any(is_attention_sized(getattr(a, "shape", ())) for a in avals):
        return False
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(lambda *xs: prim.bind(*xs, **params), *structs)
    return not any(is_attention_sized(o.shape) for o in jax.tree.leaves(out))


def _layer_groups(eqns, recomputed: Callable[[str | None], bool]):
    """Consecutive runs of equations of one layer: ``[(layer, recomputed, eqns)]``."""
    groups: list[tuple[str | None, bool, list]] = []
    for item in eqns:
        layer = item[0].layer
        if groups and groups[-1][0] == layer:
            groups[-1][2].append(item)
        else:
            groups.append((layer, recomputed(layer), [item]))
    return groups
