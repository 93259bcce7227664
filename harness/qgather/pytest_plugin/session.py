"""The session's life: what pytest_configure sets up for this process's role (qgather.pytest_plugin.role)
and pytest_unconfigure removes, and, at the end of every process's session, the rank pools' shutdown
and (under a launcher) one exit status for every rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import replace

import pytest

from qgather.pytest_plugin.collection import impl_problems_key, preload_before_key, sweep_sizes_key
from qgather.pytest_plugin.fixture import RECORD_KEY
from qgather.pytest_plugin.gpu_schedule import boot_forkserver_early, make_lease_dir, remove_lease_dir, report_header
from qgather.pytest_plugin.options import Settings, settings_key
from qgather.pytest_plugin.recorder import Recorder, recorder_key
from qgather.pytest_plugin.role import Role, role
from qgather.pytest_plugin.xdist_status import once_per_status
from qgather.runtime import external, shutdown_pools
from qgather.runtime.helpers import restore_preload
from qgather.runtime.launch import detect_launch
from qgather.suite.options import output_problem

RECORDER_NAME = "qgather-recorder"
QUIET_RANK_NAME = "qgather-quiet-rank"


@pytest.hookimpl(tryfirst=True)  # before junitxml's, which reads config.option.xmlpath
def pytest_configure(config: pytest.Config) -> None:
    """Parse the settings (every process) and set up what this process's role needs."""
    # also where no ini file registers it (an install): --exhaustive marks its extra cases slow
    config.addinivalue_line("markers", "slow: long sweeps (--exhaustive's extra cases); deselect with -m 'not slow'")
    options = Settings.from_config(config)
    this = role(config)
    if this is Role.QUIET_RANK:  # this rank's own failures go to stderr, past pytest's capture
        options = replace(options, run=replace(options.run, say=functools.partial(_uncaptured, config)))
    config.stash[settings_key] = options
    config.stash[sweep_sizes_key] = []
    if this is Role.XDIST_WORKER:
        boot_forkserver_early(config)
    if this is Role.QUIET_RANK:  # one report per job: rank 0's
        config.pluginmanager.set_blocked("terminalreporter")
        config.option.xmlpath = None
        config.pluginmanager.register(QuietRank(), QUIET_RANK_NAME)
    elif this is Role.REPORTER:
        make_lease_dir(config)
        if options.report_dir and not config.option.xmlpath and not config.option.collectonly:
            config.option.xmlpath = os.path.join(options.report_dir, "junit.xml")
        if not config.option.collectonly:
            _check_outputs(config, options)
        recorder = Recorder(config, options)
        config.stash[recorder_key] = recorder
        config.pluginmanager.register(recorder, RECORDER_NAME)


def _check_outputs(config: pytest.Config, options: Settings) -> None:
    """Every output path is writable, before the first case (not a traceback after the last)."""
    outputs = [("--report-dir", options.report_dir, True), ("--junitxml", config.option.xmlpath, False),
               ("--qgather-json", options.json_path, False)]
    for flag, path, directory in outputs:
        problem = path and output_problem(flag, path, directory)
        if problem:
            raise pytest.UsageError(problem)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which brings up the workers and writes the first status
def pytest_sessionstart(session: pytest.Session) -> None:
    """The reporting process: xdist's status line written once per status (qgather.pytest_plugin.xdist_status)."""
    if role(session.config) is Role.REPORTER:
        once_per_status(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Take down what pytest_configure set up (a second pytest.main in this process starts clean)."""
    for name in (RECORDER_NAME, QUIET_RANK_NAME):
        plugin = config.pluginmanager.get_plugin(name)
        if plugin is not None:
            config.pluginmanager.unregister(plugin)
    remove_lease_dir(config)
    if preload_before_key in config.stash:
        restore_preload(config.stash[preload_before_key])
    for key in (recorder_key, settings_key, sweep_sizes_key, impl_problems_key, preload_before_key):
        if key in config.stash:
            del config.stash[key]


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The GPU seats of a GPU run (qgather.pytest_plugin.gpu_schedule)."""
    return report_header(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The GPU seats again where pytest showed no header (-q, as `make test-multigpu` runs): a run's
    pool starts and seat waits are read against K."""
    if terminalreporter.verbosity < 0:
        for line in report_header(config):
            terminalreporter.write_line(line)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Under a launcher, a broken world stops every rank at the same case."""
    broken = external.world_broken()
    if broken:
        item.session.shouldfail = f"qgather: {broken}"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every process: the same exit status on every rank of a launched job, and no pool left running."""
    session.exitstatus = external.agree_exit_status(int(session.exitstatus))
    shutdown_pools()


class QuietRank:
    """A launched job's rank other than 0: its own failures that are not a case's shared verdict, to stderr."""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A failed test without a case record: this rank's own, which rank 0 cannot report, with what
        it wrote to stderr (a pool the test made itself writes this rank's own failures there)."""
        if report.failed and not any(key == RECORD_KEY for key, _ in report.user_properties):
            launch = detect_launch()
            where = f"job rank {launch.rank} on {launch.host}" if launch else "this rank"
            stderr = "".join(text for name, text in report.sections if name.startswith("Captured stderr"))
            text = f"qgather: {where}: {report.nodeid} failed:\n{report.longreprtext}"
            print(text + (f"\n{stderr}" if stderr else ""), file=sys.stderr, flush=True)


def _uncaptured(config: pytest.Config, text: str) -> None:
    """To this process's real stderr, even from inside a test (whose output pytest captures)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(text, file=sys.stderr, flush=True)
