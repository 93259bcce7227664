"""The session's life: what pytest_configure sets up for this process's role (qgather.pytest_plugin.role)
and pytest_unconfigure removes, and, at the end of every process's session, the rank pools' shutdown
and (under a launcher) one exit status for every rank.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

from qgather.model.options import output_problem
from qgather.pytest_plugin.collection import impl_problems_key, sweep_sizes_key
from qgather.pytest_plugin.fixture import RECORD_KEY
from qgather.pytest_plugin.options import Settings, settings_key
from qgather.pytest_plugin.recorder import Recorder, recorder_key
from qgather.pytest_plugin.role import Role, role
from qgather.runtime import external, shutdown_pools
from qgather.runtime.launch import detect_launch

RECORDER_NAME = "qgather-recorder"
QUIET_RANK_NAME = "qgather-quiet-rank"


@pytest.hookimpl(tryfirst=True)  # before junitxml's, which reads config.option.xmlpath
def pytest_configure(config: pytest.Config) -> None:
    """Parse the settings (every process) and set up what this process's role needs."""
    # also where no ini file registers it (an install): --exhaustive marks its extra cases slow
    config.addinivalue_line("markers", "slow: long sweeps (--exhaustive's extra cases); deselect with -m 'not slow'")
    options = Settings.from_config(config)
    config.stash[settings_key] = options
    config.stash[sweep_sizes_key] = []
    this = role(config)
    if this is Role.QUIET_RANK:  # one report per job: rank 0's (this rank's own failures go to stderr)
        config.pluginmanager.set_blocked("terminalreporter")
        config.option.xmlpath = None
        external.say = lambda text: _uncaptured(config, text)
        config.pluginmanager.register(QuietRank(), QUIET_RANK_NAME)
    elif this is Role.REPORTER:
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


def pytest_unconfigure(config: pytest.Config) -> None:
    """Take down what pytest_configure set up (a second pytest.main in this process starts clean)."""
    for name in (RECORDER_NAME, QUIET_RANK_NAME):
        plugin = config.pluginmanager.get_plugin(name)
        if plugin is not None:
            config.pluginmanager.unregister(plugin)
    for key in (recorder_key, settings_key, sweep_sizes_key, impl_problems_key):
        if key in config.stash:
            del config.stash[key]


def pytest_runtest_teardown(item: pytest.Item) -> None:
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
        """A failed test without a case record: this rank's own, which rank 0 cannot report."""
        if report.failed and not any(key == RECORD_KEY for key, _ in report.user_properties):
            launch = detect_launch()
            where = f"job rank {launch.rank} on {launch.host}" if launch else "this rank"
            print(f"qgather: {where}: {report.nodeid} failed:\n{report.longreprtext}", file=sys.stderr, flush=True)


def _uncaptured(config: pytest.Config, text: str) -> None:
    """To this process's real stderr, even from inside a test (whose output pytest captures)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(text, file=sys.stderr, flush=True)
