"""`qgather list`: what the harness knows (implementations, formats, scenarios, mutants), or the
case ids a selection runs (`--cases`, the same selection options as `qgather run`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from qgather.cli.common import add_selection_options, refusing_in_one_line

SECTIONS = ("impls", "formats", "scenarios", "mutants")


@refusing_in_one_line("list")
def main(argv: Sequence[str]) -> int:
    """What the harness knows: implementations, formats, scenarios, mutants, or the case ids a selection runs."""
    parser = argparse.ArgumentParser(prog="qgather list", description=main.__doc__)
    parser.add_argument("what", nargs="?", default="all", choices=("all", *SECTIONS))
    parser.add_argument("--cases", action="store_true", help="print the case ids the selection below would run")
    add_selection_options(parser)
    args = parser.parse_args(argv)
    from qgather.cli import inventory  # after parsing: a bad option is refused before torch is imported

    if args.cases:
        return inventory.list_cases(args)
    for section in SECTIONS if args.what == "all" else (args.what,):
        print(f"{section}:")
        for line in inventory.LISTERS[section]():
            print(f"  {line}")
    return 0
