"""`qgather coverage`: the coverage matrix (format x buffer x regime x scenario x configuration) of
a selection as Markdown, and the configuration designs' pairs (configuration token x shape regime
per format, the other two-way combinations, the pairs that cannot occur and why), then the depth of
each (family, format) cell and its minimum (qgather.suite.depth); exit 1 when a promised cell or pair
is missing or a promised cell is shallower than its promise."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from qgather.cli.common import add_selection_options, refusing_in_one_line, usage
from qgather.suite.options import joined_impls


@refusing_in_one_line("coverage")
def main(argv: Sequence[str] | None = None) -> int:
    """Print the coverage matrix of the selected cases."""
    parser = argparse.ArgumentParser(prog="qgather coverage", description=main.__doc__)
    add_selection_options(parser)
    args = parser.parse_args(argv)
    from qgather.suite import depth  # after parsing: bad input starts no torch
    from qgather.suite.coverage import markdown, measure, suite_cases

    named = list(joined_impls(args.impl)) if args.impl else None  # as `qgather run` selects them
    cases, primary = suite_cases(list(joined_impls(args.impl)), args.formats, args.world_sizes, args.scenarios,
                                 args.exhaustive, named=named)
    if not cases:
        return usage("coverage", "the selection has no cases")
    cov = measure(cases, primary)
    deep = depth.measure(cases, promised=not args.world_sizes)
    print(markdown(cov))
    print()
    print(depth.markdown(deep))
    return 1 if cov.broken or deep.broken else 0
