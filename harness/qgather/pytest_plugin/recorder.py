"""The session's records, kept by the process that reports (the xdist controller, or the only
process): a `Recorder` registered in pytest_configure and stored on `config.stash[recorder_key]`,
the way pytest's junitxml keeps its LogXML. It reads every test report once, takes the case
records off it (before JUnit writes the properties), counts each report where pytest's final line
counts it, and at the end writes the reports and prints the summary from one `RunResults`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Generator

import pytest

from qgather.model.case_record import CaseRecord, Outcome
from qgather.model.report_folder import remove_older
from qgather.model.verdict import Verdict
from qgather.pytest_plugin import placement
from qgather.pytest_plugin.collection import case_in
from qgather.pytest_plugin.fixture import RECORD_KEY
from qgather.pytest_plugin.options import Settings
from qgather.pytest_plugin.reports import build as build_reports
from qgather.pytest_plugin.reports import drop_nameless_testcases, write_text
from qgather.pytest_plugin.reports import write as write_reports
from qgather.pytest_plugin.results import Row, RunResults
from qgather.pytest_plugin.summary import coverage_of
from qgather.pytest_plugin.summary import write as write_summary
from qgather.pytest_plugin.timings import render as render_timings
from qgather.runtime.spec import visible_gpus
from qgather.suite.coverage import markdown as coverage_markdown

JSON_EVERY_S = 1.0  # --qgather-json is rewritten at most this often while cases finish, and at the end


@dataclasses.dataclass
class _Checked:
    """The report that decided a case's outcome (the worse, when tests checked the id twice)."""

    record: CaseRecord
    category: str


def report_outcome(report: pytest.TestReport) -> Outcome:
    """pytest's outcome of a test's call (a closed set: a report is passed, failed or skipped)."""
    if hasattr(report, "wasxfail"):
        return Outcome.XFAILED if report.skipped else Outcome.XPASSED
    return Outcome(report.outcome)


def is_case_test(nodeid: str) -> bool:
    """A test parametrized with one case."""
    return case_in(nodeid) is not None


