"""The sets of specs a value's uses may want together: the strategies of a hub node
(:mod:`autoshard.intra.problem.value_edges`, meshes of several axes), enumerated with
the uses' ties honoured and capped per mesh (jax-free)."""

from __future__ import annotations

from autoshard.hardware.mesh import DeviceMesh

# on meshes of several axes, a value read by several demands is priced by a hub node (one
# strategy per set of specs its uses may want together) where it has at most this many
# such sets, else by copy and resolution nodes (see hub_max_sets)
HUB_MAX_SETS = 64


def hub_max_sets(mesh: DeviceMesh) -> int:
    """The most wanted sets a value's hub may have on ``mesh``: :data:`HUB_MAX_SETS` on
    meshes of several axes longer than 1, 0 (no hubs: copy and resolution nodes only, the
    exact program as it was) on the others."""
    return HUB_MAX_SETS if sum(1 for n in mesh.mesh.shape if n > 1) > 1 else 0


def _wanted_sets(
    v, strategies, roots, maps, targets, cap: int, per_use: bool = False
) -> list | None:
    """Every set of specs the uses of ``v`` may want together (ties honoured: uses tied to
    one root choose together), as frozensets ordered by size then by ``targets``; None
    where there are more than ``cap``.  ``per_use``: every tuple of wants instead (the
    spec each use wants, None for none, in ``v.uses``'s order), ordered likewise: a hub
    over tuples pins what each use wants, where one over sets lets a set hold a spec no
    use wants (harmless where a larger set never costs less: not so for a partial sum,
    which a spec XLA prefers could resolve more cheaply)."""
    by_root: dict[int, list[int]] = {}
    for j, u in enumerate(v.uses):
        by_root.setdefault(roots[u.dst], []).append(j)
    states: set = {frozenset()} if not per_use else {(None,) * len(v.uses)}
    for r, js in by_root.items():
        options = set()
        for p in range(len(strategies[r])):
            qs = [maps[v.uses[j].dst][p] for j in js]
            if any(q < 0 for q in qs):
                continue
            wants = tuple(
                strategies[v.uses[j].dst][q].input_specs[v.uses[j].slot] for j, q in zip(js, qs)
            )
            options.add(wants if per_use else frozenset(w for w in wants if w is not None))
        if per_use:
            states = {_put(x, js, o) for x in states for o in options}
        else:
            states = {x | o for x in states for o in options}
        if len(states) > cap:
            return None
    index = {b: j for j, b in enumerate(targets)}
    index[None] = -1
    if per_use:
        return sorted(states, key=lambda x: (len(set(x) - {None}), [index[b] for b in x]))
    return sorted(states, key=lambda x: (len(x), sorted(index[b] for b in x)))


def wanted_sets_memo(memo: dict, v, strategies, roots, maps, targets, cap, per_use):
    """:func:`_wanted_sets` through ``memo["wanted"]``: the values of identical layers
    (uses on the same roots, maps, strategies and slots) share one answer."""
    cache = memo.setdefault("wanted", {})
    key = (
        tuple((roots[u.dst], maps[u.dst], id(strategies[u.dst]), u.slot) for u in v.uses),
        cap,
        per_use,
    )
    if key not in cache:
        cache[key] = _wanted_sets(v, strategies, roots, maps, targets, cap, per_use)
    return cache[key]


def _put(state: tuple, where: list[int], wants: tuple) -> tuple:
    out = list(state)
    for j, w in zip(where, wants):
        out[j] = w
    return tuple(out)


def specs_of(state) -> tuple:
    """The distinct specs a hub state (a set, or a tuple per use) wants."""
    if isinstance(state, frozenset):
        return tuple(state)
    return tuple(dict.fromkeys(w for w in state if w is not None))


__all__ = ["HUB_MAX_SETS", "hub_max_sets", "specs_of", "wanted_sets_memo"]
