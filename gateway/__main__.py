"""`python -m gateway ...`: the entry point, the one place that writes the process's environment."""

import os
import sys

from gateway.cli.environment import offline_defaults


def _run() -> int:
    for name, value in offline_defaults().items():  # before the CLI imports anything that reads them
        os.environ.setdefault(name, value)
    from gateway.cli.main import main

    return main()


sys.exit(_run())
