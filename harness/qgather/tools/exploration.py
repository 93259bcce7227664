"""The search behind `qgather sweep` (qgather.cli.sweep): a lattice of candidate shapes and
world sizes, explored cheap-first, failures grouped by (verdict, signature), each group shrunk to a
minimal case.

Candidates (rows, cols, world size) come from the format's row block b: rows below and around
every multiple of b (b-1, b, b+1, k*b +- 2), shards just off a block at each world size
(ws * (b +- 1), e.g. 136 = 8 x 17 for NVFP4), and every small row count (rows < world size,
zero-row ranks, odd rows). Cheap first: every candidate runs in the `virtual` scenario (all ranks
in one process). Then the real scenario runs on the warm rank pools: once for each virtual group's
representative (confirmation), then over the candidates virtual passed, smallest first, because
virtual emulates only the first all-gather and cannot see a bug of the optimizer-step path or
of the real collective. The default real scenario is `steps`: the first FSDP2 all-gather (the
`gather` scenario's stage, "unshard 1"), then optimizer steps, re-quantized shards and re-gathers.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TextIO

from qgather.engine.run import run_case
from qgather.model.case import CaseSpec
from qgather.model.records import STANDS_FOR
from qgather.model.report import CaseReport
from qgather.tools.arguments import MAX_REAL_WORLD

PROGRESS_EVERY = 50  # non-TTY: a line every this many cases ...
PROGRESS_SECONDS = 5.0  # ... or this many seconds, whichever comes first


@dataclass(frozen=True, order=True)
class Point:
    """One candidate of the lattice; the order is the shrink order (world size, rows, cols)."""

    world_size: int
    rows: int
    cols: int


GroupKey = tuple[str, str]  # (verdict, signature)


def signature(report: CaseReport) -> str:
    """The report's stage and finding with numbers masked. The stage is the report's field, read as
    the stage it stands for (the virtual scenario's emulates the first unshard: STANDS_FOR), so that
    virtual and real failures of the first gather group together."""
    if not report.stage:
        return re.sub(r"\d+", "#", report.reason)
    return re.sub(r"\d+", "#", f"{STANDS_FOR.get(report.stage, report.stage)}: {report.finding}")


def group_key(report: CaseReport) -> GroupKey | None:
    """The failure group of a report; None when it passed (or was skipped)."""
    if report.passed:
        return None
    return report.verdict.value, signature(report)


# ------------------------------------------------------------------ the candidate lattice
def candidate_rows(row_block: int, world_sizes: list[int], max_rows: int) -> list[int]:
    b = row_block
    rows = set(range(1, 2 * max(world_sizes) + 2))  # rows < world size, zero-row ranks, odd rows
    for k in range(1, max_rows // b + 2):
        rows.update(k * b + d for d in (-2, -1, 0, 1, 2))
    for ws in world_sizes:
        rows.update(ws * (b + d) for d in (-2, -1, 0, 1, 2))
    return sorted(r for r in rows if 1 <= r <= max_rows)


def shrink_cols(cols: list[int], k_multiple: int, current: int) -> list[int]:
    """Column counts to try below `current`: the sweep's own and the format's smallest K values."""
    k = max(k_multiple, 1)
    options = {*cols, k, 2 * k, 16, 32}
    return sorted(c for c in options if c < current and c % k == 0)


@dataclass
class Lattice:
    rows: list[int]
    cols: list[int]
    world_sizes: list[int]
    k_multiple: int = 1

    def points(self) -> list[Point]:
        return sorted(Point(ws, r, c) for ws in self.world_sizes for r in self.rows for c in self.cols)

    def smaller(self, point: Point, axis: str) -> list[Point]:
        """Points one axis below `point`, smallest first (the greedy shrink scans them in order)."""
        if axis == "world_size":
            return [replace(point, world_size=w) for w in self.world_sizes if w < point.world_size]
        if axis == "rows":
            return [replace(point, rows=r) for r in self.rows if r < point.rows]
        return [replace(point, cols=c) for c in shrink_cols(self.cols, self.k_multiple, point.cols)]


# ------------------------------------------------------------------ progress
class Progress:
    """A \\r-updated bar with ETA and verdict counts on a TTY; plain lines otherwise."""

    def __init__(self, stream: TextIO, tty: bool | None = None, every: int = PROGRESS_EVERY,
                 seconds: float = PROGRESS_SECONDS) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.every, self.seconds = every, seconds
        self.phase, self.total, self.done = "", 0, 0
        self.counts: Counter[str] = Counter()
        self.started = self.last = 0.0
        self.width = 0  # of the last \r line, to blank what a shorter one leaves behind

    def start(self, phase: str, total: int) -> None:
        self.phase, self.total, self.done = phase, total, 0
        self.counts = Counter()
        self.started = self.last = time.monotonic()

    def update(self, verdict: str) -> None:
        self.done += 1
        self.counts[verdict] += 1
        now = time.monotonic()
        if self.tty:
            self._rewrite(f"{self._bar()} {self._status(now)}")
        elif self.done % self.every == 0 or now - self.last >= self.seconds:
            self._write(f"sweep: {self._status(now)}\n")
            self.last = now

    def finish(self, note: str = "") -> None:
        status = self._status(time.monotonic(), eta=False) + (f" ({note})" if note else "")
        if self.tty:
            self._rewrite(f"{self._bar()} {status}")
            self._write("\n")
            self.width = 0
        else:
            self._write(f"sweep: {status}\n")

    def _rewrite(self, line: str) -> None:
        self._write("\r" + line.ljust(self.width))
        self.width = len(line)

    def _bar(self, width: int = 24) -> str:
        filled = width * self.done // self.total if self.total else width
        return "[" + "#" * filled + "." * (width - filled) + "]"

    def _status(self, now: float, eta: bool = True) -> str:
        elapsed = now - self.started
        text = f"{self.phase} {self.done}/{self.total} {elapsed:.1f}s"
        if eta and self.done:
            text += f" ETA {elapsed / self.done * (self.total - self.done):.0f}s"
        counts = ", ".join(f"{v} {n}" for v, n in sorted(self.counts.items()))
        return f"{text}: {counts}" if counts else text

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


# ------------------------------------------------------------------ running cases
@dataclass
class Group:
    key: GroupKey
    source: str  # the scenario that found it first: "virtual" or the real one
    points: list[Point] = field(default_factory=list)
    confirmation: CaseReport | None = None  # the real run of the virtual representative
    minimal: CaseReport | None = None
    shrink_complete: bool = True

    @property
    def verdict(self) -> str:
        return self.key[0]

    @property
    def signature(self) -> str:
        return self.key[1]


class Runner:
    """Runs (and remembers) the cases of one implementation, format, dtype and seed."""

    def __init__(self, impl: str, fmt: str, dtype: str, seed: int, real: str, options) -> None:
        self.impl, self.fmt, self.dtype, self.seed, self.real = impl, fmt, dtype, seed, real
        self.options = options
        self.reports: dict[tuple[Point, str], CaseReport] = {}

    def spec(self, point: Point, scenario: str) -> CaseSpec:
        return CaseSpec(self.impl, self.fmt, (point.rows, point.cols), self.dtype, point.world_size, scenario,
                        self.seed)

    def run(self, point: Point, scenario: str) -> CaseReport:
        key = (point, scenario)
        if key not in self.reports:
            self.reports[key] = run_case(self.spec(point, scenario), self.options)
        return self.reports[key]

    def reproduces(self, point: Point, group: Group) -> CaseReport | None:
        """The report of `point` in `group`, virtual first; the real scenario only for a group that
        virtual cannot show."""
        if point.world_size > MAX_REAL_WORLD and group.source != "virtual":
            return None
        report = self.run(point, "virtual")
        if group_key(report) == group.key:
            return report
        if group.source == "virtual" or point.world_size > MAX_REAL_WORLD:
            return None
        report = self.run(point, self.real)
        return report if group_key(report) == group.key else None


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() >= self.end


@dataclass
class SweepResult:
    groups: list[Group]
    explored: dict[str, tuple[int, int]]  # phase -> (cases run, candidates)
    budget_hit: bool


def explore(runner: Runner, lattice: Lattice, budget_s: float, progress: Progress,
            virtual: bool = True) -> SweepResult:
    """Virtual over every candidate, then the real scenario (confirmations, then the rest);
    then each group shrunk. Exploration stops at `budget_s`; confirming and shrinking get at most
    another `budget_s`."""
    deadline = Deadline(budget_s)
    groups: dict[GroupKey, Group] = {}
    points = lattice.points()
    explored: dict[str, tuple[int, int]] = {}
    if virtual:
        explored["virtual"] = _phase(runner, points, "virtual", groups, deadline, progress)
    real_points = [p for p in points if p.world_size <= MAX_REAL_WORLD]
    virtual_failed = {p for g in groups.values() for p in g.points}
    _confirm(runner, list(groups.values()), groups, deadline)
    todo = [p for p in real_points if p not in virtual_failed]
    explored[runner.real] = _phase(runner, todo, runner.real, groups, deadline, progress)
    budget_hit = any(done < total for done, total in explored.values())
    shrink_deadline = Deadline(budget_s)
    for group in groups.values():
        shrink(runner, lattice, group, shrink_deadline)
    return SweepResult(sorted(groups.values(), key=lambda g: g.minimal.spec.id), explored, budget_hit)


def _phase(runner: Runner, points: list[Point], scenario: str, groups: dict[GroupKey, Group],
           deadline: Deadline, progress: Progress) -> tuple[int, int]:
    progress.start(scenario, len(points))
    done = 0
    for point in points:
        if deadline.passed():
            break
        report = runner.run(point, scenario)
        done += 1
        progress.update(report.verdict.value)
        _record(groups, report, point, scenario)
    progress.finish("budget reached" if done < len(points) else "")
    return done, len(points)


def _record(groups: dict[GroupKey, Group], report: CaseReport, point: Point, scenario: str) -> None:
    key = group_key(report)
    if key is None:
        return
    group = groups.setdefault(key, Group(key, scenario))
    group.points.append(point)


def _confirm(runner: Runner, virtual_groups: list[Group], groups: dict[GroupKey, Group],
             deadline: Deadline) -> None:
    """The real scenario on each virtual group's smallest point; a different failure there is a
    group of its own."""
    for group in virtual_groups:
        point = min(group.points)
        if point.world_size > MAX_REAL_WORLD or deadline.passed():
            continue
        group.confirmation = runner.run(point, runner.real)
        key = group_key(group.confirmation)
        if key is not None and key != group.key:
            _record(groups, group.confirmation, point, runner.real)


def shrink(runner: Runner, lattice: Lattice, group: Group, deadline: Deadline) -> None:
    """Greedy over the lattice, to a fixed point: the smallest world size, then the fewest rows, then
    the fewest cols at which the case still fails in the same group (verdict and signature)."""
    current = min(group.points)
    report = runner.reproduces(current, group) or _first_report(runner, current, group)
    changed = True
    while changed:
        changed = False
        for axis in ("world_size", "rows", "cols"):
            for candidate in lattice.smaller(current, axis):
                if deadline.passed():
                    group.shrink_complete = False
                    group.minimal = _final(runner, current, report, group)
                    return
                found = runner.reproduces(candidate, group)
                if found is not None:
                    current, report, changed = candidate, found, True
                    break
    group.minimal = _final(runner, current, report, group)


def _first_report(runner: Runner, point: Point, group: Group) -> CaseReport:
    scenario = "virtual" if group.source == "virtual" else runner.real
    return runner.run(point, scenario)


def _final(runner: Runner, point: Point, report: CaseReport, group: Group) -> CaseReport:
    """The minimal case as the real scenario shows it, when it does (virtual-only groups keep the
    virtual case)."""
    if report.spec.scenario != "virtual" or point.world_size > MAX_REAL_WORLD:
        return report
    if group.source == "virtual" and group.confirmation is not None and group_key(group.confirmation) != group.key:
        return report  # the real scenario did not confirm this group
    real = runner.run(point, runner.real)
    return real if group_key(real) == group.key else report
