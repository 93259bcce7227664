"""Known-issues baseline: read, write and update the checked-in TOML file of library defects whose
failing cases a gating run accepts. Under `--baseline FILE` a case one of its patterns matches that
fails is a strict xfail (the run stays green); one that passes fails the run until the pattern goes.

One `[[issue]]` table per defect (a `Finding`), its configured variants as fnmatch globs over case ids:

    [[issue]]
    title = "torchao 0.18 float8: uneven shards"
    link = "docs/findings.md#torchao-uneven-shards"      # the upstream report, else the findings entry
    reason = "the short rank sends fewer bytes: gloo aborts"   # optional
    cases = [
        "torchao:fp8_tensor:46x64:*:ws3:*",
    ]

The old one-case form (`case = "ID"`, `reason`, `link`) is still read, as a finding of one pattern
titled by its reason. `qgather baseline update` (`update`) keeps the file's order and grouping: the
file is written in one canonical layout (`dumps`), so an update's diff is only what it changed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from qgather.model.case_record import CaseRecord
from qgather.model.known_issues import (
    BaselineError,
    Finding,
    KnownIssue,
    findings_of_text,
    load,
    load_findings,
)
from qgather.model.verdict import Verdict
from qgather.paths import BASELINE_FILE

__all__ = ["DEFAULT_FILE", "BaselineError", "Finding", "KnownIssue", "Update", "clean_reason", "dumps", "escape",
           "findings_of_text",
           "load", "load_findings", "match", "update"]

DEFAULT_FILE = BASELINE_FILE
UNTRIAGED = "Not yet triaged"  # the title prefix of the groups `update` adds for failures no entry covers
UNTRIAGED_LINK = "docs/findings.md#not-yet-triaged"
REASON_LIMIT = 160  # characters of a written reason, cut at a word boundary
HEADER = """\
# qgather known issues: library defects whose failing cases a gating run (--baseline) accepts.
# One [[issue]] table per defect:
#   title  = the finding, as docs/findings.md names it
#   link   = the upstream report, else the finding's section of docs/findings.md
#   reason = what fails (optional)
#   cases  = fnmatch globs over case ids covering the defect's configured variants, never a passing case
# A matched case that fails is a strict xfail; a matched case that passes fails the run.
# Update from a run: `qgather baseline update --from reports/verdicts.json --file {name}` keeps this
# order and grouping, adds uncovered failures to "{untriaged}" groups at the end and removes patterns
# that matched only passing cases (comments other than this header are not kept).
"""
def match(issues: Sequence[KnownIssue], case_id: str) -> KnownIssue | None:
    """The first entry that lists the case."""
    return next((issue for issue in issues if issue.matches(case_id)), None)


def escape(case_id: str) -> str:
    """A pattern that matches exactly this id (ids of external adapters may hold glob characters)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in case_id)


def dumps(findings: Iterable[Finding | KnownIssue], name: str = DEFAULT_FILE) -> str:
    """The baseline file's text in its one canonical layout: the header, then one [[issue]] per finding
    (a KnownIssue is written as a finding of one pattern titled by its reason)."""
    return HEADER.format(name=name, untriaged=UNTRIAGED) + "\n" + dump_tables(findings)


def dump_tables(findings: Iterable[Finding | KnownIssue]) -> str:
    """One [[issue]] table per finding, each followed by a blank line (what `dumps` writes after its header)."""
    # json.dumps writes a valid TOML basic string (the escapes it emits are TOML's too).
    blocks = []
    for finding in findings:
        if isinstance(finding, KnownIssue):
            finding = Finding.of(finding)
        lines = ["[[issue]]", f"title = {json.dumps(finding.title)}"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in (("link", finding.link),
                                                                     ("reason", finding.reason)) if value]
        lines += ["cases = [", *(f"    {json.dumps(pattern)}," for pattern in finding.cases), "]", ""]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


@dataclass(frozen=True)
class Update:
    """A baseline updated from a run, and what changed."""

    findings: tuple[Finding, ...]
    added: tuple[tuple[str, str], ...]  # (case id, the title of the untriaged group it went to)
    covered: int  # failing cases an existing pattern already covers
    stale: tuple[tuple[str, str], ...]  # (pattern, title): it matched only passing cases, so it was removed
    too_broad: tuple[tuple[str, str], ...]  # (pattern, a passing case it matches): kept, to narrow by hand

    #: (case id, the title of the finding it went under): a new world size of a known failure
    filed: tuple[tuple[str, str], ...] = ()

    @property
    def changed(self) -> bool:
        """Whether the file changes."""
        return bool(self.added or self.stale or self.filed)


