"""What the command line prints on, and how: consoles, progress, the version.

* :func:`out_console`: stdout; at the terminal's width, or 200 columns when piped (rich
  would cut tables to 80 columns).
* :func:`progress`: a spinner on stderr for work that can take more than a couple of
  seconds; off with ``--quiet`` or when stderr is not a terminal (pipes and logs stay
  clean, and ``--json`` output is never touched: the spinner is on stderr).
* :func:`results_only_stdout`: while a command runs, file descriptor 1 is a copy of
  descriptor 2, so whatever a library prints from C or C++ (Gloo's connection lines, a
  solver's banner) lands on stderr; Python's ``sys.stdout`` writes on the real stdout.
* :func:`version`: the installed package's version.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

PIPED_WIDTH = 200


def out_console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


@contextlib.contextmanager
def progress(args, text: str):
    """A spinner saying ``text`` on stderr while the block runs (see the module docstring)."""
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


@contextlib.contextmanager
def results_only_stdout():
    """Descriptor 1 points at stderr meanwhile; ``sys.stdout`` at the real stdout.

    The solver's :func:`~autoshard.intra.ilp.solvers.solver_output_to_stderr` does this
    around a solve; this does it around a whole command, for libraries that print on
    descriptor 1 from their own threads (Gloo in a multi-process run).  Where
    ``sys.stdout`` is not descriptor 1 (a test capturing it, an embedded interpreter)
    nothing is swapped.  Child processes inherit descriptor 1 (stderr): give them a
    stdout of their own where their output matters.
    """
    try:
        if sys.stdout.fileno() != 1:
            raise ValueError("sys.stdout is not descriptor 1")
        sys.stdout.flush()
        real = os.dup(1)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        yield
        return
    python_stdout = sys.stdout
    sys.stdout = open(  # noqa: SIM115 (closed below)
        real,
        "w",
        encoding=python_stdout.encoding,
        errors=python_stdout.errors,
        buffering=1 if python_stdout.line_buffering else -1,
    )
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        _flush_c_stdio()
        os.dup2(real, 1)
        sys.stdout.close()  # closes ``real``
        sys.stdout = python_stdout


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to reach (not POSIX)
        pass


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("autoshard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
