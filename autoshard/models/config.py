"""What every model config shares (GPT, GPT-MoE, Wide-ResNet, the test MLP).

A config is a frozen dataclass; :class:`ModelConfig` gives it a copy with some fields
changed (``None`` meaning "keep", as the CLI's size overrides pass them) and the check
that its sizes are positive integers, with a message naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Self


class ModelConfig:
    """Mixin for the models' frozen config dataclasses."""

    def replace(self, **changes) -> Self:
        """A copy with some fields changed (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def check_positive_ints(self, what: str, fields: Iterable[str]) -> None:
        """ValueError naming the first of ``fields`` that is not a positive integer."""
        for field in fields:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"{what} config field {field!r} must be a positive integer, got {value!r}"
                )
