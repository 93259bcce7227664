"""The `qgather` fixture: runs cases for a test, records each one's `CaseRecord` on the test's
report, and turns a checked case's verdict into the test's outcome.

A record rides on `item.user_properties` (the channel `record_property` uses, which xdist carries
to the controller) under RECORD_KEY, as `CaseRecord.to_dict()`; the controller's recorder takes it
off before JUnit sees the properties. A checked case also gets the JUnit properties `verdict`,
`repro` and `report`; a case run without being checked gets one `ran` property.
"""

from __future__ import annotations

import dataclasses

import pytest

from qgather.engine.run import run_case
from qgather.model.case import CaseSpec
from qgather.model.case_record import CaseRecord, KnownIssue
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.baseline import match
from qgather.pytest_plugin.options import Settings, settings

RECORD_KEY = "qgather_record"  # the user property that carries a CaseRecord dict


class QgatherFixture:
    """Runs cases under the session's options (--device, --backend, --case-timeout, --baseline)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.settings: Settings = settings(request.config)

    def run(self, case: CaseSpec | str) -> CaseReport:
        """Run a case and return its report; the test decides what the verdict means (the case is
        recorded, but the test's outcome is not the case's).

        Args:
            case: a CaseSpec or a case id.

        Returns:
            The case's CaseReport.
        """
        report, record = self._run(case)
        self._add(record, [("ran", f"{record.case}: {record.verdict.value}")])
        return report

    def check(self, case: CaseSpec | str) -> CaseReport:
        """Run a case and make its verdict this test's outcome: skip on SKIPPED, fail with the case
        report unless the policy accepts the verdict; under --baseline, xfail a listed failure and
        fail a listed case that passes (the entry is stale).

        Args:
            case: a CaseSpec or a case id.

        Returns:
            The case's CaseReport, when the test goes on (the verdict passes).

        Example:
            >>> def test_gather(case, qgather):
            ...     qgather.check(case)
        """
        report, record = self._run(case)
        issue = None if report.verdict is Verdict.SKIPPED else match(self.settings.baseline, report.spec.id)
        record = dataclasses.replace(record, checked=True, known_issue=issue)
        # Separate properties, so that a JUnit reader shows each (junit.xml <properties>).
        self._add(record, [("verdict", record.verdict.value), ("repro", record.repro), ("report", record.report)])
        if report.verdict is Verdict.SKIPPED:
            pytest.skip(report.reason)
        if issue is not None:
            if report.passed:
                pytest.fail(self._stale(report, issue), pytrace=False)
            link = f" ({issue.link})" if issue.link else ""
            pytest.xfail(f"known issue: {issue.reason}{link} - {report.verdict.value}: {report.reason}")
        if not report.passed:
            pytest.fail(record.report, pytrace=False)
        return report

    def _run(self, case: CaseSpec | str) -> tuple[CaseReport, CaseRecord]:
        spec = CaseSpec.parse(case) if isinstance(case, str) else case
        report = run_case(spec, self.settings.run)
        return report, CaseRecord.build(report, self.settings.run)

    def _add(self, record: CaseRecord, properties: list[tuple[str, str]]) -> None:
        self.request.node.user_properties.extend([(RECORD_KEY, record.to_dict()), *properties])

    def _stale(self, report: CaseReport, issue: KnownIssue) -> str:
        path = self.settings.baseline_path
        return (f"{report.spec.id}: {report.verdict.value}, which passes, but the baseline {path} lists it as a known "
                f"issue ({issue.case}: {issue.reason}). Update the baseline: remove the entry, or "
                + self.settings.stale_baseline_update())


@pytest.fixture
def qgather(request: pytest.FixtureRequest) -> QgatherFixture:
    """Runs qgather cases in a test: `qgather.check(case)` makes the case's verdict the test's outcome,
    `qgather.run(case)` returns its report for the test to judge.

    Example:
        >>> from qgather.suite.sweeps import Sweep
        >>> SWEEP = Sweep(scenarios=("gather",), formats=("nvfp4_2d",))   # parametrizes `case`
        >>> def test_gather(case, qgather):
        ...     qgather.check(case)
    """
    return QgatherFixture(request)
