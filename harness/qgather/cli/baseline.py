"""`qgather baseline update --from VERDICTS_JSON [--file known-issues.toml]`: update the known-issues
baseline from a run's case records, keeping its order and grouping (qgather.pytest_plugin.baseline
says how)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qgather.cli.common import usage
from qgather.paths import BASELINE_FILE

if TYPE_CHECKING:  # imported once the arguments are read: bad input is refused before torch loads
    from qgather.model.case_record import CaseRecord
    from qgather.pytest_plugin.baseline import Update


def main(argv: Sequence[str]) -> int:
    """Maintain the known-issues baseline."""
    parser = argparse.ArgumentParser(prog="qgather baseline", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("update", help="update the baseline from a run's verdicts.json (a minimal diff)")
    up.add_argument("--from", dest="source", required=True, metavar="VERDICTS_JSON",
                    help="the verdicts.json of a run (--report-dir) whose failures the baseline lists")
    up.add_argument("--file", default=BASELINE_FILE, help=f"the baseline to update (default: {BASELINE_FILE})")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.source):  # before torch loads, as every bad input is refused
        return usage("baseline", f"--from {args.source}: no such file (a run's verdicts.json, from --report-dir)")
    # deferred: the baseline's modules import torch, which bad arguments must not wait for
    from qgather.pytest_plugin.baseline import BaselineError, dumps, load_findings, update
    from qgather.pytest_plugin.baseline_text import updated_text

    try:
        findings = load_findings(args.file) if os.path.exists(args.file) else []
        result = update(findings, read_run(args.source))
    except BaselineError as exc:
        return usage("baseline", str(exc))
    if not os.path.exists(args.file):
        text, old = dumps(result.findings, os.path.basename(args.file)), None
    else:
        old = _read(args.file)
        text = updated_text(old, findings, result, os.path.basename(args.file))
    if text != old:
        with open(args.file, "w") as fh:
            fh.write(text)
    _print(args.file, result)
    return 0


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _print(path: str, result: Update) -> None:
    patterns = sum(len(f.cases) for f in result.findings)
    print(f"{path}: {len(result.findings)} findings, {patterns} patterns; {result.covered} failing cases already "
          f"covered, {len(result.filed)} filed under their finding, {len(result.added)} added as untriaged, "
          f"{len(result.stale)} stale patterns removed")
    for case, title in result.filed:
        print(f"  filed: {case} (under \"{title}\": the same failure at another world size)")
    for case, title in result.added:
        print(f"  added: {case} (to \"{title}\")")
    for pattern, title in result.stale:
        print(f"  stale: {pattern} (\"{title}\") matched only passing cases: removed")
    for pattern, case in result.too_broad:
        print(f"  too broad: {pattern} matches {case}, which passes: narrow it by hand")


def read_run(path: str) -> list[CaseRecord]:
    """The case records of a verdicts.json (its `cases`) or of a --qgather-json file (a list of them)."""
    # deferred, as in main: called once the arguments are read
    from qgather.model.case_record import CaseRecord, RecordError
    from qgather.pytest_plugin.baseline import BaselineError

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
