"""`qgather baseline update --from VERDICTS_JSON [--file known-issues.toml]`: rewrite the
known-issues baseline from a run's case records (qgather.pytest_plugin.baseline says how)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from qgather.cli.common import usage
from qgather.model.case_record import CaseRecord, RecordError
from qgather.pytest_plugin.baseline import DEFAULT_FILE, BaselineError, dumps, load, update


def main(argv: Sequence[str]) -> int:
    """Maintain the known-issues baseline."""
    parser = argparse.ArgumentParser(prog="qgather baseline", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("update", help="write or update the baseline from a run's verdicts.json")
    up.add_argument("--from", dest="source", required=True, metavar="VERDICTS_JSON",
                    help="the verdicts.json of a run (--report-dir) whose failures the baseline lists")
    up.add_argument("--file", default=DEFAULT_FILE, help=f"the baseline to update (default: {DEFAULT_FILE})")
    args = parser.parse_args(argv)
    try:
        issues = load(args.file) if os.path.exists(args.file) else []
        result = update(issues, read_run(args.source))
    except BaselineError as exc:
        return usage("baseline", str(exc))
    with open(args.file, "w") as fh:
        fh.write(dumps(result.issues, os.path.basename(args.file)))
    print(f"{args.file}: {len(result.issues)} entries ({result.added} new, {result.kept} kept, "
          f"{len(result.dropped)} dropped as passing, {result.uncovered} not covered by this run)")
    for issue in result.dropped:
        print(f"  dropped: {issue.case}")
    return 0


def read_run(path: str) -> list[CaseRecord]:
    """The case records of a verdicts.json (its `cases`) or of a --qgather-json file (a list of them)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BaselineError(f"--from {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise BaselineError(f"--from {path}: not JSON ({exc})") from None
    cases = data.get("cases") if isinstance(data, dict) else data
    if not isinstance(cases, list):
        raise BaselineError(f"--from {path}: not a qgather verdicts.json (no list of cases with verdicts)")
    try:
        return [CaseRecord.from_dict(case) for case in cases]
    except RecordError as exc:
        raise BaselineError(f"--from {path}: not a qgather verdicts.json ({exc})") from None
