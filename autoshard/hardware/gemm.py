"""Compute model: achieved GEMM throughput by shape, and memory-bound time (jax-free).

Takes a GEMM table (``autoshard/hardware/gemm_tables/<name>.json`` or any path) and GEMM shapes
``C[M, N] = A[M, K] @ B[K, N]``; returns achieved efficiency (fraction of peak) and seconds.

Table format (the GEMM profiler, ``benchmarks/measure_gemm_table.py``, writes the same)::

    {
      "device": "A100-SXM4-80GB",
      "dtypes": ["bf16", "fp32"],
      "peak_tflops": {"bf16": 312.0, "fp32": 19.5},
      "source": "a sentence: where the numbers come from and how they were made",
      "rows": {"bf16": [[M, N, K, achieved_tflops], ...], "fp32": [...]}
    }

Interpolation: efficiency (achieved / peak) is interpolated in the space of
``(log2 M, log2 N, log2 K)``. If a dtype's rows form a full grid (every combination of the
distinct M, N and K values present) the interpolation is trilinear on that grid; otherwise
it is inverse-distance weighting (power 2) over the 8 nearest rows. Either way a query is
first clamped to the table's range in each coordinate, so shapes beyond the table take the
efficiency of its edge, and a query that hits a row returns that row's value exactly.
Batched GEMMs are timed as one GEMM with the batch folded into M (see :meth:`gemm_time`).

:class:`GemmTiming` binds a table to a device's peaks: the per-device seconds of one
``dot_general`` shard, which the intra-op cost model (:mod:`autoshard.intra.rules.strategies`) uses
when its :class:`~autoshard.hardware.mesh.DeviceMesh` carries one, so that the ILPs, the stage DP
and the Megatron grid model (:mod:`autoshard.sim.megatron`) time a GEMM the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

TABLE_PACKAGE = "autoshard.hardware"
TABLE_DIR = "gemm_tables"
_IDW_NEIGHBOURS = 8


def available_gemm_tables() -> tuple[str, ...]:
    folder = resources.files(TABLE_PACKAGE) / TABLE_DIR
    return tuple(
        sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))
    )


@dataclass(frozen=True)
class _DtypeTable:
    """Rows of one dtype, in log2 shape space, plus a dense grid when the rows form one."""

    points: np.ndarray  # (rows, 3) log2 M, N, K
    efficiency: np.ndarray  # (rows,)
    lo: np.ndarray
    hi: np.ndarray
    axes: tuple[np.ndarray, ...] | None  # grid coordinates per dim, if a full grid
    grid: np.ndarray | None  # efficiency on the grid

    @staticmethod
    def build(rows: list, peak_tflops: float, origin: str) -> _DtypeTable:
        arr = np.asarray(rows, dtype=float)
        if arr.ndim != 2 or arr.shape[1] != 4 or len(arr) == 0:
            raise ValueError(f"{origin}: rows must be a non-empty list of [M, N, K, tflops]")
        if np.any(arr[:, :3] < 1) or np.any(arr[:, 3] <= 0):
            raise ValueError(f"{origin}: every row needs M, N, K >= 1 and tflops > 0")
        points = np.log2(arr[:, :3])
        eff = arr[:, 3] / peak_tflops
        axes = tuple(np.unique(points[:, d]) for d in range(3))
        grid = None
        if len(arr) == math.prod(len(a) for a in axes):
            grid = np.full([len(a) for a in axes], np.nan)
            idx = tuple(np.searchsorted(axes[d], points[:, d]) for d in range(3))
            grid[idx] = eff
            if np.isnan(grid).any():
                grid = None
        return _DtypeTable(
            points,
            eff,
            points.min(axis=0),
            points.max(axis=0),
            axes if grid is not None else None,
            grid,
        )

    def interpolate(self, q: np.ndarray) -> float:
        q = np.clip(q, self.lo, self.hi)
        if self.grid is not None:
            return self._trilinear(q)
        dist = np.linalg.norm(self.points - q, axis=1)
        nearest = np.argsort(dist)[:_IDW_NEIGHBOURS]
        if dist[nearest[0]] < 1e-12:
            return float(self.efficiency[nearest[0]])
        w = 1.0 / dist[nearest] ** 2
        return float(np.sum(w * self.efficiency[nearest]) / np.sum(w))

    def _trilinear(self, q: np.ndarray) -> float:
        lo_idx, frac = [], []
        for d, ax in enumerate(self.axes):
            if len(ax) == 1:
                lo_idx.append(0)
                frac.append(0.0)
                continue
            i = int(np.clip(np.searchsorted(ax, q[d], side="right") - 1, 0, len(ax) - 2))
            lo_idx.append(i)
            frac.append(float((q[d] - ax[i]) / (ax[i + 1] - ax[i])))
        value = 0.0
        for corner in range(8):
            weight, idx = 1.0, []
            for d in range(3):
                up = (corner >> d) & 1
                if up and len(self.axes[d]) == 1:
                    weight = 0.0
                    break
                weight *= frac[d] if up else 1.0 - frac[d]
                idx.append(lo_idx[d] + up)
            if weight:
                value += weight * float(self.grid[tuple(idx)])
        return value


@dataclass(frozen=True)
class GemmTable:
    """Achieved GEMM TFLOP/s by (M, N, K) per dtype for one device.

    ``tp_step_overhead_s`` (optional, JSON key of the same name, default 0): a per-step cost
    of tensor parallelism that the software this table describes pays on top of its
    collectives, ``c (1 - 1/t)`` seconds at degree ``t``. Only a table calibrated on
    model-parallel runs carries one (``v100-megatron2019``: fitted to Megatron-LM 2019's
    weak-scaling rows, docs/validation.md); :func:`autoshard.sim.megatron.simulate_megatron`
    adds it to the step's model-axis communication."""

    device: str
    source: str
    peak_tflops: dict[str, float]
    rows: dict[str, list]
    tp_step_overhead_s: float = 0.0
    _tables: dict[str, _DtypeTable] = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def from_json(obj: dict, origin: str = "gemm table") -> GemmTable:
        for key in ("device", "source", "peak_tflops", "rows"):
            if key not in obj:
                raise ValueError(f"{origin}: missing field {key!r}")
        peaks = {str(k): float(v) for k, v in obj["peak_tflops"].items()}
        rows = {str(k): list(v) for k, v in obj["rows"].items()}
        overhead = obj.get("tp_step_overhead_s", 0.0)
        if not isinstance(overhead, (int, float)) or not 0 <= overhead < float("inf"):
            raise ValueError(
                f"{origin}: tp_step_overhead_s must be a finite number of seconds >= 0, "
                f"got {overhead!r}"
            )
        tables = {}
        for dtype, dtype_rows in rows.items():
            if dtype not in peaks:
                raise ValueError(f"{origin}: rows for {dtype!r} but no peak_tflops.{dtype}")
            tables[dtype] = _DtypeTable.build(dtype_rows, peaks[dtype], f"{origin} rows.{dtype}")
        return GemmTable(
            str(obj["device"]), str(obj["source"]), peaks, rows, float(overhead), tables
        )

    @staticmethod
    def load(name_or_path: str | Path) -> GemmTable:
        """A shipped table by name (``v100``, ``a100``, ``h100``) or a table file by path."""
        path = Path(name_or_path)
        if path.suffix == ".json" or path.exists():
            return GemmTable.from_json(json.loads(path.read_text()), str(path))
        name = str(name_or_path)
        if name not in available_gemm_tables():
            raise ValueError(
                f"unknown GEMM table {name!r}; available: {', '.join(available_gemm_tables())} "
                f"(or pass the path of a table .json file)"
            )
        res = resources.files(TABLE_PACKAGE) / TABLE_DIR / f"{name}.json"
        return GemmTable.from_json(json.loads(res.read_text()), f"{TABLE_DIR}/{name}.json")

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "dtypes": sorted(self.rows),
            "peak_tflops": dict(self.peak_tflops),
            "source": self.source,
            **({"tp_step_overhead_s": self.tp_step_overhead_s} if self.tp_step_overhead_s else {}),
            "rows": {k: [list(r) for r in v] for k, v in self.rows.items()},
        }

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self.rows))

    def efficiency(self, m: float, n: float, k: float, dtype: str) -> float:
        """Achieved fraction of the table's peak for a GEMM of shape (M, N, K)."""
        if dtype not in self._tables:
            raise ValueError(
                f"GEMM table {self.device} has no rows for dtype {dtype!r}; it has {self.dtypes}"
            )
        if min(m, n, k) < 1:
            raise ValueError(f"GEMM dims must be >= 1, got M={m}, N={n}, K={k}")
        return self._tables[dtype].interpolate(np.log2([m, n, k]))

    def tflops(self, m: float, n: float, k: float, dtype: str) -> float:
        """Achieved TFLOP/s for a GEMM of shape (M, N, K)."""
        return self.efficiency(m, n, k, dtype) * self.peak_tflops[dtype]

    def gemm_time(
        self,
        m: float,
        n: float,
        k: float,
        dtype: str,
        device_peak: float | None = None,
        batch: int = 1,
    ) -> float:
        """Seconds for ``batch`` GEMMs of shape (M, N, K): 2 batch M N K / (peak x efficiency).

        ``device_peak`` (FLOP/s) defaults to the table's own peak; pass the cluster's to use
        the table's efficiencies on a device with another peak. A batched GEMM is timed as one
        GEMM of shape (batch M, N, K): one kernel launch, and efficiency of the larger shape.
        """
        peak = self.peak_tflops[dtype] * 1e12 if device_peak is None else float(device_peak)
        flops = 2.0 * batch * m * n * k
        return flops / (peak * self.efficiency(batch * m, n, k, dtype))


