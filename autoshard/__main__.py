import sys

from autoshard.cli.main import main

sys.exit(main())
