"""`python -m gateway ...`."""

import sys

from gateway.cli.main import main

sys.exit(main())
