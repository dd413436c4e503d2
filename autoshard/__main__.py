import sys

from autoshard.cli.interrupt import INTERRUPTED, MESSAGE, install_interrupt_hook

install_interrupt_hook()  # before the CLI's imports: jax's gc callback can drop a Ctrl-C
try:
    from autoshard.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the CLI imports
    print(MESSAGE, file=sys.stderr)
    sys.exit(INTERRUPTED)

sys.exit(main())
