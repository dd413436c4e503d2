"""Progress lines for long searches: a line per phase, with counts and elapsed time.

A :class:`Progress` is made once per search and handed down to its phases (trace, stage
ILPs, stage spans, DP runs).  It writes plain lines to a stream (stderr by default),
terminal or not, so that a search piped into a log still says where it is::

    search: stage ILPs 412/1,536, 38 s
    search: stage ILPs 1,536/1,536 done, 61 s

Nothing is written until the search has run ``after_s`` seconds (a search that ends
sooner prints nothing), then at most one line per phase every ``every_s`` seconds, plus
the line that closes each phase.  Elapsed times are since the search started.  The
``AUTOSHARD_PROGRESS_AFTER_S`` environment variable overrides ``after_s`` (tests set it
to 0 to see the lines of a short search).  Jax-free.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

AFTER_S = 2.0  # a search shorter than this prints nothing
EVERY_S = 5.0  # at most one line per phase this often


class Progress:
    """Rate-limited progress lines of one search (see the module docstring).

    ``enabled=False`` (the CLI's ``--quiet``) prints nothing. ``clock`` is for tests.
    """

    def __init__(
        self,
        label: str = "search",
        *,
        stream: TextIO | None = None,
        after_s: float | None = None,
        every_s: float = EVERY_S,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if after_s is None:
            after_s = float(os.environ.get("AUTOSHARD_PROGRESS_AFTER_S", AFTER_S))
        self.label = label
        self.stream = stream
        self.after_s = after_s
        self.every_s = every_s
        self.enabled = enabled
        self.clock = clock
        self.start = clock()
        self.lines = 0

    def elapsed(self) -> float:
        return self.clock() - self.start

    def write(self, text: str) -> None:
        """One line, unconditionally (when enabled): ``label: text, N s``."""
        if not self.enabled:
            return
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"{self.label}: {text}, {self.elapsed():.0f} s", file=stream, flush=True)
        self.lines += 1

    def phase(self, name: str, total: int | None = None) -> Phase:
        """A phase of ``total`` steps (None: one step of unknown length); use as a context
        manager, call :meth:`Phase.advance` per step."""
        return Phase(self, name, total)


class Phase:
    """One phase of a :class:`Progress`: counts steps, prints rate-limited lines."""

    def __init__(self, progress: Progress, name: str, total: int | None) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.done = 0
        self.last_line = -float("inf")

    def _counts(self) -> str:
        if self.total is None:
            return f"{self.name}"
        return f"{self.name} {self.done:,}/{self.total:,}"

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        p = self.progress
        now = p.clock()
        if now - p.start >= p.after_s and now - self.last_line >= p.every_s:
            self.last_line = now
            p.write(self._counts())

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc) -> None:
        p = self.progress
        if exc[0] is None and p.elapsed() >= p.after_s:
            p.write(f"{self._counts()} done")


def quiet() -> Progress:
    """A Progress that prints nothing."""
    return Progress(enabled=False)
