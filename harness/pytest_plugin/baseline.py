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

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qgather.errors import UsageError
from qgather.model.case_record import CaseRecord, KnownIssue
from qgather.model.verdict import Verdict

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # optional before 3.11: without it only reading a baseline fails, with one line
    try:
        import tomli as _toml
    except ImportError:
        _toml = None

DEFAULT_FILE = "known-issues.toml"
HEADER = """\
# qgather known issues: failing cases known upstream, as strict xfails under --baseline.
# Each [[issue]]: `case` is a case id or an fnmatch glob over case ids, `reason` says what fails,
# `link` points at the upstream issue. A listed case that passes fails the run: remove its entry.
# Regenerate from a run with `qgather baseline update --from reports/verdicts.json --file {name}`
# (comments other than this header are not kept).
"""


class BaselineError(UsageError):
    """A baseline file that cannot be read: the message is one line naming the file."""


def _tomllib():
    if _toml is None:
        raise BaselineError("reading a TOML baseline needs Python >= 3.11 or the tomli package")
    return _toml


def load(path: str) -> list[KnownIssue]:
    """The entries of a baseline file; BaselineError (one line naming the file) when it cannot be read."""
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


def match(issues: Sequence[KnownIssue], case_id: str) -> KnownIssue | None:
    """The first entry that lists the case."""
    return next((issue for issue in issues if issue.matches(case_id)), None)


def escape(case_id: str) -> str:
    """A pattern that matches exactly this id (ids of external adapters may hold glob characters)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in case_id)


def dumps(issues: Iterable[KnownIssue], name: str = DEFAULT_FILE) -> str:
    """The baseline file's text: the header, then one [[issue]] table per entry."""
    # json.dumps writes a valid TOML basic string (the escapes it emits are TOML's too).
    blocks = [HEADER.format(name=name)]
    for issue in issues:
        blocks.append(f"[[issue]]\ncase = {json.dumps(issue.case)}\nreason = {json.dumps(issue.reason)}\n"
                      f"link = {json.dumps(issue.link)}\n")
    return "\n".join(blocks)


@dataclass(frozen=True)
class Update:
    """A baseline rewritten from a run, and what changed."""

    issues: tuple[KnownIssue, ...]
    added: int
    kept: int
    dropped: tuple[KnownIssue, ...]  # entries that matched only passing cases
    uncovered: int  # entries that matched no case of the run (kept as they are)


def update(issues: Sequence[KnownIssue], cases: Sequence[CaseRecord]) -> Update:
    """The baseline after a run whose case records (verdicts.json's `cases`) are given."""
    ran = [c for c in cases if c.verdict is not Verdict.SKIPPED]
    failing = sorted({c.case: c for c in ran if not c.passed}.values(), key=lambda c: c.case)
    new, kept = [], 0
    for case in failing:
        old = match(issues, case.case)
        kept += old is not None
        reason = old.reason if old else f"{case.verdict.value}: {_first_line(case.reason)}"
        new.append(KnownIssue(escape(case.case), reason, old.link if old else ""))
    uncovered = [i for i in issues if not any(i.matches(c.case) for c in ran)]
    dropped = [i for i in issues if i not in uncovered and not any(i.matches(c.case) for c in failing)]
    result = sorted(new + uncovered, key=lambda i: i.case)
    return Update(tuple(result), len(new) - kept, kept, tuple(dropped), len(uncovered))


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else "no reason given"
