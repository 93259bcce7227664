import sys

from qgather.cli import main

sys.exit(main())
