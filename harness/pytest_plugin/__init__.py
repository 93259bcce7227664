"""qgather's pytest integration: options, the `case` parametrization, the `qgather` fixture that
runs a case and records its verdict, and the verdict summary at the end of the session.

Test modules under cases/ (harness/suite/cases/ of an install) declare
`SWEEP = qgather.suite.sweeps.Sweep(...)` (or another qgather.suite.sweeps.SuiteSweep) and one test taking `case`
and `qgather`; the command-line options narrow every sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
from collections import Counter

import pytest

from qgather.engine.run import RunOptions, run_case
from qgather.model.case import CaseSpec
from qgather.model.options import options_problem
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.baseline import match
from qgather.pytest_plugin.reports import case_record
from qgather.runtime.launch import default_world_sizes, detect_launch
from qgather.suite.sweeps import Sweep

_REPORT_KEY = "qgather_report"


from qgather.quiet import quiet_torchao  # noqa: E402 - filter before torchao is first imported

quiet_torchao()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qgather", "quantized all-gather harness")
    group.addoption("--impl", action="append", default=None,
                    help="implementation(s) under test: reference, mutant:<bug>, torchao, te, or "
                         "package.module:object (repeat or comma-separate; default: reference)")
    group.addoption("--formats", default=None, help="comma-separated formats (default: all)")
    group.addoption("--world-sizes", default=None, help="comma-separated world sizes (default: the sweep's)")
    group.addoption("--scenarios", default=None,
                    help="comma-separated scenarios: gather, steps, reshard, hooks, virtual")
    group.addoption("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend (auto: nccl when each rank can have its own GPU)")
    group.addoption("--device", default="auto", choices=("auto", "cpu", "cuda"))
    group.addoption("--case-timeout", type=float, default=None,
                    help="seconds before a case is declared HANG (default: per backend)")
    group.addoption("--qgather-summary", action="store_true", help="print the verdict summary table")
    group.addoption("--qgather-json", default=None, help="write every case's verdict to this JSON file")
    group.addoption("--report-dir", default=None, metavar="DIR",
                    help="write verdicts.md (a CI job summary), verdicts.json and junit.xml to DIR")
    group.addoption("--exhaustive", action="store_true",
                    help="every sweep's full product (dtype x seed x configuration) instead of the pairwise "
                         "covering design; the extra cases are marked slow")
    group.addoption("--baseline", default=None, metavar="FILE",
                    help="known-issues TOML: listed failing cases are strict xfails, listed passing cases fail")


def _csv(value: str | None, cast=str):
    if not value:
        return None
    return [cast(v.strip()) for v in value.split(",") if v.strip()]


def _impls(config: pytest.Config) -> list[str]:
    raw = config.getoption("--impl") or ["reference"]
    return [name for item in raw for name in _csv(item)]


@pytest.hookimpl(tryfirst=True)  # before junitxml's, which reads config.option.xmlpath
def pytest_configure(config: pytest.Config) -> None:
    # also where no ini file registers it (an install): --exhaustive marks its extra cases slow
    config.addinivalue_line("markers", "slow: long sweeps (--exhaustive's extra cases); deselect with -m 'not slow'")
    _validate_options(config)
    global _JSON_PATH, _CONTROLLER, _QUIET_RANK
    _CONTROLLER = not _is_xdist_worker(config)
    launch = detect_launch()
    _QUIET_RANK = launch is not None and launch.rank != 0
    if _QUIET_RANK:  # one report per job: rank 0's (this rank's own failures go to stderr)
        _CONTROLLER = False
        config.pluginmanager.set_blocked("terminalreporter")
        config.option.xmlpath = None
        from qgather.runtime import external

        external.say = lambda text: _uncaptured(config, text)
    _JSON_PATH = config.getoption("--qgather-json") if _CONTROLLER else None
    _BASELINE[:] = _load_baseline(config)
    report_dir = config.getoption("--report-dir")
    if report_dir and not config.option.xmlpath and not config.option.collectonly and _CONTROLLER:
        config.option.xmlpath = os.path.join(report_dir, "junit.xml")


def _uncaptured(config: pytest.Config, text: str) -> None:
    """To this process's real stderr, even from inside a test (whose output pytest captures)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(text, file=sys.stderr, flush=True)


