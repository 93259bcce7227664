"""Two runs' verdicts case by case (`qgather compare`): what an upgrade fixed, what it broke, what it
changed without a verdict saying so.

Runs are read as verdicts.json holds them (plain dicts), not as `CaseRecord`s: nothing here imports
torch, so that `qgather compare` refuses a bad input, and compares two runs, without it.

    before = RunView.from_json(json.load(fh_before), "reports/torchao-0.17.0/verdicts.json")
    after = RunView.from_json(json.load(fh_after), "reports/torchao-0.18.0/verdicts.json")
    diff = compare(before, after)
    diff.count(Change.REGRESSED), diff.failing({Change.REGRESSED})
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qgather.errors import UsageError
from qgather.model.verdict import Verdict

# The environment a comparison shows side by side: verdicts.json's key (its `environment`, else its
# `session`, else the top level) -> the label.
ENVIRONMENT_KEYS = (("torch", "torch"), ("torchao", "torchao"), ("transformer_engine", "transformer_engine"),
                    ("device", "device"), ("backend", "backend"), ("gpus", "GPUs"), ("python", "python"),
                    ("qgather_version", "qgather"))
UNKNOWN = "?"  # a field an older verdicts.json does not have


class RunDiffError(UsageError):
    """A run that cannot be compared: not a qgather verdicts.json, an interrupted run, or two runs
    without a case id in common. One line; exit 4 in the CLI."""


class Change(str, enum.Enum):
    """What became of one case id from the run before to the run after (its value is the `--fail-on` token)."""

    FIXED = "fixed"  # failed before; after, a verdict the policy accepts (not SKIPPED)
    REGRESSED = "regressed"  # passed or was skipped before; fails after
    VERDICT_CHANGED = "verdict-changed"  # another verdict, neither a fix nor a regression (e.g. ERROR -> HANG)
    EVIDENCE_CHANGED = "evidence-changed"  # the same verdict, other evidence (buffers, counts, errors)
    UNCHANGED = "unchanged"
    ONLY_BEFORE = "only-before"  # not in the run after: left out of the comparison
    ONLY_AFTER = "only-after"  # not in the run before: left out of the comparison

    @property
    def label(self) -> str:
        """How reports name it: `verdict changed`."""
        return self.value.replace("-", " ")


LEFT_OUT = (Change.ONLY_BEFORE, Change.ONLY_AFTER)


@dataclass(frozen=True)
class CaseEntry:
    """What a comparison reads of one case record: its group, its verdict and its evidence."""

    case: str
    implementation: str
    format: str
    world_size: int | str
    verdict: Verdict
    passed: bool  # the policy accepts the verdict (a baseline's known issue does not change this)
    reason: str
    evidence: tuple[str, ...]  # the reason and the report's evidence lines, run-specific text normalized

    @property
    def failed(self) -> bool:
        """A verdict the policy does not accept (SKIPPED is neither a pass nor a failure)."""
        return not self.passed and self.verdict is not Verdict.SKIPPED

    @property
    def group(self) -> tuple[str, str, int | str]:
        """implementation x format x world size: how a comparison's summary groups cases."""
        return self.implementation, self.format, self.world_size

    @classmethod
    def from_record(cls, data: Any, source: str) -> CaseEntry:
        """The entry of one of verdicts.json's `cases` (a `CaseRecord.to_dict`); RunDiffError when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("case"), str):
            raise RunDiffError(f"{source}: not a qgather verdicts.json (a case record without a case id)")
        case = data["case"]
        try:
            verdict = Verdict(data.get("verdict"))
        except ValueError:
            raise RunDiffError(f"{source}: case {case}: no verdict qgather knows ({data.get('verdict')!r})") from None
        if not isinstance(data.get("passed"), bool):
            raise RunDiffError(f"{source}: case {case}: no `passed` (true or false) in its record")
        reason = str(data.get("reason") or "")
        return cls(case, str(data.get("implementation") or UNKNOWN), str(data.get("format") or UNKNOWN),
                   data.get("world_size") or UNKNOWN, verdict, data["passed"], reason,
                   evidence(reason, str(data.get("report") or "")))


# Run-specific text in a case report: what two runs of the same code on the same data may differ in.
# Stacks and tracebacks go whole: where a waiting rank stood when another died is timing, and a
# traceback's line numbers move with every release of the library (its error itself is a line of its own).
_BLOCK_HEAD = re.compile(r"(stack \(innermost first\)|traceback \(last lines\)):$")
# A rank sampled between Python frames (waiting in C, or exiting) has "no Python stack": timing, as a stack is.
_WHERE_WAITING = re.compile(r"^rank \d+: (main thread at: |no Python stack$)")
_DEATH = re.compile(r"rank (\d+) (?:killed by|exited)")
_AFTER_A_CRASH = re.compile(r" \(then ranks? [\d,]+ .*$")  # what the others raised once a rank died: timing
_VENV_PATH = re.compile(r"\S*/(?:site|dist)-packages/")
_SOCKET = re.compile(r"\[?\d{1,3}(?:\.\d{1,3}){3}\]?:\d+")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_PID = re.compile(r"\b(pid|process) \d+")
_SECONDS = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|ms)\b")
# how many graphs a compiled case compiled itself: those an earlier case on the same pool left warm it reuses
_GRAPHS = re.compile(r"\b\d+ graph\(s\) compiled for the case")


def evidence(reason: str, report: str) -> tuple[str, ...]:
    """What a case's report says happened, comparable across runs: the reason, then the report's
    evidence lines (per-rank errors, differing buffers and counts, bytes sent) without its head (the
    id, verdict and reason again), its `reproduce:` line, its stacks and tracebacks, and with paths into
    a venv, sockets, addresses, pids, durations and a compiled case's count of graphs masked."""
    kept, block_indent = [], None
    for line in report.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        if block_indent is not None and indent > block_indent:
            continue
        block_indent = None
        text = line.strip()
        if _BLOCK_HEAD.search(text):
            block_indent = indent
        elif text and not text.startswith("reproduce:") and not _WHERE_WAITING.match(text):
            kept.append(_normalized(text))
    return (_normalized(_crash_in_rank_order(_AFTER_A_CRASH.sub("", reason))), *kept)


