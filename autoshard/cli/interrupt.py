"""Ctrl-C: one line on stderr and status 130, also where Python would drop it.

Python drops an exception raised in a garbage-collector callback ("Exception ignored in:
<function _xla_gc_callback ...>"): a SIGINT that lands while jax's callback runs (often
during its import or a trace) would be lost and the command would run on to its end.
:func:`install_interrupt_hook` makes ``sys.unraisablehook`` end the process on such a
dropped ``KeyboardInterrupt``, as any Ctrl-C ends a command. Standard library only: the
entry point installs it before the CLI's imports (jax's among them).
"""

from __future__ import annotations

import os
import sys

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)
MESSAGE = "autoshard: interrupted (Ctrl-C)"


def install_interrupt_hook() -> None:
    """Wrap ``sys.unraisablehook`` (once) so that a dropped Ctrl-C ends the process."""
    previous = sys.unraisablehook
    if getattr(previous, "autoshard_interrupt", False):
        return

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            print(MESSAGE, file=sys.stderr, flush=True)
            os._exit(INTERRUPTED)
        previous(unraisable)

    hook.autoshard_interrupt = True
    sys.unraisablehook = hook
