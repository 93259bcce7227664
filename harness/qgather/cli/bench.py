"""`qgather bench [formats|runtime|gpu|suite|list ...]`: run the benchmarks (default: all of them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from qgather.cli.common import usage

BenchMain = Callable[[Sequence[str]], int]


# One loader per benchmark: each benchmark's own imports happen when it is asked for.
def _formats() -> BenchMain:
    from qgather.tools.bench.format_bench import main
    return main


def _runtime() -> BenchMain:
    from qgather.runtime.bench import main
    return main


def _gpu() -> BenchMain:
    from qgather.tools.bench.case_bench import main
    return main


def _suite() -> BenchMain:
    from qgather.tools.bench.suite_bench import main
    return main


def _list() -> BenchMain:
    from qgather.tools.bench.list_bench import main
    return main


BENCHES: dict[str, Callable[[], BenchMain]] = {"formats": _formats, "runtime": _runtime, "gpu": _gpu, "suite": _suite,
                                               "list": _list}


def main(argv: Sequence[str]) -> int:
    """Run the named benchmarks in order (default: all); the worst exit status. Options after a
    single benchmark's name are its own (e.g. `qgather bench gpu --backend gloo --profile`)."""
    argv = list(argv)
    if argv and argv[0] in ("-h", "--help"):
        argparse.ArgumentParser(prog="qgather bench [BENCH ...] [BENCH OPTIONS]", description=main.__doc__,
                                epilog=f"benchmarks: {', '.join(BENCHES)}; `qgather bench gpu --help` for "
                                       "the GPU benchmark's options").print_help()
        return 0
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        return usage("bench", f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    if argv and len(names) != 1:
        return usage("bench", f"options ({' '.join(argv)}) belong to one named benchmark, e.g. "
                              "`qgather bench gpu --profile`")
    rc = 0
    for name in names or list(BENCHES):
        rc = max(rc, int(BENCHES[name]()(argv) or 0))
    return rc
