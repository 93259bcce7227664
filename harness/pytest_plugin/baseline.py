"""Known-issues baseline: a checked-in TOML file of case-id patterns (fnmatch globs) whose
failure is known upstream. Under `--baseline FILE` a matched case that fails is a strict xfail
(the run stays green); a matched case that passes fails the run until the entry is removed.

    [[issue]]
    case = "torchao:mxfp8:136x64:bf16:ws3:gather:s0"   # a case id or a glob
    reason = "uneven shards: ..."
    link = "https://github.com/..."

`qgather baseline update --from reports/verdicts.json [--file known-issues.toml]` rewrites the
file from a run: one exact-id entry per failing case, keeping the reason and link of the entry
that matched it; entries that matched only passing cases are dropped, entries that matched no
case of the run are kept as they are.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from dataclasses import dataclass

DEFAULT_FILE = "known-issues.toml"
HEADER = """\
# qgather known issues: failing cases known upstream, as strict xfails under --baseline.
# Each [[issue]]: `case` is a case id or an fnmatch glob over case ids, `reason` says what fails,
# `link` points at the upstream issue. A listed case that passes fails the run: remove its entry.
# Regenerate from a run with `qgather baseline update --from reports/verdicts.json --file {name}`
# (comments other than this header are not kept).
"""


class BaselineError(ValueError):
    """A baseline file that cannot be read: the message is one line naming the file."""


@dataclass(frozen=True)
class KnownIssue:
    case: str  # a case id or an fnmatch glob over case ids
    reason: str
    link: str = ""

    def matches(self, case_id: str) -> bool:
        return fnmatch.fnmatchcase(case_id, self.case)

    def as_dict(self) -> dict[str, str]:
        return {"case": self.case, "reason": self.reason, "link": self.link}


def _tomllib():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError:
        raise BaselineError("reading a TOML baseline needs Python >= 3.11 or the tomli package") from None
    return tomli


def load(path: str) -> list[KnownIssue]:
    tomllib = _tomllib()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise BaselineError(f"baseline {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BaselineError(f"baseline {path}: not valid TOML: {str(exc).splitlines()[0]}") from None
    return _issues(path, data)


def _issues(path: str, data: dict) -> list[KnownIssue]:
    unknown = sorted(set(data) - {"issue"})
    if unknown:
        raise BaselineError(f"baseline {path}: unknown top-level key {unknown[0]!r}; entries are [[issue]] tables")
    entries = data.get("issue", [])
    if not isinstance(entries, list):
        raise BaselineError(f"baseline {path}: `issue` must be an array of tables ([[issue]])")
    return [_issue(path, n, entry) for n, entry in enumerate(entries, 1)]


def _issue(path: str, n: int, entry: object) -> KnownIssue:
    where = f"baseline {path}: issue #{n}"
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} is not a table")
    extra = sorted(set(entry) - {"case", "reason", "link"})
    if extra:
        raise BaselineError(f"{where}: unknown key {extra[0]!r} (keys: case, reason, link)")
    for key in ("case", "reason"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise BaselineError(f"{where}: `{key}` must be a non-empty string")
    if not isinstance(entry.get("link", ""), str):
        raise BaselineError(f"{where}: `link` must be a string")
    return KnownIssue(entry["case"], entry["reason"], entry.get("link", ""))


def match(issues: list[KnownIssue], case_id: str) -> KnownIssue | None:
    """The first entry that lists the case."""
    return next((issue for issue in issues if issue.matches(case_id)), None)


def escape(case_id: str) -> str:
    """A pattern that matches exactly this id (ids of external adapters may hold glob characters)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in case_id)


def dumps(issues: list[KnownIssue], name: str = DEFAULT_FILE) -> str:
    # json.dumps writes a valid TOML basic string (the escapes it emits are TOML's too).
    blocks = [HEADER.format(name=name)]
    for issue in issues:
        blocks.append(f"[[issue]]\ncase = {json.dumps(issue.case)}\nreason = {json.dumps(issue.reason)}\n"
                      f"link = {json.dumps(issue.link)}\n")
    return "\n".join(blocks)


@dataclass
class Update:
    issues: list[KnownIssue]
    added: int
    kept: int
    dropped: list[KnownIssue]
    uncovered: int


def update(issues: list[KnownIssue], cases: list[dict]) -> Update:
    """The baseline after a run whose cases (verdicts.json's `cases`) are given."""
    ran = [c for c in cases if c["verdict"] != "SKIPPED"]
    failing = sorted({c["case"]: c for c in ran if not c["passed"]}.values(), key=lambda c: c["case"])
    new, kept = [], 0
    for case in failing:
        old = match(issues, case["case"])
        kept += old is not None
        reason = old.reason if old else f"{case['verdict']}: {_first_line(case.get('reason', ''))}"
        new.append(KnownIssue(escape(case["case"]), reason, old.link if old else ""))
    uncovered = [i for i in issues if not any(i.matches(c["case"]) for c in ran)]
    dropped = [i for i in issues if i not in uncovered and not any(i.matches(c["case"]) for c in failing)]
    result = sorted(new + uncovered, key=lambda i: i.case)
    return Update(result, len(new) - kept, kept, dropped, len(uncovered))


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else "no reason given"


def _read_run(path: str) -> list[dict]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BaselineError(f"--from {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise BaselineError(f"--from {path}: not JSON ({exc})") from None
    cases = data.get("cases") if isinstance(data, dict) else data  # verdicts.json, or a --qgather-json list
    if not isinstance(cases, list) or not all(isinstance(c, dict) and {"case", "verdict", "passed"} <= set(c)
                                              for c in cases):
        raise BaselineError(f"--from {path}: not a qgather verdicts.json (no list of cases with verdicts)")
    return cases


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qgather baseline", description="Maintain the known-issues baseline.")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("update", help="write or update the baseline from a run's verdicts.json")
    up.add_argument("--from", dest="source", required=True, metavar="VERDICTS_JSON")
    up.add_argument("--file", default=DEFAULT_FILE, help=f"the baseline to update (default: {DEFAULT_FILE})")
    args = parser.parse_args(argv)
    try:
        issues = load(args.file) if os.path.exists(args.file) else []
        result = update(issues, _read_run(args.source))
    except BaselineError as exc:
        print(f"qgather baseline: {exc}", file=sys.stderr)
        return 2
    with open(args.file, "w") as fh:
        fh.write(dumps(result.issues, os.path.basename(args.file)))
    print(f"{args.file}: {len(result.issues)} entries ({result.added} new, {result.kept} kept, "
          f"{len(result.dropped)} dropped as passing, {result.uncovered} not covered by this run)")
    for issue in result.dropped:
        print(f"  dropped: {issue.case}")
    return 0
