"""Planned stage units kept on disk across runs, by problem fingerprint (jax-free).

A unit (one layer's intra-op plan on one logical mesh,
:class:`~autoshard.inter.stage_cost.UnitCost`) depends on the layer's sub-graph, the mesh
(shape, links, peak, GEMM table), the ILP settings and autoshard's own code.  Its
fingerprint is the SHA-256 of all of those pickled (the code as the text of every
``autoshard/**/*.py``), so a changed model, cluster, setting or source file misses the
cache instead of reusing a stale plan.  Opt-in: set ``AUTOSHARD_CACHE_DIR`` to a directory
(``IntraStageCost`` reads it when built).  Files are written atomically; an unreadable one
counts as a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

import numpy as np

CACHE_ENV = "AUTOSHARD_CACHE_DIR"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 of every autoshard source file (path and text)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def canonical(value):
    """``value`` as nested tuples of plain values: dataclasses by type and fields, dicts
    by sorted items, arrays by dtype, shape and bytes; any other object by its repr, or
    by its type where the repr names an address."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, (dict, MappingProxyType)):
        items = [(canonical(k), canonical(v)) for k, v in value.items()]
        return ("dict", tuple(sorted(items, key=repr)))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((canonical(v) for v in value), key=repr)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(
            (f.name, canonical(getattr(value, f.name))) for f in dataclasses.fields(value)
        )
        return (type(value).__qualname__, fields)
    if isinstance(value, np.ndarray):
        return (
            "ndarray",
            str(value.dtype),
            value.shape,
            hashlib.sha256(value.tobytes()).hexdigest(),
        )
    if isinstance(value, np.generic):
        return canonical(value.item())
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else (type(value).__qualname__, text)


class UnitCache:
    """``get(key)`` / ``put(key, value)`` of pickled units under ``directory``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser() / "stage-units"
        self.hits = 0
        self.misses = 0

    @staticmethod
    def from_env() -> UnitCache | None:
        where = os.environ.get(CACHE_ENV)
        return UnitCache(where) if where else None

    @staticmethod
    def key(*parts) -> str:
        """The fingerprint of ``parts`` and of the code: the SHA-256 of a canonical text
        of their values (:func:`canonical`; not their pickle, which depends on which equal
        values happen to be one object)."""
        text = repr(canonical((code_fingerprint(), parts)))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.pkl"

    def get(self, key: str):
        try:
            with open(self._path(key), "rb") as f:
                value = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key: str, value) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(value, f, protocol=4)
        os.replace(tmp, path)
