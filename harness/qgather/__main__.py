"""`python -m qgather`: the command line (qgather.cli)."""

import sys

try:
    from qgather.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads: no run started, nothing to clean
    print("qgather: interrupted", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
