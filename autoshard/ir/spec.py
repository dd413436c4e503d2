"""Sharding specs for tensors on a logical device mesh (jax-free).

A :class:`ShardingSpec` says, for every dimension of a tensor, which mesh axes split it
(major to minor), and over which mesh axes the tensor holds only a *partial sum*
("unreduced" in the scaling-book's words).  Partial sums are what make collectives fall
out of spec algebra:

* ``partial(x) -> replicated``  is an all-reduce on ``x``;
* ``partial(x) -> sharded on x`` is a reduce-scatter on ``x``;
* ``sharded on x -> replicated`` is an all-gather on ``x``.

Specs print in scaling-book notation, with dimension sizes standing in for names:
``f32[1024@data, 4096@model]{U:model}`` is a 1024x4096 float32 tensor whose first dim is
split over ``data``, second over ``model`` and which is an unreduced partial sum over
``model``.  A partial max (a ``reduce_max`` over a split dim) prints ``{Umax:model}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Axes = tuple[str, ...]


def sub_axis(name: str) -> tuple[str, int, int] | None:
    """A sub-axis name in Shardy's notation, ``"data:(2)2"``, as ``("data", 2, 2)``: the
    part of mesh axis ``data`` of size 2 after a major part of size 2 (``data`` of size n
    read as ``[pre, size, n / (pre * size)]``, the middle factor).  None for a whole axis.

    XLA's partitioner runs some collectives over such parts (a collective-permute and an
    all-gather over pairs of a 4-device axis); specs never name them, collectives may."""
    if ":(" not in name:
        return None
    m = _SUB_AXIS.fullmatch(name)
    if m is None:
        raise ValueError(f"sub-axis {name!r} is not written as AXIS:(PRE)SIZE, e.g. 'data:(2)2'")
    return m.group(1), int(m.group(2)), int(m.group(3))


def sub_axis_name(axis: str, pre: int, size: int) -> str:
    """``sub_axis``'s inverse: ``("data", 2, 2)`` -> ``"data:(2)2"``."""
    return f"{axis}:({pre}){size}"


_SUB_AXIS = re.compile(r"(.+):\((\d+)\)(\d+)")


def cached_hash(cls):
    """Decorate a frozen dataclass so that its hash is computed once per instance.

    The planner uses specs and meshes as memo keys millions of times; the generated
    ``__hash__`` re-hashes every field each time.  The hash is kept in the instance's
    ``__dict__`` and left out of its pickle (string hashes differ between processes)."""
    generated = cls.__hash__

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash_"]
        except KeyError:
            h = generated(self)
            object.__setattr__(self, "_hash_", h)
            return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_") or k[0] != "_"}

    cls.__hash__ = __hash__
    cls.__getstate__ = __getstate__
    return cls


