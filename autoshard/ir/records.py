"""Plain records of a traced step: the boundary after which nothing imports jax."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

PHASES = ("forward", "backward", "update")


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


INPUT_KINDS = ("param", "opt_state", "data")


@dataclass(frozen=True)
class TensorRecord:
    """A value of the flat program: shape, dtype and where it comes from."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: str  # param | opt_state | data | const | literal | intermediate
    path: str = ""  # pytree path for program inputs and outputs
    literal: float | int | bool | None = None  # a scalar literal's value (equal literals
    # make equal values: the memory model's common subexpressions)

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * _itemsize(self.dtype)


@dataclass(frozen=True)
class EqnRecord:
    """One equation of the flat program.  ``elementwise``: JAX's word on whether its
    primitive is elementwise (True / False), None where JAX says nothing; see
    :func:`autoshard.ir.primitives.is_elementwise`."""

    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any]
    layer: str | None
    phase: str
    module_path: str
    elementwise: bool | None = None


@dataclass(frozen=True)
class TraceRecords:
    """The traced step as plain data."""

    tensors: tuple[TensorRecord, ...]  # indexed by id
    eqns: tuple[EqnRecord, ...]
    inputs: tuple[int, ...]  # flat program inputs, in pytree order
    outputs: tuple[int, ...]  # flat program outputs, in pytree order
    aliases: tuple[tuple[int, int], ...]  # (input id, output id): updated state
    layers: tuple[str, ...]  # layer tags in forward order
