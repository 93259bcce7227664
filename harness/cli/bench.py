"""`qgather bench [formats|runtime|gpu|suite ...]`: run the benchmarks (default: all of them)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from qgather.cli.common import usage

BENCHES = {
    "formats": "qgather.tools.format_bench",
    "runtime": "qgather.runtime.bench",
    "gpu": "qgather.tools.case_bench",
    "suite": "qgather.tools.suite_bench",
}


def main(argv: Sequence[str]) -> int:
    """Run the named benchmarks in order; the worst exit status."""
    parser = argparse.ArgumentParser(prog="qgather bench", description=main.__doc__)
    parser.add_argument("which", nargs="*", metavar="BENCH", help=f"any of {', '.join(BENCHES)} (default: all)")
    names = parser.parse_args(argv).which or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        return usage("bench", f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    rc = 0
    for name in names:
        module = importlib.import_module(BENCHES[name])  # each benchmark's own imports, when it is asked for
        rc = max(rc, int(module.main() or 0))
    return rc