def _load_baseline(config: pytest.Config) -> list:
    path = config.getoption("--baseline")
    if not path:
        return []
    from qgather.pytest_plugin.baseline import BaselineError, load

    try:
        return load(path)
    except BaselineError as exc:
        raise pytest.UsageError(str(exc)) from None


def _validate_options(config: pytest.Config) -> None:
    from qgather.formats import FORMATS
    from qgather.impls import UnknownImplementationError, get_impl

    for fmt in _csv(config.getoption("--formats")) or []:
        if fmt not in FORMATS:
            raise pytest.UsageError(f"--formats: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        sizes = _csv(config.getoption("--world-sizes"), int) or []
    except ValueError:
        raise pytest.UsageError("--world-sizes takes comma-separated integers, e.g. 2,4,8") from None
    if any(ws < 1 for ws in sizes):
        raise pytest.UsageError(f"--world-sizes: a world size must be >= 1, got {sizes}")
    problem = options_problem(config.getoption("--case-timeout"), config.getoption("--device"),
                              config.getoption("--backend"))
    if problem:
        raise pytest.UsageError(problem)
    for name in _impls(config):
        try:
            get_impl(name)
        except UnknownImplementationError as exc:
            raise pytest.UsageError(f"--impl: {exc}") from None


_SWEEP_CASES = "qgather_sweep_cases"


def _is_xdist_worker(config: pytest.Config) -> bool:
    # Asked of the config, not the environment: a subprocess started by a test inherits
    # PYTEST_XDIST_WORKER from the worker that runs the test, but it is a session of its own.
    return hasattr(config, "workerinput")


def pytest_collection_finish(session: pytest.Session) -> None:
    """A --world-sizes selection that no sweep has would otherwise pass green with nothing run."""
    if _is_xdist_worker(session.config):
        return  # a worker cannot stop the session cleanly; `qgather run` checks before pytest starts
    sizes = _csv(session.config.getoption("--world-sizes"), int)
    counts = getattr(session.config, _SWEEP_CASES, None)
    if sizes and counts is not None and sum(counts) == 0:
        raise pytest.UsageError(f"--world-sizes {','.join(map(str, sizes))}: no case in the selected suite has "
                                "that world size")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    sweep = getattr(metafunc.module, "SWEEP", None)
    if sweep is None:
        return
    config = metafunc.config
    impls = getattr(metafunc.module, "IMPLS", None) or _impls(config)
    launch = detect_launch()
    # Under a launcher the job's sizes, not a one-host pool's; --world-sizes selects as it does without one.
    if (launch is not None and isinstance(sweep, Sweep) and "virtual" not in sweep.scenarios
            and not config.getoption("--world-sizes")):
        sweep = dataclasses.replace(sweep, world_sizes=default_world_sizes(launch.world_size))
    selection = dict(formats=_csv(config.getoption("--formats")),
                     world_sizes=_csv(config.getoption("--world-sizes"), int),
                     scenarios=_csv(config.getoption("--scenarios")))
    cases = sweep.cases(impls, **selection)
    default = {c.id for c in cases}
    if config.getoption("--exhaustive"):
        cases = sweep.cases(impls, exhaustive=True, **selection)
    setattr(config, _SWEEP_CASES, [*getattr(config, _SWEEP_CASES, []), len(cases)])
    marks = [getattr(pytest.mark, m) for m in sweep.marks]
    slow = [*marks, pytest.mark.slow]
    params = [pytest.param(c, id=c.id, marks=marks if c.id in default else slow) for c in cases]
    metafunc.parametrize("case", params)


class QgatherFixture:
    """Runs cases for a test and turns verdicts into pytest outcomes."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        config = request.config
        self.options = RunOptions(
            backend=config.getoption("--backend"),
            device=config.getoption("--device"),
            case_timeout=config.getoption("--case-timeout"),
        )

    def run(self, case: CaseSpec | str) -> CaseReport:
        spec = CaseSpec.parse(case) if isinstance(case, str) else case
        report = run_case(spec, self.options)
        self._record = case_record(report, self.options)
        # Separate properties so that a JUnit reader shows each (junit.xml <properties>).
        self.request.node.user_properties.extend([
            (_REPORT_KEY, self._record), ("verdict", report.verdict.value), ("repro", self._record["repro"]),
            ("report", report.render()),
        ])
        return report

    def check(self, case: CaseSpec | str) -> CaseReport:
        """Run a case; skip on SKIPPED, fail with the mismatch report unless the policy accepts it
        (or, under --baseline, xfail a listed failure and fail a listed case that passes)."""
        report = self.run(case)
        self._record["checked"] = True  # this test's outcome is this case's outcome
        if report.verdict is Verdict.SKIPPED:
            pytest.skip(report.reason)
        issue = match(_BASELINE, report.spec.id)
        if issue is not None:
            self._record["known_issue"] = issue.as_dict()
            if report.passed:
                pytest.fail(_stale_message(self.request.config, report, issue), pytrace=False)
            link = f" ({issue.link})" if issue.link else ""
            pytest.xfail(f"known issue: {issue.reason}{link} - {report.verdict.value}: {report.reason}")
        if not report.passed:
            pytest.fail(report.render(), pytrace=False)
        return report


def _stale_message(config: pytest.Config, report: CaseReport, issue) -> str:
    path, report_dir = config.getoption("--baseline"), config.getoption("--report-dir")
    update = f"qgather baseline update --from {os.path.join(report_dir or 'reports', 'verdicts.json')} --file {path}"
    if not report_dir:
        update = f"rerun with --report-dir reports, then `{update}`"
    return (f"{report.spec.id}: {report.verdict.value}, which passes, but the baseline {path} lists it as a known "
            f"issue ({issue.case}: {issue.reason}). Update the baseline: remove the entry, or "
            + (update if not report_dir else f"run `{update}`"))


@pytest.fixture
def qgather(request: pytest.FixtureRequest) -> QgatherFixture:
    return QgatherFixture(request)


@pytest.hookimpl(tryfirst=True)  # before junitxml's: the record is not a property for junit.xml
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    records = [value for key, value in report.user_properties if key == _REPORT_KEY]
    if _CONTROLLER and records:
        # Under xdist a worker's report carries the records to the controller: strip them there only.
        report.user_properties = [(k, v) for k, v in report.user_properties if k != _REPORT_KEY]
    if report.when != "call" and not (report.when == "setup" and report.skipped):
        return
    outcome = _outcome(report)
    for record in records:
        if record.get("checked"):
            record["outcome"] = outcome
        _RECORDS.append(record)
    if records:
        _write_json()
    if _QUIET_RANK and report.failed and not records:  # a case's shared verdict is rank 0's to report
        launch = detect_launch()
        where = f"job rank {launch.rank} on {launch.host}" if launch else "this rank"
        print(f"qgather: {where}: {report.nodeid} failed:\n{report.longreprtext}", file=sys.stderr, flush=True)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    from qgather.runtime.external import world_broken

    broken = world_broken()
    if broken:  # every rank knows it at the same case: they all stop here
        item.session.shouldfail = f"qgather: {broken}"


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    return report.outcome


# Verdict records of this process (under xdist, the controller's come from the workers' reports).
_RECORDS: list[dict] = []
_JSON_PATH: str | None = None
_CONTROLLER = True
_QUIET_RANK = False  # a rank other than 0 of a launched job
_BASELINE: list = []  # qgather.pytest_plugin.baseline.KnownIssue entries of --baseline


def _write_json() -> None:
    """Rewritten after every case, so that a run killed from outside (a CI or device time limit)
    still leaves the verdicts of every case it finished."""
    if not _JSON_PATH:
        return
    partial = _JSON_PATH + ".partial"
    with open(partial, "w") as fh:
        json.dump(_RECORDS, fh, indent=1)
    os.replace(partial, _JSON_PATH)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    try:
        from qgather.runtime import shutdown_pools
    except ImportError:
        return
    if session.config.getoption("--impl") and not _is_xdist_worker(session.config):
        _fail_if_an_implementation_ran_nothing(session)
    from qgather.runtime.external import agree_exit_status

    session.exitstatus = agree_exit_status(int(session.exitstatus))  # under a launcher: the same on every rank
    shutdown_pools()
    _write_json()
    if _is_xdist_worker(session.config) or _QUIET_RANK:
        return
    if session.config.getoption("--report-dir") and not session.config.option.collectonly:
        _write_reports(session)


def _write_reports(session: pytest.Session) -> None:
    from qgather.pytest_plugin import reports as report

    config = session.config
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(terminal, "stats", {}) if terminal else {}
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
              for k in ("passed", "failed", "skipped", "xfailed", "xpassed", "error")}
    session_info = {
        "device": config.getoption("--device"),
        "backend": config.getoption("--backend"),
        "case_timeout": config.getoption("--case-timeout"),
        "baseline": config.getoption("--baseline"),
        "impls": _impls(config),
        "command": " ".join([_program(), shlex.join(sys.argv[1:])]),
        "pytest_args": list(config.invocation_params.args),
        "exit_status": int(session.exitstatus),
    }
    report.write(config.getoption("--report-dir"), report.build(_RECORDS, session_info, counts))


def _program() -> str:
    main = sys.argv[0] if sys.argv else "pytest"
    for package in ("pytest", "qgather"):
        if main.endswith(os.path.join(package, "__main__.py")):
            return f"python -m {package}"
    return os.path.basename(main)


def _fail_if_an_implementation_ran_nothing(session: pytest.Session) -> None:
    """A gate on an implementation whose every case was skipped (TE missing, no GPU) tested
    nothing: red, with the reason, instead of green."""
    skipped_only = {}
    for record in _RECORDS:
        impl = record["case"].rsplit(":", 6)[0]
        skipped_only[impl] = skipped_only.get(impl, True) and record["verdict"] == Verdict.SKIPPED.value
    empty = [impl for impl in _impls(session.config) if skipped_only.get(impl)]
    if not empty:
        return
    reasons = {impl: next(r["reason"] for r in _RECORDS if r["case"].rsplit(":", 6)[0] == impl) for impl in empty}
    session.config._qgather_ran_nothing = reasons  # read by the terminal summary
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for impl, reason in getattr(config, "_qgather_ran_nothing", {}).items():
        terminalreporter.write_line(f"qgather: every {impl} case was skipped, so nothing of it was tested "
                                    f"(first reason: {reason}); failing the run", red=True)
    _coverage_summary(terminalreporter)
    if not _RECORDS or not config.getoption("--qgather-summary"):
        return
    write = terminalreporter.write_line
    terminalreporter.section("qgather verdicts")
    by_impl: dict[str, Counter] = {}
    for record in _RECORDS:
        impl = record["case"].rsplit(":", 6)[0]
        by_impl.setdefault(impl, Counter())[record["verdict"]] += 1
    verdicts = [v.value for v in Verdict if any(c[v.value] for c in by_impl.values())]
    write(f"{'implementation':<28}" + "".join(f"{v:>18}" for v in verdicts))
    for impl, counts in sorted(by_impl.items()):
        write(f"{impl:<28}" + "".join(f"{counts[v]:>18}" for v in verdicts))
    known = [r for r in _RECORDS if r.get("outcome") == "xfailed"]
    failed = [r for r in _RECORDS if not r["passed"] and r not in known]
    write(f"{len(_RECORDS)} cases, {len(_RECORDS) - len(failed) - len(known)} as expected, {len(failed)} not"
          + (f", {len(known)} known issues (--baseline)" if known else ""))
    for record in failed[:20]:
        write(f"  {record['verdict']:<16} {record['case']}  ({record['reason'][:100]})")
        write(f"    reproduce: {record.get('repro') or 'qgather case ' + record['case']}")


def _coverage_summary(terminalreporter) -> None:
    """The coverage of the cases this session ran (`qgather coverage` prints the whole matrix)."""
    from qgather.model.case import CaseSpecError
    from qgather.suite.coverage import measure, summary_lines

    specs = []
    for case_id in dict.fromkeys(r["case"] for r in _RECORDS):
        try:
            specs.append(CaseSpec.parse(case_id))
        except CaseSpecError:
            continue
    if not specs:
        return
    terminalreporter.section("qgather coverage (format x buffer x regime x scenario x configuration)")
    for line in summary_lines(measure(specs)):
        terminalreporter.write_line(line, red=line.lstrip().startswith("MISSING"))
