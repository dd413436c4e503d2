"""What the command line prints on, and how: consoles, progress, the version.

* :func:`out_console`: stdout; at the terminal's width, or 200 columns when piped (rich
  would cut tables to 80 columns).
* :func:`progress`: a spinner on stderr for work that can take more than a couple of
  seconds; off with ``--quiet`` or when stderr is not a terminal (pipes and logs stay
  clean, and ``--json`` output is never touched: the spinner is on stderr).
* :func:`version`: the installed package's version.
"""

from __future__ import annotations

import contextlib
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


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("autoshard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
