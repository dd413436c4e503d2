"""Predicted against compiled collectives: total bytes per (kind, mesh axes), side by side.

:func:`compare_collectives` takes a plan's predicted :class:`~autoshard.ir.spec.Collective`
list and the compiled ones (:mod:`autoshard.verify.collectives`) and returns a
:class:`CollectiveComparison`, one row per (kind, axes) that agrees when both sides have it
and their bytes are within a relative tolerance.  Jax-free.

The rule is bytes, not counts, on every backend: a row's counts are shown but need not
match.  XLA combines collectives (tuples on XLA:CPU and XLA:GPU, concatenated buffers on
XLA:GPU) and the verifier reads a combined one back one value at a time, so counts usually
do match; but XLA:GPU also folds and reassociates all-reduces (moving fewer bytes:
:mod:`autoshard.verify.xla_gpu` predicts that on a GPU target), and what it moves is
what a plan is priced on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.ir.spec import Axes, Collective
from autoshard.verify.hlo import CompiledCollective


def _as_collective(c: Collective | CompiledCollective) -> Collective:
    return c.collective if isinstance(c, CompiledCollective) else c


def _key(c: Collective) -> tuple[str, Axes]:
    return c.kind, tuple(sorted(set(c.axes)))


def summarize(
    collectives: Sequence[Collective | CompiledCollective],
) -> dict[tuple[str, Axes], int]:
    """Total bytes per (kind, axes); axes as a sorted tuple, so order does not matter."""
    out: dict[tuple[str, Axes], int] = {}
    for c in map(_as_collective, collectives):
        out[_key(c)] = out.get(_key(c), 0) + c.bytes
    return out


@dataclass(frozen=True)
class ComparisonRow:
    kind: str
    axes: Axes
    predicted_count: int
    predicted_bytes: int
    compiled_count: int
    compiled_bytes: int
    agree: bool

    def to_json(self) -> dict:
        """The row as JSON (axes a list), as the verifier's benchmarks write it."""
        return {**dataclasses.asdict(self), "axes": list(self.axes)}


@dataclass(frozen=True)
class CollectiveComparison:
    """Predicted vs compiled collectives per (kind, axes)."""

    rows: tuple[ComparisonRow, ...]
    rel_tol: float

    @property
    def agree(self) -> bool:
        return all(r.agree for r in self.rows)

    def format(self) -> str:
        head = ("kind", "axes", "pred #", "pred bytes", "compiled #", "compiled bytes", "agree")
        body = [
            (r.kind, ",".join(r.axes) or "-", str(r.predicted_count), f"{r.predicted_bytes:,}",
             str(r.compiled_count), f"{r.compiled_bytes:,}", "yes" if r.agree else "NO")
            for r in self.rows
        ]  # fmt: skip
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [head, *body]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        verdict = "agree" if self.agree else "DISAGREE"
        lines.append(f"{verdict} (bytes within {self.rel_tol:.0%} per kind and axes)")
        return "\n".join(lines)


def compare_collectives(
    predicted: Sequence[Collective | CompiledCollective],
    compiled: Sequence[Collective | CompiledCollective],
    rel_tol: float = 0.02,
) -> CollectiveComparison:
    """Row per (kind, axes) present on either side; a row agrees when both sides have it
    and their total bytes differ by at most ``rel_tol`` of the larger."""
    if rel_tol < 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")
    pred, comp = list(map(_as_collective, predicted)), list(map(_as_collective, compiled))
    pred_bytes, comp_bytes = summarize(pred), summarize(comp)
    rows = []
    for key in sorted(set(pred_bytes) | set(comp_bytes)):
        p, c = pred_bytes.get(key, 0), comp_bytes.get(key, 0)
        pn, cn = sum(_key(x) == key for x in pred), sum(_key(x) == key for x in comp)
        agree = pn > 0 and cn > 0 and abs(p - c) <= rel_tol * max(p, c)
        rows.append(ComparisonRow(key[0], key[1], pn, p, cn, c, agree))
    return CollectiveComparison(tuple(rows), rel_tol)
