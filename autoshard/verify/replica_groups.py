"""Replica groups of compiled HLO, read as mesh axes.

How replica groups become mesh axes.  HLO replica groups hold *logical* ids
(``replica * num_partitions + partition``; "global device ids" in XLA's words), not
``Device.id``: the executable's device assignment maps logical id ``i`` to a device, and
for a jit over one JAX mesh that assignment is the mesh's devices in row-major order
(permuting the devices of a mesh leaves the HLO text unchanged).  A group's mesh axes are
the axes along which its members' mesh coordinates vary; the groups must partition the
devices into exactly the blocks spanned by those axes, otherwise the axes are reported as
``("?",)`` (:data:`UNKNOWN_AXES`) with a note, never guessed.  Where the groups are the
blocks of *parts* of axes (pairs of a 4-device axis), they are named as sub-axes,
``data:(1)2`` (:func:`~autoshard.ir.spec.sub_axis`).  Forms understood:
``{{0,1},{2,3}}``, ``{}`` (all), iota lists ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``, and
the mesh form ``mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}`` (sub-axes
``'b':(1)2`` too).  :func:`_global_groups` applies XLA's group modes (cross-replica,
cross-partition, flattened ids) to one instruction.  Jax-free.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from autoshard.ir.spec import Axes, Mesh, sub_axis_name
from autoshard.verify.hlo import _attr, _balanced, _Instr, _ints, _Module, _split_top

UNKNOWN_AXES: Axes = ("?",)


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm is not None else ids


def _mesh_form_groups(text: str) -> list[list[int]]:
    m = re.match(r"mesh\[(.*?)\](?:,\s*device_ids=\((.*)\))?\s*\{(.*)\}\s*$", text)
    if not m:
        raise ValueError(f"cannot read mesh-form replica groups {text!r}")
    names, sizes = [], []
    for part in _split_top(m.group(1)):
        name, size = part.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    if m.group(2) is None:
        ids = np.arange(n)
    elif it := re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", m.group(2)):
        ids = _iota(_ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None).reshape(-1)
    else:
        flat = _ints(m.group(2))
        ids = np.array(flat[-n:] if len(flat) >= n else flat)
    if ids.size != n:
        raise ValueError(f"mesh-form device_ids in {text!r} hold {ids.size} ids, mesh has {n}")
    # Split every mesh axis into factors at the sub-axis boundaries ('b':(pre)size).
    refs = []
    for part in _split_top(m.group(3)):
        r = re.fullmatch(r"\s*['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?\s*", part)
        if not r or r.group(1) not in names:
            raise ValueError(f"replica-group axis {part!r} is not one of mesh axes {names}")
        axis = names.index(r.group(1))
        pre, size = (int(r.group(2)), int(r.group(3))) if r.group(2) else (1, sizes[axis])
        refs.append((axis, pre, size))
    # Shardy reshapes an axis of size n into [pre, size, n / (pre * size)] for 'b':(pre)size,
    # so cutting every axis at its sub-axis boundaries gives factors, major first.
    cuts = [{1, s} for s in sizes]
    for axis, pre, size in refs:
        cuts[axis] |= {pre, pre * size}
    factors = [
        (axis, lo, hi)
        for axis in range(len(sizes))
        for lo, hi in itertools.pairwise(sorted(cuts[axis]))
    ]
    arr = ids.reshape([hi // lo for _, lo, hi in factors])
    grouped = [
        f
        for axis, pre, size in refs
        for f, (a, lo, _) in enumerate(factors)
        if a == axis and pre <= lo < pre * size
    ]
    rest = [i for i in range(arr.ndim) if i not in grouped]
    size = math.prod(arr.shape[i] for i in grouped)
    return arr.transpose(rest + grouped).reshape(-1, size).tolist()


def parse_replica_groups(text: str, num_ids: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups written in any HLO form -> tuple of ordered id groups.

    ``num_ids`` is the size of the id space, used for ``{}`` (one group of everyone).
    """
    text = text.strip()
    if text.startswith("mesh["):
        groups = _mesh_form_groups(text)
    elif m := re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        shape = _ints(m.group(1))
        arr = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        groups = arr.reshape(shape).tolist()
    elif text.startswith("{"):
        inner = text[1:-1].strip()
        groups = [_ints(g) for g in _split_top(inner)] if inner else [list(range(num_ids))]
    else:
        raise ValueError(
            f"unrecognised replica_groups {text!r}; expected {{{{0,1}},{{2,3}}}}, "
            "[2,4]<=[8], [4,2]<=[2,4]T(1,0) or mesh[...] {...}"
        )
    return tuple(tuple(int(i) for i in g) for g in groups)


def _coords(mesh: Mesh, device_ids: Sequence[int], assignment: Sequence[int]) -> np.ndarray:
    """Mesh coordinates of each logical id, shape (num logical ids, mesh rank)."""
    if len(device_ids) != mesh.num_devices or len(set(device_ids)) != len(device_ids):
        raise ValueError(
            f"device_ids must list the {mesh.num_devices} distinct device ids of mesh {mesh} "
            f"in row-major order, got {list(device_ids)}"
        )
    position = {d: i for i, d in enumerate(device_ids)}
    missing = [d for d in assignment if d not in position]
    if missing:
        raise ValueError(f"device assignment uses devices {missing} that are not on the mesh")
    return np.array([np.unravel_index(position[d], mesh.shape) for d in assignment]).reshape(
        len(assignment), len(mesh.shape)
    )


