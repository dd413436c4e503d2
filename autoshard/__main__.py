import os
import sys

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def _exit_on_dropped_interrupt(previous):
    """Python drops an exception raised in a garbage-collector callback; a Ctrl-C that
    lands in jax's (its import, a trace) would be lost and the command would run on. Seen
    as an unraisable KeyboardInterrupt, it ends the command as any Ctrl-C does. Installed
    here, before the CLI's imports (jax's among them), and again by ``main()``."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            print("autoshard: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED)
        previous(unraisable)

    hook.autoshard_interrupt = True
    return hook


sys.unraisablehook = _exit_on_dropped_interrupt(sys.unraisablehook)
try:
    from autoshard.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the CLI imports
    print("autoshard: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(INTERRUPTED)

sys.exit(main())
