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

import hashlib
import os
import pickle
from functools import lru_cache
from pathlib import Path

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
        """The fingerprint of ``parts`` (picklable) and of the code."""
        blob = pickle.dumps((code_fingerprint(), parts), protocol=4)
        return hashlib.sha256(blob).hexdigest()

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
