"""The known-issues baseline file read, without torch: the command line checks `--baseline FILE` before
anything heavy loads, and the plugin (qgather.pytest_plugin.baseline, which writes and updates the file)
reads it with the same rules. The file's layout: qgather.pytest_plugin.baseline.

    load("known-issues.toml")        -> [KnownIssue(case="torchao:fp8_tensor:46x64:*:ws3:*", ...), ...]
    load("nope.toml")                -> BaselineError: baseline nope.toml: cannot read it (No such file ...)
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass

from qgather.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # optional before 3.11: without it only reading a baseline fails, with one line
    try:
        import tomli as _toml
    except ImportError:
        _toml = None

_OLD_KEYS = frozenset({"case", "reason", "link"})
_NEW_KEYS = frozenset({"title", "cases", "reason", "link"})




@dataclass(frozen=True)
class KnownIssue:
    """One entry of a known-issues baseline: a case id or an fnmatch glob over case ids, and why."""

    case: str
    reason: str
    link: str = ""

    def matches(self, case_id: str) -> bool:
        """Whether the entry lists this case id."""
        return fnmatch.fnmatchcase(case_id, self.case)

    def as_dict(self) -> dict[str, str]:
        """The entry as verdicts.json writes it."""
        return {"case": self.case, "reason": self.reason, "link": self.link}


class BaselineError(UsageError):
    """A baseline file that cannot be read: the message is one line naming the file."""


@dataclass(frozen=True)
class Finding:
    """One library defect: its title, the case-id globs of its configured variants, why, and where it is reported."""

    title: str
    cases: tuple[str, ...]
    reason: str = ""
    link: str = ""

    @property
    def summary(self) -> str:
        """What a known issue says of a case this finding covers: the title, then the reason."""
        return f"{self.title}: {self.reason}" if self.reason else self.title

    def pattern_for(self, case_id: str) -> str | None:
        """The first of the finding's patterns that matches the case id."""
        return next((p for p in self.cases if KnownIssue(p, "").matches(case_id)), None)

    def issues(self) -> tuple[KnownIssue, ...]:
        """One KnownIssue per pattern (what a case record carries of the entry that matched it)."""
        return tuple(KnownIssue(pattern, self.summary, self.link) for pattern in self.cases)

    @classmethod
    def of(cls, issue: KnownIssue) -> Finding:
        """A finding of one pattern from a KnownIssue (the old one-case form)."""
        return cls(title=issue.reason, cases=(issue.case,), link=issue.link)


def _tomllib():
    if _toml is None:
        raise BaselineError("reading a TOML baseline needs Python >= 3.11 or the tomli package")
    return _toml


def load_findings(path: str, where: str = "") -> list[Finding]:
    """The findings of a baseline file; BaselineError (one line starting with `where`, by default
    "baseline PATH") when it cannot be read."""
    where = where or f"baseline {path}"
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8", errors="replace")
    except OSError as exc:
        raise BaselineError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    return findings_of_text(text, where)


def findings_of_text(text: str, where: str = "baseline") -> list[Finding]:
    """The findings of a baseline file's text; BaselineError (one line starting with `where`) when it is not one."""
    tomllib = _tomllib()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BaselineError(f"{where}: not valid TOML: {str(exc).splitlines()[0]}") from None
    unknown = sorted(set(data) - {"issue"})
    if unknown:
        raise BaselineError(f"{where}: unknown top-level key {unknown[0]!r}; entries are [[issue]] tables")
    entries = data.get("issue", [])
    if not isinstance(entries, list):
        raise BaselineError(f"{where}: `issue` must be an array of tables ([[issue]])")
    return [_finding(f"{where}: issue #{n}", entry) for n, entry in enumerate(entries, 1)]


def load(path: str, where: str = "") -> list[KnownIssue]:
    """The file's patterns, one KnownIssue each in the file's order (what --baseline matches cases against);
    `where` as load_findings'."""
    return [issue for finding in load_findings(path, where) for issue in finding.issues()]


def _finding(where: str, entry: object) -> Finding:
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} is not a table")
    if "case" in entry and "cases" not in entry:
        return Finding.of(_old_issue(where, entry))
    extra = sorted(set(entry) - _NEW_KEYS)
    if extra:
        raise BaselineError(f"{where}: unknown key {extra[0]!r} (keys: title, link, reason, cases)")
    _require_text(where, entry, "title")
    for key in ("reason", "link"):
        if not isinstance(entry.get(key, ""), str):
            raise BaselineError(f"{where}: `{key}` must be a string")
    cases = entry.get("cases")
    if not isinstance(cases, list) or not cases or not all(isinstance(c, str) and c.strip() for c in cases):
        raise BaselineError(f"{where}: `cases` must be a non-empty list of case-id patterns (strings)")
    return Finding(entry["title"], tuple(cases), entry.get("reason", ""), entry.get("link", ""))


def _old_issue(where: str, entry: dict) -> KnownIssue:
    extra = sorted(set(entry) - _OLD_KEYS)
    if extra:
        raise BaselineError(f"{where}: unknown key {extra[0]!r} (the one-case form's keys: case, reason, link)")
    for key in ("case", "reason"):
        _require_text(where, entry, key)
    if not isinstance(entry.get("link", ""), str):
        raise BaselineError(f"{where}: `link` must be a string")
    return KnownIssue(entry["case"], entry["reason"], entry.get("link", ""))


def _require_text(where: str, entry: dict, key: str) -> None:
    if not isinstance(entry.get(key), str) or not entry[key].strip():
        raise BaselineError(f"{where}: `{key}` must be a non-empty string")