def replica_group_axes(
    groups: Sequence[Sequence[int]],
    mesh: Mesh,
    device_ids: Sequence[int],
    device_assignment: Sequence[int] | None = None,
) -> Axes | None:
    """The mesh axes (in mesh order) whose blocks of devices are exactly ``groups``, or None.

    ``groups`` hold logical ids; ``device_assignment[i]`` is the device id running logical id
    ``i`` (default: ``device_ids``, the mesh's devices in row-major order, as JAX assigns).
    """
    assignment = device_ids if device_assignment is None else device_assignment
    return _group_axes(groups, mesh, _coords(mesh, device_ids, assignment))


def _group_axes(groups: Sequence[Sequence[int]], mesh: Mesh, coords: np.ndarray) -> Axes | None:
    flat = [i for g in groups for i in g]
    if sorted(flat) != list(range(len(coords))):
        return None
    varying = [
        a for a in range(len(mesh.shape)) if any(len({coords[i][a] for i in g}) > 1 for g in groups)
    ]
    size = math.prod(mesh.shape[a] for a in varying)
    if any(len(g) != size for g in groups):
        return _sub_axes(groups, mesh, coords, varying)
    blocks = {tuple(np.delete(coords[i], varying)) for g in groups for i in g[:1]}
    if len(blocks) != len(groups):  # as many devices, but not the axes' blocks
        return _sub_axes(groups, mesh, coords, varying)
    return tuple(mesh.axis_names[a] for a in varying)


def _sub_axes(groups, mesh: Mesh, coords: np.ndarray, varying) -> Axes | None:
    """The axes and sub-axes (``data:(1)2``: :func:`~autoshard.ir.spec.sub_axis`) whose
    blocks of devices are exactly ``groups``, or None: XLA's partitioner groups parts of
    an axis (pairs of a 4-device axis) for some all-gathers and all-to-alls."""
    want = sorted(sorted(g) for g in groups)
    options = []
    for a in varying:
        n = mesh.shape[a]
        options.append(
            [(a, pre, k) for pre in range(1, n + 1) for k in range(2, n + 1) if n % (pre * k) == 0]
        )
    for choice in itertools.product(*options):
        if math.prod(k for _, _, k in choice) != len(groups[0]):
            continue
        blocks: dict[tuple, list[int]] = {}
        for i, c in enumerate(coords):
            key = list(c)
            for a, pre, k in choice:  # the part's digit removed, the rest of the axis kept
                minor = mesh.shape[a] // (pre * k)
                key[a] = (c[a] // (minor * k), c[a] % minor)
            blocks.setdefault(tuple(key), []).append(i)
        if sorted(blocks.values()) == want:
            return tuple(
                mesh.axis_names[a] if k == mesh.shape[a] else sub_axis_name(mesh.axis_names[a], pre, k)
                for a, pre, k in choice
            )  # fmt: skip
    return None


def _group_order_note(groups, mesh: Mesh, coords: np.ndarray, axes: Axes) -> str:
    if len(axes) < 2 or any(":(" in a for a in axes):
        return ""
    idx = [mesh.index(a) for a in axes]
    for perm in itertools.permutations(idx):
        if all(
            list(g) == sorted(g, key=lambda i: tuple(coords[i][a] for a in perm)) for g in groups
        ):
            if list(perm) == idx:
                return ""
            return "group order is " + "-major, ".join(mesh.axis_names[a] for a in perm) + "-minor"
    return "group order matches no axis order"


def _replica_groups_text(attrs: str) -> str | None:
    """The ``replica_groups=`` value, whose mesh and iota forms run past commas."""
    m = re.search(r"(?:^|,\s*)replica_groups=", attrs)
    if not m:
        return None
    rest = attrs[m.end() :]
    if rest.startswith("{"):
        return rest[: _balanced(rest, 0)]
    if iota := re.match(r"\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?", rest):
        return iota.group(0)
    if rest.startswith("mesh["):
        end = _balanced(rest, 4)
        if d := re.match(r",\s*device_ids=", rest[end:]):
            end = _balanced(rest, end + d.end())
        return rest[: _balanced(rest, rest.index("{", end))]
    raise ValueError(f"unrecognised replica_groups in {attrs[:120]!r}")


def _global_groups(mod: _Module, ins: _Instr, kind: str) -> list[list[int]]:
    """Replica groups of ``ins`` as groups of flattened logical ids (XLA's group modes)."""
    r, p = mod.replica_count, mod.num_partitions
    has_channel = _attr(ins.attrs, "channel_id") is not None
    flattened = _attr(ins.attrs, "use_global_device_ids") == "true"
    text = _replica_groups_text(ins.attrs)
    if flattened:
        return [list(g) for g in parse_replica_groups(text or "{}", r * p)]
    if kind in ("all-to-all", "collective-permute") and has_channel:  # cross-partition
        groups = parse_replica_groups(text or "{}", p)
        return [[rep * p + i for i in g] for rep in range(r) for g in groups]
    groups = parse_replica_groups(text or "{}", r)
    if has_channel:  # cross-replica-and-partition
        return [[rep * p + i for rep in g for i in range(p)] for g in groups]
    return [[rep * p + part for rep in g] for part in range(p) for g in groups]  # cross-replica