def update(findings: Sequence[Finding], cases: Sequence[CaseRecord]) -> Update:
    """The baseline after a run whose case records (verdicts.json's `cases`) are given: order and
    grouping kept; a failing case no pattern covers goes to the untriaged group of its verdict and
    reason (a new one at the end if none); a pattern that matched only passing cases is removed."""
    ran = [c for c in cases if c.verdict is not Verdict.SKIPPED]
    failing = sorted({c.case: c for c in ran if not c.passed}.values(), key=lambda c: c.case)
    passing = sorted({c.case for c in ran if c.passed})
    kept: list[Finding] = []
    stale, too_broad = [], []
    for finding in findings:
        patterns = []
        for pattern in finding.cases:
            issue = KnownIssue(pattern, "")
            passes = [case for case in passing if issue.matches(case)]
            if passes and not any(issue.matches(c.case) for c in failing):
                stale.append((pattern, finding.title))
                continue
            too_broad += [(pattern, case) for case in passes[:1]]
            patterns.append(pattern)
        if patterns:
            kept.append(replace(finding, cases=tuple(patterns)))
    added, filed, covered = [], [], 0
    for case in failing:
        if any(f.pattern_for(case.case) for f in kept):
            covered += 1
            continue
        home = _finding_at_another_world_size(kept, case, failing)
        if home is not None:
            at, pattern = home
            # never widened over a failure of another verdict: it would count as this finding's
            unlike = [*passing, *(c.case for c in failing if c.verdict is not case.verdict)]
            kept[at] = replace(kept[at], cases=_with_world_size(kept[at].cases, pattern, case, unlike))
            filed.append((case.case, kept[at].title))
            continue
        title = f"{UNTRIAGED}: {case.verdict.value}: {clean_reason(case.reason)}"
        at = next((n for n, f in enumerate(kept) if f.title == title), None)
        if at is None:
            kept.append(Finding(title, (escape(case.case),), link=UNTRIAGED_LINK))
        else:
            kept[at] = replace(kept[at], cases=(*kept[at].cases, escape(case.case)))
        added.append((case.case, title))
    return Update(tuple(kept), tuple(added), covered, tuple(stale), tuple(too_broad), tuple(filed))


_WORLD_SIZE = re.compile(r":ws[^:]*:")
_ONE_DIGIT_SIZES = re.compile(r":ws(\d|\[\d+\]):")


def _with_world_size(patterns: tuple[str, ...], pattern: str, case: CaseRecord,
                     unlike: Sequence[str]) -> tuple[str, ...]:
    """The finding's patterns covering `case` too: `pattern` with the case's world size added to its
    set (ws2 -> ws[23]) where that matches none of the `unlike` cases (those that passed, and those that
    failed with another verdict), else the case's exact id."""
    sizes = _ONE_DIGIT_SIZES.search(pattern)
    size = _ONE_DIGIT_SIZES.search(case.case)  # the id's own: an old verdicts.json has no world_size field
    if sizes and size and size.group(1).isdigit():
        digits = "".join(sorted(set(sizes.group(1).strip("[]")) | {size.group(1)}))
        wider = pattern[:sizes.start()] + f":ws[{digits}]:" + pattern[sizes.end():]
        if not any(KnownIssue(wider, "").matches(other) for other in unlike):
            return tuple(wider if p == pattern else p for p in patterns)
    return (*patterns, escape(case.case))


def _finding_at_another_world_size(findings: Sequence[Finding], case: CaseRecord,
                                   failing: Sequence[CaseRecord]) -> tuple[int, str] | None:
    """The finding a new failure belongs to when only its world size is new: one of the finding's
    patterns matches the case with that pattern's world size widened to any, and a case the pattern
    covers failed in this run with the same verdict (the same failure, seen at another world size)."""
    for at, finding in enumerate(findings):
        for pattern in finding.cases:
            wide = _WORLD_SIZE.sub(":ws*:", pattern)
            if wide == pattern or not KnownIssue(wide, "").matches(case.case):
                continue
            issue = KnownIssue(pattern, "")
            if any(issue.matches(other.case) and other.verdict is case.verdict for other in failing):
                return at, pattern
    return None


# What changes from one run of a case to the next: it must not enter a checked-in reason.
_EPHEMERAL = [
    (re.compile(r"\[[0-9a-fA-F:.]*[:.][0-9a-fA-F:.]*\](:\d+)?"), "<address>"),  # [::1]:29500, [127.0.0.1]:29500
    (re.compile(r"\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b"), "<address>"),  # 127.0.0.1:29500
    (re.compile(r"\b(localhost|[\w-]+(\.[\w-]+)+):\d{2,5}\b"), "<address>"),  # host.name:port
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<pointer>"),
    (re.compile(r"\b(port|pid|PID|tid)(\s*[=:]?\s*)\d+\b"), r"\1\2<n>"),
    (re.compile(r"/tmp/[^\s'\"():,]+"), "<tmp>"),
]


def clean_reason(text: str, limit: int = REASON_LIMIT) -> str:
    """A case's reason as a baseline may hold it: its first line, with no address, port, pid or temporary
    path, and at most `limit` characters, cut at a word boundary with "..."."""
    lines = (text or "").strip().splitlines()
    line = lines[0].strip() if lines else ""
    for pattern, repl in _EPHEMERAL:
        line = pattern.sub(repl, line)
    if not line:
        return "no reason given"
    if len(line) <= limit:
        return line
    cut = line[:limit - 3]
    if not line[limit - 3].isspace() and " " in cut:  # the cut falls inside a word: drop that word
        cut = cut[:cut.rfind(" ")]
    return cut.rstrip(" ,;:-(") + "..."
