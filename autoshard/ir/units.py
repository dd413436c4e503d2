"""Bytes as people read them, one way everywhere (jax-free): binary units (KiB, MiB,
GiB, TiB: powers of 1,024), three significant digits, the unit always written.

XLA's memory statistics, the memory model and the device presets all count bytes; every
printed memory figure goes through :func:`format_bytes`, so a plan's peak, a verify
table and a refusal never mix MB with MiB.
"""

from __future__ import annotations

import math

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(nbytes: float, *, exact: bool = False, signed: bool = False) -> str:
    """``107 B``, ``3.09 KiB``, ``1.25 MiB``, ``16 GiB``; ``exact`` adds the byte count
    (``3.09 KiB (3,168 B)``), ``signed`` a sign (``+1.2 MiB``, for differences)."""
    if not math.isfinite(nbytes):
        return f"{nbytes} B"
    sign = ("+" if nbytes >= 0 else "-") if signed else ("-" if nbytes < 0 else "")
    n = abs(nbytes)
    for unit, scale in _UNITS:
        if n >= scale:
            v = n / scale  # 1,000-1,023 of a unit: four digits, never 1.01e+03
            text = f"{sign}{v:.3g} {unit}" if v < 999.5 else f"{sign}{v:.0f} {unit}"
            break
    else:
        text = f"{sign}{n:,.0f} B"
    if exact and n >= 2**10:
        text += f" ({sign}{n:,.0f} B)"
    return text
