"""`python -m qgather.tools.standalone [--check] [--root DIR]`: write (or check) the findings'
standalone scripts (docs/repro/) and upstream drafts (docs/upstream/). Exit 1 when --check finds a
stale file, naming it and the command that regenerates it."""

from __future__ import annotations

import argparse
import sys

from qgather.tools.standalone.docs import stale_files, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qgather.tools.standalone", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.root)
        for path in stale:
            print(f"{path}: not what the generator writes; run `make repro-docs`", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
