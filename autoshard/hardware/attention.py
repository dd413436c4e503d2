"""Compute model of the fused attention kernel: achieved throughput by shape (jax-free).

Takes an attention table (``autoshard/hardware/attention_tables/<name>.json`` or any path)
and a fused attention's per-device shape (batch x heads, sequence, head dim); returns the
kernel's seconds forward and backward.  Format (``benchmarks/gpu_attention.py
--table-out`` writes the same)::

    {
      "device": "A100-SXM4-80GB",
      "dtype": "bf16",
      "peak_tflops": 312.0,
      "source": "a sentence: where the numbers come from and how they were made",
      "rows": [[batch_heads, seq, head_dim, fwd_tflops, bwd_tflops], ...]
    }

TFLOP/s count FLOPs as :mod:`autoshard.ir.graph` does (forward ``4 B H S^2 D``, the full
square even when causal; backward 2.5x that).  Efficiency (achieved / peak) is
interpolated in ``(log2 batch_heads, log2 seq, log2 head_dim)`` exactly as the GEMM tables
are (:mod:`autoshard.hardware.gemm`: trilinear on a full grid, else inverse-distance
weighting over the nearest rows; a query is clamped to the table's range first), one
table for the forward and one for the backward.

:class:`AttentionTiming` binds a table to a device's peak: a fused attention node's
per-device seconds, FLOPs / (device peak x efficiency), which the node cost of the intra-op
ILP (:func:`autoshard.intra.rules.strategies.strategy_seconds`), and through it the stage DP and
the simulator, use when the :class:`~autoshard.hardware.mesh.DeviceMesh` carries one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from autoshard.hardware.gemm import _DtypeTable

TABLE_PACKAGE = "autoshard.hardware"
TABLE_DIR = "attention_tables"
BWD_FLOPS_RATIO = 2.5  # backward FLOPs / forward FLOPs (autoshard.ir.graph)


def available_attention_tables() -> tuple[str, ...]:
    folder = resources.files(TABLE_PACKAGE) / TABLE_DIR
    return tuple(
        sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))
    )


@dataclass(frozen=True)
class AttentionTable:
    """Achieved fused attention TFLOP/s by (batch x heads, seq, head dim), forward and
    backward, for one device and dtype."""

    device: str
    dtype: str
    peak_tflops: float
    source: str
    rows: tuple[tuple[float, ...], ...]
    _fwd: _DtypeTable = field(repr=False, compare=False, default=None)
    _bwd: _DtypeTable = field(repr=False, compare=False, default=None)

    @staticmethod
    def from_json(obj: dict, origin: str = "attention table") -> AttentionTable:
        for key in ("device", "dtype", "peak_tflops", "source", "rows"):
            if key not in obj:
                raise ValueError(f"{origin}: missing field {key!r}")
        peak = float(obj["peak_tflops"])
        if not peak > 0:
            raise ValueError(f"{origin}: peak_tflops must be > 0, got {obj['peak_tflops']!r}")
        rows = np.asarray(obj["rows"], dtype=float)
        if rows.ndim != 2 or rows.shape[1] != 5 or len(rows) == 0:
            raise ValueError(
                f"{origin}: rows must be a non-empty list of "
                "[batch_heads, seq, head_dim, fwd_tflops, bwd_tflops]"
            )
        fwd = _DtypeTable.build(rows[:, [0, 1, 2, 3]].tolist(), peak, f"{origin} forward")
        bwd = _DtypeTable.build(rows[:, [0, 1, 2, 4]].tolist(), peak, f"{origin} backward")
        return AttentionTable(
            str(obj["device"]),
            str(obj["dtype"]),
            peak,
            str(obj["source"]),
            tuple(tuple(r) for r in rows.tolist()),
            fwd,
            bwd,
        )

    @staticmethod
    def load(name_or_path: str | Path) -> AttentionTable:
        """A shipped table by name (``a100``, ...) or a table file by path."""
        path = Path(name_or_path)
        if path.suffix == ".json" or path.exists():
            return AttentionTable.from_json(json.loads(path.read_text()), str(path))
        name = str(name_or_path)
        if name not in available_attention_tables():
            raise ValueError(
                f"unknown attention table {name!r}; available: "
                f"{', '.join(available_attention_tables()) or 'none'} "
                "(or pass the path of a table .json file)"
            )
        res = resources.files(TABLE_PACKAGE) / TABLE_DIR / f"{name}.json"
        return AttentionTable.from_json(json.loads(res.read_text()), f"{TABLE_DIR}/{name}.json")

    def efficiency(self, batch_heads: float, seq: float, head_dim: float, backward: bool) -> float:
        """Achieved fraction of the table's peak, forward or backward."""
        if min(batch_heads, seq, head_dim) < 1:
            raise ValueError(
                f"attention dims must be >= 1, got batch_heads={batch_heads}, seq={seq}, "
                f"head_dim={head_dim}"
            )
        table = self._bwd if backward else self._fwd
        return table.interpolate(np.log2([batch_heads, seq, head_dim]))

    def tflops(self, batch_heads: float, seq: float, head_dim: float, backward: bool) -> float:
        return self.efficiency(batch_heads, seq, head_dim, backward) * self.peak_tflops


@functools.cache
def load_attention_table(name_or_path: str) -> AttentionTable:
    """:meth:`AttentionTable.load`, once per name (the meshes of a search share it)."""
    return AttentionTable.load(name_or_path)


@dataclass(frozen=True)
class AttentionTiming:
    """Seconds of one fused attention shard on one device: the table's efficiency at the
    device's peak (``peak_flops``, FLOP/s, of the table's dtype).  Compares and hashes by
    table device and peak, so a :class:`~autoshard.hardware.mesh.DeviceMesh` carrying one
    stays a cache key; memoised per shape."""

    table: AttentionTable = field(repr=False, compare=False)
    peak_flops: float
    table_device: str = ""
    _memo: dict = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def for_device(table: AttentionTable, peak_flops) -> AttentionTiming:
        """``peak_flops``: a mapping dtype -> FLOP/s (a :class:`DeviceSpec`'s); the table's
        dtype must be among them."""
        if table.dtype not in peak_flops:
            raise ValueError(
                f"attention table {table.device} is {table.dtype!r}; the device has peaks "
                f"for {sorted(peak_flops)}"
            )
        return AttentionTiming(table, float(peak_flops[table.dtype]), table.device)

    def seconds(
        self, flops: float, batch_heads: int, seq: int, head_dim: int, backward: bool
    ) -> float:
        """``flops`` (the shard's, as the op graph counts them) at the table's efficiency
        for ``(batch_heads, seq, head_dim)``."""
        key = (batch_heads, seq, head_dim, backward)
        if key not in self._memo:
            self._memo[key] = self.table.efficiency(batch_heads, seq, head_dim, backward)
        return flops / (self.peak_flops * self._memo[key])


__all__ = [
    "AttentionTable",
    "AttentionTiming",
    "BWD_FLOPS_RATIO",
    "available_attention_tables",
    "load_attention_table",
]
