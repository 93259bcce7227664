"""The terminal summary at the end of a session: the ran-nothing gate's reason, the coverage of the
cases run, and (--qgather-summary) the verdicts per implementation with the counts reconciled with
pytest's final line, then the first failures with the command that reruns each.
"""

from __future__ import annotations

import pytest

from qgather.model.case import CaseSpec, CaseSpecError
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.results import RunResults
from qgather.suite.coverage import measure, summary_lines

FAILURES_SHOWN = 20


def write(terminal: pytest.TerminalReporter, results: RunResults, verdicts: bool) -> None:
    """Everything qgather adds to pytest's terminal summary; the verdicts only when asked."""
    for impl, reason in results.ran_nothing.items():
        terminal.write_line(f"qgather: every {impl} case was skipped, so nothing of it was tested "
                            f"(first reason: {reason}); failing the run", red=True)
    _coverage(terminal, results)
    if verdicts and (results.cases or results.also_ran):
        terminal.section("qgather verdicts")
        for line in verdict_lines(results):
            terminal.write_line(line)


def verdict_lines(results: RunResults) -> list[str]:
    """The verdict table per implementation, the headline, pytest's counts row by row, the failures."""
    by_impl = results.by_implementation()
    present = [v.value for v in Verdict if any(c[v.value] for c in by_impl.values())]
    lines = [f"{'implementation':<28}" + "".join(f"{v:>18}" for v in present)]
    lines += [f"{impl:<28}" + "".join(f"{counts[v]:>18}" for v in present) for impl, counts in by_impl.items()]
    lines += [results.headline(), *_table(results.reconciliation())]
    if results.also_ran_line():
        lines.append(results.also_ran_line())
    for record in results.failures[:FAILURES_SHOWN]:
        stale = " (baseline stale)" if record.known_issue else ""
        lines.append(f"  {record.verdict.value + stale:<16} {record.case}  ({_first_line(record.reason)[:100]})")
        lines.append(f"    reproduce: {record.repro}")
    if len(results.failures) > FAILURES_SHOWN:
        lines.append(f"  ... and {len(results.failures) - FAILURES_SHOWN} more (--report-dir writes them all)")
    for nodeid in results.failing_other_tests[:FAILURES_SHOWN]:
        lines.append(f"  failed, not one case: {nodeid}")
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    width = max(len(r[0]) for r in rows)
    return ["  " + r[0].ljust(width) + "".join(f"{cell:>9}" for cell in r[1:]) for r in rows]


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _coverage(terminal: pytest.TerminalReporter, results: RunResults) -> None:
    """The coverage of the cases this session ran (`qgather coverage` prints the whole matrix)."""
    specs = []
    for record in (*results.cases, *results.also_ran):
        try:
            specs.append(CaseSpec.parse(record.case))  # coverage reads the shape, which only the spec holds
        except CaseSpecError:
            continue
    if not specs:
        return
    terminal.section("qgather coverage (format x buffer x regime x scenario x configuration)")
    for line in summary_lines(measure(specs)):
        terminal.write_line(line, red=line.lstrip().startswith("MISSING"))