@cached_hash
@dataclass(frozen=True)
class Mesh:
    """A logical mesh: axis names and sizes (no devices, no costs)."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.shape):
            raise ValueError(
                f"mesh has {len(self.axis_names)} axis names {self.axis_names} but "
                f"{len(self.shape)} sizes {self.shape}"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be unique, got {self.axis_names}")
        for name, size in zip(self.axis_names, self.shape):
            if not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"mesh axis {name!r} has size {size!r}; sizes must be positive ints"
                )

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def size(self, axes: str | Axes) -> int:
        """Number of devices spanned by one axis or a group of axes."""
        if not isinstance(axes, (str, tuple)):
            axes = tuple(axes)
        try:
            return self.__dict__["_sizes_"][axes]
        except KeyError:
            pass
        group = (axes,) if isinstance(axes, str) else axes
        n = 1
        for a in group:
            n *= self.axis_size(a)
        self.__dict__.setdefault("_sizes_", {})[axes] = n  # memo: not a field, not pickled
        return n

    def axis_size(self, axis: str) -> int:
        """Devices along one axis or sub-axis (:func:`sub_axis`); raises ValueError for a
        name that is neither, or a sub-axis that does not divide its axis."""
        sub = sub_axis(axis)
        if sub is None:
            return self.shape[self.index(axis)]
        parent, pre, size = sub
        n = self.shape[self.index(parent)]
        if pre < 1 or size < 1 or n % (pre * size):
            raise ValueError(
                f"sub-axis {axis!r}: {pre} x {size} does not divide mesh axis {parent!r} of "
                f"size {n}"
            )
        return size

    def parent_index(self, axis: str) -> int:
        """Index of the mesh axis that ``axis`` (an axis or a sub-axis) is part of."""
        sub = sub_axis(axis)
        return self.index(axis if sub is None else sub[0])

    def index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise ValueError(
                f"mesh axis {axis!r} does not exist; this mesh has axes {self.axis_names}"
            ) from None

    def __str__(self) -> str:
        return "x".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))


# How the partial results of a partial spec combine: a sum (a dot with a split
# contracting dim, a reduce_sum), or a max / min (a reduce_max / reduce_min over a split
# dim, resolved by an all-reduce whose computation is a max / min).
PARTIAL_OPS = ("sum", "max", "min")


@cached_hash
@dataclass(frozen=True)
class ShardingSpec:
    """Per-dimension mesh axes plus the axes over which the value is a partial result
    (``partial``), combined by ``partial_op`` (a sum unless said otherwise)."""

    dims: tuple[Axes, ...]
    partial: Axes = ()
    partial_op: str = "sum"

    def __post_init__(self) -> None:
        if self.partial_op not in PARTIAL_OPS:
            raise ValueError(f"partial_op {self.partial_op!r} is not one of {PARTIAL_OPS}")

    @staticmethod
    def replicated(rank: int) -> ShardingSpec:
        return ShardingSpec(tuple(() for _ in range(rank)))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> Axes:
        """Every mesh axis this spec uses, for sharding or as a partial sum."""
        out: list[str] = [a for d in self.dims for a in d]
        out.extend(self.partial)
        return tuple(out)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and all(not d for d in self.dims)

    def validate(self, mesh: Mesh, shape: tuple[int, ...] | None = None) -> None:
        """Raise ValueError if the spec uses unknown or repeated axes or splits unevenly."""
        used = self.used_axes
        for a in used:
            mesh.index(a)
        if len(set(used)) != len(used):
            raise ValueError(f"spec {self} uses a mesh axis twice")
        if shape is not None:
            if len(shape) != self.rank:
                raise ValueError(f"spec {self} has rank {self.rank}, tensor has shape {shape}")
            for size, axes in zip(shape, self.dims):
                if size % mesh.size(axes):
                    raise ValueError(
                        f"dim of size {size} cannot be split evenly over {axes} "
                        f"({mesh.size(axes)} devices)"
                    )

    def shard_shape(self, mesh: Mesh, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The per-device block shape of a tensor of ``shape`` under this spec."""
        return tuple(size // mesh.size(axes) for size, axes in zip(shape, self.dims))

    def shard_fraction(self, mesh: Mesh) -> float:
        """Fraction of the full tensor each device holds."""
        n = 1
        for axes in self.dims:
            n *= mesh.size(axes)
        return 1.0 / n

    def with_dim(self, dim: int, axes: Axes) -> ShardingSpec:
        dims = list(self.dims)
        dims[dim] = tuple(axes)
        return ShardingSpec(tuple(dims), self.partial, self.partial_op)

    def with_partial(self, partial: Axes, op: str | None = None) -> ShardingSpec:
        return ShardingSpec(self.dims, tuple(partial), self.partial_op if op is None else op)

    def to_json(self) -> dict:
        out = {"dims": [list(d) for d in self.dims], "partial": list(self.partial)}
        if self.partial_op != "sum":  # plans without partial max / min read as before
            out["partial_op"] = self.partial_op
        return out

    @staticmethod
    def from_json(obj: dict) -> ShardingSpec:
        return ShardingSpec(
            tuple(tuple(d) for d in obj["dims"]),
            tuple(obj.get("partial", ())),
            obj.get("partial_op", "sum"),
        )

    def format(self, shape: tuple[int, ...] | None = None, dtype: str | None = None) -> str:
        """Scaling-book notation, e.g. ``f32[1024@data, 4096]{U:model}``."""
        parts = []
        for i, axes in enumerate(self.dims):
            size = str(shape[i]) if shape is not None else f"d{i}"
            parts.append(size + ("@" + "+".join(axes) if axes else ""))
        text = f"{_short_dtype(dtype) if dtype else ''}[{', '.join(parts)}]"
        if self.partial:
            op = "" if self.partial_op == "sum" else self.partial_op
            text += "{U" + op + ":" + ",".join(self.partial) + "}"
        return text

    def __str__(self) -> str:
        return self.format()


_SHORT_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int32": "s32",
    "int64": "s64",
    "uint32": "u32",
    "bool": "pred",
    "int8": "s8",
    "uint8": "u8",
}


def _short_dtype(dtype: str) -> str:
    return _SHORT_DTYPES.get(dtype, dtype)


COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


@dataclass(frozen=True)
class Collective:
    """One collective, predicted or compiled.

    ``bytes`` is the per-device message size with the convention of the alpha-beta
    formulas: all-reduce -> the reduced buffer; all-gather -> the gathered output;
    reduce-scatter -> the input before scattering; all-to-all -> the buffer exchanged;
    collective-permute -> the buffer each device sends.  ``axes`` are the mesh axes the
    collective runs over (its replica groups; a sub-axis where XLA groups part of an axis,
    :func:`sub_axis`); a collective-permute's are the axes along which a device and the
    one it sends to differ.
    """

    kind: str
    axes: Axes
    bytes: int

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"unknown collective kind {self.kind!r}; expected one of {COLLECTIVE_KINDS}"
            )

    def to_json(self) -> dict:
        return {"kind": self.kind, "axes": list(self.axes), "bytes": int(self.bytes)}

    @staticmethod
    def from_json(obj: dict) -> Collective:
        return Collective(obj["kind"], tuple(obj["axes"]), int(obj["bytes"]))