def _crash_in_rank_order(reason: str) -> str:
    """`CRASH: rank 3 killed by SIGABRT; rank 1 killed by SIGABRT` in rank order: which dying rank was
    noticed first is timing."""
    head, sep, deaths = reason.partition("CRASH: ")
    parts = deaths.split("; ")
    if not sep or not all(_DEATH.match(p) for p in parts):
        return reason
    return head + sep + "; ".join(sorted(parts, key=lambda p: int(_DEATH.match(p).group(1))))


def _normalized(line: str) -> str:
    line = _VENV_PATH.sub("<site>/", line)
    line = _SOCKET.sub("<socket>", line)
    line = _ADDRESS.sub("0x<address>", line)
    line = _PID.sub(r"\1 <pid>", line)
    line = _GRAPHS.sub("<n> graph(s) compiled for the case", line)
    return _SECONDS.sub("<seconds>", line)


@dataclass(frozen=True)
class RunView:
    """One run as a comparison sees it: where it came from, its environment, its cases by id."""

    source: str  # the path as given
    environment: tuple[tuple[str, str], ...]  # (label, value), ENVIRONMENT_KEYS' order
    cases: Mapping[str, CaseEntry]

    @classmethod
    def from_json(cls, data: Any, source: str) -> RunView:
        """The run of a verdicts.json's content; RunDiffError (one line naming `source`) when it is not
        one, is of an interrupted run, or lists a case id twice."""
        if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
            raise RunDiffError(f"{source}: not a qgather verdicts.json (no list of cases; a run's --report-dir "
                               "writes one)")
        if data.get("incomplete"):
            raise RunDiffError(f"{source}: an interrupted run ({len(data['cases'])} of "
                               f"{data.get('collected_cases') or '?'} cases): rerun it to completion first")
        cases: dict[str, CaseEntry] = {}
        for record in data["cases"]:
            entry = CaseEntry.from_record(record, source)
            if entry.case in cases:
                raise RunDiffError(f"{source}: case {entry.case} is listed twice")
            cases[entry.case] = entry
        return cls(source, _environment(data), cases)


