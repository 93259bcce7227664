"""`python -m qgather`: the command line (qgather.cli)."""

import sys

from qgather.cli import main

sys.exit(main())
