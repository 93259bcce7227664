"""The argument parser of `qgather sweep`, whose module imports torch: built here, where nothing
heavy is imported, so that the command line refuses bad input before torch loads (`check_sweep`, a
Command's `check`); the sweep parses its arguments with the same parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from qgather.cli.common import add_run_options
from qgather.model.case import DTYPES
from qgather.suite.options import refuse_unknown_formats, refuse_unknown_impl

REAL_SCENARIOS = ("steps", "gather", "reshard", "hooks")  # the sweep's scenarios run on rank pools
DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)
DEFAULT_COLS = (64,)
DEFAULT_BUDGET_S = 300.0

SWEEP_DESCRIPTION = ("`qgather sweep`: explore shapes x world sizes of one implementation and format, group the "
                     "failures by (verdict, signature), and shrink each group to a minimal case with the command "
                     "that reproduces it.")


def sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qgather sweep", description=SWEEP_DESCRIPTION)
    parser.add_argument("--impl", required=True, help="implementation, e.g. reference, mutant:<bug>, pkg.mod:Obj")
    parser.add_argument("--format", required=True, dest="fmt", help="format, e.g. nvfp4_2d")
    parser.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                        help="comma-separated world sizes to explore (default: %(default)s)")
    parser.add_argument("--max-rows", default=None, help="largest dim 0 (default: 4 x max(row block, 16) + 2)")
    parser.add_argument("--cols", default=",".join(map(str, DEFAULT_COLS)), help="K values, e.g. 32,64")
    parser.add_argument("--dtype", default="bf16", help=f"one of {', '.join(DTYPES)}")
    parser.add_argument("--seed", default="0", help="the data seed of every explored case (default: %(default)s)")
    parser.add_argument("--budget-s", default=str(DEFAULT_BUDGET_S),
                        help="seconds of exploration; confirming and shrinking get at most as many again")
    parser.add_argument("--scenario", default="steps", choices=REAL_SCENARIOS,
                        help="the real scenario run on the rank pools (default steps: the first gather, then "
                             "optimizer steps and re-gathers)")
    add_run_options(parser)
    return parser



def check_sweep(argv: Sequence[str]) -> None:
    """`qgather sweep`'s arguments read, and its names checked as far as that needs no import: argparse's
    refusal (SystemExit 2), or an OptionError naming the option, before the sweep's module loads torch."""
    args = sweep_parser().parse_args(list(argv))
    refuse_unknown_impl(args.impl)
    refuse_unknown_formats([args.fmt], "--format")
