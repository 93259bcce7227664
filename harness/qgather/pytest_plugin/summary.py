"""The terminal summary at the end of a session: the ran-nothing gate's reason, (--qgather-summary)
the verdicts per implementation with the counts reconciled with pytest's final line and the first
failures with the command that reruns each, the coverage's broken promises (or one line saying none
is broken), and where the reports are.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from qgather.errors import first_line
from qgather.model.case import CaseSpec, CaseSpecError
from qgather.model.text import clip
from qgather.model.verdict import Verdict
from qgather.pytest_plugin import placement
from qgather.pytest_plugin.results import RunResults
from qgather.suite.coverage import Coverage, measure, promise_lines
from qgather.suite.memo import Memo

FAILURES_SHOWN = 20


def write(terminal: pytest.TerminalReporter, results: RunResults, verdicts: bool, reports: Sequence[str] = (),
          interrupted: str = "") -> None:
    """Everything qgather adds to pytest's terminal summary; the verdicts only when asked; `reports`:
    the report files this session writes (their directory first); `interrupted`: the interruption line."""
    for impl, reason in results.ran_nothing.items():
        terminal.write_line(f"qgather: every {impl} case was skipped, so nothing of it was tested "
                            f"(first reason: {reason}); failing the run", red=True)
    for record in results.unplaced[:FAILURES_SHOWN]:
        terminal.write_line(f"qgather: {record.case} was skipped although this host's GPUs can run it on NCCL "
                            f"({first_line(record.reason)}); failing the run", red=True)
    if verdicts and (results.cases or results.also_ran):
        terminal.section("qgather verdicts")
        for line in verdict_lines(results):
            terminal.write_line(line)
        for line in placement.table_lines(results.cases):
            terminal.write_line(line)
    if interrupted:
        terminal.write_line(interrupted, red=True)
    for line in coverage_lines(results, bool(interrupted)):
        terminal.write_line(line, red=line.lstrip().startswith("MISSING"))
    if reports:
        terminal.write_line(f"reports written to {reports[0]}: {', '.join(reports[1:])}")


def verdict_lines(results: RunResults) -> list[str]:
    """The verdict table per implementation, the headline, pytest's counts row by row, the failures."""
    by_impl = results.by_implementation()
    present = [v.value for v in Verdict if any(c[v.value] for c in by_impl.values())]
    lines = [f"{'implementation':<28}" + "".join(f"{v:>18}" for v in present)]
    lines += [f"{impl:<28}" + "".join(f"{counts[v]:>18}" for v in present) for impl, counts in by_impl.items()]
    lines += [results.headline(), *_table(results.reconciliation())]
    if results.other_tests_line():
        lines.append(results.other_tests_line())
    for record in results.failures[:FAILURES_SHOWN]:
        stale = " (baseline stale)" if record.known_issue else ""
        lines.append(f"  {record.verdict.value + stale:<16} {record.case}  ({clip(record.reason, 100)})")
        lines.append(f"    reproduce: {record.repro}")
    if len(results.failures) > FAILURES_SHOWN:
        lines.append(f"  ... and {len(results.failures) - FAILURES_SHOWN} more (--report-dir writes them all)")
    for nodeid in results.failing_other_tests[:FAILURES_SHOWN]:
        lines.append(f"  failed, other test: {nodeid}")
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    width = max(len(r[0]) for r in rows)
    return ["  " + r[0].ljust(width) + "".join(f"{cell:>9}" for cell in r[1:]) for r in rows]


def coverage_lines(results: RunResults, interrupted: bool) -> list[str]:
    """The summary's coverage lines: the promises of the cases that ran, or why there are none to
    judge (an interrupted run hit only what it reached; a run whose every case was SKIPPED hit nothing)."""
    records = (*results.cases, *results.also_ran)
    cov = coverage_of(results)
    if cov is None:
        return ["coverage: nothing hit, no case ran (every case was SKIPPED)"] if records else []
    if interrupted:
        ran = sum(1 for r in records if r.verdict is not Verdict.SKIPPED)
        return [f"coverage: not judged, the run was interrupted after {ran} cases ran (coverage.md: their cells)"]
    return promise_lines(cov)


def coverage_of(results: RunResults) -> Coverage | None:
    """The coverage of the cases this session ran, SKIPPED ones left out (None: none ran);
    `qgather coverage` prints a selection's whole matrix, the report directory holds this session's
    (coverage.md)."""
    specs = []
    for record in (*results.cases, *results.also_ran):
        if record.verdict is Verdict.SKIPPED:
            continue
        try:
            specs.append(CaseSpec.parse(record.case))  # coverage reads the shape, which only the spec holds
        except CaseSpecError:
            continue
    if not specs:
        return None
    kept = Memo()  # the designs' pairs, the same for every run of this source
    cov = measure(specs, memo=kept)
    kept.flush()
    return cov