def _environment(data: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    places = [p for p in (data.get("environment"), data.get("session"), data) if isinstance(p, dict)]
    shown = []
    for key, label in ENVIRONMENT_KEYS:
        value = next((p[key] for p in places if key in p), UNKNOWN)
        if isinstance(value, list):
            value = ", ".join(f"{n} x {name}" for name, n in Counter(map(str, value)).items()) or "no GPU"
        shown.append((label, str(value)))
        if key == "backend":  # what `auto` came to: where the cases' ranks ran
            shown.append(("ran on", _ran_on(data["cases"])))
    return tuple(shown)


def _ran_on(cases: list[dict[str, Any]]) -> str:
    """`gloo/cpu 2900, virtual 158`: where the cases' ranks ran (CaseRecord.ran_on), most first."""
    counts = Counter(str(c.get("ran_on")) for c in cases if isinstance(c, dict) and c.get("ran_on"))
    return ", ".join(f"{where} {n}" for where, n in counts.most_common()) or UNKNOWN


@dataclass(frozen=True)
class CaseChange:
    """One case id of either run and what became of it."""

    case: str
    change: Change
    before: CaseEntry | None  # None: only after
    after: CaseEntry | None  # None: only before

    @property
    def group(self) -> tuple[str, str, int | str]:
        entry = self.after or self.before
        assert entry is not None  # a change has at least one side
        return entry.group

    def describe(self) -> str:
        """One line: `EXACT -> SILENT_MISMATCH: <reason after>`, or the evidence's first difference."""
        if self.before is None or self.after is None:
            entry = self.before or self.after
            assert entry is not None
            return f"{entry.verdict.value}" + (f": {entry.reason}" if entry.reason else "")
        if self.change is Change.EVIDENCE_CHANGED:
            old, new = first_difference(self.before.evidence, self.after.evidence)
            verdict = self.after.verdict.value
            named = f"{verdict}: " if not old.startswith(verdict) else ""  # a CRASH's reason names it
            return f"{named}{old or '(nothing)'} -> {new or '(nothing)'}"
        reason = self.after.reason or self.before.reason
        return f"{self.before.verdict.value} -> {self.after.verdict.value}" + (f": {reason}" if reason else "")


def first_difference(before: tuple[str, ...], after: tuple[str, ...]) -> tuple[str, str]:
    """The first evidence line that differs, on each side ("" where that side has no more lines)."""
    for index in range(max(len(before), len(after))):
        old = before[index] if index < len(before) else ""
        new = after[index] if index < len(after) else ""
        if old != new:
            return old, new
    return "", ""


def classify(before: CaseEntry, after: CaseEntry) -> Change:
    """What became of a case both runs have."""
    if before.failed and not after.failed and after.verdict is not Verdict.SKIPPED:
        return Change.FIXED
    if after.failed and not before.failed:
        return Change.REGRESSED
    if before.verdict is not after.verdict:
        return Change.VERDICT_CHANGED
    if before.evidence != after.evidence:
        return Change.EVIDENCE_CHANGED
    return Change.UNCHANGED


@dataclass(frozen=True)
class RunDiff:
    """Every case id of two runs with its change, ordered by group (implementation, format, world size), then id."""

    before: RunView
    after: RunView
    changes: tuple[CaseChange, ...]

    def count(self, change: Change) -> int:
        return sum(1 for c in self.changes if c.change is change)

    def counts(self) -> dict[Change, int]:
        """Every change, in Change's order, with how many case ids it has (zeros included)."""
        return {change: self.count(change) for change in Change}

    @property
    def common(self) -> int:
        """How many case ids both runs have: the comparison's scope."""
        return sum(1 for c in self.changes if c.change not in LEFT_OUT)

    def of(self, change: Change) -> list[CaseChange]:
        return [c for c in self.changes if c.change is change]

    def failing(self, fail_on: Iterable[Change]) -> list[CaseChange]:
        """The case ids whose change is one of `fail_on`: the comparison fails when there is any."""
        wanted = set(fail_on)
        return [c for c in self.changes if c.change in wanted]

    def groups(self) -> dict[tuple[str, str, int | str], Counter[Change]]:
        """implementation x format x world size -> how many case ids of each change."""
        out: dict[tuple[str, str, int | str], Counter[Change]] = {}
        for c in self.changes:
            out.setdefault(c.group, Counter())[c.change] += 1
        return out


def compare(before: RunView, after: RunView) -> RunDiff:
    """Every case id of either run with what became of it; RunDiffError when no id is in both (two
    runs of different suites: nothing to compare)."""
    ids = set(before.cases) | set(after.cases)
    if not set(before.cases) & set(after.cases):
        raise RunDiffError(f"{before.source} and {after.source} have no case id in common "
                           f"({len(before.cases)} and {len(after.cases)} cases): nothing to compare")
    changes = [_change(case, before.cases.get(case), after.cases.get(case)) for case in ids]
    changes.sort(key=lambda c: (_sortable(c.group), c.case))
    return RunDiff(before, after, tuple(changes))


def _change(case: str, before: CaseEntry | None, after: CaseEntry | None) -> CaseChange:
    if after is None:
        return CaseChange(case, Change.ONLY_BEFORE, before, None)
    if before is None:
        return CaseChange(case, Change.ONLY_AFTER, None, after)
    return CaseChange(case, classify(before, after), before, after)


def _sortable(group: tuple[str, str, int | str]) -> tuple:
    impl, fmt, world_size = group
    return impl, fmt, (0, world_size, "") if isinstance(world_size, int) else (1, 0, str(world_size))