@dataclass(frozen=True)
class GemmTiming:
    """Seconds of one GEMM on one device: the table's efficiency at the device's peak.

    ``half_dtype`` is the table dtype used for 2-byte operands (``fp16`` or ``bf16``: the
    dtype the step is simulated in); 4-byte operands use ``fp32``. ``peak_flops`` maps
    those dtypes to the device's FLOP/s. Equal timings compare (and hash) equal by table
    device, dtype and peaks, so a :class:`~autoshard.hardware.mesh.DeviceMesh` carrying one stays a
    usable cache key. Results are memoised per shape (identical layers repeat shapes).
    """

    table: GemmTable = field(repr=False, compare=False)
    half_dtype: str
    peak_flops: tuple[tuple[str, float], ...]
    table_device: str = ""
    _memo: dict = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def for_device(table: GemmTable, half_dtype: str, peak_flops) -> GemmTiming:
        """``peak_flops``: a mapping dtype -> FLOP/s (a :class:`DeviceSpec`'s)."""
        wanted = {half_dtype, "fp32"}
        peaks = tuple(sorted((k, float(v)) for k, v in peak_flops.items() if k in wanted))
        if half_dtype not in dict(peaks) or half_dtype not in table.dtypes:
            raise ValueError(
                f"GEMM timing needs dtype {half_dtype!r} in both the device peaks "
                f"({sorted(peak_flops)}) and the GEMM table {table.device} ({table.dtypes})"
            )
        return GemmTiming(table, half_dtype, peaks, table.device)

    def dtype_for(self, itemsize: int) -> str:
        return "fp32" if itemsize >= 4 and "fp32" in dict(self.peak_flops) else self.half_dtype

    def seconds(self, batch: int, m: int, n: int, k: int, itemsize: int) -> float:
        """``batch`` GEMMs ``[M, K] x [K, N]`` with operands of ``itemsize`` bytes."""
        key = (batch * m, n, k, itemsize)
        if key not in self._memo:
            dtype = self.dtype_for(itemsize)
            peak = dict(self.peak_flops)[dtype]
            rows = dtype if dtype in self.table.dtypes else self.half_dtype
            self._memo[key] = self.table.gemm_time(m, n, k, rows, peak, batch)
        return self._memo[key]


def memory_bound_time(nbytes: float, hbm_bandwidth: float) -> float:
    """Seconds to stream ``nbytes`` through HBM at ``hbm_bandwidth`` bytes/s."""
    if nbytes < 0 or hbm_bandwidth <= 0:
        raise ValueError(f"need nbytes >= 0 and hbm_bandwidth > 0, got {nbytes}, {hbm_bandwidth}")
    return nbytes / hbm_bandwidth
