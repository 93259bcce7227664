"""The argument parsers of the tools whose modules import torch (`qgather selftest`, `qgather
golden`) and the sweep's bounds its exploration shares (its parser: qgather.cli.arguments): here,
where nothing heavy is imported, so that the command line refuses bad input before torch loads
(qgather.cli's Command.check); the tool parses its arguments with the same parser. Each description
is its tool's docstring's first paragraph (tests/test_bad_input.py checks they agree).
"""

from __future__ import annotations

import argparse

from qgather.paths import golden_dir

MAX_REAL_WORLD = 64  # above this a sweep's world size runs as the virtual scenario
MAX_ROWS = 1 << 16

SELFTEST_DESCRIPTION = ("The bug zoo's self-test (`qgather selftest`, `make selftest`): does the harness catch "
                        "every bug?")


def selftest_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qgather selftest", description=SELFTEST_DESCRIPTION)
    parser.add_argument("mutants", nargs="*", metavar="MUTANT", help="only these (e.g. nibble_swap)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case's full report")
    parser.add_argument("--suite", action="store_true",
                        help="mutation mode: every mutant over a fixed sample of the default suite")
    parser.add_argument("--keep-pools", action="store_true",
                        help="leave the rank pools running (for callers that run more cases)")
    return parser


def golden_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qgather golden", description="The golden corpus: stored inputs and quantized buffers, with a manifest.")
    parser.add_argument("--producer", choices=("reference", "te"), default="reference",
                        help="who quantizes the corpus: the reference or TransformerEngine (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="verify the stored corpus instead of writing")
    parser.add_argument("--dir", default=golden_dir(), help="the corpus directory (default: %(default)s)")
    return parser