class Recorder:
    """Collects the session's case records and counts; writes verdicts.json/md and --qgather-json."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self._checked: dict[str, _Checked] = {}
        self._also_ran: dict[str, CaseRecord] = {}
        self._case_tests: set[str] = set()
        self._other_tests: set[str] = set()
        self._failing_other: list[str] = []
        self._rows: dict[Row, Counter[str]] = {row: Counter() for row in Row}
        self._json_written = 0.0
        self.ran_nothing: dict[str, str] = {}
        self.unplaced: list[CaseRecord] = []  # a GPU job's cases skipped for want of GPUs (placement)
        # the case tests to run (M of "interrupted after N of M cases"), known once collection finished
        # (deselection included): None while collecting, when an interrupt leaves M unknown
        self.collected_cases: int | None = None
        self._started = time.time()  # a report file older than this is an earlier run's

    # ------------------------------------------------------------------ hooks
    @pytest.hookimpl(tryfirst=True)  # before junitxml's: the record is not a property for junit.xml
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Take the case records off the report, and count the report where pytest counts it."""
        records = [CaseRecord.from_dict(v) for k, v in report.user_properties if k == RECORD_KEY]
        if records:
            report.user_properties = [(k, v) for k, v in report.user_properties if k != RECORD_KEY]
        category = self._category(report)
        if report.when == "call":  # the records of a test's cases, made while it ran
            checked = [r for r in records if r.checked]
            if len(checked) == 1:  # one case each: the test's outcome is the case's
                self._case_tests.add(report.nodeid)
                self._check(checked[0], report, category)
                records = [r for r in records if not r.checked]
            for record in records:  # run without being checked (or several checked by one test)
                self._also_ran.setdefault(record.case, dataclasses.replace(record, checked=False))
            if len(checked) == 1:
                return
        if category:
            row = Row.AROUND if report.nodeid in self._case_tests else Row.OTHER
            self._count(row, category, report.nodeid, report.failed)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A collection error or a skipped module counts in pytest's final line too."""
        if report.failed:
            self._count(Row.OTHER, "error", report.nodeid, True)
        elif report.skipped:
            self._count(Row.OTHER, "skipped", report.nodeid, False)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Generator[None, object, object]:
        """How many case tests this process collected (without xdist: all of them), counted only once the
        collection finished: pytest's collection-finish hook runs on an interrupt too, with the items
        collected so far or not yet deselected (13288 where the run had 2466)."""
        result = yield
        if not session.config.pluginmanager.has_plugin("dsession"):  # xdist's controller collects nothing
            self.collected_cases = sum(1 for item in session.items if is_case_test(item.nodeid))
        return result

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not loaded
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        """Under xdist: every worker collects the whole session; the first one's count is the session's."""
        if self.collected_cases is None:
            self.collected_cases = sum(1 for nodeid in ids if is_case_test(nodeid))

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, None, None]:
        """Before the other hooks: fail a run in which a named implementation ran nothing (so that
        a launched job's ranks agree on that exit status). After them: write the reports."""
        self.interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
        self._gate(session)
        if self.interrupted:
            self._junit_says_incomplete()
        if self.settings.report_dir and not self._writes_reports():
            self._keep_last_junit()
        yield
        self._write_json(force=True)
        xml = self.config.option.xmlpath
        if self.interrupted and xml and os.path.isfile(xml):
            drop_nameless_testcases(xml)
        if self._writes_reports():
            self._junit_into_folder()
            results = self.results()
            data = build_reports(results, self.settings, session)
            data["incomplete"] = self.interrupted
            data["collected_cases"] = self.collected_cases
            write_reports(self.settings.report_dir, data)
            cov = coverage_of(results)
            if cov is not None:
                write_text(os.path.join(self.settings.report_dir, "coverage.md"), coverage_markdown(cov))
            if results.cases or results.also_ran:
                write_text(os.path.join(self.settings.report_dir, "timings.md"),
                           render_timings((*results.cases, *results.also_ran)))
            remove_older(self.settings.report_dir, self._started)  # one run, one report folder

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """The ran-nothing gate's reason, with --qgather-summary the verdicts reconciled with
        pytest's final line, the interruption, the coverage's broken promises, where the reports are."""
        write_summary(terminalreporter, self.results(), verdicts=self.settings.summary,
                      reports=self.report_files(), interrupted=self.interrupted_line())

    # ------------------------------------------------------------------ interruption and files
    interrupted = False

    def interrupted_line(self) -> str:
        """`qgather: interrupted after N of M cases` when the session was interrupted, else ""."""
        if not self.interrupted:
            return ""
        ran = len(self._checked)
        if self.collected_cases is None:
            return "qgather: interrupted while collecting the cases, before any ran"
        return f"qgather: interrupted after {ran} of {max(self.collected_cases, ran)} cases"

    def report_files(self) -> list[str]:
        """The report directory and the files this session writes there ([] without --report-dir)."""
        directory = self.settings.report_dir
        if not self._writes_reports():
            return []
        files = ["verdicts.md", "verdicts.json"]
        if self.config.option.xmlpath:  # written there, or copied there from where --junitxml names
            files.append("junit.xml")
        if self._checked or self._also_ran:
            files += ["coverage.md", "timings.md"]
        return [directory.rstrip("/") + "/", *files]

    def _writes_reports(self) -> bool:
        """Whether this session writes the report directory: asked for, and some test ran or the run was
        interrupted (its reports say incomplete); a run that ran nothing, e.g. a -k that matches nothing,
        leaves the last run's reports as they were."""
        if not self.settings.report_dir or self.config.option.collectonly:
            return False
        ran = self._checked or self._also_ran or any(sum(c.values()) for c in self._rows.values())
        return bool(ran or self.interrupted)

    def _junit_says_incomplete(self) -> None:
        """An interrupted run's junit.xml carries `incomplete` as a property of its suite (pytest's LogXML
        writes it after this hook's first half)."""
        from _pytest.junitxml import xml_key  # pytest's own key for its LogXML plugin (pytest >= 7)

        xml = self.config.stash.get(xml_key, None)
        if xml is not None:
            xml.add_global_property("incomplete", self.interrupted_line().removeprefix("qgather: "))

    def _junit_into_folder(self) -> None:
        """The report folder holds the run's junit.xml also when --junitxml names another path: a copy."""
        xml, folder = self.config.option.xmlpath, self.settings.report_dir
        inside = os.path.join(folder, "junit.xml")
        if xml and os.path.isfile(xml) and os.path.abspath(xml) != os.path.abspath(inside):
            shutil.copyfile(xml, inside)

    def _keep_last_junit(self) -> None:
        """Stop pytest's junitxml from writing the report directory's junit.xml over the last run's."""
        from _pytest.junitxml import xml_key  # pytest's own key for its LogXML plugin (pytest >= 7)

        xml = self.config.stash.get(xml_key, None)
        inside = xml is not None and os.path.dirname(os.path.abspath(xml.logfile)) == os.path.abspath(
            self.settings.report_dir)
        if inside:  # this hook call already holds junitxml's sessionfinish: it writes, to nowhere
            xml.logfile = os.devnull
            self.config.pluginmanager.unregister(xml)
            del self.config.stash[xml_key]

    # ------------------------------------------------------------------ records
    def results(self) -> RunResults:
        """The snapshot every report reads."""
        return RunResults(
            cases=tuple(c.record for c in self._checked.values()),
            also_ran=tuple(r for case, r in self._also_ran.items() if case not in self._checked),
            rows={row: dict(counts) for row, counts in self._rows.items()},
            other_tests=len(self._other_tests),
            failing_other_tests=tuple(self._failing_other),
            ran_nothing=dict(self.ran_nothing),
            unplaced=tuple(self.unplaced),
        )

    def _category(self, report: pytest.TestReport) -> str:
        """The category pytest's terminal counts the report under ("" for one it does not count)."""
        category = self.config.hook.pytest_report_teststatus(report=report, config=self.config)[0]
        return category if isinstance(category, str) else category[0]

    def _check(self, record: CaseRecord, report: pytest.TestReport, category: str) -> None:
        record = dataclasses.replace(record, outcome=report_outcome(report))
        old = self._checked.get(record.case)
        if old is None:
            self._checked[record.case] = _Checked(record, category)
            self._rows[Row.CASES][category] += 1  # a call report always has a category
        elif record.outcome.rank > old.record.outcome.rank:  # the worse outcome is the case's
            self._rows[Row.CASES][old.category] -= 1
            self._rows[Row.REPEATS][old.category] += 1
            self._checked[record.case] = _Checked(record, category)
            self._rows[Row.CASES][category] += 1
        else:
            self._rows[Row.REPEATS][category] += 1
        self._write_json()

    def _count(self, row: Row, category: str, nodeid: str, failed: bool) -> None:
        self._rows[row][category] += 1
        if row is Row.OTHER:
            self._other_tests.add(nodeid)
            if failed and nodeid not in self._failing_other:
                self._failing_other.append(nodeid)

    def _gate(self, session: pytest.Session) -> None:
        """Red instead of green: a gate on an implementation whose every case was skipped (TE
        missing, no GPU) tested nothing of it; a GPU job skipped a case its GPUs could run on NCCL."""
        records = [c.record for c in self._checked.values()] + list(self._also_ran.values())
        for impl in self.settings.impls if self.settings.impls_named else ():
            mine = [r for r in records if r.implementation == impl]
            if mine and all(r.verdict is Verdict.SKIPPED for r in mine):
                self.ran_nothing[impl] = mine[0].reason
        if self.settings.run.device_type() == "cuda":
            self.unplaced = placement.unplaced_on_gpus(records, len(visible_gpus()))
        if (self.ran_nothing or self.unplaced) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write_json(self, force: bool = False) -> None:
        """--qgather-json: every checked case's record, rewritten while the run goes, so that a run
        killed from outside (a CI or device time limit) still leaves the verdicts it finished."""
        path = self.settings.json_path
        now = time.monotonic()
        if not path or (not force and now - self._json_written < JSON_EVERY_S):
            return
        self._json_written = now
        partial = path + ".partial"
        with open(partial, "w") as fh:
            json.dump([c.record.to_dict() for c in self._checked.values()], fh, indent=1)
        os.replace(partial, path)


recorder_key = pytest.StashKey[Recorder]()
